"""The training loop: build the stage, parallelize, resume, step, checkpoint.

Every rank runs :func:`run_training` with the same config (launched by torchrun). The
checkpoint policy lives in :mod:`shardsmith.trainer.checkpoint.policy`, the step's math in
:mod:`shardsmith.trainer.step`. The loop survives failures (:mod:`shardsmith.trainer.fault`):
after an elastic restart it resumes from the newest committed checkpoint, in whatever
layout the new world size gives; SIGTERM/SIGUSR1 checkpoint at the next step boundary and
return; a non-finite loss or gradient norm skips the update, and too many in a row roll
back; a watchdog dumps the stacks of a hung step. What happened goes to ``metrics.jsonl``
(:mod:`shardsmith.trainer.observe.metrics`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardsmith.layout import flops_per_token, reshards_after_forward
from shardsmith.storage import read_manifest
from shardsmith.trainer.checkpoint.policy import CheckpointPolicy, TrainState
from shardsmith.trainer.checkpoint.resume import schedule_change
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.data import GlobalBatchSampler, build_dataset
from shardsmith.trainer.detect import DetectConfig
from shardsmith.trainer.detect.goodput import breakdown, goodput_line, launch_time
from shardsmith.trainer.detect.watch import Detectors
from shardsmith.trainer.fault.bad_steps import BadStepPolicy
from shardsmith.trainer.fault.elastic import (
    elastic_restart_count,
    fit_world_size,
    warn_if_restarts_unsafe,
)
from shardsmith.trainer.fault.guard import FaultGuard
from shardsmith.trainer.fault.hooks import FaultHooks
from shardsmith.trainer.fault.watchdog import apply_collective_timeout, set_group_timeouts
from shardsmith.trainer.moe import router_stats
from shardsmith.trainer.observe.console import (
    EtaClock,
    duration,
    known_peak_flops,
    peak_memory_nbytes,
)
from shardsmith.trainer.observe.metrics import (
    EventLog,
    MetricsWriter,
    announced_run_dir,
    iter_json_lines,
    run_dir,
    step_line,
    step_record,
)
from shardsmith.trainer.observe.profiling import profile_step
from shardsmith.trainer.optim import build_optimizer, lr_lambda
from shardsmith.trainer.parallel import (
    build_grad_sum_groups,
    build_mesh,
    build_stage_model,
    device_type,
    end_distributed,
    finalize_grads,
    init_distributed,
)
from shardsmith.trainer.rng import seed_rng
from shardsmith.trainer.step import StepMath, StepMetrics

__all__ = ["Trainer", "run_training"]

log = logging.getLogger("shardsmith.train")


@dataclass
class Trainer:
    """All state of one rank's training job: build with :meth:`create`, then :meth:`run`.

    Attributes (beyond the config and this rank's place in the mesh):
        state: the model, optimizer, scheduler, data position and counters a checkpoint holds.
        step_math: forward/backward, gradient norm and global loss of a step.
        checkpointing: when to save, what to resume from, rollbacks.
        events: the metrics.jsonl channel (rank 0 writes).
        restarts: torchrun's restart count of this worker group.
        preempted: :meth:`run` returned early after a preemption checkpoint.
    """

    cfg: TrainConfig
    rank: int
    coords: dict[str, int]
    state: TrainState
    step_math: StepMath
    checkpointing: CheckpointPolicy
    events: EventLog
    history: list[StepMetrics] = field(default_factory=list)
    grad_sum_groups: dict = field(default_factory=dict)
    hooks: FaultHooks = field(default_factory=lambda: FaultHooks(0, env={}))
    flops_token: float = 0.0
    restarts: int = 0
    preempted: bool = False
    mesh: Any = field(default=None, repr=False)
    guard: FaultGuard | None = field(default=None, repr=False)
    eta: EtaClock = field(default_factory=EtaClock, repr=False)
    detect: Detectors = field(
        default_factory=lambda: Detectors(DetectConfig(straggler_every=0), lambda r: None),
        repr=False,
    )

    def __post_init__(self) -> None:
        self.hooks.slow_inside(self.state.model)  # tests only: a rank slow inside its forward

    @classmethod
    def create(cls, cfg: TrainConfig) -> "Trainer":
        """Build everything for this rank; every rank must call it (collective)."""
        apply_collective_timeout(max(cfg.fault.init_timeout, cfg.fault.collective_timeout))
        init_distributed()
        parallel = cfg.parallel
        cfg.check_layout()  # the launcher checked it too (a library caller may not)
        mesh = build_mesh(parallel)
        rank = dist.get_rank()
        coords = parallel.coords(rank)
        sampler = _build_sampler(cfg, coords)
        reshard = reshards_after_forward(cfg.fsdp_reshard_after_forward, parallel.pp)
        model, stage = build_stage_model(
            cfg.model,
            parallel,
            mesh,
            seed=cfg.seed,
            bf16=cfg.mixed_precision == "bf16",
            activation_checkpointing=cfg.ac_policy,
            sequence_parallel=cfg.sequence_parallel,
            compile=cfg.compile,
            reshard_after_forward=reshard,
        )
        seed_rng(cfg.seed, 0, coords)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.optim, cfg.optim.decay_steps or cfg.steps)
        )
        state = TrainState(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
            bad_steps=BadStepPolicy(max_bad_steps=cfg.fault.max_bad_steps),
        )
        step_math = StepMath.for_job(cfg, model, stage.index, mesh, coords)
        events = EventLog(
            MetricsWriter(
                announced_run_dir(cfg) if rank == 0 else "",
                wandb=cfg.wandb,
                config=cfg.to_json() if cfg.wandb else None,
            ),
            rank=rank,
        )
        grad_sum_groups = build_grad_sum_groups(cfg.model, parallel)
        restarts = elastic_restart_count()
        replicas = mesh["dp_replicate"].get_group() if parallel.dp_replicate > 1 else None
        siblings = mesh["tp"].get_group() if parallel.tp > 1 else None
        checkpointing = CheckpointPolicy(
            cfg,
            state,
            rank=rank,
            coords=coords,
            restarts=restarts,
            event=events,
            replica_group=replicas,
            sibling_group=siblings,
        )
        return cls(
            cfg=cfg,
            rank=rank,
            coords=coords,
            state=state,
            step_math=step_math,
            checkpointing=checkpointing,
            events=events,
            grad_sum_groups=grad_sum_groups,
            hooks=FaultHooks(rank),
            flops_token=flops_per_token(cfg.model),
            restarts=restarts,
            mesh=mesh,
            detect=Detectors(cfg.detect, events, torch.device(device_type()), parallel),
        )

    # ---- what tests and callers read ---------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """This rank's (parallelized) stage."""
        return self.state.model

    @property
    def step(self) -> int:
        """Optimizer steps taken (including skipped bad steps)."""
        return self.state.step

    def save(self) -> None:
        """Checkpoint the current step (collective); see :meth:`CheckpointPolicy.save`."""
        self.checkpointing.save()

    def wait_for_save(self) -> None:
        """Wait for an in-flight background save; raises SaveError if it failed."""
        self.checkpointing.wait(final=True)

    def resume(self) -> bool:
        """Resume as configured (collective); see :meth:`CheckpointPolicy.resume`."""
        return self.checkpointing.resume()

    # ---- one step -------------------------------------------------------------------------

    def train_step(self) -> StepMetrics:
        """One optimizer step on the next global batch (collective: every rank calls it).

        A non-finite global loss or gradient norm skips the update: gradients are dropped,
        neither optimizer nor LR scheduler steps, the step number still advances (as
        Megatron counts skipped iterations); ``state.bad_steps`` counts it and says when a
        rollback is due. The decision uses all-reduced values, so it is the same on all ranks.
        """
        t0 = time.perf_counter()
        state, step_math = self.state, self.step_math
        step = state.step + 1
        self._skip_bad_data()
        start = state.sampler.sample_index
        inputs, targets = state.sampler.next_local_batch()
        state.optimizer.zero_grad(set_to_none=True)
        rng = self.detect.rng_before(step)
        with self.detect.step_clock() as clock:  # own work vs. blocked in collectives
            local_loss = step_math.forward_backward(inputs, targets)
            self.hooks.slow_down()
            moe = router_stats(state.model, self.cfg.model)
            sdc = self.detect.check_replay(
                step,
                state.model,
                lambda: step_math.forward_backward(inputs, targets),
                rng,
                lambda model: self.hooks.flip_bit(step, model),
            )
            finalize_grads(state.model, self.grad_sum_groups)
            local_loss = self.hooks.corrupt(
                start // self.cfg.global_batch_size, state.model, local_loss
            )
            self.hooks.in_step(step)
            loss = step_math.global_loss(local_loss)
            grad_norm = step_math.grad_norm_and_clip()
        lr = state.optimizer.param_groups[0]["lr"]
        verdict = state.bad_steps.observe(loss, grad_norm, start, state.sampler.sample_index)
        if verdict != "ok":
            self.detect.bad_step(step, state.model, float(local_loss))
        tokens = self.cfg.global_batch_size * self.cfg.model.seq_length
        if verdict == "ok" and sdc == "ok":
            state.optimizer.step()
            state.scheduler.step()
            state.tokens_seen += tokens
        else:
            state.optimizer.zero_grad(set_to_none=True)
        state.step = step
        detect = self.detect.timed(step, clock.own_s, clock.blocked_s)
        metrics = StepMetrics(
            step,
            loss,
            grad_norm,
            lr,
            time.perf_counter() - t0,
            tokens,
            skipped=verdict != "ok" or sdc != "ok",
            moe=moe,
            detect=detect,
        )
        self.history.append(metrics)
        return metrics

    def _skip_bad_data(self) -> None:
        """Jump over a data window that a rollback marked bad."""
        sampler = self.state.sampler
        index = self.state.bad_steps.next_sample(sampler.sample_index)
        if index != sampler.sample_index:
            self.events(
                {
                    "event": "data_skip",
                    "step": self.step,
                    "from_sample": sampler.sample_index,
                    "to_sample": index,
                }
            )
            sampler.load_state_dict({"sample_index": index})

    def _log_step(self, m: StepMetrics) -> None:
        bad_steps = self.state.bad_steps
        record = step_record(
            step=m.step,
            loss=m.loss,
            lr=m.lr,
            grad_norm=m.grad_norm,
            duration_s=m.duration_s,
            tokens=m.tokens,
            skipped=m.skipped,
            flops_token=self.flops_token,
            peak_flops=self.cfg.fault.peak_flops or known_peak_flops(),
            world_size=self.cfg.parallel.world_size,
            counters={
                "skipped_steps": bad_steps.skipped_steps,
                "rollbacks": bad_steps.rollbacks,
                "restarts": self.restarts,
            },
        )
        record.update(m.moe)
        record.update(m.detect)
        record.update(
            steps=self.cfg.steps,
            tokens_seen=self.state.tokens_seen,
            peak_mem_nbytes=peak_memory_nbytes(),
            eta_s=round(self.eta.eta_s(m.duration_s, self.cfg.steps - m.step), 1),
        )
        self.events(record)
        if m.skipped:
            self.events(
                {
                    "event": "bad_step",
                    "step": m.step,
                    "loss": repr(m.loss),
                    "grad_norm": repr(m.grad_norm),
                    "consecutive": bad_steps.consecutive,
                    "skipped_steps": bad_steps.skipped_steps,
                }
            )
        if self.rank == 0 and self.cfg.log_interval and m.step % self.cfg.log_interval == 0:
            print(step_line(record), flush=True)

    # ---- loop -----------------------------------------------------------------------------

    def run(self) -> list[StepMetrics]:
        """Resume if asked, train to ``cfg.steps``, checkpointing as configured.

        Returns early, with :attr:`preempted` set, after a SIGTERM/SIGUSR1 on any rank:
        the step boundary's all-reduce makes every rank checkpoint that step and return.
        Collective: every rank calls it.

        Raises:
            TrainingDiverged: bad steps could not be rolled back.
            SaveError: a checkpoint failed.
        """
        self.events.hold()  # a start whose resume is refused leaves metrics.jsonl as it was
        self._arm()
        t0 = time.perf_counter()
        try:
            self._resume_and_report()
            self.events.release()
            while self.step < self.cfg.steps and not self.preempted:
                self._iteration()
            if not self.preempted and self.checkpointing.final_due():
                self.save()
            self.wait_for_save()
            accounted = self._goodput() if self.rank == 0 else ""
        finally:
            self._disarm()
        if self.rank == 0 and not self.preempted:
            print(
                f"done: step {self.step}/{self.cfg.steps}, {len(self.history)} steps in "
                f"{duration(time.perf_counter() - t0)}{accounted}",
                file=sys.stderr,
                flush=True,
            )
        return self.history

    def _goodput(self) -> str:
        """Rank 0: the run's ``goodput`` event (:mod:`shardsmith.trainer.detect.goodput`), from
        its metrics.jsonl; ``"; goodput ..."`` for the final line, ``""`` without a run directory."""
        path = self.events.writer.path
        if not path or not os.path.exists(path):
            return ""
        g = breakdown(iter_json_lines(path), end_time=time.time())
        self.events({"event": "goodput", "step": self.step, **g})
        return "; " + goodput_line(g)

    def _resume_and_report(self) -> None:
        """Resume; say when the resumed step is at or past ``--steps`` and when the LR
        schedule differs from the one the checkpoint was trained on (a ``schedule_change`` event)."""
        if not self.resume() or self.checkpointing.resumed_from is None:
            return
        src = self.checkpointing.resumed_from
        if self.step >= self.cfg.steps and self.rank == 0:
            print(
                f"step {self.step} is at or past --steps {self.cfg.steps}: nothing to train",
                file=sys.stderr,
                flush=True,
            )
        if self.rank == 0:
            saved = read_manifest(src[0])
            if message := schedule_change(saved.config, self.cfg, self.step, saved.state):
                self.events({"event": "schedule_change", "step": self.step, "message": message})

    def _iteration(self) -> None:
        """One step, then its boundary: agree on preemption, roll back or save."""
        assert self.guard is not None
        self.hooks.at_step_start(self.step + 1, on_node_loss=self.checkpointing.lose_local_node)
        self.guard.begin(self.step + 1)
        with profile_step(self.step + 1, self.cfg.profile_steps, run_dir(self.cfg), self.rank):
            m = self.train_step()
        preempt = self.guard.end()
        if len(self.history) == 1:  # start-up is over: training timeouts from now on
            groups = [None, *self.grad_sum_groups.values()]
            groups += self.mesh.get_all_groups() if self.mesh is not None else []
            set_group_timeouts(self.cfg.fault.collective_timeout, groups)
        self._log_step(m)
        bad_steps = self.state.bad_steps
        if bad_steps.consecutive >= bad_steps.max_bad_steps:
            self.checkpointing.roll_back()
        elif self.checkpointing.interval_due(m.step):  # either tier (local: every N steps)
            self.checkpointing.save(persistent=self.checkpointing.persistent_due(m.step))
        if preempt:
            self._preempt()

    def _preempt(self) -> None:
        """Checkpoint the current step (unless just saved), wait for the commit, and mark
        the run preempted (collective)."""
        assert self.guard is not None
        t0 = time.perf_counter()
        has_root = self.checkpointing.root is not None
        if not has_root:
            log.warning("preempted with no --ckpt: progress since the start is lost")
        elif self.checkpointing.final_due(preempted=True):
            self.save()
        self.wait_for_save()
        self.guard.preemption.done()
        self.preempted = True
        self.events(
            {
                "event": "preempt",
                "step": self.step,
                "seconds": round(time.perf_counter() - t0, 4),
                "signal": self.guard.signal_name(),
                "checkpoint": has_root,
            }
        )
        if self.rank == 0:
            how = "interrupted" if self.guard.signal_name() == "SIGINT" else "preempted"
            saved = "checkpoint committed" if has_root else "nothing saved (no --ckpt)"
            print(f"{how} at step {self.step}: {saved}; exiting", file=sys.stderr, flush=True)

    def _arm(self) -> None:
        """Start the watchdog and the signal handlers; log the start."""
        directory = run_dir(self.cfg)
        dump = (
            os.path.join(directory, "hang-stacks", f"rank-{self.rank:05d}.txt") if directory else ""
        )
        self.guard = FaultGuard(self.cfg.fault, dump_path=dump, on_hang=self._on_hang)
        self.events(
            {
                "event": "start",
                "launch_time": round(launch_time(), 3),
                "restart_count": self.restarts,
                "world_size": self.cfg.parallel.world_size,
                "layout": self.cfg.parallel.to_json(),
                "steps": self.cfg.steps,
            }
        )

    def _disarm(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.events.close()

    def _on_hang(self, step: int, duration_s: float, threshold_s: float) -> None:
        self.events(
            {
                "event": "hang_suspected",
                "step": step,
                "seconds": round(duration_s, 3),
                "threshold": round(threshold_s, 3),
            }
        )


def _build_sampler(cfg: TrainConfig, coords: dict[str, int]) -> GlobalBatchSampler:
    """This rank's view of the global batches (its DP rank's slice of each)."""
    dataset = build_dataset(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    parallel = cfg.parallel
    return GlobalBatchSampler(
        dataset,
        global_batch_size=cfg.global_batch_size,
        dp_degree=parallel.dp,
        dp_rank=parallel.dp_rank(coords),
    )


def run_training(cfg: TrainConfig) -> list[StepMetrics]:
    """Entry point of one rank (collective): fit the layout to the world size, build,
    resume, train, checkpoint, tear down. Returns early (exit 0 for the worker) after a
    preemption checkpoint."""
    warn_if_restarts_unsafe()
    world = int(os.environ.get("WORLD_SIZE", cfg.parallel.world_size))
    trainer = Trainer.create(fit_world_size(cfg, world))
    try:
        return trainer.run()
    finally:
        end_distributed()
