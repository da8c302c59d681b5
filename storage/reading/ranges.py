"""Load-time read planning (no I/O): which byte ranges of which files fill requested boxes.

For every (requested box, saved shard) intersection
(:func:`~shardsmith.storage.reading.spans.intersections`, shared with the zarr reader and the
offline reshard planner) the bytes to read are widened to whole checksum
chunks (:func:`~shardsmith.storage.reading.spans.chunk_span`), so every byte read is verified; strided intersections skip
chunks that hold only gap bytes; contiguous pieces are read straight into their destination
(scattered over its rows where needed). :func:`coalesce` merges touching ranges of a file
into one request. Execution (threads, ranged reads, verification) is in
:mod:`shardsmith.storage.reading.execute`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable

import numpy as np
import torch

from shardsmith.layout import DTYPE_NBYTES, Box, row_major_span, row_major_strides
from shardsmith.storage.formats.tensor_files import byte_view
from shardsmith.storage.manifest.records import ShardRecord, TensorRecord
from shardsmith.storage.reading.spans import chunk_span, intersections

#: Ranges of one file that touch are merged into one request up to this many bytes.
MAX_MERGED_READ_NBYTES = 32 * 2**20
#: An intersection split into more row runs than this is read as one span (bounds planning).
_MAX_RUNS = 2**16
#: A piece is read straight into a non-contiguous part of its destination (one iovec per
#: row segment) when it has at most this many segments of at least this many bytes; otherwise
#: into scratch, verified there in whole chunks and copied into place by one strided copy. Each
#: segment costs a Python buffer object, an iovec and a CRC call, so short rows go through
#: scratch (re-measure the dp_shard4 load of ``python bench/checkpoint_vs_dcp.py --gb 1``).
_MAX_SCATTER_RUNS = 2**14
_MIN_SCATTER_NBYTES = 16 << 10


@dataclass
class ReadPart:
    """Checksum chunks ``[c0, c1)`` of one shard, read into ``dests`` (in order, no gaps).

    ``start``/``end`` are absolute byte offsets in the shard's file."""

    shard: ShardRecord
    c0: int
    c1: int
    start: int
    end: int
    dests: list[memoryview]


@dataclass
class ScratchPiece:
    """Where one saved shard's part of a requested box goes, when it is read via scratch:
    ``scratch[first:last]`` holds the saved shard's row-major elements covering ``common``."""

    out: torch.Tensor
    box: Box
    saved: Box
    common: Box
    scratch: torch.Tensor
    first: int
    last: int


def _chunk_groups(
    saved: Box, common: Box, itemsize: int, chunk: int, a: int, b: int
) -> list[tuple[int, int]]:
    """Runs ``[c0, c1)`` of consecutive checksum chunks of ``saved`` holding bytes of ``common``.

    ``[a, b)`` is the byte span of ``common`` in the saved shard. When the gaps between the
    intersection's rows are at least a chunk long, the chunks that hold only gap bytes are
    left out (e.g. a TP column slice of a saved row slice with long rows); otherwise one group.
    """
    whole = [(a // chunk, -(-b // chunk))]
    strides = row_major_strides(saved.lengths)
    j = len(saved.lengths) - 1
    while j > 0 and common.lengths[j] == saved.lengths[j]:
        j -= 1
    if j == 0:
        return whole  # contiguous in the shard
    run = common.lengths[j] * strides[j] * itemsize  # bytes of one row segment
    if strides[j - 1] * itemsize - run < chunk or prod(common.lengths[:j]) > _MAX_RUNS:
        return whole  # every chunk of the span is touched
    rel = [c - s for c, s in zip(common.offsets, saved.offsets)]
    begin = run_starts(rel, strides, common.lengths, j) * itemsize  # increasing
    c0, c1 = begin // chunk, -(-(begin + run) // chunk)
    cuts = np.flatnonzero(c0[1:] > c1[:-1]) + 1  # a row past the group so far
    heads, tails = np.concatenate(([0], cuts)), np.concatenate((cuts - 1, [len(c0) - 1]))
    return list(zip(c0[heads].tolist(), c1[tails].tolist()))


def run_starts(rel: list[int], strides: list[int], lengths: tuple[int, ...], j: int) -> np.ndarray:
    """First elements (row-major order) of the row segments of a box inside a larger row-major
    array: the box starts at ``rel`` (elements, per dim) and has ``lengths``; dims ``>= j`` are
    one contiguous segment. Vectorized: one array for all ``prod(lengths[:j])`` segments."""
    starts = np.array([rel[j] * strides[j]], dtype=np.int64)
    for d in range(j - 1, -1, -1):
        outer = (rel[d] + np.arange(lengths[d], dtype=np.int64)) * strides[d]
        starts = (outer[:, None] + starts[None, :]).reshape(-1)
    return starts


def _scatter_views(
    box: Box, common: Box, out: torch.Tensor, itemsize: int
) -> list[memoryview] | None:
    """The bytes of ``out`` (contiguous, holding ``box``) that hold ``common``, as runs in
    row-major order (one run when ``common`` is contiguous in ``out``, else one per row
    segment, e.g. a TP column slice); ``None`` when the runs are too many or too short to
    read into directly (then a scratch buffer is cheaper)."""
    view = byte_view(out)
    if not box.lengths:
        return [view]
    strides = row_major_strides(box.lengths)
    j = len(box.lengths) - 1
    while j > 0 and common.lengths[j] == box.lengths[j]:
        j -= 1
    run = common.lengths[j] * strides[j]  # elements per run
    count = prod(common.lengths[:j])
    if count > 1 and (count > _MAX_SCATTER_RUNS or run * itemsize < _MIN_SCATTER_NBYTES):
        return None
    rel = [c - o for c, o in zip(common.offsets, box.offsets)]
    nbytes = run * itemsize
    return [
        view[s : s + nbytes]
        for s in (run_starts(rel, strides, common.lengths, j) * itemsize).tolist()
    ]


def _new_scratch(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def plan_piece(
    shard: ShardRecord,
    saved: Box,
    common: Box,
    box: Box,
    out: torch.Tensor,
    itemsize: int,
    chunk: int,
    scratch_of: Callable[[int], torch.Tensor] = _new_scratch,
) -> tuple[ScratchPiece | None, list[ReadPart]]:
    """Plan the reads of ``common`` (the part of ``box`` in ``saved``), widened to whole
    checksum chunks. When ``common`` is contiguous in the shard its bytes are read straight
    into ``out`` (scattered over its rows when it is a column slice there of few, long
    segments; only the chunk margins go to small buffers); otherwise into a scratch buffer
    (``scratch_of(nbytes)``: a 1-d ``uint8`` tensor) that is copied into ``out`` after
    verification (the returned ``ScratchPiece``)."""
    first, last = row_major_span(saved, common)
    a, b = first * itemsize, last * itemsize
    views = (
        _scatter_views(box, common, out, itemsize)
        if last - first == common.numel and out.is_contiguous()
        else None
    )
    if views is not None:
        lo, hi = chunk_span(a, b, chunk, shard.nbytes)
        c0, c1 = lo // chunk, -(-b // chunk)
        dests = [memoryview(bytearray(a - lo))] if a > lo else []
        dests += views
        if hi > b:
            dests.append(memoryview(bytearray(hi - b)))
        return None, [
            ReadPart(shard, c0, c1, shard.byte_offset + lo, shard.byte_offset + hi, dests)
        ]
    groups = _chunk_groups(saved, common, itemsize, chunk, a, b)
    base, top = groups[0][0] * chunk, min(groups[-1][1] * chunk, shard.nbytes)
    scratch = scratch_of(top - base)
    view = memoryview(scratch.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    parts = []
    for c0, c1 in groups:
        lo, hi = c0 * chunk, min(c1 * chunk, shard.nbytes)
        parts.append(
            ReadPart(
                shard,
                c0,
                c1,
                shard.byte_offset + lo,
                shard.byte_offset + hi,
                [view[lo - base : hi - base]],
            )
        )
    return ScratchPiece(out, box, saved, common, scratch, a - base, b - base), parts


def coalesce(parts: list[ReadPart]) -> list[list[ReadPart]]:
    """Group parts into requests: per file, by offset, touching ranges merged up to
    :data:`MAX_MERGED_READ_NBYTES`."""
    reads: list[list[ReadPart]] = []
    for p in sorted(parts, key=lambda p: (p.shard.file, p.start)):
        last = reads[-1] if reads else None
        if (
            last
            and last[-1].shard.file == p.shard.file
            and last[-1].end == p.start
            and p.end - last[0].start <= MAX_MERGED_READ_NBYTES
        ):
            last.append(p)
        else:
            reads.append([p])
    return reads


def planned_spans(
    saved: Box, common: Box, itemsize: int, chunk: int, shard_nbytes: int
) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of one saved shard's data (relative to its first byte) that
    a read of ``common`` (the part of a requested box inside ``saved``) fetches: the checksum
    chunks it touches, as :func:`plan_piece` widens them (pure). A shrink's sender and receiver
    both use it (:mod:`shardsmith.trainer.checkpoint.peer_reshard`), so the ranges sent are
    exactly those the receiving load reads."""
    first, last = row_major_span(saved, common)
    a, b = first * itemsize, last * itemsize
    if last - first == common.numel:
        return [chunk_span(a, b, chunk, shard_nbytes)]
    groups = _chunk_groups(saved, common, itemsize, chunk, a, b)
    return [(c0 * chunk, min(c1 * chunk, shard_nbytes)) for c0, c1 in groups]


def planned_read_nbytes(rec: TensorRecord, box: Box, chunk: int) -> int:
    """Bytes a read of ``box`` of the tensor ``rec`` fetches from storage: the saved shards'
    checksum chunks it touches, as :func:`plan_piece` widens them (no I/O; safetensors
    checkpoints). Lets ranks compare reading boxes apart with reading their union once
    (:func:`shardsmith.trainer.checkpoint.shared_reads.load_into_siblings`)."""
    itemsize = DTYPE_NBYTES[rec.dtype]
    return sum(
        b - a
        for shard, saved, common in intersections(rec, box)
        for a, b in planned_spans(saved, common, itemsize, chunk, shard.nbytes)
    )
