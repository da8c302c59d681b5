"""Stragglers: which rank's compute is slow, from every rank's own step timings.

Each rank times, per step, its *compute* (forward and backward: :meth:`StepMath.forward_backward`)
and its *collective wait* (the gradient reduction, the global loss and the gradient norm: the
all-reduces where a rank waits for the slowest). Once per window of ``straggler_every``
steps every rank contributes its window means to one all-gather (two float64 per rank), and
every rank judges the same numbers:

* a rank is *slow in a window* when its mean compute time exceeds the median over ranks by
  ``straggler_factor``;
* after ``straggler_windows`` slow windows in a row, a ``straggler`` event names it (once per
  streak), with each named rank's compute time and the median;
* the step record of a window's last step carries ``compute_s_median``, ``compute_s_max``
  and ``wait_s_max`` (seconds, window means), and ``slowest_rank`` and
  ``slowest_compute_ratio`` when a rank is slow in it; the step line shows those two.

Compute time includes the collectives inside forward and backward (TP all-reduces, FSDP
all-gathers and reduce-scatters), which wait for peers too; the slow rank still stands out,
because its peers spend its extra time waiting in the next collective outside compute.

Cost per step at 1,024 ranks: two ``perf_counter`` calls, nothing else; per window one
all-gather of 16 bytes per rank (16 KiB received per rank), a median over 1,024 numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardsmith.trainer.detect import DetectConfig


def slow_ranks(compute_s: list[float], factor: float) -> list[int]:
    """Ranks whose compute time exceeds ``factor`` x the median over ranks (pure).

    Args:
        compute_s: one mean compute time per rank, seconds.
        factor: > 1.
    """
    if len(compute_s) < 2:
        return []
    median = statistics.median(compute_s)
    return [r for r, t in enumerate(compute_s) if t > factor * median]


@dataclass
class StragglerWatch:
    """One rank's step timings and the window judgement (every rank holds one).

    Attributes:
        cfg: the detect config (``straggler_*`` fields).
        streaks: rank -> slow windows in a row.
    """

    cfg: DetectConfig
    streaks: dict[int, int] = field(default_factory=dict)
    _compute_s: float = 0.0
    _wait_s: float = 0.0
    _steps: int = 0

    def record(self, compute_s: float, wait_s: float) -> None:
        """Add one step's compute and collective-wait times (seconds) to the window."""
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
        """The window's verdict from every rank's mean compute and wait times (pure but for
        :attr:`streaks`); see :meth:`close_window`."""
        slow = slow_ranks(compute_s, self.cfg.straggler_factor)
        self.streaks = {r: self.streaks.get(r, 0) + 1 for r in slow}
        median = statistics.median(compute_s)
        fields: dict[str, Any] = {
            "compute_s_median": round(median, 6),
            "compute_s_max": round(max(compute_s), 6),
            "wait_s_max": round(max(wait_s), 6),
        }
        if slow:
            worst = max(slow, key=lambda r: compute_s[r])
            fields.update(
                slowest_rank=worst,
                slowest_compute_ratio=round(compute_s[worst] / max(median, 1e-12), 2),
            )
        named = sorted(r for r, n in self.streaks.items() if n == self.cfg.straggler_windows)
        if not named:
            return fields, None
        event = {
            "event": "straggler",
            "step": step,
            "ranks": named,
            "compute_s": {str(r): round(compute_s[r], 6) for r in named},
            "median_compute_s": round(median, 6),
            "max_wait_s": round(max(wait_s), 6),
            "windows": self.cfg.straggler_windows,
            "factor": self.cfg.straggler_factor,
        }
        return fields, event
