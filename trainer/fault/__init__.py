"""Surviving failures: elastic world sizes, preemption signals, hangs and bad steps.

One module per concern, each owned by the training loop
(:class:`~shardsmith.trainer.train.Trainer`):

* :mod:`.elastic`: after an elastic restart with another world size, re-derive
  ``dp_shard`` (when the user left it free) so the job runs in a new layout and loads its
  checkpoint by resharding; torchrun's restart count.
* :mod:`.preemption`: SIGTERM/SIGUSR1 (SLURM, Kubernetes) ask for a checkpoint at the
  next step boundary; the trainer agrees on it over all ranks with
  :func:`~shardsmith.trainer.comm.any_rank`. A second signal, or a signal while the
  watchdog says the step is hung, exits at once.
* :mod:`.watchdog`: collectives fail after a timeout; before that, a step much slower
  than the median dumps every thread's stack.
* :mod:`.bad_steps`: non-finite loss or gradient norm skips the update; too many in a row
  roll back and skip the data window that caused them.
* :mod:`.guard`: :class:`~.guard.FaultGuard`, the watchdog and the signal handlers
  around the training loop.

Where a (re)started job resumes from is checkpoint policy (the launcher's
:func:`shardsmith.trainer.runtime.preflight.resolve`, after a restart
:func:`shardsmith.trainer.checkpoint.recovery.persistent_source`); fault injection for tests lives
in :mod:`shardsmith.trainer.fault.hooks`. This module holds the package's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsmith.errors import ConfigError

__all__ = ["FaultConfig"]


@dataclass(kw_only=True)
class FaultConfig:
    """How the trainer survives failures (the modules of this package).

    Attributes:
        preempt_deadline: seconds from the first SIGTERM/SIGUSR1 to a committed checkpoint
            and exit 0; a rank still busy after that exits 1 (stacks dumped).
        collective_timeout: seconds a training collective (every group of the mesh, gloo
            and NCCL) may wait for its peers before it fails, from the first step on.
        init_timeout: the timeout before that (``init_process_group(timeout=max(init_timeout,
            collective_timeout))``): start-up, resume and the first step wait for the slowest
            process; the background checkpoint group keeps it too.
        hang_factor: the watchdog dumps every thread's stack of a rank whose current step
            has run longer than ``max(hang_min_seconds, hang_factor * median step time)``.
        hang_min_seconds: lower bound of that threshold (the first step's threshold is
            ``hang_factor * hang_min_seconds``: no median exists yet).
        max_bad_steps: this many consecutive steps with a non-finite loss or gradient norm
            (each skipped) roll back to the last committed checkpoint and skip their data.
        max_rollbacks: more rollbacks than this in one process fail the run.
        peak_flops: peak FLOP/s of one device for model-FLOPs utilization (e.g. 989e12 for
            an H100 SXM in bf16 dense); 0 = do not report MFU.
        derive_dp_shard: ``dp_shard`` was not fixed by the user (``--dp-shard -1``): when the
            job's world size differs from the layout (an elastic restart with fewer or more
            processes) it is re-derived as ``world / (pp * dp_replicate * tp)``.

    The time fields keep their names (``preempt_deadline`` …, ``hang_min_seconds``; all in
    seconds): they are saved in every manifest's config and are the ``train`` flags' targets.
    """

    preempt_deadline: float = 300.0
    collective_timeout: float = 600.0
    init_timeout: float = 600.0
    hang_factor: float = 10.0
    hang_min_seconds: float = 60.0
    max_bad_steps: int = 3
    max_rollbacks: int = 3
    peak_flops: float = 0.0
    derive_dp_shard: bool = False

    def __post_init__(self) -> None:
        for name in ("preempt_deadline", "collective_timeout", "init_timeout", "hang_min_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fault.{name}={getattr(self, name)}: must be > 0 seconds")
        if not self.hang_factor > 1:
            raise ConfigError(
                f"fault.hang_factor={self.hang_factor}: must be > 1 (a multiple of the "
                "median step time)"
            )
        if self.max_bad_steps < 1:
            raise ConfigError(f"fault.max_bad_steps={self.max_bad_steps}: must be >= 1")
        if self.max_rollbacks < 0:
            raise ConfigError(f"fault.max_rollbacks={self.max_rollbacks}: must be >= 0")
        if self.peak_flops < 0:
            raise ConfigError(
                f"fault.peak_flops={self.peak_flops}: must be >= 0 FLOP/s (0 = no MFU)"
            )
