"""The reshard's copies into a local target file: each slab written at its place by the read
thread that read it, several at once, so the copies of one file use every core.

Three ways, tried in this order by the executor (``reshard/engine.py: _Executor._read_and_write``):

* :func:`copy_slab_verified`: a slab that is one contiguous range of a local source file
  (a tensor saved split on dim 0): mapped, verified and written block by block.
* :func:`write_assembled_at`: a slab gathered from several local sources' rows (a tensor
  saved split on dim 1, e.g. row-parallel ``wo``/``w2`` going to a smaller TP): the sources
  are mapped, and the slab is gathered, checksummed and written a few MiB at a time while
  those bytes are in cache, each source chunk verified once, just before its first use.
* :func:`write_slab_at`: bytes already assembled (:func:`~shardsmith.reshard.stream.assemble_slab`:
  a remote source, or a dtype conversion).
"""

from __future__ import annotations

import contextlib
from math import prod
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from shardsmith.layout import DTYPE_NBYTES, Box, row_major_span, row_major_strides
from shardsmith.reshard.planner import PlanEntry
from shardsmith.reshard.slabs import ASSEMBLED_SLAB_NBYTES, Piece, Slab
from shardsmith.reshard.stream import RAW_DTYPES, BufferPool, slab_crcs, slab_offset
from shardsmith.storage import grid_crcs, require_full_read, verify_chunks, verify_chunks_split
from shardsmith.storage.manifest import Manifest, check_file_once, load_chunk_crcs
from shardsmith.storage.store import Store, map_range, pwrite_all


def copy_slab_verified(
    src: Store,
    manifest: Manifest,
    slab: Slab,
    entry: PlanEntry,
    out: int,
    chunk_nbytes: int,
    lock: Any = contextlib.nullcontext(),
) -> list[tuple[int, int]] | None:
    """Copy a :attr:`~Slab.zero_copy` slab of a local source into the local target file open as
    descriptor ``out``, at its place: the slab's source range is mapped once (``mmap``, pages
    faulted in as it is read, :func:`~shardsmith.storage.store.posix.map_range`), then block by block (one
    source checksum chunk) its chunks are verified through the mapping and the needed bytes
    written from it (``pwrite``, :data:`~shardsmith.storage.store.posix.WRITE_PIECE_NBYTES` pieces)
    while they are in cache, so each byte crosses memory once (reading each block into a
    buffer first costs a second pass; re-measure with ``python bench/copy_primitives.py``
    and ``python bench/reshard_bench.py --gb 2``). Any thread,
    any slab; the writes into one file hold its ``lock`` (threads writing one file at once spin
    on its inode lock in the kernel), the checksums do not.

    Returns:
        The bytes' ``(CRC-32C, length)`` pieces on the entry's ``chunk_nbytes`` grid (from the
        verifying pass where the grids line up), or ``None`` when the slab is not a zero-copy
        slab of a local source (the caller reads and writes it).

    Raises:
        IntegrityError: a source chunk's checksum, the file's size or header is wrong (what was
            written before it is in the temporary target file, which is then discarded).
        OSError: reading or writing failed.
    """
    piece = slab.pieces[0] if slab.zero_copy else None
    path = src.local_path(piece.shard.file) if piece is not None else None
    if piece is None or path is None:
        return None
    shard, size, start = piece.shard, manifest.chunk_nbytes, slab_offset(entry, slab)
    mapped, url = _map_read_range(src, manifest, piece, path)
    view = mapped
    sub = chunk_nbytes if chunk_nbytes and size % chunk_nbytes == 0 else size
    skip, end, pos = (
        piece.first - piece.read_start,
        piece.last - piece.read_start,
        entry.byte_offset + start,
    )
    use_known = (
        sub == chunk_nbytes and start % chunk_nbytes == 0 and slab_crcs(piece, [0], sub) is not None
    )
    block = max(1, (1 << 20) // size) * size
    subs, pieces = [], []
    for b in range(0, piece.read_nbytes, block):
        view = mapped[b : b + block]
        subs += verify_chunks_split(shard, (piece.read_start + b) // size, view, size, sub, url)
        lo, hi = max(b, skip), min(b + len(view), end)
        if lo < hi:
            with lock:
                pwrite_all(out, view[lo - b : hi - b], pos + lo - skip)
            if not use_known:
                pieces += grid_crcs(view[lo - b : hi - b], start + lo - skip, chunk_nbytes)
    del view, mapped  # unmapped here (no other reference)
    if use_known:
        known = slab_crcs(piece, subs, sub) or []
        return [(c, min(chunk_nbytes, end - skip - k * chunk_nbytes)) for k, c in enumerate(known)]
    return pieces


def write_slab_at(
    out: int,
    entry: PlanEntry,
    slab: Slab,
    data: np.ndarray,
    known: list[int] | None,
    chunk_nbytes: int,
    lock: Any = contextlib.nullcontext(),
) -> list[tuple[int, int]]:
    """Write a slab's bytes (from :func:`assemble_slab`) at their place in the local target file
    open as descriptor ``out`` (whose entry data starts at ``entry.byte_offset``) with
    ``pwrite``, holding ``lock``. Any thread, any slab.

    Returns:
        The bytes' ``(CRC-32C, length)`` pieces on the entry's ``chunk_nbytes`` grid
        (:func:`~shardsmith.storage.checksum.grid_crcs`; from ``known`` when given and aligned).

    Raises:
        OSError: the write failed (``ENOSPC``: the disk is full).
    """
    start = slab_offset(entry, slab)
    with lock:
        pwrite_all(out, data, entry.byte_offset + start)
    return grid_crcs(data, start, chunk_nbytes, known)


def write_assembled_at(
    src: Store,
    manifest: Manifest,
    slab: Slab,
    entry: PlanEntry,
    out: int,
    chunk_nbytes: int,
    pool: BufferPool,
    lock: Any = contextlib.nullcontext(),
    unit_nbytes: int = ASSEMBLED_SLAB_NBYTES,
) -> list[tuple[int, int]] | None:
    """Gather a slab from several local sources into the local target file open as ``out``, at
    its place, ``unit_nbytes`` of rows at a time: each source's read range is mapped once
    (``mmap``); for each unit, the source chunks it needs that are not verified yet are
    verified through the mapping, its rows are gathered into one reused pool buffer, then
    checksummed on the target's ``chunk_nbytes`` grid and written (``pwrite``, holding
    ``lock``) while the buffer is in cache. Every source chunk of the read ranges is verified
    once, before any of its bytes is written.

    So a slab can be large (few source chunks read twice at slab boundaries) while the
    gather stays in cache (``python bench/copy_primitives.py``, its row-parallel merge).
    Memory: one ``unit_nbytes`` buffer; the mappings are page cache.

    Returns:
        The bytes' ``(CRC-32C, length)`` pieces on the entry's ``chunk_nbytes`` grid, or
        ``None`` (nothing done) when the slab is not gathered, converts its dtype, or has a
        source that is not a local file (the caller assembles it).

    Raises:
        IntegrityError: a source chunk's checksum, a file's size or header is wrong (what was
            written before it is in the temporary target file, which is then discarded).
        OSError: mapping or writing failed.
    """
    paths = [src.local_path(p.shard.file) for p in slab.pieces]
    if slab.zero_copy or slab.converts or not slab.box.lengths or not paths or None in paths:
        return None
    size, itemsize = manifest.chunk_nbytes, DTYPE_NBYTES[entry.src_dtype]
    raw = RAW_DTYPES[itemsize]
    sources = [
        _map_source(src, manifest, piece, str(path), itemsize)
        for piece, path in zip(slab.pieces, paths)
    ]
    row_nbytes, row0 = prod(slab.box.lengths[1:]) * itemsize, slab.box.offsets[0]
    rows = max(1, unit_nbytes // max(1, row_nbytes))
    buf, done = pool.take(min(slab.src_nbytes, rows * row_nbytes)), []
    try:
        for r in range(row0, row0 + slab.box.lengths[0], rows):
            unit = Box(
                (r,) + slab.box.offsets[1:],
                (min(rows, row0 + slab.box.lengths[0] - r),) + slab.box.lengths[1:],
            )
            nbytes, pos = unit.numel * itemsize, slab_offset(entry, slab) + (r - row0) * row_nbytes
            target = buf[:nbytes].view(raw).reshape(unit.lengths)
            for piece, source in zip(slab.pieces, sources):
                common = piece.common.intersect(unit)
                if common is None:
                    continue
                first, last = (x * itemsize for x in row_major_span(piece.saved, common))
                view, verified, url, strides = source
                need = min(-(-last // size) * size, piece.read_end)
                if need > verified:  # the chunks up to this unit's last byte
                    verify_chunks(
                        piece.shard,
                        verified // size,
                        [view[verified - piece.read_start : need - piece.read_start].data],
                        size,
                        url,
                    )
                    source[1] = need
                seg = view[first - piece.read_start : last - piece.read_start].view(raw)
                target[common.relative_to(unit)] = as_strided(
                    seg, common.lengths, strides, writeable=False
                )
            with lock:
                pwrite_all(out, buf[:nbytes], entry.byte_offset + pos)
            done += grid_crcs(buf[:nbytes], pos, chunk_nbytes)
    finally:
        pool.give(buf)
        sources.clear()  # the mappings go with their last view
    return done


def _map_read_range(
    src: Store, manifest: Manifest, piece: Piece, path: str
) -> tuple[memoryview, str]:
    """(the piece's chunk-aligned read range of the local file ``path``, mapped; the file's URL),
    after the file's size and header are checked (once per file) and its chunk CRCs fetched.

    Raises:
        IntegrityError: the file is truncated, oversized or its header disagrees.
    """
    check_file_once(src, manifest, piece.shard.file)
    load_chunk_crcs(src, manifest.chunk_nbytes, [piece.shard])
    offset, url = piece.shard.byte_offset + piece.read_start, src.url_of(piece.shard.file)
    mapped = map_range(path, offset, piece.read_nbytes)
    require_full_read(len(mapped), piece.read_nbytes, offset, url)
    return mapped, url


def _map_source(
    src: Store, manifest: Manifest, piece: Piece, path: str, itemsize: int
) -> list[Any]:
    """[the piece's read range mapped as ``uint8``, verified up to (shard byte), url, byte strides]."""
    mapped, url = _map_read_range(src, manifest, piece, path)
    return [
        np.frombuffer(mapped, np.uint8),
        piece.read_start,
        url,
        [s * itemsize for s in row_major_strides(piece.saved.lengths)],
    ]
