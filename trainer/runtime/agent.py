"""torchelastic's local agent as ``shardsmith train`` runs it: what the console says about
its workers, and no moment at which a signal loses one.

:func:`run_agent` builds :class:`ConsoleAgent` (``LocalElasticAgent``, built as its own
documentation shows: a ``WorkerSpec`` and the rendezvous handler of torchrun's
``launch_agent``) from a ``LaunchConfig``. What it adds:

* **The restart line.** Before a restart it prints which ranks failed and how, from the
  agent's own ``RunResult`` (each ``ProcessFailure``'s exit code; a negative one is the
  signal that ended the process; :func:`restart_line` says which ranks it names):
  ``restart 1 of 3: rank 1 died (SIGKILL); restarting 2 processes``.
* **Signals at any moment.** torchelastic installs its handler (which raises
  ``SignalException``) only as it starts the workers, then spawns them one by one; a signal
  between two spawns raised out of the spawn loop and lost the processes already started
  (they trained on, orphaned, after the launcher had exited). :class:`StopSignals` installs
  the launcher's handler for :data:`STOP_SIGNALS` before the rendezvous and holds a signal
  back while the workers are spawned, raising it once the agent knows every process;
  torchelastic's own handler keeps SIGQUIT only (``TORCHELASTIC_SIGNALS_TO_HANDLE``).
* **A Ctrl-C before the loop.** A worker interrupted before its trainer installed the
  preemption handler dies of the SIGINT (:mod:`shardsmith.trainer.runtime.worker` leaves
  SIGINT at its default until then: a worker blocked in a rendezvous or a collective would
  never see a Python-level handler run), and the agent says so: ``interrupted before the
  first step: nothing saved``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator, Mapping

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

#: Signals that stop the job, handled by the launcher itself (SIGTERM/SIGUSR1: a scheduler's
#: preemption; SIGINT: Ctrl-C; SIGHUP: the terminal is gone). The agent forwards each to
#: the workers.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
#: What torchelastic's own handler is left with (it installs it as workers start).
AGENT_SIGNALS = "SIGQUIT"


class StopSignals:
    """The launcher's handler of :data:`STOP_SIGNALS`: raises ``SignalException`` as
    torchelastic's handler does, except inside :meth:`held`, which raises it at its end."""

    def __init__(self) -> None:
        self.holding = False
        self.pending: int | None = None
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handler on :data:`STOP_SIGNALS` (main thread only), the previous ones after."""
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A signal that arrives inside is raised when the block ends, not inside it."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            if self.pending is not None:
                signum, self.pending = self.pending, None
                self._handle(signum, None)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending = self.pending or signum
            return
        sigval = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def failure_text(exitcode: int) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if exitcode < 0:
        try:
            return f"died ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"died (signal {-exitcode})"
    return f"exited with code {exitcode}"


def restart_line(
    restart: int, max_restarts: int, exitcodes: Mapping[int, int], nproc: int, *, then: str = ""
) -> str:
    """The console line of a restart: ``restart`` of ``max_restarts``, the ranks that failed
    (``exitcodes``: rank -> exit code, torchelastic's ``RunResult.failures``; empty: no rank
    died, a member reported the failure) and what happens next: ``then``, by default
    torchelastic's ``restarting {nproc} processes`` (the in-process supervisor says its own).

    The ranks named are those a signal killed (SIGKILL, SIGSEGV, SIGABRT...), else those
    that exited non-zero; the others that failed in the same moment (peers whose collective
    broke, exit code 1) are counted. SIGTERM deaths are left out: once one worker fails,
    torchelastic stops the others with it and lists them too (named only when every
    worker ended so)."""
    term = -signal.SIGTERM
    killed = {r: c for r, c in exitcodes.items() if c < 0 and c != term}
    exited = {r: c for r, c in exitcodes.items() if c > 0}
    named = killed or exited or dict(exitcodes)
    others = sum(1 for r, c in exitcodes.items() if r not in named and c != term)
    failed = ", ".join(f"rank {r} {failure_text(c)}" for r, c in sorted(named.items()))
    if not failed:
        failed = "no rank died (a member reported a failure)"
    if others:
        failed += f"; {others} other rank{'s' if others > 1 else ''} failed with it"
    return (
        f"restart {restart} of {max_restarts}: {failed}; {then or f'restarting {nproc} processes'}"
    )


class ConsoleAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with the launcher's console and signal handling (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.signals = StopSignals()
        self._failed: dict[int, int] = {}

    def _monitor_workers(self, worker_group: Any) -> Any:
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            self._failed = {rank: f.exitcode for rank, f in result.failures.items()}
        return result

    def _restart_workers(self, worker_group: Any) -> None:
        spec = worker_group.spec
        if self._failed:
            restart = spec.max_restarts - self._remaining_restarts
            line = restart_line(restart, spec.max_restarts, self._failed, len(worker_group.workers))
            print(line, file=sys.stderr, flush=True)
            self._failed = {}
        super()._restart_workers(worker_group)

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        with self.signals.held():  # the agent holds every process before a signal is raised
            return super()._start_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        if death_sig != signal.SIGINT:
            return
        handlers = getattr(self._pcontext, "subprocess_handlers", {})
        if any(h.proc.returncode == -signal.SIGINT for h in handlers.values()):
            print("interrupted before the first step: nothing saved", file=sys.stderr, flush=True)


def run_agent(config: LaunchConfig, entrypoint: str, args: tuple[str, ...]) -> None:
    """Run ``entrypoint args`` on ``config.nproc_per_node`` local workers under
    :class:`ConsoleAgent` until they finish (torchrun's ``launch_agent``, single node).
    Main thread only.

    Raises:
        ChildFailedError: a worker failed after ``config.max_restarts`` restarts.
        SignalException: one of :data:`STOP_SIGNALS` (or SIGQUIT) stopped the job; the
            workers were sent it and waited for (``config.shutdown_timeout`` seconds).
    """
    assert config.logs_specs is not None  # LaunchConfig.__post_init__ sets the default
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    agent = ConsoleAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        shutdown_timeout=config.shutdown_timeout or 30,
    )
    interrupted = False
    try:
        with agent.signals.installed():
            result = agent.run()
    except SignalException:
        interrupted = True  # the rendezvous stays open, as torchrun leaves it
        raise
    finally:
        if not interrupted:
            spec.rdzv_handler.shutdown()
    if result.is_failed():
        raise ChildFailedError(name=entrypoint, failures=result.failures)
