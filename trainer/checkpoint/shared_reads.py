"""Loads whose storage reads are shared by a group of ranks: each byte fetched once, then sent.

Two groups share reads at scale:

* **replicas** (the ``dp_replicate`` group of HSDP) hold the *same* boxes:
  :func:`load_into_replicas` splits the tensors among them and broadcasts each;
* **siblings** (the ``tp`` group) hold *different* boxes of the same tensors. When a load
  raises TP (a tp2 checkpoint into tp4), a target rank needs half of every row of a saved
  row-parallel shard, and a checksum chunk is verified whole, so both siblings would read
  every chunk of it (1.28x the bytes of a tp2·dp2 -> tp4 load). :func:`load_into_siblings`
  has one member read the union of the siblings' boxes (which is a saved shard there) and
  broadcasts it in blocks; each member keeps its part.

Both only pay off where a repeated read is not already served from memory
(:func:`shares_reads`): an object store, or members on different nodes.
"""

from __future__ import annotations

import functools
from math import prod
from typing import Callable

import torch
import torch.distributed as dist

from shardsmith.errors import CheckpointError, IntegrityError
from shardsmith.layout import DTYPE_NBYTES, Box, lpt_assign
from shardsmith.storage.formats import read_boxes
from shardsmith.storage.manifest import Manifest
from shardsmith.storage.reading import ReadStats, planned_read_nbytes
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.save_load import load_into, load_requests, unpadded
from shardsmith.trainer.comm import any_rank, broadcast_into, gather_json

#: Tensors smaller than this (bytes) are read by every replica itself: one broadcast of them
#: costs about what the read does (step counters, norms, biases).
SHARED_READ_MIN_NBYTES = 1 << 20
#: Siblings read a tensor's union once when that saves at least this fraction of the bytes
#: they would read apart.
SIBLING_MIN_SAVING = 0.05
#: Largest block of a union read and broadcast at once (bytes; one row at least): bounds the
#: host or device memory a sibling load holds beyond the job's own tensors.
SIBLING_BLOCK_NBYTES = 256 << 20

Reader = Callable[..., ReadStats]


def shares_reads(
    step_store: Store, group: dist.ProcessGroup | None, simulate_nodes: int = 0
) -> bool:
    """Whether a load should read once per group (:func:`load_into_replicas`,
    :func:`load_into_siblings`): yes for a group of more than one rank, unless the checkpoint
    is on a local filesystem and every member runs on this node (then the page cache already
    serves repeated reads from memory, and a broadcast would only add copies). Nodes as the
    local tier counts them (:func:`~shardsmith.trainer.checkpoint.local_tier.ranks_per_node`:
    ``LOCAL_WORLD_SIZE`` consecutive ranks, or ``simulate_nodes``). Every member of ``group``
    calls it: for a local checkpoint one MAX all-reduce makes them agree even if their
    environments differ."""
    if group is None or dist.get_world_size(group) < 2:
        return False
    if not step_store.is_posix:
        return True
    from shardsmith.trainer.checkpoint.local_tier import (
        ranks_per_node,  # (local_tier imports checkpoint)
    )

    per_node = ranks_per_node(dist.get_world_size(), simulate_nodes)
    return any_rank(len({r // per_node for r in dist.get_process_group_ranks(group)}) > 1, group)


def share_reader(
    step_store: Store, siblings: dist.ProcessGroup | None, simulate_nodes: int = 0
) -> Reader:
    """The function that reads a rank's boxes (``load_into``'s arguments): :func:`load_into_siblings`
    over ``siblings`` (the ``tp`` group) where :func:`shares_reads` holds for it, else
    :func:`~shardsmith.trainer.checkpoint.save_load.load_into`. Every member of ``siblings`` calls it."""
    if siblings is not None and shares_reads(step_store, siblings, simulate_nodes):
        return functools.partial(load_into_siblings, group=siblings)
    return load_into


def _raise_together(error: Exception | None, group: dist.ProcessGroup, who: str) -> None:
    """Make every member of ``group`` raise when any member's ``error`` is set (one all-reduce;
    the messages are gathered only then): the member its own error, its peers an
    ``IntegrityError`` for an integrity failure, else a ``CheckpointError``, naming the member
    (``who``: its role, e.g. "replica") and repeating its message. So no rank waits in a
    broadcast for a reader that gave up."""
    if not any_rank(error is not None, group):
        return
    failures = gather_json(None if error is None else [type(error).__name__, str(error)], group)
    if error is not None:
        raise error
    member, failure = next((m, f) for m, f in enumerate(failures) if f is not None)
    kind = IntegrityError if failure[0] == "IntegrityError" else CheckpointError
    raise kind(
        f"{who} {member} of this rank's group (global rank {dist.get_global_rank(group, member)}) "
        f"failed to read its share: {failure[1]}"
    )


def load_into_replicas(
    step_store: Store,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    boxes: dict[str, Box],
    shapes: dict[str, tuple[int, ...]],
    group: dist.ProcessGroup,
    *,
    strict: bool = True,
    reader: Reader = load_into,
) -> ReadStats:
    """:func:`~shardsmith.trainer.checkpoint.save_load.load_into` for a group of replicas (ranks holding
    the same boxes, e.g. the ``dp_replicate`` group of HSDP): each member reads and verifies
    about 1/R of the bytes (:func:`~shardsmith.layout.sharding.lpt_assign` by bytes), then each
    tensor is broadcast from its reader. Storage reads drop R-fold (HSDP with 8 replicas on a
    5 TB checkpoint: 5 TB read instead of 40 TB); the rest travels over the process group
    (NCCL for GPU tensors). Tensors under :data:`SHARED_READ_MIN_NBYTES` are read by every
    member. ``reader`` reads a member's share (``load_into``'s arguments; e.g.
    :func:`load_into_siblings` bound to the TP group, collective there).

    Every member of ``group`` calls it with the same ``boxes`` (the caller checks).

    Returns:
        This rank's :class:`ReadStats`: ``nbytes_read`` of its share, ``nbytes_needed`` of
        all its boxes.

    Raises:
        CheckpointError, IntegrityError: as ``load_into``, on every member when any member's
        share failed (see :func:`_raise_together`).
    """
    nbytes = {
        f: b.numel * tensors[f].element_size() for f, b in boxes.items() if f in manifest.tensors
    }
    readers = lpt_assign(
        {f: n for f, n in nbytes.items() if n >= SHARED_READ_MIN_NBYTES}, dist.get_world_size(group)
    )
    me = dist.get_rank(group)
    mine = {f: b for f, b in boxes.items() if readers.get(f, me) == me}
    error: Exception | None = None
    stats = ReadStats()
    try:
        stats = reader(step_store, manifest, tensors, mine, shapes, strict=strict)
    except Exception as exc:  # shared below, then raised here
        error = exc
    _raise_together(error, group, "replica")
    for fqn in sorted(readers):
        broadcast_into(
            unpadded(tensors[fqn], boxes[fqn]), dist.get_global_rank(group, readers[fqn]), group
        )
    stats.nbytes_needed = sum(nbytes.values())
    return stats


def sibling_unions(manifest: Manifest, member_boxes: list[dict[str, Box]]) -> dict[str, Box]:
    """The tensors a group of siblings should read once, each with the union of their boxes.

    Pure and deterministic (every member computes the same answer from the same gathered
    boxes). A tensor qualifies when every member holds a non-empty box of it, the boxes are
    disjoint and tile their bounding box exactly (e.g. TP column blocks of the same rows), the
    union holds at least :data:`SHARED_READ_MIN_NBYTES`, and reading the union once fetches at
    least :data:`SIBLING_MIN_SAVING` fewer bytes than the members reading their boxes apart
    (:func:`~shardsmith.storage.reading.ranges.planned_read_nbytes`). None for zarr checkpoints.
    """
    if not manifest.traits.raw_shards or len(member_boxes) < 2:
        return {}
    out: dict[str, Box] = {}
    common = set.intersection(*(set(m) for m in member_boxes))
    for fqn in sorted(common & set(manifest.tensors)):
        rec, bs = manifest.tensors[fqn], [m[fqn] for m in member_boxes]
        if not bs[0].lengths or any(b.numel == 0 for b in bs):
            continue
        lo = tuple(min(b.offsets[d] for b in bs) for d in range(len(bs[0].lengths)))
        hi = tuple(max(b.offsets[d] + b.lengths[d] for b in bs) for d in range(len(bs[0].lengths)))
        union = Box(lo, tuple(h - o for o, h in zip(lo, hi)))
        disjoint = all(bs[i].intersect(bs[j]) is None for i in range(len(bs)) for j in range(i))
        if not disjoint or sum(b.numel for b in bs) != union.numel:
            continue
        if union.numel * DTYPE_NBYTES[rec.dtype] < SHARED_READ_MIN_NBYTES:
            continue
        apart = sum(planned_read_nbytes(rec, b, manifest.chunk_nbytes) for b in bs)
        if apart >= planned_read_nbytes(rec, union, manifest.chunk_nbytes) * (
            1 + SIBLING_MIN_SAVING
        ):
            out[fqn] = union
    return out


def _row_blocks(box: Box, itemsize: int, max_nbytes: int) -> list[Box]:
    """``box`` cut along dim 0 into runs of whole rows of at most ``max_nbytes`` (one row at least)."""
    row = prod(box.lengths[1:]) * itemsize
    step = max(1, max_nbytes // max(row, 1))
    return [
        Box(
            (box.offsets[0] + r,) + box.offsets[1:],
            (min(step, box.lengths[0] - r),) + box.lengths[1:],
        )
        for r in range(0, box.lengths[0], step)
    ]


def _union_batches(
    unions: dict[str, Box], itemsize: dict[str, int], members: int, block_nbytes: int
) -> list[list[tuple[str, Box, int]]]:
    """The unions' row blocks (:func:`_row_blocks`) in batches of consecutive blocks of at most
    ``members * block_nbytes`` (or one block), each block with the member that reads it:
    balanced by bytes within the batch (:func:`~shardsmith.layout.sharding.lpt_assign`), so every
    member reads about ``block_nbytes`` of each batch at the same time. Pure, deterministic."""
    blocks = [
        (f, b, b.numel * itemsize[f])
        for f in sorted(unions)
        for b in _row_blocks(unions[f], itemsize[f], block_nbytes)
    ]
    batches: list[list[tuple[str, Box, int]]] = [[]]
    total = 0
    for f, b, n in blocks:
        if batches[-1] and total + n > members * block_nbytes:
            batches.append([])
            total = 0
        batches[-1].append((f, b, n))
        total += n
    out = []
    for batch in filter(None, batches):
        readers = lpt_assign({f"{i:08d}": n for i, (_, _, n) in enumerate(batch)}, members)
        out.append([(f, b, readers[f"{i:08d}"]) for i, (f, b, _) in enumerate(batch)])
    return out


def load_into_siblings(
    step_store: Store,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    boxes: dict[str, Box],
    shapes: dict[str, tuple[int, ...]],
    *,
    group: dist.ProcessGroup,
    strict: bool = True,
    block_nbytes: int = SIBLING_BLOCK_NBYTES,
) -> ReadStats:
    """:func:`~shardsmith.trainer.checkpoint.save_load.load_into` for a group of siblings (ranks holding
    disjoint boxes of the same tensors: the ``tp`` group). The members exchange their boxes
    (one all-gather of JSON); for the tensors :func:`sibling_unions` selects, one member
    reads and verifies each block of at most ``block_nbytes`` whole rows of the union of the
    boxes, the members reading their blocks of a batch at once (:func:`_union_batches`), then
    broadcasts it over ``group`` (NCCL for GPU tensors), and every member copies its part out;
    every other tensor each member reads itself. Memory beyond the job's tensors, per member:
    the blocks it reads in a batch (LPT: at most about ``2 * block_nbytes``) plus one
    receive buffer of at most ``block_nbytes`` (plus what ``read_boxes`` itself holds: scratch
    for strided reads, the host staging buffer for GPU destinations).

    Every member of ``group`` calls it (the boxes may differ; a tensor some member lacks is
    read apart).

    Returns:
        This rank's :class:`ReadStats`: ``nbytes_read`` of its own reads and union blocks,
        ``nbytes_needed`` of all its boxes.

    Raises:
        CheckpointError, IntegrityError: as ``load_into``, on every member when any member's
        read failed (the checks of its tensors included; see :func:`_raise_together`).
    """
    requests, error = [], None
    try:
        requests = load_requests(step_store, manifest, tensors, boxes, shapes, strict=strict)
    except Exception as exc:
        error = exc
    _raise_together(error, group, "sibling")
    gathered = gather_json({f: b.to_json() for f, b, _ in requests}, group)
    unions = sibling_unions(
        manifest,
        [
            {f: Box(tuple(b["offsets"]), tuple(b["lengths"])) for f, b in m.items()}
            for m in gathered
        ],
    )
    stats, dests = ReadStats(), {f: (b, d) for f, b, d in requests}
    own = [
        r for r in requests if r[0] not in unions
    ]  # read with the first batch (coalesced with it)
    itemsize = {f: dests[f][1].element_size() for f in unions}
    for batch in _union_batches(unions, itemsize, dist.get_world_size(group), block_nbytes) or [[]]:
        _share_batch(step_store, manifest, batch, dests, group, stats, own)
        own = []
    stats.nbytes_needed = sum(
        b.numel * d.element_size() for _, b, d in requests
    )  # (a union read counted it whole)
    stats.tensors_shared = len(unions)
    return stats


def _share_batch(
    step_store: Store,
    manifest: Manifest,
    batch: list[tuple[str, Box, int]],
    dests: dict[str, tuple[Box, torch.Tensor]],
    group: dist.ProcessGroup,
    stats: ReadStats,
    own: list[tuple[str, Box, torch.Tensor]],
) -> None:
    """One batch of :func:`load_into_siblings`: this member allocates its blocks and one
    receive buffer per device (as large as the largest block another member reads), reads its
    blocks and ``own`` requests (one concurrent :func:`read_boxes`, so touching ranges merge),
    the members agree nobody failed (an allocation included), then every block is broadcast
    from its reader and each member copies its part of it into its destination; a block read
    here is dropped once sent."""
    me, error = dist.get_rank(group), None
    reads: list[tuple[str, Box, torch.Tensor]] = []
    receive: dict[torch.device, torch.Tensor] = {}
    try:
        for f, block, reader in batch:
            dest = dests[f][1]
            if reader == me:
                reads.append(
                    (f, block, torch.empty(block.lengths, dtype=dest.dtype, device=dest.device))
                )
            elif (
                receive.get(dest.device, torch.empty(0)).numel() < block.numel * dest.element_size()
            ):
                receive[dest.device] = torch.empty(
                    block.numel * dest.element_size(), dtype=torch.uint8, device=dest.device
                )
        with torch.no_grad():
            read_boxes(step_store, manifest, own + reads, stats=stats)
    except Exception as exc:  # torch.OutOfMemoryError included
        error = exc
    _raise_together(error, group, "sibling")
    mine = [t for _, _, t in reversed(reads)]
    del reads
    for fqn, block, reader in batch:
        box, dest = dests[fqn]
        if reader == me:
            buf = mine.pop()  # dropped after this iteration
        else:
            buf = (
                receive[dest.device][: block.numel * dest.element_size()]
                .view(dest.dtype)
                .view(block.lengths)
            )
        broadcast_into(buf, dist.get_global_rank(group, reader), group)
        part = block.intersect(box)
        if part is not None and part.numel:
            dest.detach()[part.relative_to(box)].copy_(buf[part.relative_to(block)])
