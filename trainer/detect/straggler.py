"""Stragglers: which rank is slow at its own work, from every rank's own step timings.

Each rank splits every step's wall time (forward, backward, gradient reduction, global loss
and gradient norm) into its *own work* and its *collective wait*, the part it spends blocked
in a collective waiting for peers (:mod:`.waits`). A rank slowed anywhere, also inside its
forward or backward under FSDP2, TP or a pipeline, spends the extra time working while its
peers spend it waiting, so its own work grows and theirs does not. Once per window of
``straggler_every`` steps every rank contributes its window means to one all-gather (two
float64 per rank), and every rank judges the same numbers:

* a rank is *slow in a window* when its mean own work exceeds ``straggler_factor`` x the
  median over its *peers*: the other ranks of its pipeline stage (they run the same layers),
  or all other ranks when it has none (``pp`` = world size);
* after ``straggler_windows`` slow windows in a row, a ``straggler`` event names it (once per
  streak), with each named rank's own work, its collective wait and the median;
* the step record of a window's last step carries ``compute_s_median``, ``compute_s_max``
  (own work) and ``wait_s_max`` (seconds, window means), and ``slowest_rank`` and
  ``slowest_compute_ratio`` (own work over its peers' median) when a rank is slow in it;
  the step line shows those two.

Cost per step at 1,024 ranks: two ``perf_counter`` calls per step and per blocking wait,
nothing else; per window one all-gather of 16 bytes per rank (16 KiB received per rank),
medians over 1,024 numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardsmith.trainer.detect import DetectConfig


def slow_ranks(compute_s: list[float], factor: float, stages: list[int] | None = None) -> list[int]:
    """Ranks whose own work exceeds ``factor`` x the median of their peers' (pure).

    Args:
        compute_s: one mean own-work time per rank, seconds.
        factor: > 1.
        stages: each rank's pipeline stage (default: all the same); a rank's peers are the
            other ranks of its stage, or every other rank when its stage has no other.
    """
    if len(compute_s) < 2:
        return []
    return [r for r, t in enumerate(compute_s) if t > factor * peer_median(compute_s, r, stages)]


def peer_median(compute_s: list[float], rank: int, stages: list[int] | None = None) -> float:
    """The median own work of ``rank``'s peers (see :func:`slow_ranks`); needs two ranks."""
    others = [r for r in range(len(compute_s)) if r != rank]
    if stages is not None:
        same = [r for r in others if stages[r] == stages[rank]]
        others = same or others
    return statistics.median(compute_s[r] for r in others)


@dataclass
class StragglerWatch:
    """One rank's step timings and the window judgement (every rank holds one).

    Attributes:
        cfg: the detect config (``straggler_*`` fields).
        stages: each rank's pipeline stage (empty: one stage), to judge a rank by its peers.
        streaks: rank -> slow windows in a row.
    """

    cfg: DetectConfig
    stages: list[int] = field(default_factory=list)
    streaks: dict[int, int] = field(default_factory=dict)
    _compute_s: float = 0.0
    _wait_s: float = 0.0
    _steps: int = 0

    def record(self, compute_s: float, wait_s: float) -> None:
        """Add one step's own-work and collective-wait times (seconds) to the window."""
        self._compute_s += compute_s
        self._wait_s += wait_s
        self._steps += 1

    def due(self, step: int) -> bool:
        """Step ``step`` closes a window (the same answer on every rank)."""
        every = self.cfg.straggler_every
        return every > 0 and step % every == 0 and self._steps > 0

    def close_window(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """All-gather the window's means (collective: every rank, at the same step) and judge.

        Returns:
            (fields for the step record, see the module's docstring; the ``straggler`` event,
            or None).
        """
        mine = torch.tensor(
            [self._compute_s / self._steps, self._wait_s / self._steps], dtype=torch.float64
        )
        everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        self._compute_s = self._wait_s = 0.0
        self._steps = 0
        return self.judge(step, [float(t[0]) for t in everyone], [float(t[1]) for t in everyone])

    def judge(
        self, step: int, compute_s: list[float], wait_s: list[float]
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The window's verdict from every rank's mean own-work and wait times (pure but for
        :attr:`streaks`); see :meth:`close_window`."""
        stages = self.stages or None
        slow = slow_ranks(compute_s, self.cfg.straggler_factor, stages)
        self.streaks = {r: self.streaks.get(r, 0) + 1 for r in slow}
        median = statistics.median(compute_s)
        fields: dict[str, Any] = {
            "compute_s_median": round(median, 6),
            "compute_s_max": round(max(compute_s), 6),
            "wait_s_max": round(max(wait_s), 6),
        }
        ratio = {r: compute_s[r] / max(peer_median(compute_s, r, stages), 1e-12) for r in slow}
        if slow:
            worst = max(slow, key=lambda r: ratio[r])
            fields.update(slowest_rank=worst, slowest_compute_ratio=round(ratio[worst], 2))
        named = sorted(r for r, n in self.streaks.items() if n == self.cfg.straggler_windows)
        if not named:
            return fields, None
        event = {
            "event": "straggler",
            "step": step,
            "ranks": named,
            "compute_s": {str(r): round(compute_s[r], 6) for r in named},
            "wait_s": {str(r): round(wait_s[r], 6) for r in named},
            "median_compute_s": round(median, 6),
            "max_wait_s": round(max(wait_s), 6),
            "windows": self.cfg.straggler_windows,
            "factor": self.cfg.straggler_factor,
        }
        return fields, event
