"""Parallelism from PyTorch's own building blocks: DeviceMesh, TP, FSDP2, pipelining.

The mesh is built once from :class:`ParallelDims` and passed down; nothing here is
global. Order of application (as in torchtitan): pipeline split -> TP -> FSDP2.
The placements this produces are exactly those of
:mod:`shardsmith.layout.plan` (checked at every save and load).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardsmith.layout import MESH_AXES, ModelConfig, ParallelDims, stage_layers
from shardsmith.layout.plan import grad_sum_groups, kv_replicas, padded_vocab_size, param_specs
from shardsmith.trainer.model import Transformer, init_weights


def device_type() -> str:
    """``cuda`` when GPUs are visible, else ``cpu`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> None:
    """Initialize the default process group from torchrun's environment (idempotent).

    Backend: nccl on CUDA, gloo on CPU; gloo is also registered for CPU tensors on CUDA
    so CPU-side collectives (checkpoint metadata) work everywhere.
    """
    if dist.is_initialized():
        return
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")


def build_mesh(dims: ParallelDims) -> DeviceMesh:
    """One named 4-D mesh ``(pp, dp_replicate, dp_shard, tp)``, tp innermost.

    Must be called by every rank. Raises ``ValueError`` when the world size differs
    from ``dims.world_size``.
    """
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"layout {dims.describe()} needs {dims.world_size} processes, "
                         f"but the job has {world}")
    return init_device_mesh(device_type(), dims.shape, mesh_dim_names=MESH_AXES)


@dataclass
class StageInfo:
    """This rank's pipeline stage."""

    index: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def build_stage_model(cfg: ModelConfig, dims: ParallelDims, pp_rank: int, seed: int) -> tuple[Transformer, StageInfo]:
    """Build the full model on CPU, initialize it deterministically, keep this stage's part.

    Every layout thus starts from bitwise identical weights. (Memory: the full model is
    materialized once per rank; fine at the sizes this trainer targets on CPU.)
    """
    full = Transformer(cfg)
    init_weights(full, seed)
    ranges = stage_layers(cfg, dims)
    info = StageInfo(pp_rank, dims.pp, ranges[pp_rank])
    vocab = padded_vocab_size(cfg.vocab_size, dims.tp)
    copies = kv_replicas(cfg, dims)
    stage = Transformer(cfg, info.layers, first=info.first, last=info.last, padded_vocab=vocab,
                        kv_copies=copies)
    wanted = stage.state_dict()
    weights = {}
    for k, v in full.state_dict().items():
        if k not in wanted:
            continue
        if k.endswith(("attention.wk.weight", "attention.wv.weight")) and copies > 1:
            # (K*Dh, D) -> (K*copies*Dh, D): each kv head repeated for the TP ranks sharing it
            v = v.view(cfg.num_kv_heads, cfg.head_dim, -1).repeat_interleave(copies, dim=0).flatten(0, 1)
        if k in ("tok_embeddings.weight", "output.weight") and vocab != cfg.vocab_size:
            v = torch.cat([v, v.new_zeros(vocab - cfg.vocab_size, v.shape[1])])   # padding rows
        weights[k] = v
    stage.load_state_dict(weights, strict=True)
    return stage, info


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP: column-parallel q/k/v/w1/w3, row-parallel wo/w2, vocab-parallel
    embedding and output (logits stay vocab-sharded for loss parallel)."""
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                         use_local_output=False)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, bf16: bool, pipelined: bool) -> None:
    """FSDP2 (ZeRO-3) over ``dp_shard``, HSDP replication over ``dp_replicate`` when the mesh is 2-D.

    Each block is its own FSDP unit, then the root. With pipelining, parameters stay
    unsharded between microbatches (``reshard_after_forward=False``), as torchtitan does.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not pipelined)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not pipelined)


def parallelize(model: Transformer, mesh: DeviceMesh, dims: ParallelDims, *, bf16: bool,
                activation_checkpointing: bool) -> Transformer:
    """Apply activation checkpointing, TP and FSDP2 to one stage's model, in place."""
    for block in model.layers.values():
        block.activation_checkpointing = activation_checkpointing
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.dp > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        apply_fsdp(model, dp_mesh, bf16=bf16, pipelined=dims.pp > 1)
    return model


def build_grad_sum_groups(cfg: ModelConfig, dims: ParallelDims) -> dict[str, dist.ProcessGroup]:
    """Process groups summing the gradients of tied copies (see
    :func:`shardsmith.layout.plan.grad_sum_groups`), keyed by parameter FQN, for this rank.

    Collective: every rank creates every group, in the same order.
    """
    rank = dist.get_rank()
    made: dict[tuple[tuple[int, ...], ...], list] = {}
    out: dict[str, dist.ProcessGroup] = {}
    for fqn, spec in param_specs(cfg, dims).items():
        groups = grad_sum_groups(spec, dims)
        if not groups:
            continue
        key = tuple(tuple(g) for g in groups)
        if key not in made:
            made[key] = [(g, dist.new_group(g)) for g in groups]
        for ranks, group in made[key]:
            if rank in ranks:
                out[fqn] = group
    return out


def finalize_grads(model: torch.nn.Module, groups: dict[str, dist.ProcessGroup]) -> None:
    """Make every rank's local gradient shard match its parameter's shard, then sum tied copies.

    1. A DTensor gradient whose placement differs from its parameter's (the vocab-parallel
       embedding's gradient comes back ``Replicate`` while the weight is ``Shard(0)``) is
       redistributed to the parameter's placement, so local gradient and parameter shards
       correspond element for element (the gradient norm and tied sums rely on it).
    2. Local gradient shards of tied copies are all-reduced (summed) over their groups
       (see :func:`build_grad_sum_groups`).

    Collective over the TP groups and the tied-copy groups; every rank calls it after backward.
    """
    from torch.distributed.tensor import DTensor

    for fqn, p in model.named_parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        group = groups.get(fqn)
        if group is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
