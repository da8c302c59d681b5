"""Surviving failures: elastic world sizes, preemption signals, hangs and bad steps.

Every piece is small and owned by :class:`~shardsmith.trainer.train.Trainer`:

* :func:`fit_world_size`: after an elastic restart with another world size, re-derive
  ``dp_shard`` (when the user left it free) so the job runs in a new layout and loads its
  checkpoint by resharding.
* :class:`PreemptionHandler`: SIGTERM/SIGUSR1 (SLURM, Kubernetes) ask for a checkpoint at
  the next step boundary; the trainer agrees on it over all ranks with :func:`any_rank`.
  A second signal, or a signal while the watchdog says the step is hung, exits at once.
* :func:`apply_collective_timeout` and :class:`StepWatchdog`: collectives fail after a
  timeout; before that, a step much slower than the median dumps every thread's stack.
* :class:`BadStepPolicy`: non-finite loss or gradient norm skips the update; too many in
  a row roll back and skip the data window that caused them (PaLM's remedy for loss
  spikes: Chowdhery et al. 2022, section 5.1).
* :class:`FaultGuard`: the watchdog and the signal handlers around the training loop.
* :func:`choose_resume`: where a (re)started job resumes from.

Fault injection for tests lives in :mod:`shardsmith.trainer.fault_hooks`.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardsmith.errors import LayoutError, TrainingDiverged  # noqa: F401  (re-exported)
from shardsmith.storage.commit import find_latest_committed, resolve_checkpoint, step_dir
from shardsmith.storage.fs import Store
from shardsmith.trainer.config import FaultConfig, TrainConfig

log = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# ---- elastic world size ---------------------------------------------------------------


def elastic_restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this worker group (0 = first
    start; ``TORCHELASTIC_RESTART_COUNT``, set by the agent for every worker)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def warn_if_restarts_unsafe() -> None:
    """Warn when torchrun may restart this group while sharing its agent's TCPStore:
    restarted groups can then read the previous group's stale keys and fail to connect
    (pytorch#135712). ``shardsmith train`` sets the fix; external torchrun users set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if restarts > 0 and shared and os.environ.get("RANK", "0") == "0":
        log.warning("torchrun --max-restarts %d with a shared agent TCPStore: restarted groups may fail "
                    "to connect (pytorch#135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", restarts)


def fit_world_size(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """The config to run with ``world_size`` processes.

    When the layout already has that world size, ``cfg`` is returned unchanged. Else, if
    ``cfg.fault.derive_dp_shard`` (the user left ``--dp-shard`` free), ``dp_shard`` becomes
    ``world_size / (pp * dp_replicate * tp)``: tp, pp and dp_replicate stay as configured.

    Raises:
        LayoutError: the world size does not fit (names both and what would).
    """
    dims = cfg.parallel
    if dims.world_size == world_size:
        return cfg
    fixed = dims.pp * dims.dp_replicate * dims.tp
    if not cfg.fault.derive_dp_shard:
        raise LayoutError(f"layout {dims.describe()} needs {dims.world_size} processes but the job has "
                          f"{world_size}; pass --dp-shard -1 to let dp_shard follow the world size")
    if world_size % fixed:
        raise LayoutError(f"world size {world_size} is not a multiple of pp*dp_replicate*tp={fixed} "
                          f"({dims.describe()}); run on a multiple of {fixed} processes")
    new_dims = replace(dims, dp_shard=world_size // fixed)
    if os.environ.get("RANK", "0") == "0":
        log.warning("world size %d differs from layout %s: running as %s (dp_shard re-derived)",
                    world_size, dims.describe(), new_dims.describe())
    return replace(cfg, parallel=new_dims)


def choose_resume(how: str, root: Store | None, restarts: int,
                  storage_options: dict[str, Any] | None = None) -> tuple[Store, int] | None:
    """Which step directory a job resumes from (every rank decides alike).

    * ``how="auto"``: the newest committed step under ``root``, if any.
    * ``how="none"``: nothing, unless this is an elastic restart (``restarts`` > 0): then
      as ``auto``, so a restarted group never starts over.
    * ``how=URL``: that checkpoint, unless ``root`` already holds a committed step and this
      is an elastic restart or the URL lies outside ``root`` (a requeued job continues
      from its own newest checkpoint, not from the one it was first started from).

    Raises:
        CheckpointNotFound: ``how`` is a URL without a committed step.
    """
    explicit: tuple[Store, int] | None = None
    inside = False
    if how not in ("auto", "none"):
        src_root, step_store, step = resolve_checkpoint(how, storage_options)
        explicit = (step_store, step)
        inside = root is not None and src_root.url.rstrip("/") == root.url.rstrip("/")
    prefer_root = how == "auto" or restarts > 0 or (explicit is not None and not inside)
    if root is not None and prefer_root:
        latest = find_latest_committed(root)
        if latest is not None:
            return root.child(step_dir(latest)), latest
    return explicit


def apply_collective_timeout(seconds: float) -> None:
    """Make every process group created from now on time out after ``seconds``.

    ``init_process_group`` and ``new_group`` (which DeviceMesh uses for its sub-groups)
    fall back to ``torch.distributed.distributed_c10d``'s default timeouts when given
    none, so both defaults (gloo and NCCL) are set here; call before the process group
    exists. The trainer calls it with the start-up timeout (``max(init_timeout,
    collective_timeout)``: rendezvous waits for the slowest process to start) and tightens
    the training groups with :func:`set_group_timeouts` after the first step, as
    torchtitan does (``comm.init_timeout_seconds`` / ``comm.train_timeout_seconds``).
    """
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=seconds)
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    if dist.is_initialized():
        log.warning("collective timeout set after init_process_group: applies to new groups only")


def set_group_timeouts(seconds: float, groups: list[dist.ProcessGroup | None]) -> None:
    """Set the timeout of existing process groups (``None`` = the default group): a
    collective waiting longer fails (gloo raises; NCCL's watchdog aborts the process), and
    torchrun then restarts or fails the job. Uses ``distributed_c10d._set_pg_timeout``
    (private; the call torchtitan's ``set_pg_timeouts`` makes). Every rank calls it for
    the groups it belongs to."""
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=seconds)
    for group in groups:
        distributed_c10d._set_pg_timeout(timeout, group)


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (one MAX all-reduce of a CPU
    int; gloo on CPU jobs, the gloo half of ``cpu:gloo,cuda:nccl`` on GPU jobs).
    Every rank of ``group`` must call it."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


# ---- preemption -----------------------------------------------------------------------


class PreemptionHandler:
    """Turns SIGTERM/SIGUSR1 into a request to checkpoint and exit.

    The first signal sets :attr:`requested` and starts a ``deadline`` timer; the trainer
    checks the flag at each step boundary (all ranks agree via :func:`any_rank`), saves,
    waits for the commit, calls :meth:`done` and exits 0. A second signal, a signal while
    ``is_hung()`` is true, or the deadline passing exits at once with a stack dump on
    stderr (``128 + signal`` / 1). A repeat within ``repeat_grace`` seconds of the first
    is the same notice, not a second signal: SLURM signals every process of a job step,
    and torchrun's agent forwards the one it gets to its workers as well.

    Args:
        deadline: seconds from the first signal to :meth:`done`.
        is_hung: true while the current step is hung (then no step boundary will come).
        exit_fn: how to exit (``os._exit``; injectable for tests).
        repeat_grace: seconds during which a repeated signal is ignored.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, deadline: float, *, is_hung: Callable[[], bool] = lambda: False,
                 exit_fn: Callable[[int], Any] = os._exit, repeat_grace: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline = deadline
        self.requested: int | None = None
        self._is_hung = is_hung
        self._exit = exit_fn
        self._grace, self._clock, self._first_at = repeat_grace, clock, 0.0
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> bool:
        """Install the handlers (main thread only; returns False elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in PREEMPT_SIGNALS:
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
        name = signal.Signals(signum).name
        if self.requested is not None and self._clock() - self._first_at < self._grace:
            return                                   # the same notice, delivered twice
        if self.requested is not None or self._is_hung():
            why = "second signal" if self.requested is not None else "the current step is hung"
            _say(f"rank {os.environ.get('RANK', '?')}: {name}: {why}; exiting now without a checkpoint")
            faulthandler.dump_traceback(2, all_threads=True)
            self._exit(128 + signum)
            return
        self.requested, self._first_at = signum, self._clock()
        _say(f"rank {os.environ.get('RANK', '?')}: {name}: checkpointing at the next step boundary, "
             f"then exiting (deadline {self.deadline:g}s; send it again to exit now)")
        self._timer = threading.Timer(self.deadline, self._deadline_passed)
        self._timer.daemon = True
        self._timer.start()

    def _deadline_passed(self) -> None:
        _say(f"rank {os.environ.get('RANK', '?')}: preemption checkpoint not committed within "
             f"--preempt-deadline {self.deadline:g}s; exiting without it (stacks follow)")
        faulthandler.dump_traceback(2, all_threads=True)
        self._exit(1)


def _say(message: str) -> None:
    """One line on stderr, safe inside a signal handler (a single write)."""
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass


# ---- hangs ----------------------------------------------------------------------------


def hang_threshold(durations: list[float], factor: float, min_seconds: float) -> float:
    """Seconds after which a step counts as hung: ``max(min_seconds, factor * median)``
    of the recent step ``durations`` (seconds); ``factor * min_seconds`` before any."""
    if not durations:
        return factor * min_seconds
    return max(min_seconds, factor * statistics.median(durations))


class StepWatchdog:
    """A daemon thread that dumps every thread's stack when a step runs too long.

    The trainer calls :meth:`begin` before and :meth:`end` after each step. When the
    running step passes :func:`hang_threshold` of the last ``window`` steps, the stacks of
    all threads go to stderr and, with ``dump_path``, are appended to that file; then
    ``on_hang(step, seconds, threshold)`` is called, once per step. The step is not
    interrupted: the collective timeout fails it, and torchrun tears the job down.

    Args:
        factor, min_seconds: see :func:`hang_threshold`.
        dump_path: file to append stack dumps to ("" = stderr only).
        on_hang: called from the watchdog thread after a dump.
        clock: monotonic seconds (injectable for tests).
        window: how many recent steps the median is over.
        start_thread: False = no thread; call :meth:`check` yourself (tests).
    """

    def __init__(self, *, factor: float, min_seconds: float, dump_path: str = "",
                 on_hang: Callable[[int, float, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, window: int = 50,
                 start_thread: bool = True) -> None:
        self.factor, self.min_seconds = factor, min_seconds
        self.dump_path, self.on_hang, self.clock = dump_path, on_hang, clock
        self.durations: deque[float] = deque(maxlen=window)
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
            return hang_threshold(list(self.durations), self.factor, self.min_seconds)

    def begin(self, step: int) -> None:
        """Step ``step`` starts now."""
        with self._cv:
            self._step, self._started, self.fired = step, self.clock(), False
            self._cv.notify()

    def end(self) -> None:
        """The step begun last finished; its duration joins the median."""
        with self._cv:
            if self._started is not None:
                self.durations.append(self.clock() - self._started)
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
            limit = hang_threshold(list(self.durations), self.factor, self.min_seconds)
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
                limit = hang_threshold(list(self.durations), self.factor, self.min_seconds)
                remaining = self._started + limit - self.clock()
                if remaining > 0:
                    self._cv.wait(min(remaining, 1.0))
                    continue
            try:
                self.check()
            except Exception:  # never dies silently
                log.exception("watchdog: dumping stacks failed")

    def _dump(self, step: int, elapsed: float, limit: float) -> None:
        header = (f"rank {os.environ.get('RANK', '?')}: step {step} has run {elapsed:.1f}s, over the "
                  f"hang threshold {limit:.1f}s; stacks of all threads:\n")
        _say(header.rstrip())
        faulthandler.dump_traceback(2, all_threads=True)
        if self.dump_path:
            os.makedirs(os.path.dirname(self.dump_path) or ".", exist_ok=True)
            with open(self.dump_path, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {header}")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)


class FaultGuard:
    """The training loop's fault machinery for one process: the hang watchdog, the
    preemption signal handlers and the step-boundary agreement. Close it when the loop ends.

    Args:
        cfg: the fault config.
        dump_path: file each hang dump is appended to ("" = stderr only).
        on_hang: see :class:`StepWatchdog`.
    """

    def __init__(self, cfg: FaultConfig, *, dump_path: str = "",
                 on_hang: Callable[[int, float, float], None] | None = None) -> None:
        self.watchdog = StepWatchdog(factor=cfg.hang_factor, min_seconds=cfg.hang_min_seconds,
                                     dump_path=dump_path, on_hang=on_hang)
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


# ---- bad steps ------------------------------------------------------------------------


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
        return {"consecutive": self.consecutive, "skipped_steps": self.skipped_steps,
                "rollbacks": self.rollbacks, "streak": self.streak, "skip_windows": self.skip_windows}

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
