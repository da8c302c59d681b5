"""Loading: read boxes of logical tensors back from a checkpoint's shards by ranged reads.

(Writing: :mod:`shardsmith.storage.safetensors` and :mod:`shardsmith.storage.tensor_files`.)
 :func:`read_safetensors_boxes` (through :func:`shardsmith.storage.formats.read_boxes`) fills target boxes of logical
tensors from the saved shards they intersect, reading only the checksum chunks that hold
needed bytes (so every byte read is verified), coalesced per file, concurrently, and
straight into the destination where the piece is contiguous.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch

from shardsmith.errors import IntegrityError
from shardsmith.layout.box import Box, row_major_span, row_major_strides
from shardsmith.storage.checksum import require_full_read, verify_chunks
from shardsmith.storage.fs import Store
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.storage.manifest import Manifest, ShardRecord
from shardsmith.storage.tensor_files import TORCH_DTYPES, byte_view
from shardsmith.storage.verify import check_file_once

# ---- reading: ranged, coalesced, concurrent; every byte read is verified --------------------

#: Ranged reads in flight at once in one :func:`read_safetensors_boxes` call (threads: local
#: ``preadv`` and object-store GETs both release the GIL).
READ_WORKERS = 8
#: Ranges of one file that touch are merged into one request up to this many bytes.
MAX_MERGED_READ_NBYTES = 32 * 2**20
#: Scratch bytes (for pieces that cannot be read straight into their destination) one
#: :func:`read_safetensors_boxes` call holds at once; beyond it the reads planned so far are run first.
MAX_SCRATCH_NBYTES = 256 * 2**20
#: An intersection split into more row runs than this is read as one span (bounds planning).
_MAX_RUNS = 2**16
#: A piece is read straight into a non-contiguous part of its destination (one iovec per
#: row segment) when it has at most this many segments of at least this many bytes.
_MAX_SCATTER_RUNS = 2**14
_MIN_SCATTER_NBYTES = 512


@dataclass
class ReadStats:
    """Bytes read from storage vs bytes the caller needed, for read amplification."""

    nbytes_read: int = 0
    nbytes_needed: int = 0


@dataclass
class _Part:
    """Checksum chunks ``[c0, c1)`` of one shard, read into ``dests`` (in order, no gaps).

    ``start``/``end`` are absolute byte offsets in the shard's file."""

    shard: ShardRecord
    c0: int
    c1: int
    start: int
    end: int
    dests: list[memoryview]


@dataclass
class _Piece:
    """Where one saved shard's part of a requested box goes, when it is read via scratch:
    ``scratch[first:last]`` holds the saved shard's row-major elements covering ``common``."""

    out: torch.Tensor
    box: Box
    saved: Box
    common: Box
    scratch: torch.Tensor
    first: int
    last: int


def _chunk_groups(saved: Box, common: Box, itemsize: int, chunk: int, a: int, b: int) -> list[tuple[int, int]]:
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
        return whole                                          # contiguous in the shard
    run = common.lengths[j] * strides[j] * itemsize           # bytes of one row segment
    if strides[j - 1] * itemsize - run < chunk or prod(common.lengths[:j]) > _MAX_RUNS:
        return whole                                          # every chunk of the span is touched
    rel = [c - s for c, s in zip(common.offsets, saved.offsets)]
    groups: list[tuple[int, int]] = []
    for index in itertools.product(*(range(n) for n in common.lengths[:j])):
        begin = (sum((r + i) * s for r, i, s in zip(rel, index, strides)) + rel[j] * strides[j]) * itemsize
        c0, c1 = begin // chunk, -(-(begin + run) // chunk)
        if groups and c0 <= groups[-1][1]:
            groups[-1] = (groups[-1][0], max(groups[-1][1], c1))
        else:
            groups.append((c0, c1))
    return groups


def _scatter_views(box: Box, common: Box, out: torch.Tensor, itemsize: int) -> list[memoryview] | None:
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
    run = common.lengths[j] * strides[j]                      # elements per run
    count = prod(common.lengths[:j])
    if count > 1 and (count > _MAX_SCATTER_RUNS or run * itemsize < _MIN_SCATTER_NBYTES):
        return None
    rel = [c - o for c, o in zip(common.offsets, box.offsets)]
    views = []
    for index in itertools.product(*(range(n) for n in common.lengths[:j])):
        start = sum((r + i) * s for r, i, s in zip(rel, index, strides)) + rel[j] * strides[j]
        views.append(view[start * itemsize:(start + run) * itemsize])
    return views


def _plan_piece(shard: ShardRecord, saved: Box, common: Box, box: Box, out: torch.Tensor, itemsize: int,
                chunk: int) -> tuple[_Piece | None, list[_Part]]:
    """Plan the reads of ``common`` (the part of ``box`` in ``saved``), widened to whole
    checksum chunks. When ``common`` is contiguous in the shard its bytes are read straight
    into ``out`` (scattered over its rows when it is a column slice there; only the chunk
    margins go to small buffers); otherwise into a scratch buffer that is copied into ``out``
    after verification (the returned ``_Piece``)."""
    first, last = row_major_span(saved, common)
    a, b = first * itemsize, last * itemsize
    views = _scatter_views(box, common, out, itemsize) \
        if last - first == common.numel and out.is_contiguous() else None
    if views is not None:
        c0, c1 = a // chunk, -(-b // chunk)
        lo, hi = c0 * chunk, min(c1 * chunk, shard.nbytes)
        dests = [memoryview(bytearray(a - lo))] if a > lo else []
        dests += views
        if hi > b:
            dests.append(memoryview(bytearray(hi - b)))
        return None, [_Part(shard, c0, c1, shard.byte_offset + lo, shard.byte_offset + hi, dests)]
    groups = _chunk_groups(saved, common, itemsize, chunk, a, b)
    base, top = groups[0][0] * chunk, min(groups[-1][1] * chunk, shard.nbytes)
    scratch = torch.empty(top - base, dtype=torch.uint8)
    view = memoryview(scratch.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    parts = []
    for c0, c1 in groups:
        lo, hi = c0 * chunk, min(c1 * chunk, shard.nbytes)
        parts.append(_Part(shard, c0, c1, shard.byte_offset + lo, shard.byte_offset + hi, [view[lo - base:hi - base]]))
    return _Piece(out, box, saved, common, scratch, a - base, b - base), parts


def _fill_from_scratch(piece: _Piece) -> None:
    """Copy a verified scratch piece into its place in ``out``."""
    dtype = piece.out.dtype
    raw = piece.scratch[piece.first:piece.last]
    if piece.first % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()                                     # realign (odd chunk sizes only)
    elems = raw.view(dtype)
    # elems covers the saved box's row-major storage from the intersection's first element:
    # view it through the saved box's strides.
    src = elems.as_strided(piece.common.lengths, row_major_strides(piece.saved.lengths)) if piece.common.lengths \
        else elems.view(())
    piece.out[piece.common.relative_to(piece.box)] = src


def _merge(parts: list[_Part]) -> list[list[_Part]]:
    """Group parts into requests: per file, by offset, touching ranges merged up to
    :data:`MAX_MERGED_READ_NBYTES`."""
    reads: list[list[_Part]] = []
    for p in sorted(parts, key=lambda p: (p.shard.file, p.start)):
        last = reads[-1] if reads else None
        if (last and last[-1].shard.file == p.shard.file and last[-1].end == p.start
                and p.end - last[0].start <= MAX_MERGED_READ_NBYTES):
            last.append(p)
        else:
            reads.append([p])
    return reads


def _run_reads(store: Store, parts: list[_Part], chunk: int, source: str) -> int:
    """Read and verify all parts, concurrently; returns bytes read."""
    def one(read: list[_Part]) -> int:
        start, end = read[0].start, read[-1].end
        url = f"{source}/{read[0].shard.file}"
        got = store.read_into(read[0].shard.file, start, [d for p in read for d in p.dests])
        require_full_read(got, end - start, start, url)
        for p in read:
            verify_chunks(p.shard, p.c0, p.dests, chunk, url)
        return got

    reads = _merge(parts)
    if len(reads) <= 1:
        return sum(one(r) for r in reads)
    with ThreadPoolExecutor(min(READ_WORKERS, len(reads))) as pool:
        return sum(pool.map(one, reads))


def destination(fqn: str, box: Box, dtype_name: str, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor a read of ``box`` fills: ``out`` after checking its shape and dtype, or a new one.

    Raises:
        ValueError: ``out`` does not have shape ``box.lengths`` and the tensor's dtype.
    """
    dtype = TORCH_DTYPES[dtype_name]
    if out is None:
        return torch.empty(box.lengths, dtype=dtype)
    if tuple(out.shape) != box.lengths or out.dtype != dtype:
        raise ValueError(f"read_box({fqn!r}): destination is {out.dtype} {tuple(out.shape)}, the box "
                         f"needs {dtype} {box.lengths}")
    return out


def read_safetensors_boxes(store: Store, manifest: Manifest, requests: Sequence[tuple[str, Box, torch.Tensor | None]],
               stats: ReadStats | None = None, source: str = "") -> list[torch.Tensor]:
    """Assemble several boxes of logical tensors from a checkpoint's shards in one go.

    For every (request, saved shard) intersection only the checksum chunks holding needed
    bytes are read (row segments of strided intersections when the gaps are long), ranges
    of a file that touch are coalesced, the reads run concurrently, and every byte read is
    verified against the manifest's chunk checksums before it is used. Contiguous pieces
    are read straight into their destination (no intermediate copy).

    Args:
        store: the step directory's store (shard file paths are relative to it).
        manifest: the parsed manifest of that step.
        requests: (fqn, global box in elements, destination or ``None``); a destination has
            shape ``box.lengths`` and the tensor's dtype (it is overwritten).
        stats: optional counters updated with bytes read and needed.
        source: URL for messages (default: the store's).

    Returns:
        One tensor per request, of shape ``box.lengths`` (the destination when given).

    Raises:
        KeyError: an fqn is not in the checkpoint.
        ValueError: a destination has the wrong shape or dtype.
        IntegrityError: a read byte does not match its checksum, or a file it touches is
            truncated, oversized or has a safetensors header that disagrees with the manifest,
            or the saved shards do not cover a box.
    """
    source = source or store.url
    chunk = manifest.chunk_nbytes
    outs: list[torch.Tensor] = []
    parts: list[_Part] = []
    pieces: list[_Piece] = []
    scratch_nbytes = 0

    def flush() -> None:
        nonlocal parts, pieces, scratch_nbytes
        nbytes = _run_reads(store, parts, chunk, source)
        for piece in pieces:
            _fill_from_scratch(piece)
        if stats is not None:
            stats.nbytes_read += nbytes
        parts, pieces, scratch_nbytes = [], [], 0

    for fqn, box, out in requests:
        rec = manifest.tensors[fqn]
        itemsize = DTYPE_NBYTES[rec.dtype]
        out = destination(fqn, box, rec.dtype, out)
        outs.append(out)
        out = out.detach()                                    # same memory; writable under autograd
        filled = 0
        for shard in rec.shards:
            saved = Box(tuple(shard.offsets), tuple(shard.lengths))
            common = saved.intersect(box) if box.lengths else saved
            if common is None or common.numel == 0:
                continue
            check_file_once(store, manifest, shard.file, source)   # size + header, once per file
            piece, new_parts = _plan_piece(shard, saved, common, box, out, itemsize, chunk)
            parts += new_parts
            if piece is not None:
                pieces.append(piece)
                scratch_nbytes += piece.scratch.numel()
            filled += common.numel
            if stats is not None:
                stats.nbytes_needed += common.numel * itemsize
            if scratch_nbytes > MAX_SCRATCH_NBYTES:
                flush()
        if filled != box.numel:
            raise IntegrityError(f"{source}: saved shards of {fqn!r} cover {filled} of the "
                                 f"{box.numel} elements of box {box}")
    flush()
    return outs
