"""Bad steps: a non-finite loss or gradient norm skips the update; too many in a row roll
back and skip the data window that caused them (PaLM's remedy for loss spikes:
Chowdhery et al. 2022, section 5.1). The rollback itself is
:meth:`~shardsmith.trainer.checkpoint.policy.CheckpointPolicy.roll_back`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BadStepPolicy:
    """Skip a step whose loss or gradient norm is not finite; roll back after
    ``max_bad_steps`` in a row and skip the data window they trained on.

    The inputs are global (all-reduced) values, so every rank decides the same.
    Windows are in global sample indices (``[start, end)``, see ``GlobalBatchSampler``).

    Attributes:
        consecutive: bad steps in the current streak.
        skipped_steps: bad steps skipped in total.
        rollbacks: rollbacks done.
        streak: ``[start, end)`` samples of the current streak.
        skip_windows: data windows to jump over, sorted, disjoint.
    """

    max_bad_steps: int
    consecutive: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    streak: list[int] = field(default_factory=list)
    skip_windows: list[list[int]] = field(default_factory=list)

    def observe(self, loss: float, grad_norm: float, start: int, end: int) -> str:
        """Judge one step that trained on samples ``[start, end)``.

        Returns:
            ``"ok"`` (apply the update), ``"skip"`` (do not) or ``"rollback"`` (do not, and
            roll back: the streak reached ``max_bad_steps``).
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive, self.streak = 0, []
            return "ok"
        self.skipped_steps += 1
        self.consecutive += 1
        self.streak = [self.streak[0] if self.streak else start, end]
        return "rollback" if self.consecutive >= self.max_bad_steps else "skip"

    def start_rollback(self) -> list[int]:
        """Record the rollback: the streak's window joins :attr:`skip_windows`.
        Returns the window ``[start, end)``."""
        window = list(self.streak)
        self.rollbacks += 1
        self.consecutive, self.streak = 0, []
        self.skip_windows = _merge_windows(self.skip_windows + [window])
        return window

    def next_sample(self, index: int) -> int:
        """Where the data continues from sample ``index``: the end of a skip window that
        holds it, else ``index``."""
        for start, end in self.skip_windows:
            if start <= index < end:
                index = end
        return index

    def state_json(self) -> dict[str, Any]:
        """Saved in the manifest's state (``fault``)."""
        return {
            "consecutive": self.consecutive,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "streak": self.streak,
            "skip_windows": self.skip_windows,
        }

    def load_state_json(self, state: dict[str, Any], *, keep_counters: bool = False) -> None:
        """Restore :meth:`state_json`; with ``keep_counters`` (a rollback) the in-memory
        counters and windows win (they know about the rolled-back steps)."""
        if keep_counters:
            self.skip_windows = _merge_windows(self.skip_windows + state.get("skip_windows", []))
            self.consecutive, self.streak = 0, []
            return
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.streak = [int(x) for x in state.get("streak", [])]
        self.skip_windows = _merge_windows(state.get("skip_windows", []))


def _merge_windows(windows: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for start, end in sorted([int(a), int(b)] for a, b in windows):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
