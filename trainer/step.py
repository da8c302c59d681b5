"""The math of one optimizer step on one rank: forward and backward over the
microbatches (or the pipeline schedule), the global gradient norm with clipping, and
the global loss. The loop around it (data, bad-step verdict, optimizer and scheduler
steps) is :meth:`shardsmith.trainer.train.Trainer.train_step`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardsmith.layout import (
    MESH_AXES,
    ModelConfig,
    ParallelDims,
    param_specs,
    reshards_after_forward,
)
from shardsmith.trainer import pipeline
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.context_parallel import context_parallel
from shardsmith.trainer.moe import set_aux_loss_scale
from shardsmith.trainer.parallel import device_type


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, T, V) (vocab-sharded DTensor under loss parallel),
    targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def schedule_for(
    model: torch.nn.Module,
    pp_rank: int,
    parallel: ParallelDims,
    pp_group: dist.ProcessGroup,
    num_microbatches: int,
    name: str = "",
    reshard_after_forward: bool = True,
) -> Any:
    """This rank's pipeline schedule (see :func:`shardsmith.trainer.pipeline.build_schedule`)
    with :func:`loss_fn`."""
    return pipeline.build_schedule(
        model,
        pp_rank,
        parallel.num_chunks,
        pp_group,
        num_microbatches,
        loss_fn,
        torch.device(device_type()),
        name,
        reshard_after_forward,
    )


@dataclass
class StepMetrics:
    """What one optimizer step produced (the same on every rank).

    Attributes:
        step: global step number (1-based).
        loss: mean loss over the global batch (not finite for a bad step).
        grad_norm: global L2 norm of the gradients, before clipping.
        lr: learning rate of the step.
        duration_s: wall time of the step on this rank, in seconds.
        tokens: tokens in the global batch.
        skipped: the update was not applied (non-finite loss or gradient norm).
        moe: MoE router statistics (:func:`shardsmith.trainer.moe.router_stats`); {} when dense.
        detect: the straggler window's step-record fields (:mod:`shardsmith.trainer.detect.straggler`).
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    duration_s: float
    tokens: int
    skipped: bool = False
    moe: dict[str, Any] = field(default_factory=dict)
    detect: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepMath:
    """One rank's part of a step's computation.

    Attributes:
        model: this rank's (parallelized) stage.
        schedule: the pipeline schedule when ``parallel.pp > 1``, else None.
        model_cfg, parallel: the model and the layout (the sharding plan counts replicas).
        coords: this rank's mesh coordinates.
        num_microbatches: microbatches per rank per step.
        bf16: autocast the forward to bfloat16.
        grad_clip: clip the global gradient norm to this (0 = no clipping).
        cp: this rank's context-parallel group (None without): it feeds its tokens of the
            same samples (:meth:`ContextParallel.shard`).
        reshard_after_forward: the FSDP policy the model was built with
            (:func:`shardsmith.layout.reshards_after_forward`); False exchanges parameters
            and gradients once per step in the plain microbatch loop too.
    """

    model: torch.nn.Module
    schedule: Any
    model_cfg: ModelConfig
    parallel: ParallelDims
    coords: dict[str, int]
    num_microbatches: int
    bf16: bool = False
    grad_clip: float = 0.0
    cp: Any = None
    reshard_after_forward: bool = True

    @classmethod
    def for_job(
        cls, cfg: TrainConfig, model: torch.nn.Module, pp_rank: int, mesh: Any, coords: dict
    ) -> "StepMath":
        """The step math of a job's rank: its pipeline schedule when ``pp > 1``
        (:func:`schedule_for`), its context-parallel group and the FSDP policy of ``cfg``
        (collective only through the mesh's groups, which exist already)."""
        parallel, num_mb = cfg.parallel, cfg.num_microbatches()
        reshard = reshards_after_forward(cfg.fsdp_reshard_after_forward, parallel.pp)
        schedule = None
        if parallel.pp > 1:
            group = mesh["pp"].get_group()
            schedule = schedule_for(
                model, pp_rank, parallel, group, num_mb, cfg.pipeline_schedule, reshard
            )
        return cls(
            model,
            schedule,
            cfg.model,
            parallel,
            coords,
            num_mb,
            bf16=cfg.mixed_precision == "bf16",
            grad_clip=cfg.optim.grad_clip,
            cp=context_parallel(mesh, parallel),
            reshard_after_forward=reshard,
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.bf16:
            return torch.autocast(device_type(), dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_ctx(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.parallel.tp > 1 else contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run all microbatches of this rank's batch (inputs and targets (B, T)); returns the
        mean loss on this rank's batch (only meaningful on the last pipeline stage; 0 elsewhere).

        The MoE load-balancing loss (times ``moe_aux_loss_coeff``) enters the gradients in
        each MoE layer's backward (:mod:`shardsmith.trainer.moe`), scaled like the
        microbatch losses (1 / microbatches here; the pipeline schedule divides its
        gradients by the microbatches itself); the returned loss is the LM loss alone."""
        dev = device_type()
        if self.cp is not None:  # (B, T) -> this rank's (B, T / cp)
            inputs, targets = self.cp.shard(inputs), self.cp.shard(targets)
        inputs, targets = inputs.to(dev), targets.to(dev)
        coeff = self.model_cfg.moe_aux_loss_coeff
        set_aux_loss_scale(
            self.model, coeff if self.schedule is not None else coeff / self.num_microbatches
        )
        if self.schedule is not None:
            return self._pipelined(inputs, targets)
        total: torch.Tensor | float = 0.0
        pairs = zip(inputs.chunk(self.num_microbatches), targets.chunk(self.num_microbatches))
        for i, (x, y) in enumerate(pairs):
            self._exchange_policy(last=i == self.num_microbatches - 1)
            with self._loss_ctx():
                with self._autocast():
                    logits = self.model(x)
                loss = loss_fn(logits, y) / self.num_microbatches
                loss.backward()
            total = total + _plain(loss.detach()).float()  # on the device: no sync per microbatch
        return torch.as_tensor(total, dtype=torch.float32).cpu()

    def _exchange_policy(self, last: bool) -> None:
        """FSDP's gradient exchange for the next microbatch of the plain (unpipelined) loop:
        with parameters kept gathered after forward (``reshard_after_forward`` False) no sync
        and no reshard until the last microbatch, the gradients accumulating unsharded (one
        all-gather and one reduce-scatter per step); the HSDP replica all-reduce only after
        the last microbatch, in both policies (FSDP2 holds the partial reduce-scatter outputs)."""
        if not isinstance(self.model, FSDPModule):
            return
        sync = last or self.reshard_after_forward
        self.model.set_requires_gradient_sync(sync)  # (also sets requires_all_reduce: set it after)
        self.model.set_reshard_after_backward(sync)
        self.model.set_requires_all_reduce(last)

    def _pipelined(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        first, last = self._holds_first_and_last()
        args = (inputs,) if first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if last else {}
        with self._loss_ctx(), self._autocast():
            # return_outputs=False: the last stage keeps no microbatch's logits for a merged
            # output we never use (M of them, (b, s, V/t) each, held to the step's end).
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros(())
        return torch.stack([_plain(loss).float() for loss in losses]).mean()

    def _holds_first_and_last(self) -> tuple[bool, bool]:
        """Whether this rank holds the first and the last model chunk (the V pipeline style
        puts both on pipeline rank 0)."""
        pp, parallel = self.coords["pp"], self.parallel
        return parallel.chunk_rank(0) == pp, parallel.chunk_rank(parallel.num_chunks - 1) == pp

    def grad_norm_and_clip(self) -> float:
        """Global L2 norm of all gradients, then clip to :attr:`grad_clip` (collective).

        Each rank sums the squares of its local gradient shards, divided by the number of
        ranks holding the same shard (replicas over dp_replicate / tp, from the sharding
        plan), and one all-reduce over the world gives the exact global sum.
        """
        parallel = self.parallel
        specs = param_specs(self.model_cfg, parallel)
        total: torch.Tensor | float = 0.0
        grads = []
        for fqn, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.append(g)
            used = {a for axes in specs[fqn].dim_axes for a in axes}
            replicas = prod(getattr(parallel, a) for a in MESH_AXES if a != "pp" and a not in used)
            replicas *= specs[fqn].tp_replicas * len(specs[fqn].stages)  # tied copies
            total = total + g.double().pow(2).sum() / replicas  # stays on the device
        total = torch.as_tensor(
            total, dtype=torch.float64
        ).cpu()  # one host sync, not one per tensor
        dist.all_reduce(total)
        norm = float(total.sqrt())
        clip = self.grad_clip
        if clip > 0 and norm > clip:
            coef = clip / (norm + 1e-6)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return norm

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean loss over the global batch: last-stage, tp-rank-0 ranks contribute, divided by
        dp * cp (collective; every cp rank's mean is over the same number of tokens)."""
        contributes = self._holds_first_and_last()[1] and self.coords["tp"] == 0
        t = (local.double().cpu() if contributes else torch.zeros((), dtype=torch.float64)).reshape(
            1
        )
        dist.all_reduce(t)
        return float(t.item() / (self.parallel.dp * self.parallel.cp))


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
