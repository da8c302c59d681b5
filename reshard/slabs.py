"""Slabs and pieces: how the planner cuts one target tensor shard into reads.

A *slab* is consecutive dim-0 rows of a target box, so its bytes are contiguous in the
target file; its *pieces* are the source reads that fill it, each widened to the
source's checksum chunks (exactly what is verified). Slabs are about
``ReshardOptions.slab_target_nbytes`` and are also cut at every source shard's first and
last row, so a tensor saved split on dim 0 is copied slab by slab from single reads
(:attr:`Slab.zero_copy`). Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd, prod

from shardsmith.layout import DTYPE_NBYTES, Box, row_major_span
from shardsmith.storage.manifest import Manifest, ShardRecord
from shardsmith.storage.reading import chunk_span, intersections


@dataclass(frozen=True)
class Piece:
    """One verified ranged read of a source shard and the part of a slab it supplies.

    Attributes:
        shard: the source shard record (file, byte offset, chunk checksums).
        saved: the source shard's box (global elements).
        common: the global box copied into the slab.
        read_start, read_end: bytes to read, relative to the shard's data, chunk-aligned.
        first, last: bytes ``[first, last)`` (relative to the shard) spanning ``common``'s
            elements in the shard's row-major storage.
    """

    shard: ShardRecord
    saved: Box
    common: Box
    read_start: int
    read_end: int
    first: int
    last: int

    @property
    def read_nbytes(self) -> int:
        return self.read_end - self.read_start


@dataclass(frozen=True)
class Slab:
    """Consecutive dim-0 rows of a target entry: contiguous bytes of the target file.

    Attributes:
        box: global box of the slab.
        pieces: source reads that fill it (their ``common`` boxes tile ``box``).
        src_nbytes: bytes in the source dtype; nbytes: bytes written (target dtype).
        converts: the executor converts the dtype (holding a converted copy).
    """

    box: Box
    pieces: tuple[Piece, ...]
    src_nbytes: int
    nbytes: int
    converts: bool = False

    @property
    def zero_copy(self) -> bool:
        """True when one source read holds the slab's bytes contiguously, as they are
        written (same rows, whole rows, same dtype): the executor writes a view of it."""
        if self.converts or len(self.pieces) != 1:
            return False
        p = self.pieces[0]
        return p.common == self.box and p.last - p.first == self.src_nbytes

    @property
    def buffer_nbytes(self) -> int:
        """Memory the executor holds for this slab: the largest piece read (pieces are
        read one at a time), plus the assembled slab and the converted copy if any."""
        largest = max((p.read_nbytes for p in self.pieces), default=0)
        if self.zero_copy:
            return largest
        return self.src_nbytes + largest + (self.nbytes if self.converts else 0)


def _pieces(manifest: Manifest, fqn: str, box: Box) -> tuple[Piece, ...]:
    """Source reads covering ``box`` of ``fqn``: one per intersecting saved shard."""
    rec = manifest.tensors[fqn]
    itemsize, chunk = DTYPE_NBYTES[rec.dtype], manifest.chunk_nbytes
    out = []
    for shard, saved, common in intersections(rec, box):
        first, last = row_major_span(saved, common)
        start, end = chunk_span(first * itemsize, last * itemsize, chunk, shard.nbytes)
        out.append(Piece(shard, saved, common, start, end, first * itemsize, last * itemsize))
    return tuple(out)


def _row_bytes(box: Box, itemsize: int) -> int:
    return prod(box.lengths[1:]) * itemsize


def _cut_geometry(shard: ShardRecord, tail: Box, itemsize: int) -> tuple[int, int, int, int] | None:
    """(first row, row bytes, first needed byte in a row, end of needed bytes in a row) of a
    source shard for target boxes with dims 1.. equal to ``tail``; ``None`` if disjoint."""
    saved_tail = Box(tuple(shard.offsets[1:]), tuple(shard.lengths[1:]))
    inner = saved_tail.intersect(tail)
    if inner is None or inner.numel == 0:
        return None
    first, last = row_major_span(saved_tail, inner)
    return shard.offsets[0], saved_tail.numel * itemsize, first * itemsize, last * itemsize


def _aligned_end(manifest: Manifest, fqn: str, box: Box, start: int, end: int) -> int:
    """Largest row ``e`` in ``[start + (end - start) // 2, end]`` at which every source
    shard cut by it has a checksum-chunk boundary between the slab's last needed byte and
    the next slab's first, so consecutive slabs never read (and verify) the same chunk
    twice; ``end`` when there is none."""
    rec = manifest.tensors[fqn]
    itemsize, chunk = DTYPE_NBYTES[rec.dtype], manifest.chunk_nbytes
    tail = Box(box.offsets[1:], box.lengths[1:])
    shards = []  # ((row0, width, first, last), stop row) of intersecting shards
    for s in rec.shards:
        geometry = _cut_geometry(s, tail, itemsize)
        if geometry is not None:
            shards.append((geometry, s.offsets[0] + s.lengths[0]))

    def cut_ok(e: int) -> bool:
        for (row0, width, first, last), stop in shards:
            if row0 < e < stop:
                m = e - row0
                if -(-((m - 1) * width + last) // chunk) > (m * width + first) // chunk:
                    return False
        return True

    lowest = start + max(1, (end - start) // 2)
    cut = [g for g, stop in shards if g[0] < end < stop]
    if not cut:
        return end
    row0, width, first, last = cut[0]
    if first == 0 and last == width:  # whole rows: aligned cuts repeat every `period` rows
        period = chunk // gcd(chunk, width)
        e = row0 + (end - row0) // period * period
        candidates: range = range(e, lowest - 1, -period) if period > 0 else range(0)
    else:
        candidates = range(end, lowest - 1, -1)
    for e in candidates[:4096]:
        if e > start and cut_ok(e):
            return e
    return end


def _shard_row_cuts(manifest: Manifest, fqn: str, box: Box) -> list[int]:
    """Sorted dim-0 rows inside ``box`` where a saved shard of ``fqn`` intersecting it starts
    or ends. A slab cut there is filled by fewer source reads; where the saved shards hold
    whole rows of ``box`` (a tensor split on dim 0, e.g. column-parallel TP or FSDP shards),
    each slab then comes from one contiguous read and is copied as it is
    (:attr:`Slab.zero_copy`: written from the source's mapping for a local source) instead of assembled."""
    lo, hi = box.offsets[0], box.offsets[0] + box.lengths[0]
    rows: set[int] = set()
    for shard, _, _ in intersections(manifest.tensors[fqn], box):
        rows.update((shard.offsets[0], shard.offsets[0] + shard.lengths[0]))
    return sorted(r for r in rows if lo < r < hi)


#: Bytes of a gathered slab (a tensor saved split on dim 1 or later, e.g. row-parallel
#: ``wo``/``w2`` going to a smaller TP) assembled, checksummed and written at once by
#: ``reshard/posix_copy.py: write_assembled_at``: small enough that the assembled rows are
#: still in cache when they are checksummed and written. The slab itself (one read per
#: source) is as large as any other, so few source chunks are read twice at slab boundaries.
ASSEMBLED_SLAB_NBYTES = 4 << 20


def cut_slabs(
    manifest: Manifest, fqn: str, box: Box, dtype: str, slab_nbytes: int
) -> tuple[Slab, ...]:
    """Cut ``box`` into dim-0 slabs of about ``slab_nbytes`` (at least one row each), also at
    every source shard's first and last row (:func:`_shard_row_cuts`), and, between those,
    where possible on the sources' checksum-chunk boundaries (:func:`_aligned_end`)."""
    src_dtype = manifest.tensors[fqn].dtype
    src_item, dst_item = DTYPE_NBYTES[src_dtype], DTYPE_NBYTES[dtype]
    converts = src_dtype != dtype
    if not box.lengths:  # 0-d: one slab
        return (Slab(box, _pieces(manifest, fqn, box), src_item, dst_item, converts),)
    widest = max(
        [_row_bytes(box, src_item)]
        + [prod(s.lengths[1:]) * src_item for s in manifest.tensors[fqn].shards]
    )
    rows = max(1, slab_nbytes // max(1, widest))
    out, row, stop = [], box.offsets[0], box.offsets[0] + box.lengths[0]
    cuts = _shard_row_cuts(manifest, fqn, box)
    while row < stop:
        end = min(stop, row + rows)
        cut = next((c for c in cuts if row < c < end), None)
        if cut is not None:
            end = cut
        elif end < stop:
            end = _aligned_end(manifest, fqn, box, row, end)
        sub = Box((row,) + box.offsets[1:], (end - row,) + box.lengths[1:])
        out.append(
            Slab(
                sub,
                _pieces(manifest, fqn, sub),
                sub.numel * src_item,
                sub.numel * dst_item,
                converts,
            )
        )
        row = end
    return tuple(out)
