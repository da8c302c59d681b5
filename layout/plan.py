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
from itertools import product
from math import prod

from shardsmith.layout.box import Box, chunk_range
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout import ModelConfig, ParallelDims, stage_layers, validate_layout
from shardsmith.layout.dims import FSDP_AXES, MESH_AXES


#: Prefixes of optimizer-state FQNs; the rest of the name is the parameter's FQN.
OPTIM_PREFIXES: tuple[str, ...] = ("optim.exp_avg.", "optim.exp_avg_sq.", "optim.step.")

# The tensor-parallel plan (Megatron-LM, Shoeybi et al. 2019), the one table the trainer's
# ``parallelize_module`` plan is built from (trainer/parallel.py::tp_plan). Block modules are
# named relative to ``layers.<i>``, the others relative to the model.
#: Column-parallel linears: the output features (weight dim 0) split over tp.
COLWISE: tuple[str, ...] = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                            "feed_forward.w3")
#: Row-parallel linears: the input features (weight dim 1) split over tp.
ROWWISE: tuple[str, ...] = ("attention.wo", "feed_forward.w2")
#: Vocab-parallel embedding and output projection: the vocab rows (dim 0) split over tp.
VOCAB_PARALLEL: tuple[str, ...] = ("tok_embeddings", "output")
#: MoE expert tensors ``[E, F, D]`` / ``[E, D, F]`` under expert tensor parallelism (Megatron's
#: default ``--expert-tensor-parallel-size`` = tp): w1/w3 column-parallel, w2 row-parallel,
#: so the expert hidden size F splits over tp (trainer/moe.py::shard_experts slices them).
EXPERT_TP: dict[str, int] = {"feed_forward.experts.w1": 1, "feed_forward.experts.w3": 1,
                             "feed_forward.experts.w2": 2}


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

    def _split(self, dims: ParallelDims, coords: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets, lengths = [], []
        for d, (size, axes) in enumerate(zip(self.shape, self.dim_axes)):
            if d == 0 and self.pad_dim0_to:
                size = self.pad_dim0_to
            start, length = 0, size
            for axis in axes:
                if axis in FSDP_AXES[1:]:
                    continue                                   # folded into FSDP_AXES[0]
                parts, index = getattr(dims, axis), coords[axis]
                if axis == FSDP_AXES[0]:
                    parts, index = dims.fsdp, dims.fsdp_index(coords)
                if axis == "tp":
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
        ("tok_embeddings.weight", (model.vocab_size, d), None)]
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
        return [(p + "w1.weight", (f, d), i), (p + "w2.weight", (d, f), i), (p + "w3.weight", (f, d), i)]
    e, f = model.num_experts, model.expert_ffn_size
    return [(p + "router.weight", (e, d), i), (p + "experts.w1", (e, f, d), i),
            (p + "experts.w2", (e, d, f), i), (p + "experts.w3", (e, f, d), i)]


def _dim_axes(fqn: str, ndim: int) -> tuple[tuple[str, ...], ...]:
    """TP then FSDP placement of one parameter (see module docstring)."""
    tp_dim = tp_split_dim(fqn)
    axes: list[tuple[str, ...]] = [() for _ in range(ndim)]
    if tp_dim is not None:
        axes[tp_dim] = ("tp",)
    axes[0] = axes[0] + FSDP_AXES
    return tuple(axes)


def param_specs(model: ModelConfig, dims: ParallelDims, dtype: str = "F32") -> dict[str, TensorSpec]:
    """Specs of the model parameters under ``dims``.

    Raises:
        LayoutError: the layout does not divide the model (see
            :func:`shardsmith.layout.validate_layout`).
    """
    validate_layout(model, dims)
    stages = stage_layers(model, dims)
    stage_of = {layer: s for s, layers in enumerate(stages) for layer in layers}
    last = dims.pp - 1
    vocab_pad = padded_vocab_size(model.vocab_size, dims.tp)
    specs: dict[str, TensorSpec] = {}
    for fqn, shape, layer in _param_shapes(model):
        if layer is not None:
            holders: tuple[int, ...] = (stage_of[layer],)
        elif fqn == "tok_embeddings.weight":
            holders = (0, last) if model.tie_embeddings and last > 0 else (0,)
        else:
            holders = (last,)
        pad = vocab_pad if fqn in ("tok_embeddings.weight", "output.weight") and vocab_pad != shape[0] else 0
        replicas = kv_replicas(model, dims) if fqn.endswith(("attention.wk.weight", "attention.wv.weight")) else 1
        specs[fqn] = TensorSpec(fqn, shape, dtype, _dim_axes(fqn, len(shape)), holders, pad, replicas)
    return specs


def optimizer_specs(params: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
    """AdamW state specs: ``exp_avg``/``exp_avg_sq`` follow their parameter; ``step`` is a
    replicated 0-d float32 per parameter (as ``torch.optim.AdamW`` keeps it)."""
    specs: dict[str, TensorSpec] = {}
    for fqn, p in params.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            name = f"optim.{kind}.{fqn}"                       # OPTIM_PREFIXES
            specs[name] = TensorSpec(name, p.shape, p.dtype, p.dim_axes, p.stages, p.pad_dim0_to,
                                     p.tp_replicas)
        name = f"optim.step.{fqn}"
        specs[name] = TensorSpec(name, (), "F32", (), p.stages)
    return specs


def checkpoint_specs(model: ModelConfig, dims: ParallelDims, *, with_optimizer: bool = True,
                     dtype: str = "F32") -> dict[str, TensorSpec]:
    """Every logical tensor a checkpoint of this layout holds, by FQN."""
    params = param_specs(model, dims, dtype)
    return {**params, **optimizer_specs(params)} if with_optimizer else params


def rank_boxes(specs: dict[str, TensorSpec], dims: ParallelDims, rank: int) -> dict[str, Box]:
    """Boxes of every tensor held by ``rank`` (those of its pipeline stage), empty ones included."""
    coords = dims.coords(rank)
    return {fqn: s.box(dims, coords) for fqn, s in specs.items() if coords["pp"] in s.stages}


def shard_file_name(rank: int) -> str:
    """Checkpoint-relative path of the safetensors file written by ``rank``."""
    return f"shards/rank-{rank:05d}.safetensors"


#: A box is *tiny* when it holds at most this fraction of a rank's even share of the
#: checkpoint's bytes (norms, AdamW step counters, biases: kilobytes beside gigabytes).
TINY_BOX_SHARE = 1 / 1024


def lpt_assign(sizes: dict[str, int], bins: int) -> dict[str, int]:
    """Greedy longest-processing-time balancing (Graham 1969): items largest first, each to the
    bin with the fewest bytes so far; ties by item name, then by the lower bin. Pure and
    deterministic, so every rank computes the same answer without a collective.

    Args:
        sizes: item name -> bytes.
        bins: number of bins (ranks), >= 1.

    Returns:
        Item name -> bin (``0 .. bins - 1``).
    """
    load = [0] * bins
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        b = min(range(bins), key=lambda r: (load[r], r))
        out[name] = b
        load[b] += sizes[name]
    return out


def write_assignment(specs: dict[str, TensorSpec], dims: ParallelDims, *,
                     rank: int | None = None) -> dict[int, list[tuple[str, Box]]]:
    """Which rank writes which (fqn, box): each distinct non-empty box exactly once.

    Replicas of a box (over dp_replicate, tp_replicas kv copies, stages sharing tied
    weights) are given to the holder with the fewest bytes assigned so far, largest first,
    ties to the lowest rank (greedy longest-processing-time load balancing, Graham 1969).
    Tiny boxes (:data:`TINY_BOX_SHARE`: norms, AdamW step counters) go to their lowest
    holder, so those with the same holders land in one file: a loading rank that needs a
    stage's norms and step counters then reads one or two files' metadata for them, not
    every file of the stage (at 1,024 ranks, 128 files' headers and sidecars for a
    reshard); their bytes are too few to balance. Pure and deterministic, so a save and an
    offline reshard to the same layout write the same files.

    ``rank``: that rank's list alone, equal to the whole-world call's, computed from its
    *component* (:func:`_component_boxes`: the ranks joined to it through holders of
    non-tiny boxes, usually a handful), where the whole world is every box of every tensor
    (~300,000 for 8B on 1,024 ranks, tp8 x dp_shard128: tens of seconds of Python on the
    first save of every rank).

    Returns:
        rank -> list of (fqn, box) in FQN order: every rank of ``dims`` (possibly empty
        lists), or ``{rank: its list}``.
    """
    tiny = sum(spec.nbytes for spec in specs.values()) * TINY_BOX_SHARE / dims.world_size
    boxes = ((fqn, box_holders(spec, dims)) for fqn, spec in specs.items()) if rank is None \
        else _component_boxes(specs, dims, rank, tiny)
    out: dict[int, list[tuple[str, Box]]] = {r: [] for r in range(dims.world_size)} if rank is None else {rank: []}
    items: list[tuple[int, str, Box, list[int]]] = []
    for fqn, holders_of in boxes:
        itemsize = DTYPE_NBYTES[specs[fqn].dtype]
        for box, holders in holders_of:
            nbytes = box.numel * itemsize
            if nbytes > tiny:
                items.append((nbytes, fqn, box, holders))
            elif holders[0] in out:
                out[holders[0]].append((fqn, box))
    items.sort(key=lambda k: (-k[0], k[1], k[2].offsets))
    load = [0] * dims.world_size
    for nbytes, fqn, box, holders in items:
        writer = min(holders, key=lambda r: (load[r], r))
        load[writer] += nbytes
        if writer in out:
            out[writer].append((fqn, box))
    for written in out.values():
        written.sort(key=lambda k: k[0])
    return out


def _component_boxes(specs: dict[str, TensorSpec], dims: ParallelDims, rank: int,
                     tiny: float) -> list[tuple[str, list[tuple[Box, list[int]]]]]:
    """(fqn, [(box, holders)]) as :func:`box_holders` lists them, for the non-empty boxes
    :func:`write_assignment` needs to give ``rank`` its list: the non-tiny boxes held in
    ``rank``'s component, grown from ``rank`` by adding the holders of each non-tiny box a
    member holds (breadth first; closed, so the greedy over these boxes alone gives its
    members what the whole world's does: a box's writer depends only on its holders'
    loads), and the tiny boxes ``rank`` holds, with their lowest holder alone."""
    shared: dict[tuple, tuple[list[list[list[int]]], list[dict[int, int]]]] = {}   # per splitting pattern
    parts, where = {}, {}
    for fqn, spec in specs.items():
        pattern = (spec.dim_axes, spec.tp_replicas, spec.stages)
        if pattern not in shared:
            axes = [_axis_parts(spec, dims, axis) for axis in MESH_AXES]
            shared[pattern] = axes, [{c: i for i, group in enumerate(groups) for c in group} for groups in axes[1:]]
        parts[fqn], where[fqn] = shared[pattern]
    seen: dict[str, dict[tuple[int, ...], tuple[Box, list[int]] | None]] = {fqn: {} for fqn in specs}
    component, frontier = {rank}, [rank]
    while frontier:
        member = frontier.pop()
        coords = dims.coords(member)
        for fqn, spec in specs.items():
            if coords["pp"] not in spec.stages:
                continue
            key = tuple(index[coords[axis]] for index, axis in zip(where[fqn], MESH_AXES[1:]))
            if key in seen[fqn]:
                continue
            chosen = [spec.stages, *(groups[k] for groups, k in zip(parts[fqn][1:], key))]
            first = dict(zip(MESH_AXES, (group[0] for group in chosen)))
            box = spec.box(dims, first)
            small = box.numel * DTYPE_NBYTES[spec.dtype] <= tiny
            if box.is_empty or (small and member != rank):
                seen[fqn][key] = None
                continue
            if small:                                 # only its lowest holder writes it (row-major ranks)
                seen[fqn][key] = (box, [dims.rank_of(first)])
                continue
            holders = _holders(dims, chosen)
            seen[fqn][key] = (box, holders)
            for h in holders:
                if h not in component:
                    component.add(h)
                    frontier.append(h)
    return [(fqn, [found for _, found in sorted(keyed.items()) if found]) for fqn, keyed in seen.items()]


def _axis_parts(spec: TensorSpec, dims: ParallelDims, axis: str) -> list[list[int]]:
    """The coordinates of ``axis`` grouped by the part of ``spec`` they hold: one group per
    part when the axis splits the tensor (tp: ``tp_replicas`` consecutive ranks per part),
    else one group of every coordinate (a replicated axis); pp: the holding stages."""
    if axis == "pp":
        return [list(spec.stages)]
    size = getattr(dims, axis)
    if not any(axis in axes for axes in spec.dim_axes):
        return [list(range(size))]
    width = spec.tp_replicas if axis == "tp" else 1
    return [list(range(p * width, (p + 1) * width)) for p in range(size // width)]


def _holders(dims: ParallelDims, groups: list) -> list[int]:
    """The ranks (ascending) whose coordinates take every combination of ``groups`` (one list
    of coordinates per axis, in :data:`MESH_AXES` order)."""
    return sorted(dims.rank_of(dict(zip(MESH_AXES, c))) for c in product(*groups))


def box_holders(spec: TensorSpec, dims: ParallelDims) -> list[tuple[Box, list[int]]]:
    """Every distinct non-empty box of ``spec`` under ``dims`` with the ranks holding it
    (ascending), in mesh order of the splitting coordinates. Pure; no loop over ranks that
    do not hold the tensor."""
    groups = [_axis_parts(spec, dims, axis) for axis in MESH_AXES]
    out = []
    for parts in product(*groups[1:]):
        coords = {axis: part[0] for axis, part in zip(MESH_AXES[1:], parts)}
        coords["pp"] = spec.stages[0]
        box = spec.box(dims, coords)
        if box.is_empty:
            continue
        out.append((box, _holders(dims, [groups[0][0], *parts])))
    return out


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
        if c["pp"] not in spec.stages:
            continue
        pp_key = c["pp"] if len(spec.stages) == 1 else -1
        tp_key = c["tp"] // spec.tp_replicas if spec.tp_replicas > 1 else c["tp"]
        key = (pp_key, *(c[a] for a in MESH_AXES if a not in ("pp", "tp")), tp_key)
        groups.setdefault(key, []).append(rank)
    return [g for g in groups.values() if len(g) > 1]
