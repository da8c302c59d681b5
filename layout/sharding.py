"""The sharding plan: one pure function from (model config, parallel dims) to placements.

The trainer uses it to check the boxes its DTensors hold and to decide which rank
writes which replica; the offline resharder uses it to compute target boxes
without building a model or a process group. The manifest stores the *saved*
boxes, so loading never depends on the plan the checkpoint was written with.

Placement convention: for every tensor dim, the mesh axes that split it, major to
minor. ``wq.weight: dim0 by (tp, dp_shard)`` means dim 0 is first cut into ``tp``
chunks (TP ``ColwiseParallel``) and each TP chunk is cut into ``dp_shard`` chunks
(FSDP2 ``fully_shard`` over the TP-local tensor, DTensor ``_StridedShard``). Cuts
follow ``torch.chunk`` (see :func:`shardsmith.layout.box.chunk_range`).
Axes not named split nothing: the tensor is replicated over them. The FSDP axes
(``dp_shard``, ``cp``: :data:`~shardsmith.layout.dims.FSDP_AXES`) always appear together and
cut as one flattened axis of ``dp_shard * cp`` chunks (FSDP2 over torchtitan's
``dp_shard_cp`` mesh dim), so a box depends on their product alone: cp2·dps1 and dps2 hold
the same boxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable

from shardsmith.layout.box import Box, chunk_range
from shardsmith.layout.dims import FSDP_AXES, MESH_AXES, ParallelDims
from shardsmith.layout.dims import MeshAxisName as Axis
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout.model_config import ModelConfig, stage_layers, validate_layout

#: The namespace of optimizer state in a checkpoint: ``optim.<state>.<parameter fqn>``, with
#: ``<state>`` one of AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``. Every package builds and
#: parses those names through the helpers below.
OPTIM_NAMESPACE = "optim."
OPTIM_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "step")
#: Prefixes of optimizer-state FQNs; the rest of the name is the parameter's FQN.
OPTIM_PREFIXES: tuple[str, ...] = tuple(f"{OPTIM_NAMESPACE}{s}." for s in OPTIM_STATES)


def optim_fqn(state: str, fqn: str) -> str:
    """The checkpoint name of optimizer state ``state`` of parameter ``fqn``."""
    return f"{OPTIM_NAMESPACE}{state}.{fqn}"


def is_optim_fqn(name: str) -> bool:
    """Whether ``name`` is optimizer state (not a parameter)."""
    return name.startswith(OPTIM_NAMESPACE)


def optim_state_of(name: str) -> str | None:
    """``"exp_avg"`` for ``optim.exp_avg.<fqn>``; None for a parameter's name."""
    return name.split(".", 2)[1] if is_optim_fqn(name) and name.count(".") >= 2 else None


def has_optim_state(names: Iterable[str]) -> bool:
    """Whether any of ``names`` is optimizer state (a checkpoint that can resume training)."""
    return any(is_optim_fqn(n) for n in names)


# The tensor-parallel plan (Megatron-LM, Shoeybi et al. 2019), the one table the trainer's
# ``parallelize_module`` plan is built from (trainer/parallel.py::tp_plan). Block modules are
# named relative to ``layers.<i>``, the others relative to the model.
#: Column-parallel linears: the output features (weight dim 0) split over tp.
COLWISE: tuple[str, ...] = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "feed_forward.w1",
    "feed_forward.w3",
)
#: Row-parallel linears: the input features (weight dim 1) split over tp.
ROWWISE: tuple[str, ...] = ("attention.wo", "feed_forward.w2")
#: Vocab-parallel embedding and output projection: the vocab rows (dim 0) split over tp.
VOCAB_PARALLEL: tuple[str, ...] = ("tok_embeddings", "output")
#: MoE expert tensors ``[E, F, D]`` / ``[E, D, F]`` under expert tensor parallelism (Megatron's
#: default ``--expert-tensor-parallel-size`` = tp): w1/w3 column-parallel, w2 row-parallel,
#: so the expert hidden size F splits over tp (trainer/moe.py::shard_experts slices them).
EXPERT_TP: dict[str, int] = {
    "feed_forward.experts.w1": 1,
    "feed_forward.experts.w3": 1,
    "feed_forward.experts.w2": 2,
}


def tp_module_key(module: str) -> str:
    """A module path as the TP tables name it: ``layers.3.attention.wq`` -> ``attention.wq``."""
    parts = module.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" and len(parts) > 2 else module


def tp_split_dim(fqn: str) -> int | None:
    """The dim of parameter ``fqn`` that the tp axis splits, or ``None`` (replicated over tp)."""
    if tp_module_key(fqn) in EXPERT_TP:
        return EXPERT_TP[tp_module_key(fqn)]
    key = tp_module_key(fqn.rsplit(".", 1)[0])
    if key in COLWISE or key in VOCAB_PARALLEL:
        return 0
    if key in ROWWISE:
        return 1
    return None


@dataclass(frozen=True)
class TensorSpec:
    """Where a logical tensor lives under a layout.

    Attributes:
        fqn: global name, e.g. ``layers.17.attention.wq.weight``.
        shape: global shape in elements (canonical: no padding, no fusion).
        dtype: safetensors dtype name (``F32``, ``BF16`` ...).
        dim_axes: per tensor dim, mesh axes splitting it, major to minor.
        stages: pipeline stages holding a copy (two for tied embeddings with pp > 1).
        pad_dim0_to: dim 0 is padded to this length before splitting (vocab padded to a
            multiple of tp, Megatron-style); boxes are clipped back to ``shape``, so the
            padding rows are never stored. 0 = no padding.
        tp_replicas: consecutive TP ranks sharing one copy (GQA with tp > num_kv_heads:
            tp/num_kv_heads ranks hold the same kv head); the tp axis then splits into
            ``tp // tp_replicas`` parts.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    dim_axes: tuple[tuple[str, ...], ...]
    stages: tuple[int, ...]
    pad_dim0_to: int = 0
    tp_replicas: int = 1

    @property
    def stage(self) -> int:
        """The first stage holding this tensor."""
        return self.stages[0]

    def local_lengths(self, dims: ParallelDims, coords: dict[str, int]) -> tuple[int, ...]:
        """Shape of the local tensor the rank at ``coords`` holds (padding included)."""
        return self._split(dims, coords)[1]

    def _split(
        self, dims: ParallelDims, coords: dict[str, int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets, lengths = [], []
        for d, (size, axes) in enumerate(zip(self.shape, self.dim_axes)):
            if d == 0 and self.pad_dim0_to:
                size = self.pad_dim0_to
            start, length = 0, size
            for axis in axes:
                if axis in FSDP_AXES[1:]:
                    continue  # folded into FSDP_AXES[0]
                parts, index = getattr(dims, axis), coords[axis]
                if axis == FSDP_AXES[0]:
                    parts, index = dims.fsdp, dims.fsdp_index(coords)
                if axis == Axis.tp:
                    parts, index = parts // self.tp_replicas, index // self.tp_replicas
                sub_start, length = chunk_range(length, parts, index)
                start += sub_start
            offsets.append(start)
            lengths.append(length)
        return tuple(offsets), tuple(lengths)

    def box(self, dims: ParallelDims, coords: dict[str, int]) -> Box:
        """The box of real (unpadded) elements held by the rank at ``coords`` (in a holding
        stage). With padding it is a prefix of the local tensor along dim 0."""
        offsets, lengths = self._split(dims, coords)
        if self.pad_dim0_to and offsets:
            valid = max(0, min(lengths[0], self.shape[0] - offsets[0]))
            offsets = (min(offsets[0], self.shape[0]),) + offsets[1:]
            lengths = (valid,) + lengths[1:]
        return Box(offsets, lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole logical tensor."""
        return prod(self.shape) * DTYPE_NBYTES[self.dtype]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding to a multiple of ``tp`` (Megatron pads the same way,
    to make the vocab-parallel embedding and output split evenly)."""
    return -(-vocab_size // tp) * tp


def kv_replicas(model: ModelConfig, dims: ParallelDims) -> int:
    """TP ranks sharing each kv head: ``tp // num_kv_heads`` when tp > num_kv_heads, else 1."""
    return dims.tp // model.num_kv_heads if dims.tp > model.num_kv_heads else 1


def _param_shapes(model: ModelConfig) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(fqn, shape, layer index or None) of every parameter, in module order."""
    d, hd = model.hidden_size, model.head_dim
    out: list[tuple[str, tuple[int, ...], int | None]] = [
        ("tok_embeddings.weight", (model.vocab_size, d), None)
    ]
    for i in range(model.num_layers):
        p = f"layers.{i}."
        out += [
            (p + "attention_norm.weight", (d,), i),
            (p + "attention.wq.weight", (model.num_attention_heads * hd, d), i),
            (p + "attention.wk.weight", (model.num_kv_heads * hd, d), i),
            (p + "attention.wv.weight", (model.num_kv_heads * hd, d), i),
            (p + "attention.wo.weight", (d, model.num_attention_heads * hd), i),
            (p + "ffn_norm.weight", (d,), i),
        ]
        out += _ffn_shapes(model, i)
    out.append(("norm.weight", (d,), None))
    if not model.tie_embeddings:
        out.append(("output.weight", (model.vocab_size, d), None))
    return out


def _ffn_shapes(model: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """The FFN parameters of layer ``i``: dense SwiGLU, or the MoE router ``[E, D]`` and the
    experts' matrices with a leading expert dim ``[E, F, D]`` / ``[E, D, F]`` (so an expert-
    parallel or FSDP split of dim 0 is a box along the experts)."""
    d, p = model.hidden_size, f"layers.{i}.feed_forward."
    if not model.is_moe_layer(i):
        f = model.ffn_hidden_size
        return [
            (p + "w1.weight", (f, d), i),
            (p + "w2.weight", (d, f), i),
            (p + "w3.weight", (f, d), i),
        ]
    e, f = model.num_experts, model.expert_ffn_size
    return [
        (p + "router.weight", (e, d), i),
        (p + "experts.w1", (e, f, d), i),
        (p + "experts.w2", (e, d, f), i),
        (p + "experts.w3", (e, f, d), i),
    ]


def _dim_axes(fqn: str, ndim: int) -> tuple[tuple[str, ...], ...]:
    """TP then FSDP placement of one parameter (see module docstring)."""
    tp_dim = tp_split_dim(fqn)
    axes: list[tuple[str, ...]] = [() for _ in range(ndim)]
    if tp_dim is not None:
        axes[tp_dim] = (Axis.tp,)
    axes[0] = axes[0] + FSDP_AXES
    return tuple(axes)


def param_specs(
    model: ModelConfig, dims: ParallelDims, dtype: str = "F32"
) -> dict[str, TensorSpec]:
    """Specs of the model parameters under ``dims``.

    Raises:
        LayoutError: the layout does not divide the model (see
            :func:`shardsmith.layout.validate_layout`).
    """
    validate_layout(model, dims)
    stages = stage_layers(model, dims)
    stage_of = {layer: s for s, layers in enumerate(stages) for layer in layers}
    last = dims.chunk_rank(dims.num_chunks - 1)  # the rank holding the output (V: rank 0)
    vocab_pad = padded_vocab_size(model.vocab_size, dims.tp)
    specs: dict[str, TensorSpec] = {}
    for fqn, shape, layer in _param_shapes(model):
        if layer is not None:
            holders: tuple[int, ...] = (stage_of[layer],)
        elif fqn == "tok_embeddings.weight":
            holders = (0, last) if model.tie_embeddings and last > 0 else (0,)
        else:
            holders = (last,)
        pad = (
            vocab_pad
            if fqn in ("tok_embeddings.weight", "output.weight") and vocab_pad != shape[0]
            else 0
        )
        replicas = (
            kv_replicas(model, dims)
            if fqn.endswith(("attention.wk.weight", "attention.wv.weight"))
            else 1
        )
        specs[fqn] = TensorSpec(
            fqn, shape, dtype, _dim_axes(fqn, len(shape)), holders, pad, replicas
        )
    return specs


def optimizer_specs(params: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
    """AdamW state specs: ``exp_avg``/``exp_avg_sq`` follow their parameter; ``step`` is a
    replicated 0-d float32 per parameter (as ``torch.optim.AdamW`` keeps it)."""
    specs: dict[str, TensorSpec] = {}
    for fqn, p in params.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            name = optim_fqn(kind, fqn)
            specs[name] = TensorSpec(
                name, p.shape, p.dtype, p.dim_axes, p.stages, p.pad_dim0_to, p.tp_replicas
            )
        name = optim_fqn("step", fqn)
        specs[name] = TensorSpec(name, (), "F32", (), p.stages)
    return specs


def checkpoint_specs(
    model: ModelConfig, dims: ParallelDims, *, with_optimizer: bool = True, dtype: str = "F32"
) -> dict[str, TensorSpec]:
    """Every logical tensor a checkpoint of this layout holds, by FQN."""
    params = param_specs(model, dims, dtype)
    return {**params, **optimizer_specs(params)} if with_optimizer else params


def rank_boxes(specs: dict[str, TensorSpec], dims: ParallelDims, rank: int) -> dict[str, Box]:
    """Boxes of every tensor held by ``rank`` (those of its pipeline stage), empty ones included."""
    coords = dims.coords(rank)
    return {fqn: s.box(dims, coords) for fqn, s in specs.items() if coords[Axis.pp] in s.stages}


def shard_file_name(rank: int) -> str:
    """Checkpoint-relative path of the safetensors file written by ``rank``."""
    return f"shards/rank-{rank:05d}.safetensors"


def grad_sum_groups(spec: TensorSpec, dims: ParallelDims) -> list[list[int]]:
    """Groups of ranks whose copies of ``spec`` are *tied*: each computes part of the
    gradient, and the parts must be summed so every copy takes the same update.

    Tied copies are kv heads shared by ``tp_replicas`` consecutive TP ranks (GQA with
    tp > num_kv_heads, as Megatron replicates them) and the embedding held by the first
    and the last pipeline stage with tied embeddings (Megatron's embedding group). DP
    replicas are not tied copies (FSDP averages them) and neither are TP-replicated
    norms (their gradients are already complete on every TP rank).

    Returns:
        Rank lists of size >= 2, in rank order; empty when the tensor has no tied copies.
    """
    if spec.tp_replicas == 1 and len(spec.stages) == 1:
        return []
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        if c[Axis.pp] not in spec.stages:
            continue
        pp_key = c[Axis.pp] if len(spec.stages) == 1 else -1
        tp_key = c[Axis.tp] // spec.tp_replicas if spec.tp_replicas > 1 else c[Axis.tp]
        key = (
            pp_key,
            *(c[a] for a in MESH_AXES if a not in (Axis.pp, Axis.tp)),
            tp_key,
        )
        groups.setdefault(key, []).append(rank)
    return [g for g in groups.values() if len(g) > 1]
