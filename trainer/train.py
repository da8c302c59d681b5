"""The training loop: build the stage, parallelize, resume, step, checkpoint.

Every rank runs :func:`run_training` with the same config (launched by torchrun). The
loop survives failures (see :mod:`shardsmith.trainer.fault`): after an elastic restart it
resumes from the newest committed checkpoint, in whatever layout the new world size
gives; SIGTERM/SIGUSR1 checkpoint at the next step boundary and return; a non-finite
loss or gradient norm skips the update, and too many in a row roll back; a watchdog
dumps the stacks of a hung step. What happened goes to ``metrics.jsonl``
(:mod:`shardsmith.trainer.metrics`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardsmith.layout import validate_layout
from shardsmith.layout.plan import checkpoint_specs, param_specs, rank_boxes
from shardsmith.storage.commit import (find_latest_committed, open_manifest, read_manifest, resolve_checkpoint,
                                       step_dir)
from shardsmith.storage.fs import Store
from shardsmith.storage.gc import gc_after_commit
from shardsmith.storage.manifest import MANIFEST_NAME
from shardsmith.trainer.async_save import AsyncCheckpointer
from shardsmith.trainer.checkpoint import (SaveResult, gather_json, init_optimizer_state, load_into,
                                           model_state_tensors, save_checkpoint)
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.data import GlobalBatchSampler, TokenDataset, load_tokens, vocab_size_needed
from shardsmith.trainer.fault import (BadStepPolicy, FaultGuard, TrainingDiverged, any_rank,
                                      apply_collective_timeout, choose_resume, elastic_restart_count,
                                      fit_world_size, set_group_timeouts, warn_if_restarts_unsafe)
from shardsmith.trainer.fault_hooks import FaultHooks
from shardsmith.trainer.metrics import (MetricsWriter, flops_per_token, iter_json_lines,  # noqa: F401
                                        run_dir, step_line, step_record)
from shardsmith.trainer.optim import build_optimizer, lr_lambda
from shardsmith.trainer.parallel import (build_grad_sum_groups, build_mesh, build_stage_model, device_type,
                                        init_distributed, parallelize, finalize_grads)
from shardsmith.trainer.rng import apply_rng, gather_rng, seed_rng

log = logging.getLogger("shardsmith.train")


@dataclass
class StepMetrics:
    """What one optimizer step produced (the same on every rank).

    Attributes:
        step: global step number (1-based).
        loss: mean loss over the global batch (not finite for a bad step).
        grad_norm: global L2 norm of the gradients, before clipping.
        lr: learning rate of the step.
        seconds: wall time of the step on this rank.
        tokens: tokens in the global batch.
        skipped: the update was not applied (non-finite loss or gradient norm).
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    tokens: int
    skipped: bool = False


@dataclass
class Trainer:
    """All state of one rank's training job. Build with :meth:`create`.

    Attributes (beyond the model and its optimizer):
        restarts: torchrun's restart count of this worker group.
        preempted: :meth:`run` returned early after a preemption checkpoint.
        last_saved_step: step of the newest checkpoint saved or loaded by this job.
    """

    cfg: TrainConfig
    rank: int
    coords: dict[str, int]
    model: torch.nn.Module
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: GlobalBatchSampler
    schedule: Any
    num_microbatches: int
    step: int = 0
    tokens_seen: int = 0
    history: list[StepMetrics] = field(default_factory=list)
    root: Store | None = None
    checkpointer: AsyncCheckpointer | None = None
    grad_sum_groups: dict = field(default_factory=dict)
    bad_steps: BadStepPolicy = field(default_factory=lambda: BadStepPolicy(max_bad_steps=3))
    hooks: FaultHooks = field(default_factory=lambda: FaultHooks(0, env={}))
    metrics: MetricsWriter = field(default_factory=lambda: MetricsWriter(""))
    flops_token: float = 0.0
    restarts: int = 0
    preempted: bool = False
    last_saved_step: int = -1
    mesh: Any = field(default=None, repr=False)
    guard: FaultGuard | None = field(default=None, repr=False)

    @classmethod
    def create(cls, cfg: TrainConfig) -> "Trainer":
        """Build everything for this rank; every rank must call it (collective)."""
        apply_collective_timeout(max(cfg.fault.init_timeout, cfg.fault.collective_timeout))
        init_distributed()
        dims = cfg.parallel
        validate_layout(cfg.model, dims)
        num_mb = cfg.num_microbatches()
        mesh = build_mesh(dims)
        rank = dist.get_rank()
        coords = dims.coords(rank)
        tokens = load_tokens(cfg.data)
        if vocab_size_needed(tokens) > cfg.model.vocab_size:
            raise ValueError(f"data needs vocab_size >= {vocab_size_needed(tokens)}, model has "
                             f"{cfg.model.vocab_size}; pass --vocab-size")
        dataset = TokenDataset(tokens, cfg.model.seq_length, cfg.data.seed)
        dp_rank = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]
        sampler = GlobalBatchSampler(dataset, global_batch_size=cfg.global_batch_size,
                                     dp_degree=dims.dp, dp_rank=dp_rank)
        model, stage = build_stage_model(cfg.model, dims, coords["pp"], cfg.seed)
        seed_rng(cfg.seed, 0, coords)
        model = model.to(device_type())
        parallelize(model, mesh, dims, bf16=cfg.mixed_precision == "bf16",
                    activation_checkpointing=cfg.activation_checkpointing)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.optim.decay_steps or cfg.steps))
        schedule = None
        if dims.pp > 1:
            pipe = PipelineStage(model, stage.index, stage.num_stages, torch.device(device_type()),
                                 group=mesh["pp"].get_group())
            schedule = Schedule1F1B(pipe, n_microbatches=num_mb, loss_fn=_loss_fn)
        root = Store(cfg.checkpoint.url, cfg.checkpoint.storage_options) if cfg.checkpoint.url else None
        trainer = cls(cfg=cfg, rank=rank, coords=coords, model=model, optimizer=optimizer,
                      scheduler=scheduler, sampler=sampler, schedule=schedule,
                      num_microbatches=num_mb, root=root, mesh=mesh,
                      bad_steps=BadStepPolicy(max_bad_steps=cfg.fault.max_bad_steps),
                      hooks=FaultHooks(rank), metrics=MetricsWriter(run_dir(cfg) if rank == 0 else ""),
                      flops_token=flops_per_token(cfg.model), restarts=elastic_restart_count())
        trainer.grad_sum_groups = build_grad_sum_groups(cfg.model, dims)
        if root is not None and cfg.checkpoint.async_save:
            trainer.checkpointer = AsyncCheckpointer(root, cfg.model, dims, on_commit=trainer._on_commit,
                                                     tensor_format=cfg.checkpoint.tensor_format,
                                                     zarr_codec=cfg.checkpoint.zarr_codec)
            trainer.checkpointer.overlap_with(optimizer)   # snapshot overlaps fwd/bwd; step waits
        return trainer

    # ---- one step -------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.mixed_precision == "bf16":
            return torch.autocast(device_type(), dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_ctx(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.cfg.parallel.tp > 1 else contextlib.nullcontext()

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run all microbatches of this rank's batch; returns the mean loss on this rank's
        batch (only meaningful on the last pipeline stage; 0 elsewhere)."""
        dev = device_type()
        inputs, targets = inputs.to(dev), targets.to(dev)
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            with self._loss_ctx(), self._autocast():
                if self.coords["pp"] == 0:
                    self.schedule.step(inputs)
                elif self.coords["pp"] == self.cfg.parallel.pp - 1:
                    self.schedule.step(target=targets, losses=losses)
                else:
                    self.schedule.step()
            if not losses:
                return torch.zeros(())
            return torch.stack([_plain(l).float() for l in losses]).mean()
        total = torch.zeros(())
        for x, y in zip(inputs.chunk(self.num_microbatches), targets.chunk(self.num_microbatches)):
            with self._loss_ctx():
                with self._autocast():
                    logits = self.model(x)
                loss = _loss_fn(logits, y) / self.num_microbatches
                loss.backward()
            total += _plain(loss.detach()).float().cpu()
        return total

    def _grad_norm_and_clip(self) -> float:
        """Global L2 norm of all gradients, then clip to ``optim.grad_clip``.

        Each rank sums the squares of its local gradient shards, divided by the number of
        ranks holding the same shard (replicas over dp_replicate / tp, from the sharding
        plan), and one all-reduce over the world gives the exact global sum.
        """
        dims = self.cfg.parallel
        specs = param_specs(self.cfg.model, dims)
        total = torch.zeros((), dtype=torch.float64)
        grads = []
        for fqn, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.append(g)
            used = {a for axes in specs[fqn].dim_axes for a in axes}
            replicas = prod(getattr(dims, a) for a in ("dp_replicate", "dp_shard", "tp") if a not in used)
            replicas *= specs[fqn].tp_replicas * len(specs[fqn].stages)   # tied copies
            total += g.double().pow(2).sum().cpu() / replicas
        dist.all_reduce(total)
        norm = float(total.sqrt())
        clip = self.cfg.optim.grad_clip
        if clip > 0 and norm > clip:
            coef = clip / (norm + 1e-6)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return norm

    def _global_loss(self, local: torch.Tensor) -> float:
        """Mean loss over the global batch: last-stage, tp-rank-0 ranks contribute, divided by dp."""
        contributes = self.coords["pp"] == self.cfg.parallel.pp - 1 and self.coords["tp"] == 0
        t = (local.double().cpu() if contributes else torch.zeros((), dtype=torch.float64)).reshape(1)
        dist.all_reduce(t)
        return float(t.item() / self.cfg.parallel.dp)

    def train_step(self) -> StepMetrics:
        """One optimizer step on the next global batch (collective: every rank calls it).

        A non-finite global loss or gradient norm skips the update: gradients are dropped,
        neither optimizer nor LR scheduler steps, the step number still advances (as
        Megatron counts skipped iterations); :attr:`bad_steps` counts it and says when a
        rollback is due. The decision uses all-reduced values, so it is the same on all ranks.
        """
        t0 = time.perf_counter()
        step = self.step + 1
        self._skip_bad_data()
        start = self.sampler.sample_index
        inputs, targets = self.sampler.next_local_batch()
        self.optimizer.zero_grad(set_to_none=True)
        local_loss = self._forward_backward(inputs, targets)
        finalize_grads(self.model, self.grad_sum_groups)
        local_loss = self.hooks.corrupt(start // self.cfg.global_batch_size, self.model, local_loss)
        self.hooks.in_step(step)
        loss = self._global_loss(local_loss)
        grad_norm = self._grad_norm_and_clip()
        lr = self.optimizer.param_groups[0]["lr"]
        verdict = self.bad_steps.observe(loss, grad_norm, start, self.sampler.sample_index)
        tokens = self.cfg.global_batch_size * self.cfg.model.seq_length
        if verdict == "ok":
            self.optimizer.step()
            self.scheduler.step()
            self.tokens_seen += tokens
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        metrics = StepMetrics(step, loss, grad_norm, lr, time.perf_counter() - t0, tokens,
                              skipped=verdict != "ok")
        self.history.append(metrics)
        return metrics

    def _skip_bad_data(self) -> None:
        """Jump over a data window that a rollback marked bad."""
        index = self.bad_steps.next_sample(self.sampler.sample_index)
        if index != self.sampler.sample_index:
            self._event({"event": "data_skip", "step": self.step, "from_sample": self.sampler.sample_index,
                         "to_sample": index})
            self.sampler.load_state_dict({"sample_index": index})

    # ---- checkpoints ----------------------------------------------------------------------

    def state_json(self) -> dict[str, Any]:
        """Non-tensor state saved in the manifest (without ``rng``: :meth:`save` gathers it)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "data": self.sampler.state_dict(), "lr_scheduler": self.scheduler.state_dict(),
                "fault": self.bad_steps.state_json()}

    def save(self) -> None:
        """Checkpoint the current step (collective). With ``async_save`` this returns after
        the host snapshot and the commit happens in the background (see :meth:`wait_for_save`).

        The state includes every rank's RNG state by role (all-gathered, see
        :mod:`shardsmith.trainer.rng`). A step that is already committed (a job sent back to
        an older step) is un-committed first, so no reader ever sees old manifest + new data.

        Raises:
            SaveError: this save failed (sync) or the previous background save failed (async).
        """
        assert self.root is not None
        self._uncommit(self.step)
        init_optimizer_state(self.model, self.optimizer)
        tensors = model_state_tensors(self.model, self.optimizer)
        state = {**self.state_json(), "rng": gather_rng(self.rank, self.coords, self.cfg.parallel)}
        self.last_saved_step = self.step
        if self.checkpointer is not None:
            self.checkpointer.save(self.step, tensors, config=self.cfg.to_json(), state=state)
            return
        result = save_checkpoint(self.root, self.step, tensors, model_cfg=self.cfg.model,
                                 dims=self.cfg.parallel, config=self.cfg.to_json(), state=state,
                                 tensor_format=self.cfg.checkpoint.tensor_format,
                                 zarr_codec=self.cfg.checkpoint.zarr_codec)
        self._on_commit(result)

    def _uncommit(self, step: int) -> None:
        """Rank 0 deletes the manifest of ``step`` if committed; the all-reduce keeps every
        rank from writing that step's data before (collective)."""
        existed = False
        if self.rank == 0:
            key = f"{step_dir(step)}/{MANIFEST_NAME}"
            if self.root is not None and self.root.exists(key):
                log.warning("step %d is already committed under %s: un-committing it before saving "
                            "it again", step, self.root.url)
                self.root.delete(key)
                existed = True
        any_rank(existed)

    def wait_for_save(self) -> None:
        """Wait for an in-flight background save; raises SaveError if it failed."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def _on_commit(self, result: SaveResult) -> None:
        """After a commit (in the saving thread): log it; rank 0 collects old and incomplete steps."""
        self._event({"event": "save", "step": result.step, "nbytes": result.nbytes,
                     "seconds": round(result.seconds, 4), "blocked_seconds": round(result.blocked_seconds, 4)})
        ckpt = self.cfg.checkpoint
        if self.rank == 0 and self.root is not None:
            deleted = gc_after_commit(self.root, keep_last=ckpt.keep_last or None,
                                      keep_every=ckpt.keep_every or None)
            if deleted:
                self._event({"event": "gc", "deleted_steps": deleted})

    def resume_source(self) -> tuple[Store, int] | None:
        """Which step directory to resume from: see :func:`~shardsmith.trainer.fault.choose_resume`
        (``auto``, ``none`` or a URL; after an elastic restart the root's newest step wins)."""
        ckpt = self.cfg.checkpoint
        return choose_resume(ckpt.resume, self.root, self.restarts, ckpt.storage_options)

    def resume(self) -> bool:
        """Load the checkpoint chosen by :meth:`resume_source` into the current layout.

        Returns False when there is nothing to resume. Raises CheckpointNotFound for an
        explicit URL without a committed step.
        """
        src = self.resume_source()
        if src is None:
            if self.cfg.checkpoint.init_from:
                self._init_from(self.cfg.checkpoint.init_from)
            return False
        self._load(*src, reason="resume")
        return True

    def _init_from(self, url: str) -> None:
        """Load only the model weights of checkpoint ``url`` (any layout; optimizer state,
        counters and data position stay fresh). Collective."""
        _, step_store, step = resolve_checkpoint(url, self.cfg.checkpoint.storage_options)
        specs = checkpoint_specs(self.cfg.model, self.cfg.parallel, with_optimizer=False)
        boxes = rank_boxes(specs, self.cfg.parallel, self.rank)
        manifest = read_manifest(step_store, fqns=boxes)          # only the records of this rank's tensors
        tensors = model_state_tensors(self.model, None)
        stats = load_into(step_store, manifest, tensors, boxes, {f: s.shape for f, s in specs.items()})
        read = gather_json([stats.nbytes_read, stats.nbytes_needed])
        self._event({"event": "init_from", "from": step_store.url, "source_step": step,
                     "saved_layout": manifest.layout, "nbytes_read": sum(r[0] for r in read)})

    def _load(self, step_store: Store, step: int, *, reason: str) -> None:
        """Load tensors (resharding by box intersection), counters, data position, LR
        schedule, bad-step state and RNG (restored, or re-derived on a new layout)."""
        t0 = time.perf_counter()
        reader = open_manifest(step_store)                         # the head: configs, state, index
        init_optimizer_state(self.model, self.optimizer)
        tensors = model_state_tensors(self.model, self.optimizer)
        with_optim = any(k.startswith("optim.") for k in reader.tensor_names)
        specs = checkpoint_specs(self.cfg.model, self.cfg.parallel, with_optimizer=with_optim)
        boxes = rank_boxes(specs, self.cfg.parallel, self.rank)
        manifest = reader.manifest(boxes)                          # only the records of this rank's tensors
        stats = load_into(step_store, manifest, tensors, boxes, {f: s.shape for f, s in specs.items()})
        state = manifest.state
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.sampler.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # The LR at the resumed step comes from *this* run's schedule (same formula as
        # LambdaLR.get_lr, so an unchanged schedule resumes bitwise); the saved _last_lr would
        # belong to the old schedule when --steps/--lr-decay-steps changed.
        sched = self.scheduler
        sched._last_lr = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, sched._last_lr):
            group["lr"] = lr
        self.bad_steps.load_state_json(state.get("fault", {}), keep_counters=reason == "rollback")
        rng = apply_rng(state.get("rng"), self.cfg.parallel, self.rank, self.coords, self.cfg.seed, self.step)
        self.last_saved_step = step
        read = gather_json([stats.nbytes_read, stats.nbytes_needed])
        layout = self.cfg.parallel.to_json()
        self._event({"event": "resume", "reason": reason, "step": step, "from": step_store.url,
                     "saved_layout": manifest.layout, "layout": layout,
                     "resharded": any(manifest.layout.get(k) != v for k, v in layout.items()),
                     "restart_count": self.restarts, "rng": rng,
                     "seconds": round(time.perf_counter() - t0, 4),
                     "nbytes_read": sum(r[0] for r in read), "nbytes_needed": sum(r[1] for r in read)})

    def _roll_back(self) -> None:
        """After ``max_bad_steps`` bad steps in a row: load the newest committed checkpoint
        and mark the streak's data window to be skipped (collective; all ranks decide alike).

        Raises:
            TrainingDiverged: no committed checkpoint, or more than ``max_rollbacks``.
        """
        bad_step, streak = self.step, self.bad_steps.consecutive
        window = self.bad_steps.start_rollback()
        if self.bad_steps.rollbacks > self.cfg.fault.max_rollbacks:
            raise TrainingDiverged(f"step {bad_step}: {streak} bad steps in a row after "
                                   f"{self.cfg.fault.max_rollbacks} rollbacks already; the run diverges. "
                                   "Lower --lr, check the data, or raise --max-rollbacks")
        self.wait_for_save()
        latest = find_latest_committed(self.root) if self.root is not None else None
        if latest is None:
            raise TrainingDiverged(f"steps {bad_step - streak + 1}..{bad_step} had a non-finite loss or "
                                   "gradient norm and there is no committed checkpoint to roll back to; "
                                   "set --ckpt and --save-interval, or lower --lr")
        self._load(self.root.child(step_dir(latest)), latest, reason="rollback")
        self._event({"event": "rollback", "from_step": bad_step, "to_step": latest, "skip_samples": window,
                     "rollbacks": self.bad_steps.rollbacks, "skipped_steps": self.bad_steps.skipped_steps})

    # ---- loop -----------------------------------------------------------------------------

    def _event(self, record: dict[str, Any]) -> None:
        """Rank 0 appends a record to metrics.jsonl (events are also logged)."""
        if self.rank != 0:
            return
        record = {"time": round(time.time(), 3), **record}
        if "event" in record:
            log.info("%s", json.dumps(record))
        self.metrics.write(record)

    def _log_step(self, m: StepMetrics) -> None:
        record = step_record(step=m.step, loss=m.loss, lr=m.lr, grad_norm=m.grad_norm, seconds=m.seconds,
                             tokens=m.tokens, skipped=m.skipped, flops_token=self.flops_token,
                             peak_flops=self.cfg.fault.peak_flops, world_size=self.cfg.parallel.world_size,
                             counters={"skipped_steps": self.bad_steps.skipped_steps,
                                       "rollbacks": self.bad_steps.rollbacks, "restarts": self.restarts})
        self._event(record)
        if m.skipped:
            self._event({"event": "bad_step", "step": m.step, "loss": repr(m.loss), "grad_norm": repr(m.grad_norm),
                         "consecutive": self.bad_steps.consecutive, "skipped_steps": self.bad_steps.skipped_steps})
        if self.rank == 0 and self.cfg.log_interval and m.step % self.cfg.log_interval == 0:
            print(step_line(record), flush=True)

    def run(self) -> list[StepMetrics]:
        """Resume if asked, train to ``cfg.steps``, checkpointing as configured.

        Returns early, with :attr:`preempted` set, after a SIGTERM/SIGUSR1 on any rank:
        the step boundary's all-reduce makes every rank checkpoint that step and return.
        Collective: every rank calls it.

        Raises:
            TrainingDiverged: bad steps could not be rolled back.
            SaveError: a checkpoint failed.
        """
        self._arm()
        try:
            self.resume()
            while self.step < self.cfg.steps and not self.preempted:
                self._iteration()
            if not self.preempted:
                ckpt = self.cfg.checkpoint
                if self.root is not None and ckpt.save_final and self.step != self.last_saved_step:
                    self.save()
            self.wait_for_save()
        finally:
            self._disarm()
        return self.history

    def _iteration(self) -> None:
        """One step, then its boundary: agree on preemption, roll back or save."""
        assert self.guard is not None
        self.hooks.at_step_start(self.step + 1)
        self.guard.begin(self.step + 1)
        m = self.train_step()
        preempt = self.guard.end()
        if len(self.history) == 1:            # start-up is over: training timeouts from now on
            groups = [None, *self.grad_sum_groups.values()]
            groups += self.mesh.get_all_groups() if self.mesh is not None else []
            set_group_timeouts(self.cfg.fault.collective_timeout, groups)
        self._log_step(m)
        ckpt = self.cfg.checkpoint
        if self.bad_steps.consecutive >= self.bad_steps.max_bad_steps:
            self._roll_back()
        elif self.root is not None and ckpt.save_interval and m.step % ckpt.save_interval == 0:
            self.save()
        if preempt:
            self._preempt()

    def _preempt(self) -> None:
        """Checkpoint the current step (unless just saved), wait for the commit, and mark
        the run preempted (collective)."""
        assert self.guard is not None
        t0 = time.perf_counter()
        if self.root is None:
            log.warning("preempted with no checkpoint root (--ckpt): progress since the start is lost")
        elif self.step != self.last_saved_step:
            self.save()
        self.wait_for_save()
        self.guard.preemption.done()
        self.preempted = True
        self._event({"event": "preempt", "step": self.step, "seconds": round(time.perf_counter() - t0, 4),
                     "signal": self.guard.signal_name(), "checkpoint": self.root is not None})
        if self.rank == 0:
            print(f"preempted: checkpoint of step {self.step} committed; exiting", file=sys.stderr, flush=True)

    def _arm(self) -> None:
        """Start the watchdog and the signal handlers; log the start."""
        directory = run_dir(self.cfg)
        dump = os.path.join(directory, "hang-stacks", f"rank-{self.rank:05d}.txt") if directory else ""
        self.guard = FaultGuard(self.cfg.fault, dump_path=dump, on_hang=self._on_hang)
        self._event({"event": "start", "restart_count": self.restarts, "world_size": self.cfg.parallel.world_size,
                     "layout": self.cfg.parallel.to_json(), "steps": self.cfg.steps})

    def _disarm(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.metrics.close()

    def _on_hang(self, step: int, seconds: float, threshold: float) -> None:
        self._event({"event": "hang_suspected", "step": step, "seconds": round(seconds, 3),
                     "threshold": round(threshold, 3)})


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, T, V) (vocab-sharded DTensor under loss parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


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
        if dist.is_initialized():
            dist.destroy_process_group()
