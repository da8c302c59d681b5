"""The training loop's fault machinery for one process (watchdog + signal handlers)."""

from __future__ import annotations

import signal
from typing import Callable

from shardsmith.trainer.comm import any_rank
from shardsmith.trainer.fault import FaultConfig
from shardsmith.trainer.fault.preemption import PreemptionHandler
from shardsmith.trainer.fault.watchdog import StepWatchdog


class FaultGuard:
    """The training loop's fault machinery for one process: the hang watchdog, the
    preemption signal handlers and the step-boundary agreement. Close it when the loop ends.

    Args:
        cfg: the fault config.
        dump_path: file each hang dump is appended to ("" = stderr only).
        on_hang: see :class:`StepWatchdog`.
    """

    def __init__(
        self,
        cfg: FaultConfig,
        *,
        dump_path: str = "",
        on_hang: Callable[[int, float, float], None] | None = None,
    ) -> None:
        self.watchdog = StepWatchdog(
            factor=cfg.hang_factor, min_s=cfg.hang_min_seconds, dump_path=dump_path, on_hang=on_hang
        )
        self.preemption = PreemptionHandler(cfg.preempt_deadline, is_hung=self.watchdog.is_hung)
        self.preemption.install()

    def begin(self, step: int) -> None:
        """Step ``step`` starts (the watchdog times it)."""
        self.watchdog.begin(step)

    def end(self) -> bool:
        """The step's boundary (collective): True on every rank when any rank got a
        preemption signal. The agreement's all-reduce is inside the timed step."""
        preempt = any_rank(self.preemption.requested is not None)
        self.watchdog.end()
        return preempt

    def signal_name(self) -> str:
        """The signal this rank got, or ``"peer"`` (another rank got it)."""
        sig = self.preemption.requested
        return "peer" if sig is None else signal.Signals(sig).name

    def close(self) -> None:
        """Stop the watchdog, restore the signal handlers, cancel the deadline."""
        self.watchdog.close()
        self.preemption.uninstall()
