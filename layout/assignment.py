"""Who writes which box: each distinct box of a checkpoint written once, by everyone.

The write assignment turns the sharding plan's boxes (:mod:`shardsmith.layout.sharding`) into
one writer per distinct box: replicas (DP replicas, TP-replicated norms) spread over their
holders by longest-processing-time balancing, tiny replicated boxes kept together with their
lowest holder, and each rank computing its own list from the ranks that share its replicated
boxes, never the world's.
"""

from __future__ import annotations

from itertools import product

from shardsmith.layout.box import Box
from shardsmith.layout.dims import MESH_AXES
from shardsmith.layout.dims import MeshAxisName as Axis
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout.model_config import ParallelDims
from shardsmith.layout.sharding import TensorSpec

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


def write_assignment(
    specs: dict[str, TensorSpec], dims: ParallelDims, *, rank: int | None = None
) -> dict[int, list[tuple[str, Box]]]:
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
    boxes = (
        ((fqn, box_holders(spec, dims)) for fqn, spec in specs.items())
        if rank is None
        else _component_boxes(specs, dims, rank, tiny)
    )
    out: dict[int, list[tuple[str, Box]]] = (
        {r: [] for r in range(dims.world_size)} if rank is None else {rank: []}
    )
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


def _component_boxes(
    specs: dict[str, TensorSpec], dims: ParallelDims, rank: int, tiny: float
) -> list[tuple[str, list[tuple[Box, list[int]]]]]:
    """(fqn, [(box, holders)]) as :func:`box_holders` lists them, for the non-empty boxes
    :func:`write_assignment` needs to give ``rank`` its list: the non-tiny boxes held in
    ``rank``'s component, grown from ``rank`` by adding the holders of each non-tiny box a
    member holds (breadth first; closed, so the greedy over these boxes alone gives its
    members what the whole world's does: a box's writer depends only on its holders'
    loads), and the tiny boxes ``rank`` holds, with their lowest holder alone."""
    shared: dict[
        tuple, tuple[list[list[list[int]]], list[dict[int, int]]]
    ] = {}  # per splitting pattern
    parts, where = {}, {}
    for fqn, spec in specs.items():
        pattern = (spec.dim_axes, spec.tp_replicas, spec.stages)
        if pattern not in shared:
            axes = [_axis_parts(spec, dims, axis) for axis in MESH_AXES]
            shared[pattern] = (
                axes,
                [{c: i for i, group in enumerate(groups) for c in group} for groups in axes[1:]],
            )
        parts[fqn], where[fqn] = shared[pattern]
    seen: dict[str, dict[tuple[int, ...], tuple[Box, list[int]] | None]] = {
        fqn: {} for fqn in specs
    }
    component, frontier = {rank}, [rank]
    while frontier:
        member = frontier.pop()
        coords = dims.coords(member)
        for fqn, spec in specs.items():
            if coords[Axis.pp] not in spec.stages:
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
            if small:  # only its lowest holder writes it (row-major ranks)
                seen[fqn][key] = (box, [dims.rank_of(first)])
                continue
            holders = _holders(dims, chosen)
            seen[fqn][key] = (box, holders)
            for h in holders:
                if h not in component:
                    component.add(h)
                    frontier.append(h)
    return [
        (fqn, [found for _, found in sorted(keyed.items()) if found]) for fqn, keyed in seen.items()
    ]


def _axis_parts(spec: TensorSpec, dims: ParallelDims, axis: str) -> list[list[int]]:
    """The coordinates of ``axis`` grouped by the part of ``spec`` they hold: one group per
    part when the axis splits the tensor (tp: ``tp_replicas`` consecutive ranks per part),
    else one group of every coordinate (a replicated axis); pp: the holding stages."""
    if axis == Axis.pp:
        return [list(spec.stages)]
    size = getattr(dims, axis)
    if not any(axis in axes for axes in spec.dim_axes):
        return [list(range(size))]
    width = spec.tp_replicas if axis == Axis.tp else 1
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
        coords[Axis.pp] = spec.stages[0]
        box = spec.box(dims, coords)
        if box.is_empty:
            continue
        out.append((box, _holders(dims, [groups[0][0], *parts])))
    return out
