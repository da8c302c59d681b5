"""The training loop: build the stage, parallelize, resume, step, checkpoint.

Every rank runs :func:`run_training` with the same config (launched by torchrun).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from math import prod
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardsmith.errors import CheckpointNotFound
from shardsmith.reshard.layout import validate_layout
from shardsmith.reshard.plan import checkpoint_specs, param_specs, rank_boxes
from shardsmith.storage.commit import find_latest_committed, read_manifest, resolve_checkpoint, step_dir
from shardsmith.storage.fs import Store
from shardsmith.trainer.async_save import AsyncCheckpointer
from shardsmith.trainer.checkpoint import (SaveResult, gather_json, init_optimizer_state, load_into,
                                           model_state_tensors, save_checkpoint)
from shardsmith.trainer.config import OptimConfig, TrainConfig
from shardsmith.trainer.data import GlobalBatchSampler, TokenDataset, load_tokens, vocab_size_needed
from shardsmith.trainer.parallel import build_mesh, build_stage_model, device_type, init_distributed, parallelize

log = logging.getLogger("shardsmith.train")


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of ``cfg.lr`` at a step: linear warmup then cosine to ``min_lr_ratio``
    (see :class:`~shardsmith.trainer.config.OptimConfig`)."""

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        decay = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / decay)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms). ``foreach=False`` because
    parameters live on different meshes (TP-sharded and replicated)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


@dataclass
class StepMetrics:
    """What one optimizer step produced (the same on every rank)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    tokens: int


@dataclass
class Trainer:
    """All state of one rank's training job. Build with :meth:`create`."""

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

    @classmethod
    def create(cls, cfg: TrainConfig) -> "Trainer":
        """Build everything for this rank; every rank must call it (collective)."""
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
                      num_microbatches=num_mb, root=root)
        if root is not None and cfg.checkpoint.async_save:
            trainer.checkpointer = AsyncCheckpointer(root, cfg.model, dims, on_commit=trainer._on_commit)
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
        """One optimizer step on the next global batch."""
        t0 = time.perf_counter()
        inputs, targets = self.sampler.next_local_batch()
        self.optimizer.zero_grad(set_to_none=True)
        local_loss = self._forward_backward(inputs, targets)
        grad_norm = self._grad_norm_and_clip()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        tokens = self.cfg.global_batch_size * self.cfg.model.seq_length
        self.tokens_seen += tokens
        metrics = StepMetrics(self.step, self._global_loss(local_loss), grad_norm, lr,
                              time.perf_counter() - t0, tokens)
        self.history.append(metrics)
        return metrics

    # ---- checkpoints ----------------------------------------------------------------------

    def state_json(self) -> dict[str, Any]:
        """Non-tensor state saved in the manifest."""
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "data": self.sampler.state_dict(), "lr_scheduler": self.scheduler.state_dict()}

    def save(self) -> None:
        """Checkpoint the current step (collective). With ``async_save`` this returns after
        the host snapshot and the commit happens in the background (see :meth:`wait_for_save`).

        Raises:
            SaveError: this save failed (sync) or the previous background save failed (async).
        """
        assert self.root is not None
        init_optimizer_state(self.model, self.optimizer)
        tensors = model_state_tensors(self.model, self.optimizer)
        if self.checkpointer is not None:
            self.checkpointer.save(self.step, tensors, config=self.cfg.to_json(), state=self.state_json())
            return
        result = save_checkpoint(self.root, self.step, tensors, model_cfg=self.cfg.model,
                                 dims=self.cfg.parallel, config=self.cfg.to_json(), state=self.state_json())
        self._on_commit(result)

    def wait_for_save(self) -> None:
        """Wait for an in-flight background save; raises SaveError if it failed."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def _on_commit(self, result: SaveResult) -> None:
        self._event({"event": "save", "step": result.step, "nbytes": result.nbytes,
                     "seconds": round(result.seconds, 4), "blocked_seconds": round(result.blocked_seconds, 4)})

    def resume_source(self) -> tuple[Store, int] | None:
        """Which step directory to resume from, per ``checkpoint.resume``."""
        how = self.cfg.checkpoint.resume
        if how == "none":
            return None
        if how == "auto":
            if self.root is None:
                return None
            latest = find_latest_committed(self.root)
            return None if latest is None else (self.root.child(step_dir(latest)), latest)
        _, step_store, step = resolve_checkpoint(how, self.cfg.checkpoint.storage_options)
        return step_store, step

    def resume(self) -> bool:
        """Load the checkpoint chosen by :meth:`resume_source` into the current layout.

        Returns False when there is nothing to resume. Raises CheckpointNotFound for an
        explicit URL without a committed step.
        """
        src = self.resume_source()
        if src is None:
            return False
        step_store, step = src
        manifest = read_manifest(step_store)
        init_optimizer_state(self.model, self.optimizer)
        tensors = model_state_tensors(self.model, self.optimizer)
        with_optim = any(k.startswith("optim.") for k in manifest.tensors)
        specs = checkpoint_specs(self.cfg.model, self.cfg.parallel, with_optimizer=with_optim)
        boxes = rank_boxes(specs, self.cfg.parallel, self.rank)
        stats = load_into(step_store, manifest, tensors, boxes, {f: s.shape for f, s in specs.items()})
        state = manifest.state
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.sampler.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        read = gather_json([stats.nbytes_read, stats.nbytes_needed])
        self._event({"event": "resume", "step": step, "from": step_store.url,
                     "saved_layout": manifest.layout, "layout": self.cfg.parallel.to_json(),
                     "nbytes_read": sum(r[0] for r in read), "nbytes_needed": sum(r[1] for r in read)})
        return True

    # ---- loop -----------------------------------------------------------------------------

    def _event(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        record = {"time": round(time.time(), 3), **record}
        if "event" in record:
            log.info("%s", json.dumps(record))
        run_dir = self.cfg.run_dir or (self.cfg.checkpoint.url if self.root is not None and self.root.is_local else "")
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    def run(self) -> list[StepMetrics]:
        """Resume if asked, train to ``cfg.steps``, checkpointing as configured."""
        self.resume()
        ckpt = self.cfg.checkpoint
        while self.step < self.cfg.steps:
            m = self.train_step()
            self._event({"step": m.step, "loss": m.loss, "lr": m.lr, "grad_norm": m.grad_norm,
                         "tokens_per_s": round(m.tokens / m.seconds, 1), "seconds": round(m.seconds, 4)})
            if self.rank == 0 and self.cfg.log_interval and m.step % self.cfg.log_interval == 0:
                print(f"step {m.step:6d}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad_norm {m.grad_norm:.3f}  "
                      f"{m.tokens / m.seconds:,.0f} tok/s", flush=True)
            if self.root is not None and ckpt.save_interval and m.step % ckpt.save_interval == 0:
                self.save()
        if self.root is not None and ckpt.save_final and self.history and (
                not ckpt.save_interval or self.step % ckpt.save_interval):
            self.save()
        self.wait_for_save()
        return self.history


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, T, V) (vocab-sharded DTensor under loss parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def run_training(cfg: TrainConfig) -> list[StepMetrics]:
    """Entry point of one rank (collective): build, resume, train, checkpoint, tear down."""
    trainer = Trainer.create(cfg)
    try:
        return trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def iter_json_lines(path: str) -> Iterator[dict[str, Any]]:
    """Records of a metrics.jsonl file."""
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
