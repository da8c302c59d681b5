"""The detectors the training loop holds: one object, four calls per step at most
(:class:`Detectors`); what each costs is in its own module."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardsmith.layout import ParallelDims
from shardsmith.trainer.detect import DetectConfig
from shardsmith.trainer.detect.nonfinite import attribute_nonfinite
from shardsmith.trainer.detect.replay import judge_replay, replay_mismatches, rng_state, tolerance
from shardsmith.trainer.detect.straggler import StragglerWatch
from shardsmith.trainer.detect.waits import StepClock, step_clock


@dataclass
class Detectors:
    """Stragglers, replay checks and non-finite attribution of one rank (every rank holds one
    and calls each method at the same steps: some are collective).

    Attributes:
        cfg: what to watch and how often.
        event: the run's event channel (rank 0 writes).
        device: where the model computes (picks the replay tolerance).
        dims: the job's layout: a straggler is judged against the ranks of its pipeline stage.
    """

    cfg: DetectConfig
    event: Callable[[dict[str, Any]], None]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dims: ParallelDims | None = None
    straggler: StragglerWatch = field(init=False)
    replayed: str = field(default="", init=False)

    def __post_init__(self) -> None:
        dims = self.dims
        stages = [dims.coords(r)["pp"] for r in range(dims.world_size)] if dims else []
        self.straggler = StragglerWatch(self.cfg, stages)

    def step_clock(self) -> contextlib.AbstractContextManager[StepClock]:
        """Time a step: its wall time and the part blocked in collectives (:mod:`.waits`;
        local). Without straggler windows nothing is wrapped or timed."""
        if self.cfg.straggler_every > 0:
            return step_clock()
        return contextlib.nullcontext(StepClock())

    def replay_due(self, step: int) -> bool:
        """Step ``step`` is re-run and compared (the same answer on every rank)."""
        every = self.cfg.check_replay_every
        return every > 0 and step % every == 0

    def rng_before(self, step: int) -> dict[str, Any] | None:
        """The RNG state to replay from, on replay steps (call before the forward)."""
        return rng_state() if self.replay_due(step) else None

    def check_replay(
        self,
        step: int,
        model: torch.nn.Module,
        rerun: Callable[[], Any],
        rng: dict[str, Any] | None,
        after_replay: Callable[[torch.nn.Module], None] | None = None,
    ) -> str:
        """On replay steps (``rng`` not None): re-run, compare, report, apply ``on_sdc``
        (collective); ``"ok"`` or ``"skip"``. The outcome (``match`` or ``mismatch``) goes
        into the step's record as ``replay`` (:meth:`timed`). See :mod:`.replay`."""
        if rng is None:
            return "ok"
        mine = replay_mismatches(model, rerun, rng, tolerance(self.cfg, self.device), after_replay)
        verdict = judge_replay(step, mine, self.cfg, self.event)
        self.replayed = "match" if verdict == "match" else "mismatch"
        return "skip" if verdict == "skip" else "ok"

    def timed(self, step: int, compute_s: float, wait_s: float) -> dict[str, Any]:
        """Record a step's own-work and collective-wait times; at a window's end all-gather and judge
        (collective). Returns the fields for the step record (see :mod:`.straggler`), and
        ``replay`` after a replay check."""
        replay = {"replay": self.replayed} if self.replayed else {}
        self.replayed = ""
        watch = self.straggler
        watch.record(compute_s, wait_s)
        if not watch.due(step):
            return replay
        fields, straggler = watch.close_window(step)
        if straggler is not None:
            self.event(straggler)
        return {**fields, **replay}

    def bad_step(self, step: int, model: torch.nn.Module, local_loss: float) -> None:
        """Name where a non-finite loss or gradient norm came from (collective, on bad steps)."""
        self.event(attribute_nonfinite(step, model, local_loss))
