"""The streaming pieces of the reshard executor: memory budget, checksums on the fly,
verified reads assembled into slabs, and target files written as streams.

No torch here (``convert_dtype`` imports it only when a reshard converts dtypes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from math import prod

import numpy as np
from numpy.lib.stride_tricks import as_strided

from shardsmith.layout import DTYPE_NBYTES, row_major_strides
from shardsmith.reshard.planner import PlanEntry
from shardsmith.reshard.slabs import Piece, Slab
from shardsmith.storage import chunk_crc32c, require_full_read, verify_chunks, verify_chunks_split
from shardsmith.storage.manifest import (
    FileRecord,
    Manifest,
    ShardRecord,
    check_file_once,
    load_chunk_crcs,
)
from shardsmith.storage.store import Store, map_range

RAW_DTYPES = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}  # element-size views: dtype-agnostic copies


@dataclass
class FileResult:
    """A finished target file: its manifest records; ``written`` False when kept; ``sidecar``
    the record of its chunk-CRC sidecar (the shards' ``crc_index`` point into it)."""

    name: str
    record: FileRecord
    shards: dict[str, ShardRecord]
    written: bool
    sidecar: FileRecord | None = None


class BufferBudget:
    """A byte-counting semaphore: a reservation is admitted when it fits in ``capacity``
    or when nothing else is held (so one slab larger than the budget still runs, alone).
    ``peak`` is the high-water mark of bytes held."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, block: bool = True) -> bool:
        """Reserve ``nbytes``; returns False (without reserving) when it does not fit and
        ``block`` is False."""
        with self._cond:
            while self.in_use and self.in_use + nbytes > self.capacity:
                if not block:
                    return False
                self._cond.wait()
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= nbytes
            assert self.in_use >= 0, self.in_use
            self._cond.notify_all()


class BufferPool:
    """Byte buffers reused from slab to slab, so steady state allocates nothing (every
    fresh allocation costs a page fault per 4 KiB) and RSS stays near the budget.

    A request takes the smallest free buffer at most 1/8 + 1 MiB larger, else a new one
    (rounded up to 1 MiB). Buffers given back are kept while all buffers together
    (held and free) stay within ``keep_nbytes``; beyond that they are freed.
    """

    def __init__(self, keep_nbytes: int) -> None:
        self.keep_nbytes = keep_nbytes
        self.allocated = 0
        self.free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A 1-d ``uint8`` buffer of at least ``nbytes`` (only the first ``nbytes`` are yours)."""
        with self._lock:
            fits = [
                i
                for i, b in enumerate(self.free)
                if nbytes <= b.nbytes <= nbytes + nbytes // 8 + (1 << 20)
            ]
            if fits:
                return self.free.pop(
                    min(fits, key=lambda i: self.free[i].nbytes)
                )  # (arrays: no ==)
            size = -(-max(nbytes, 1) // (1 << 20)) * (1 << 20)
            while self.free and self.allocated + size > self.keep_nbytes:
                self.allocated -= self.free.pop(0).nbytes  # make room: drop the oldest
            self.allocated += size
        return np.empty(size, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`take` (a view of mapped file pages is just dropped)."""
        if not buf.flags.owndata:
            return
        with self._lock:
            if self.allocated > self.keep_nbytes:
                self.allocated -= buf.nbytes
            else:
                self.free.append(buf)


def read_piece(
    src: Store, manifest: Manifest, piece: Piece, pool: BufferPool, sub_nbytes: int = 0
) -> tuple[np.ndarray, list[int] | None]:
    """Read a piece's chunk-aligned range and verify every chunk against the manifest (and,
    the first time a file is touched, its size and header).

    Local sources are mapped from the page cache (:meth:`Store.map_range`: the checksum pass
    is the only one over the bytes; the write copies straight from the mapping); other
    stores read into a pool buffer.

    Args:
        sub_nbytes: when it divides the source's chunk size, also return the CRC-32Cs of the
            range's ``sub_nbytes`` pieces, from the same pass (0: don't).

    Returns:
        (a 1-d ``uint8`` array whose first ``piece.read_nbytes`` bytes hold the range: a pool
        buffer or a read-only view of the mapping, which :meth:`BufferPool.give` drops;
        the pieces' CRCs or ``None``).

    Raises:
        IntegrityError: missing, short or oversized file, header or checksum mismatch
            (names the file and byte range).
    """
    shard, chunk_nbytes = piece.shard, manifest.chunk_nbytes
    check_file_once(src, manifest, shard.file)
    load_chunk_crcs(src, chunk_nbytes, [shard])  # version 2: the shard's CRCs, from its sidecar
    offset, first = shard.byte_offset + piece.read_start, piece.read_start // chunk_nbytes
    url = src.url_of(shard.file)
    path = src.local_path(shard.file)
    mapped = map_range(path, offset, piece.read_nbytes) if path is not None else None
    buf = (
        np.frombuffer(mapped, dtype=np.uint8)
        if mapped is not None
        else pool.take(piece.read_nbytes)
    )
    try:
        got = (
            len(mapped)
            if mapped is not None
            else src.read_into(shard.file, offset, [buf.data[: piece.read_nbytes]])
        )
        require_full_read(got, piece.read_nbytes, offset, url)
        if sub_nbytes and chunk_nbytes % sub_nbytes == 0:
            return buf, verify_chunks_split(
                shard, first, buf.data[:got], chunk_nbytes, sub_nbytes, url
            )
        verify_chunks(shard, first, [buf.data[:got]], chunk_nbytes, url)
    except BaseException:
        pool.give(buf)
        raise
    return buf, None


def slab_crcs(piece: Piece, subs: list[int] | None, sub_nbytes: int) -> list[int] | None:
    """The ``sub_nbytes`` chunk CRCs of a zero-copy slab's bytes ``[piece.first, piece.last)``
    from those of the verified read (which starts at ``piece.read_start``); ``None`` when the
    slab does not start on a piece or ends inside one."""
    skip, end = piece.first - piece.read_start, piece.last - piece.read_start
    if subs is None or skip % sub_nbytes or (end % sub_nbytes and piece.last != piece.read_end):
        return None
    return subs[skip // sub_nbytes : -(-end // sub_nbytes)]


def assemble_slab(
    src: Store,
    manifest: Manifest,
    slab: Slab,
    entry: PlanEntry,
    pool: BufferPool,
    chunk_nbytes: int = 0,
) -> tuple[np.ndarray, np.ndarray | None, list[int] | None]:
    """The slab's bytes in the target dtype, as a contiguous 1-d ``uint8`` array.

    Each piece is read, verified, and copied through a strided view of the source
    shard's row-major storage into the slab; pieces are read one at a time. A slab that
    one read holds as it is written (:attr:`Slab.zero_copy`) is returned as a view of it (of a
    local source: of its mapping), with its ``chunk_nbytes`` chunk CRCs when they came out of
    the verifying pass.

    Returns:
        (bytes, the pool buffer holding them, to give back once written, or ``None`` when
        converted to a new array; the bytes' chunk CRCs or ``None``).
    """
    if slab.zero_copy:
        piece = slab.pieces[0]
        buf, subs = read_piece(src, manifest, piece, pool, chunk_nbytes)
        data = buf[piece.first - piece.read_start : piece.last - piece.read_start]
        return data, buf, slab_crcs(piece, subs, chunk_nbytes)
    itemsize = DTYPE_NBYTES[entry.src_dtype]
    raw = RAW_DTYPES[itemsize]
    held = pool.take(slab.src_nbytes)
    try:
        out = held[: slab.src_nbytes].view(raw).reshape(slab.box.lengths)
        for piece in slab.pieces:
            buf, _ = read_piece(src, manifest, piece, pool)
            try:
                seg = buf[piece.first - piece.read_start : piece.last - piece.read_start].view(raw)
                strides = [s * itemsize for s in row_major_strides(piece.saved.lengths)]
                out[piece.common.relative_to(slab.box)] = as_strided(
                    seg, piece.common.lengths, strides, writeable=False
                )
            finally:
                pool.give(buf)
        if entry.dtype == entry.src_dtype:
            return (
                held[: slab.src_nbytes],
                held,
                _assembled_crcs(held[: slab.src_nbytes], slab, entry, chunk_nbytes),
            )
        converted = convert_dtype(out, entry.src_dtype, entry.dtype).reshape(-1).view(np.uint8)
    except BaseException:
        pool.give(held)
        raise
    pool.give(held)
    return converted, None, None


def slab_offset(entry: PlanEntry, slab: Slab) -> int:
    """Byte offset of ``slab`` in its entry's data (target dtype)."""
    if not slab.box.lengths:
        return 0
    return (
        (slab.box.offsets[0] - entry.box.offsets[0])
        * prod(entry.box.lengths[1:])
        * DTYPE_NBYTES[entry.dtype]
    )


def _assembled_crcs(
    data: np.ndarray, slab: Slab, entry: PlanEntry, chunk_nbytes: int
) -> list[int] | None:
    """The ``chunk_nbytes`` chunk CRCs of an assembled slab, computed here (on a read thread,
    while the bytes are in cache) when the slab starts a chunk of its entry; else ``None``
    (the writer checksums it)."""
    if not chunk_nbytes or slab_offset(entry, slab) % chunk_nbytes:
        return None
    return chunk_crc32c(data.data, chunk_nbytes)


def convert_dtype(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Convert raw elements between float dtypes with torch's rounding (round to nearest
    even), returning raw elements of ``dst``. Imports torch only when called."""
    import torch

    from shardsmith.storage.formats import TORCH_DTYPES

    converted = torch.from_numpy(raw).view(TORCH_DTYPES[src]).to(TORCH_DTYPES[dst])
    return converted.view(torch.uint8).numpy().view(RAW_DTYPES[DTYPE_NBYTES[dst]])
