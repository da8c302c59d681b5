"""Where a step's time went on one rank: its own work, or blocked in a collective.

A rank slowed inside its own forward or backward (a throttled GPU, a faulty core) makes its
peers wait inside the collectives of that forward and backward: FSDP2's all-gathers and
reduce-scatters, TP's all-reduces, the pipeline's receives. The step's wall time is then the
same on every rank and names no one. What differs is where it went: the slow rank computes
while its peers wait, so the slow rank is the one that waits least. :func:`step_clock`
measures, for one step, the wall time and the part of it this thread spends blocked in a
collective; the rest is the rank's own work (:attr:`StepClock.own_s`).

The waits are taken where a CPU (gloo) rank blocks: ``Work.wait`` (the synchronous
``torch.distributed`` calls wait through it; FSDP2 and the pipeline schedules call it on
their asynchronous handles) and ``torch.distributed._functional_collectives.wait_tensor``
(DTensor's collectives, TP's). Both are wrapped once per process (:func:`install`); outside a
:func:`step_clock` a wrapper only looks up a thread-local, inside one it adds two
``perf_counter`` calls per wait. Other threads (the background save's) are never timed.

On CUDA with NCCL, ``Work.wait`` makes the compute stream wait and returns at once: the host
does not block in it, so nothing is counted there and a rank's own work is its step's wall
time, as it was before this module.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_TIMED = "__shardsmith_timed__"
_local = threading.local()


@dataclass
class StepClock:
    """One step of one rank, in seconds: ``wall_s`` from the start of :func:`step_clock` to
    its end, ``blocked_s`` of it spent blocked in collective waits."""

    wall_s: float = 0.0
    blocked_s: float = 0.0

    @property
    def own_s(self) -> float:
        """The rank's own work: the wall time less the time blocked in collectives."""
        return max(0.0, self.wall_s - self.blocked_s)


def _timed(wait: Callable[..., Any]) -> Callable[..., Any]:
    """``wait`` adding its blocked time to this thread's running clock, if any."""

    @functools.wraps(wait)
    def timed_wait(*args: Any, **kwargs: Any) -> Any:
        clock = getattr(_local, "clock", None)
        if clock is None:
            return wait(*args, **kwargs)
        _local.clock = None  # a wait inside a wait counts once
        t0 = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            clock.blocked_s += time.perf_counter() - t0
            _local.clock = clock

    setattr(timed_wait, _TIMED, True)
    return timed_wait


def install() -> None:
    """Wrap ``Work.wait`` and the functional collectives' ``wait_tensor`` (once per process;
    idempotent). Any rank, any thread."""
    if not getattr(dist.Work.wait, _TIMED, False):
        dist.Work.wait = _timed(dist.Work.wait)  # type: ignore[method-assign]
    if not getattr(funcol.wait_tensor, _TIMED, False):
        funcol.wait_tensor = _timed(funcol.wait_tensor)


@contextlib.contextmanager
def step_clock() -> Iterator[StepClock]:
    """Time the block on this thread: its wall time and the part blocked in collective waits
    (filled in when the block ends; local, no communication)."""
    install()
    clock = StepClock()
    outer = getattr(_local, "clock", None)
    _local.clock = clock
    t0 = time.perf_counter()
    try:
        yield clock
    finally:
        clock.wall_s = time.perf_counter() - t0
        _local.clock = outer
