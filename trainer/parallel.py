"""Parallelism from PyTorch's own building blocks: DeviceMesh, TP, FSDP2, pipelining.

The mesh is built once from :class:`ParallelDims` and passed down; nothing here is
global. Order of application (as in torchtitan): pipeline split -> TP -> FSDP2, all on
the ``meta`` device, then only local shards are materialized. The TP plan is built from
the tables of :mod:`shardsmith.layout.sharding`, and the placements this produces are checked
against the plan's ``dim_axes`` at every build (and the boxes at every save and load).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardsmith.layout import (
    COLWISE,
    FSDP_AXES,
    FSDP_MESH_DIM,
    MESH_AXES,
    ROWWISE,
    VOCAB_PARALLEL,
    ModelConfig,
    ParallelDims,
    TensorSpec,
    chunk_layers,
    grad_sum_groups,
    kv_replicas,
    padded_vocab_size,
    param_specs,
    stage_layers,
    tp_module_key,
)
from shardsmith.trainer.context_parallel import attach, context_parallel, fsdp_mesh
from shardsmith.trainer.model import Transformer, op_sac_contexts
from shardsmith.trainer.moe import (
    EXPERT_TP_DIMS,
    MoEFeedForward,
    expert_parallel_params,
    expert_params,
    shard_experts,
)
from shardsmith.trainer.pipeline import ChunkedStage
from shardsmith.trainer.weight_init import materialize_local_shards

log = logging.getLogger(__name__)


def device_type() -> str:
    """``cuda`` when every process of this node can have a GPU of its own
    (``torch.cuda.device_count() >= LOCAL_WORLD_SIZE``), else ``cpu`` (gloo). With GPUs
    visible but fewer than the local processes (e.g. ``shardsmith demo``'s 4 processes on a
    1-GPU machine) it warns once and runs on the CPU: NCCL refuses two ranks on one GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.device_count() >= local:
        return "cuda"
    _warn_too_few_gpus(torch.cuda.device_count(), local)
    return "cpu"


@functools.lru_cache(maxsize=None)
def _warn_too_few_gpus(gpus: int, local: int) -> None:
    log.warning(
        "%d processes on this node but %d GPU(s) visible: running on the CPU (gloo); "
        "launch at most %d processes per node to train on the GPUs",
        local,
        gpus,
        gpus,
    )


def end_distributed() -> None:
    """Destroy the process groups (if any) and collect reference cycles, while the interpreter
    is fully alive (every rank, at its end).

    A gloo worker thread drops its reference to a finished collective *after* the caller's
    ``wait`` returned; when that is the last one, the work's (Python-owned) tensors are freed
    on that thread, which must take the GIL. A group kept alive past ``destroy_process_group``
    by a reference cycle (an exception's traceback frames holding the group, as a caught load
    failure leaves) keeps such threads running into interpreter finalization, and a thread that
    asks for the GIL then is ended by ``pthread_exit``, whose forced unwind meets a
    ``noexcept`` frame: ``terminate called without an active exception`` (SIGABRT) after the
    rank finished its work. Collecting the cycles here destroys the groups now; their
    destructors (run without the GIL) join those threads. (Workers started by the launcher
    also skip the teardown: :func:`~shardsmith.trainer.runtime.worker.exit_process`.)
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


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


def build_mesh(dims: ParallelDims, device: str = "") -> DeviceMesh:
    """One named 4-D mesh ``(pp, dp_replicate, dp_shard, tp)``, tp innermost, on ``device``
    (default :func:`device_type`; benches pin ``cpu``).

    Must be called by every rank. Raises ``ValueError`` when the world size differs
    from ``dims.world_size``.
    """
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(
            f"layout {dims.describe()} needs {dims.world_size} processes, but the job has {world}"
        )
    return init_device_mesh(device or device_type(), dims.shape, mesh_dim_names=MESH_AXES)


@dataclass
class StageInfo:
    """This rank's pipeline stage."""

    index: int
    num_stages: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def build_stage_model(
    cfg: ModelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    seed: int,
    bf16: bool = False,
    activation_checkpointing: bool | str = False,
    sequence_parallel: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
) -> tuple[Transformer | ChunkedStage, StageInfo]:
    """Build this rank's pipeline stage without ever holding more than its own shards.

    The stage (only its layers; embedding on the first stage, norm and output on the last,
    the embedding on both with tied embeddings; with virtual stages one such model per
    chunk, in a :class:`~shardsmith.trainer.pipeline.ChunkedStage`) is built on the ``meta`` device, TP and
    FSDP2 are applied (:func:`parallelize`), then only the local shards are allocated
    (``to_empty``) and filled by the layout-independent init of
    :mod:`shardsmith.trainer.weight_init` (bitwise the same weights in every layout).
    ``reshard_after_forward``: FSDP's policy (:func:`apply_fsdp`).
    Peak memory: this rank's parameter shards plus one 4 MiB generation block.

    Collective (TP/FSDP set-up): every rank calls it with the global ``mesh`` of
    :func:`build_mesh`. Returns the parallelized stage and its :class:`StageInfo`.

    Raises:
        AssertionError: a parameter's DTensor placements or local shape differ from
            :func:`shardsmith.layout.sharding.param_specs` (internal invariant).
    """
    coords = dims.coords(dist.get_rank())
    info = StageInfo(coords["pp"], dims.pp, stage_layers(cfg, dims)[coords["pp"]])
    specs = param_specs(cfg, dims)
    chunks = []
    for c in dims.chunk_ids(coords["pp"]):
        chunk = chunk_model(cfg, dims, c)
        parallelize(
            chunk,
            mesh,
            dims,
            bf16=bf16,
            activation_checkpointing=activation_checkpointing,
            sequence_parallel=sequence_parallel,
            compile=compile,
            reshard_after_forward=reshard_after_forward,
        )
        check_placements(chunk, specs, dims)
        chunk.to_empty(device=device_type())
        chunk.reset_buffers()
        materialize_local_shards(chunk, cfg, dims, coords, seed, specs)
        chunks.append(chunk)
    if len(chunks) == 1:
        return chunks[0], info
    return ChunkedStage(chunks, dims.chunk_ids(coords["pp"])), info


def chunk_model(cfg: ModelConfig, dims: ParallelDims, chunk: int) -> Transformer:
    """Pipeline model chunk ``chunk`` (of ``dims.num_chunks``; the whole model without
    pipelining) on the ``meta`` device, not parallelized: its layers (:func:`chunk_layers`),
    the embedding on chunk 0, norm and output on the last, the vocabulary padded to a multiple
    of tp, kv heads copied as the sharding plan says. Local, no collective."""
    with torch.device("meta"):
        return Transformer(
            cfg,
            chunk_layers(cfg, dims)[chunk],
            first=chunk == 0,
            last=chunk == dims.num_chunks - 1,
            padded_vocab=padded_vocab_size(cfg.vocab_size, dims.tp),
            kv_copies=kv_replicas(cfg, dims),
        )


def tp_plan(model: Transformer, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """``parallelize_module`` plan of one stage, from the tables of :mod:`shardsmith.layout.sharding`.

    ``COLWISE``/``ROWWISE`` linears get torch's ``ColwiseParallel``/``RowwiseParallel``;
    ``VOCAB_PARALLEL`` modules split the vocab (dim 0): ``RowwiseParallel`` on the embedding
    (torch shards an ``nn.Embedding``'s dim 0 under it), ``ColwiseParallel`` on the output
    projection with vocab-sharded logits (B, T, Vp) kept as a DTensor for loss parallel.

    ``sequence_parallel`` (Korthikanti et al. 2022; torchtitan's ``apply_tp``): the residual
    stream and the norms run on sequence shards (B, T/tp, D): the embedding and the row-wise
    linears reduce-scatter along T (``Shard(1)``), the norms are ``SequenceParallel``, and
    attention, FFN and output all-gather T first (``PrepareModuleInput``). Either way attention
    and FFN take their input as one DTensor, so the backward sums the column-parallel linears'
    input gradients before one collective (four per layer and microbatch, as Megatron's fused
    QKV and gate/up; seven with a DTensor per linear). No parameter
    changes placement (norm weights stay replicated over tp), so checkpoints are the same.
    A MoE FFN gets its whole sequence (all-gathered) and keeps its sequence shard of the output.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        key = tp_module_key(name)
        if key in COLWISE:
            plan[name] = ColwiseParallel()
        elif key in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=seq)
        elif key in VOCAB_PARALLEL and isinstance(module, nn.Embedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif key in VOCAB_PARALLEL:
            plan[name] = ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            )
        elif sequence_parallel and key in ("attention_norm", "ffn_norm", "norm"):
            plan[name] = SequenceParallel()
        elif isinstance(module, MoEFeedForward):
            if sequence_parallel:
                # the experts run on the whole sequence (split over tp inside each expert) and
                # keep their rank's sequence shard of the TP-reduced output
                plan[name] = PrepareModuleInputOutput(
                    input_layouts=Shard(1),
                    desired_input_layouts=Replicate(),
                    use_local_input=True,
                    output_layouts=Replicate(),
                    desired_output_layouts=Shard(1),
                )
        elif key in ("attention", "feed_forward"):
            # one input DTensor per block: its column-parallel linears' input gradients add up
            # before one all-reduce (reduce-scatter under SP), Megatron's fused-QKV count,
            # instead of one per linear
            extra = (None, None) if key == "attention" else ()  # rope cos, sin
            plan[name] = PrepareModuleInput(
                input_layouts=(seq, *extra), desired_input_layouts=(Replicate(), *extra)
            )
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Megatron-style TP over ``tp_mesh`` with the plan of :func:`tp_plan`, in place."""
    parallelize_module(model, tp_mesh, tp_plan(model, sequence_parallel=sequence_parallel))


def placement_axes(
    p: torch.Tensor, ndim: int, expert: tuple[int, int] | None = None
) -> tuple[tuple[str, ...], ...]:
    """Per tensor dim, the mesh axes a parameter's DTensor placements split it by, major to
    minor (the plan's ``dim_axes`` convention). FSDP2 over a TP-sharded dim records the
    dp_shard split as ``_StridedShard``: applied after (minor to) the plain ``Shard``.
    ``expert`` = (ep, tp dim or -1) of an expert tensor, whose TP split (and, with ep > 1,
    expert split over dp_shard) is by plain local slicing (:func:`shard_experts`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    major: list[list[str]] = [[] for _ in range(ndim)]
    minor: list[list[str]] = [[] for _ in range(ndim)]
    if expert is not None and expert[1] >= 0:
        major[expert[1]].append("tp")
    if expert is not None and expert[0] > 1:
        major[0].append("dp_shard")
    if isinstance(p, DTensor):
        for axis, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
            axes = FSDP_AXES if axis == FSDP_MESH_DIM else (axis,)
            if isinstance(placement, _StridedShard):
                minor[placement.dim].extend(axes)
            elif isinstance(placement, Shard):
                major[placement.dim].extend(axes)
    return tuple(tuple(a + b) for a, b in zip(major, minor))


def check_placements(model: Transformer, specs: dict[str, TensorSpec], dims: ParallelDims) -> None:
    """Assert every parameter is split exactly as the plan's ``dim_axes`` says (axes of
    degree 1 split nothing and are left out). Local to the rank; run at every build."""
    experts = {
        fqn: (m.ep_size, EXPERT_TP_DIMS[name] if m.tp_size > 1 else -1)
        for fqn, (_, m, name) in expert_params(model).items()
    }
    for fqn, p in model.named_parameters():
        spec = specs[fqn]
        want = tuple(tuple(a for a in axes if getattr(dims, a) > 1) for axes in spec.dim_axes)
        got = tuple(
            tuple(a for a in axes if getattr(dims, a) > 1)
            for axes in placement_axes(p, len(spec.shape), experts.get(fqn))
        )
        assert got == want, f"{fqn}: DTensor placements split dims by {got}, the plan says {want}"


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    *,
    bf16: bool,
    ignored: set[nn.Parameter] | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """FSDP2 (ZeRO-3) over ``dp_shard``, HSDP replication over ``dp_replicate`` when the mesh is 2-D.

    Each block is its own FSDP unit, then the root. ``reshard_after_forward``
    (:func:`shardsmith.layout.reshards_after_forward` of the job's policy): True frees every
    unit's gathered parameters after its forward (gathered again for backward: the least
    memory); False keeps them gathered until the step's gradients are reduced (one all-gather
    per step; :class:`shardsmith.trainer.pipeline.FsdpPipelineStage` and
    :meth:`shardsmith.trainer.step.StepMath.forward_backward` keep gradient sync off until the
    last microbatch). Gradients are reduced in fp32 (``reduce_dtype``); ``ignored`` parameters
    (expert-parallel experts, already split over dp_shard) are left alone.
    """
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in model.layers.values():
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored,
        )
    fully_shard(
        model,
        mesh=dp_mesh,
        mp_policy=mp,
        reshard_after_forward=reshard_after_forward,
        ignored_params=ignored,
    )


def apply_compile(model: Transformer, backend: str = "inductor") -> None:
    """``torch.compile`` each block, as torchtitan does (one graph per block, reused across
    layers). In place (``nn.Module.compile``): parameter FQNs never gain ``_orig_mod.``, so
    compiled and uncompiled runs read and write the same checkpoints."""
    for block in model.layers.values():
        block.compile(backend=backend)


def apply_ac(model: Transformer, policy: bool | str) -> None:
    """Activation checkpointing of each block (torchtitan's ``apply_ac`` modes), in place:
    ``True``/``"full"`` recomputes every block, ``"op"`` every block but the ops
    :func:`shardsmith.trainer.model.op_sac_contexts` keeps, a number ``"N"`` every N-th
    layer by global index (layers ``N-1, 2N-1, ...``, so every layout recomputes the same
    layers), ``False``/``""`` none (:attr:`TrainConfig.ac_policy`)."""
    for name, block in model.layers.items():
        if policy == "op":
            block.activation_checkpointing, block.checkpoint_contexts = True, op_sac_contexts
        elif isinstance(policy, str) and policy.isdigit():
            block.activation_checkpointing = (int(name) + 1) % int(policy) == 0
        else:
            block.activation_checkpointing = bool(policy)


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    bf16: bool,
    activation_checkpointing: bool | str,
    sequence_parallel: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
) -> Transformer:
    """Apply activation checkpointing, TP (with sequence parallelism when asked), per-block
    ``torch.compile`` and FSDP2 (:func:`apply_fsdp`, ``reshard_after_forward``) to one stage's
    model, in place (torchtitan's order)."""
    apply_ac(model, activation_checkpointing)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel)
    if compile:
        apply_compile(model)
    experts: set[nn.Parameter] = set()
    if dims.expert_parallel > 1 or dims.tp > 1:
        ep_group = mesh["dp_shard"].get_group() if dims.expert_parallel > 1 else None
        tp_group = mesh["tp"].get_group() if dims.tp > 1 else None
        for module in model.modules():
            if isinstance(module, MoEFeedForward):
                experts.update(shard_experts(module, ep_group, tp_group))
    if dims.dp_replicate * dims.fsdp > 1:
        apply_fsdp(
            model,
            fsdp_mesh(mesh, dims),
            bf16=bf16,
            ignored=experts,
            reshard_after_forward=reshard_after_forward,
        )
    attach(model, context_parallel(mesh, dims))
    return model


def build_grad_sum_groups(cfg: ModelConfig, dims: ParallelDims) -> dict[str, dist.ProcessGroup]:
    """Process groups summing the gradients of tied copies (see
    :func:`shardsmith.layout.sharding.grad_sum_groups`), keyed by parameter FQN, for this rank.

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

    for p, ep in expert_parallel_params(model).values():
        if p.grad is not None:  # expert-parallel: summed over the group's batches
            p.grad.div_(ep)
    for fqn, p in model.named_parameters():
        if p.grad is None:
            continue
        if (
            isinstance(p.grad, DTensor)
            and isinstance(p, DTensor)
            and tuple(p.grad.placements) != tuple(p.placements)
        ):
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        group = groups.get(fqn)
        if group is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
