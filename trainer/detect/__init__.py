"""Detect, attribute and account: which rank is slow, which rank computes wrong, where a
non-finite value appeared, and how much of the wall time became training.

One module per concern, each called by the training loop
(:class:`~shardsmith.trainer.train.Trainer`):

* :mod:`.straggler`: per-rank compute and collective-wait time of each step, all-gathered
  every ``straggler_every`` steps; a ``straggler`` event names the ranks whose compute time
  exceeds the median by ``straggler_factor`` for ``straggler_windows`` windows in a row.
* :mod:`.replay`: ``--check-replay-every N`` re-runs a step's forward and backward from the
  same inputs and RNG state and compares each rank's gradients (bitwise on CPU); an ``sdc``
  event names the rank and tensor; ``--on-sdc`` says what happens next.
* :mod:`.nonfinite`: on a step whose loss or gradient norm is not finite, a ``nonfinite``
  event names the first rank and parameter where it appeared.
* :mod:`.goodput`: productive time, lost work, checkpoint blocking, restart and recovery,
  start-up, as fractions of the wall time, from ``metrics.jsonl`` (pure).

This module holds the package's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsmith.errors import ConfigError

__all__ = ["DetectConfig", "SDC_POLICIES"]

#: ``--on-sdc`` choices. There is no ``skip-rank``: every rank of a TP x PP x FSDP job holds a
#: part of the model or of the optimizer state no other rank has, so a synchronous step
#: cannot go on without one of them; replacing a rank is a restart (``stop``, then the
#: supervisor's warm spare under ``--restart in-process``).
SDC_POLICIES = ("stop", "skip-step", "continue")


@dataclass(kw_only=True)
class DetectConfig:
    """What the detectors of this package watch, and how often.

    Attributes:
        straggler_every: steps per straggler window: each rank's compute and wait times are
            all-gathered once per window (0 = off).
        straggler_factor: a rank is slow in a window when its mean compute time exceeds the
            median over ranks by this factor.
        straggler_windows: windows in a row a rank must be slow before the ``straggler`` event.
        check_replay_every: re-run every N-th step's forward and backward and compare the
            gradients (0 = off).
        on_sdc: after a replay mismatch: ``stop`` (raise on every rank), ``skip-step`` (drop
            the step's update, as a bad step) or ``continue`` (report only).
        replay_tolerance: largest allowed ``|original - replay|`` relative to the tensor's
            largest magnitude; negative = automatic: 0 (bitwise) on CPU, 1e-5 on CUDA, whose
            split-K GEMMs and atomic adds in backward reorder float sums between runs.
    """

    straggler_every: int = 100
    straggler_factor: float = 1.5
    straggler_windows: int = 3
    check_replay_every: int = 0
    on_sdc: str = "stop"
    replay_tolerance: float = -1.0

    def __post_init__(self) -> None:
        for name in ("straggler_every", "check_replay_every"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"detect.{name}={getattr(self, name)}: must be >= 0 steps (0 = off)"
                )
        if not self.straggler_factor > 1:
            raise ConfigError(
                f"detect.straggler_factor={self.straggler_factor}: must be > 1 (a multiple "
                "of the median compute time)"
            )
        if self.straggler_windows < 1:
            raise ConfigError(f"detect.straggler_windows={self.straggler_windows}: must be >= 1")
        if self.on_sdc not in SDC_POLICIES:
            raise ConfigError(
                f"detect.on_sdc={self.on_sdc!r}: choose one of {', '.join(SDC_POLICIES)}"
            )
