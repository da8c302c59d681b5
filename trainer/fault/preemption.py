"""Preemption: SIGTERM/SIGUSR1 (SLURM, Kubernetes) and SIGINT (Ctrl-C) ask for a checkpoint at
the next step boundary, then exit; a second signal, or one while the step is hung, exits at once."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from typing import Any, Callable

#: Signals a scheduler preempts with: the job checkpoints and exits 0.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: Signals the handler installs for: the preemption signals and Ctrl-C (exit 130 at the launcher).
STOP_SIGNALS = (*PREEMPT_SIGNALS, signal.SIGINT)
#: A Ctrl-C reaches every process of the terminal's group and the agent forwards it again
#: within milliseconds; a Ctrl-C after this many seconds is the user's second one.
SIGINT_REPEAT_GRACE_S = 1.0


class PreemptionHandler:
    """Turns SIGTERM/SIGUSR1 and SIGINT (Ctrl-C) into a request to checkpoint and exit.

    The first signal sets :attr:`requested` and starts a ``deadline`` timer; the trainer
    checks the flag at each step boundary (all ranks agree via :func:`~shardsmith.trainer.comm.any_rank`), saves,
    waits for the commit, calls :meth:`done` and exits 0. A second signal, a signal while
    ``is_hung()`` is true, or the deadline passing exits at once with a stack dump on
    stderr (``128 + signal`` / 1). A repeat within ``repeat_grace_s`` seconds of the first
    is the same notice, not a second signal: SLURM signals every process of a job step,
    and torchrun's agent forwards the one it gets to its workers as well.

    Args:
        deadline_s: seconds from the first signal to :meth:`done`.
        is_hung: true while the current step is hung (then no step boundary will come).
        exit_fn: how to exit (``os._exit``; injectable for tests).
        repeat_grace_s: seconds during which a repeated signal is ignored.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        deadline_s: float,
        *,
        is_hung: Callable[[], bool] = lambda: False,
        exit_fn: Callable[[int], Any] = os._exit,
        repeat_grace_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline_s = deadline_s
        self.requested: int | None = None
        self._is_hung = is_hung
        self._exit = exit_fn
        self._grace_s, self._clock, self._first_at = repeat_grace_s, clock, 0.0
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> bool:
        """Install the handlers (main thread only; returns False elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Restore the previous handlers and cancel the deadline."""
        self.done()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def done(self) -> None:
        """The checkpoint is committed: cancel the deadline timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handle(self, signum: int, frame: Any) -> None:
        # torchrun's agent forwards the user's second Ctrl-C as SIGTERM (it stops the workers
        # when its wait after the first forward is interrupted): that is the second Ctrl-C.
        again = self.requested == signal.SIGINT and signum == signal.SIGTERM
        signum = signal.SIGINT if again else signum
        ctrl_c = signum == signal.SIGINT
        name = "Ctrl-C" if ctrl_c else signal.Signals(signum).name
        grace = SIGINT_REPEAT_GRACE_S if ctrl_c else self._grace_s
        if self.requested is not None and not again and self._clock() - self._first_at < grace:
            return  # the same notice, delivered twice
        # Ctrl-C reaches every rank at once: rank 0 speaks for all. Another signal may reach
        # one rank only (a scheduler's, or a rank's own): that rank says so.
        tell = say_once if ctrl_c else (lambda m: say(f"rank {os.environ.get('RANK', '?')}: {m}"))
        if self.requested is not None or self._is_hung():
            why = "again" if self.requested is not None else "while the current step is hung"
            tell(f"{name} {why}: exiting now without a checkpoint")
            if not ctrl_c:
                faulthandler.dump_traceback(2, all_threads=True)
            self._exit(128 + signum)
            return
        self.requested, self._first_at = signum, self._clock()
        tell(
            f"{name}: checkpointing at the next step boundary, then exiting (deadline "
            f"{self.deadline_s:g}s; {'press it' if ctrl_c else 'send it'} again to exit now)"
        )
        self._timer = threading.Timer(self.deadline_s, self._deadline_passed)
        self._timer.daemon = True
        self._timer.start()

    def _deadline_passed(self) -> None:
        say(
            f"rank {os.environ.get('RANK', '?')}: preemption checkpoint not committed within "
            f"--preempt-deadline {self.deadline_s:g}s; exiting without it (stacks follow)"
        )
        faulthandler.dump_traceback(2, all_threads=True)
        self._exit(1)


def say_once(message: str) -> None:
    """:func:`say` on rank 0 only: every rank gets the signal, one line says what happens."""
    if os.environ.get("RANK", "0") == "0":
        say(message)


def say(message: str) -> None:
    """One line on stderr, safe inside a signal handler (a single write)."""
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass
