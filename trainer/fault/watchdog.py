"""Hangs and timeouts: collectives fail after a timeout; before that, a step much slower
than the median dumps every thread's stack (:class:`StepWatchdog`)."""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from shardsmith.trainer.fault.preemption import say

log = logging.getLogger(__name__)


def apply_collective_timeout(timeout_s: float) -> None:
    """Make every process group created from now on time out after ``timeout_s`` seconds.

    ``init_process_group`` and ``new_group`` (which DeviceMesh uses for its sub-groups)
    fall back to ``torch.distributed.distributed_c10d``'s default timeouts when given
    none, so both defaults (gloo and NCCL) are set here; call before the process group
    exists. The trainer calls it with the start-up timeout (``max(init_timeout,
    collective_timeout)``: rendezvous waits for the slowest process to start) and tightens
    the training groups with :func:`set_group_timeouts` after the first step, as
    torchtitan does (``comm.init_timeout_seconds`` / ``comm.train_timeout_seconds``).
    Called once a group exists, it warns only when it changes the timeout (an in-process
    restart's generation sets it before its group, then the trainer again).
    """
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=timeout_s)
    unchanged = distributed_c10d.default_pg_timeout == timeout  # e.g. set again in-process
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    if dist.is_initialized() and not unchanged:
        log.warning("collective timeout set after init_process_group: applies to new groups only")


def set_group_timeouts(timeout_s: float, groups: list[dist.ProcessGroup | None]) -> None:
    """Set the timeout of existing process groups (``None`` = the default group): a
    collective waiting longer fails (gloo raises; NCCL's watchdog aborts the process), and
    torchrun then restarts or fails the job. Uses ``distributed_c10d._set_pg_timeout``
    (private; the call torchtitan's ``set_pg_timeouts`` makes). Every rank calls it for
    the groups it belongs to."""
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=timeout_s)
    for group in groups:
        distributed_c10d._set_pg_timeout(timeout, group)


def hang_threshold(durations_s: list[float], factor: float, min_s: float) -> float:
    """Seconds after which a step counts as hung: ``max(min_s, factor * median)`` of the
    recent step durations ``durations_s`` (seconds); ``factor * min_s`` before any."""
    if not durations_s:
        return factor * min_s
    return max(min_s, factor * statistics.median(durations_s))


class StepWatchdog:
    """A daemon thread that dumps every thread's stack when a step runs too long.

    The trainer calls :meth:`begin` before and :meth:`end` after each step. When the
    running step passes :func:`hang_threshold` of the last ``window`` steps, the stacks of
    all threads go to stderr and, with ``dump_path``, are appended to that file; then
    ``on_hang(step, seconds, threshold)`` is called, once per step. The step is not
    interrupted: the collective timeout fails it, and torchrun tears the job down.

    Args:
        factor, min_s: see :func:`hang_threshold`.
        dump_path: file to append stack dumps to ("" = stderr only).
        on_hang: called from the watchdog thread after a dump.
        clock: monotonic seconds (injectable for tests).
        window: how many recent steps the median is over.
        start_thread: False = no thread; call :meth:`check` yourself (tests).
    """

    def __init__(
        self,
        *,
        factor: float,
        min_s: float,
        dump_path: str = "",
        on_hang: Callable[[int, float, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        window: int = 50,
        start_thread: bool = True,
    ) -> None:
        self.factor, self.min_s = factor, min_s
        self.dump_path, self.on_hang, self.clock = dump_path, on_hang, clock
        self.durations_s: deque[float] = deque(maxlen=window)
        self.fired = False
        self._step = 0
        self._started: float | None = None
        self._stopped = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="shardsmith-watchdog", daemon=True)
        if start_thread:
            self._thread.start()

    def threshold(self) -> float:
        """The current hang threshold in seconds."""
        with self._cv:
            return hang_threshold(list(self.durations_s), self.factor, self.min_s)

    def begin(self, step: int) -> None:
        """Step ``step`` starts now."""
        with self._cv:
            self._step, self._started, self.fired = step, self.clock(), False
            self._cv.notify()

    def end(self) -> None:
        """The step begun last finished; its duration joins the median."""
        with self._cv:
            if self._started is not None:
                self.durations_s.append(self.clock() - self._started)
            self._started, self.fired = None, False
            self._cv.notify()

    def is_hung(self) -> bool:
        """True while the running step has passed the threshold (the watchdog fired)."""
        return self.fired

    def close(self) -> None:
        """Stop the thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self) -> bool:
        """Dump once if the running step is over the threshold; True if it dumped now.
        (The thread calls this; tests call it with a fake clock.)"""
        with self._cv:
            if self._started is None or self.fired:
                return False
            elapsed = self.clock() - self._started
            limit = hang_threshold(list(self.durations_s), self.factor, self.min_s)
            if elapsed < limit:
                return False
            self.fired = True
            step = self._step
        self._dump(step, elapsed, limit)
        if self.on_hang is not None:
            self.on_hang(step, elapsed, limit)
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._stopped:
                    return
                if self._started is None or self.fired:
                    self._cv.wait()
                    continue
                limit = hang_threshold(list(self.durations_s), self.factor, self.min_s)
                remaining = self._started + limit - self.clock()
                if remaining > 0:
                    self._cv.wait(min(remaining, 1.0))
                    continue
            try:
                self.check()
            except Exception:  # never dies silently
                log.exception("watchdog: dumping stacks failed")

    def _dump(self, step: int, elapsed: float, limit: float) -> None:
        header = (
            f"rank {os.environ.get('RANK', '?')}: step {step} has run {elapsed:.1f}s, over the "
            f"hang threshold {limit:.1f}s; stacks of all threads:\n"
        )
        say(header.rstrip())
        faulthandler.dump_traceback(2, all_threads=True)
        if self.dump_path:
            os.makedirs(os.path.dirname(self.dump_path) or ".", exist_ok=True)
            with open(self.dump_path, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {header}")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
