"""Shard files: encode local tensors as one safetensors file; read boxes back by ranged reads.

Writing: :func:`encode_shard_file` turns ``{key: tensor}`` into the file's bytes plus
the per-key byte ranges and chunked CRC-32C checksums that go into the manifest.

Reading: :func:`read_boxes` (and :func:`read_box` for one) fills target boxes of logical
tensors from the saved shards they intersect, reading only the checksum chunks that hold
needed bytes (so every byte read is verified), coalesced per file, concurrently, and
straight into the destination where the piece is contiguous.
"""

from __future__ import annotations

import itertools
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from typing import Sequence

import torch
from safetensors.torch import save as safetensors_save

from shardsmith.errors import IntegrityError
from shardsmith.layout.box import Box, row_major_span
from shardsmith.storage.checksum import (chunk_crc32c, crc32c, crc32c_combine, require_full_read,
                                          verify_chunks)
from shardsmith.storage.crashpoints import crash_point
from shardsmith.storage.fs import Store
from shardsmith.layout.dtypes import DTYPE_NBYTES, DTYPES
from shardsmith.storage.manifest import FileRecord, Manifest, ShardRecord
from shardsmith.storage.verify import check_file_once

#: torch dtype of each checkpoint dtype (from the one table, :mod:`shardsmith.layout.dtypes`).
TORCH_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, d.torch_name) for n, d in DTYPES.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass
class EncodedFile:
    """A shard file ready to upload, and what the manifest records of it.

    Attributes:
        data: the file's bytes (safetensors).
        record: size and whole-file CRC-32C.
        spans: key -> (byte_offset, nbytes, chunk checksums) of each entry's data.
    """

    data: bytes
    record: FileRecord
    spans: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


def parse_safetensors_header(prefix: bytes, source: str) -> tuple[int, dict]:
    """Parse a safetensors header from the file's first bytes.

    Returns:
        (data_start, header) where data_start is the absolute offset of the data region.

    Raises:
        IntegrityError: the prefix is too short or the header is not valid JSON.
    """
    if len(prefix) < 8:
        raise IntegrityError(f"{source}: truncated safetensors file ({len(prefix)} bytes)")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if 8 + header_len > len(prefix):
        raise IntegrityError(f"{source}: safetensors header of {header_len} bytes runs past the data read")
    try:
        header = json.loads(prefix[8:8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"{source}: corrupt safetensors header ({exc})") from exc
    return 8 + header_len, header


def encode_shard_file(tensors: dict[str, torch.Tensor], chunk_nbytes: int,
                      metadata: dict[str, str] | None = None) -> EncodedFile:
    """Serialize ``{key: tensor}`` (any shapes, CPU) into one safetensors file.

    Zero-element tensors are skipped (an empty shard is not stored).
    """
    kept = {k: t.detach().contiguous() for k, t in tensors.items() if t.numel() > 0}
    data = safetensors_save(kept, metadata=metadata)
    data_start, header = parse_safetensors_header(data[:8 + struct.unpack("<Q", data[:8])[0]], "<new>")
    view = memoryview(data)
    spans: dict[str, tuple[int, int, list[int]]] = {}
    for key in kept:
        begin, end = header[key]["data_offsets"]
        start = data_start + begin
        spans[key] = (start, end - begin, chunk_crc32c(view[start:start + end - begin], chunk_nbytes))
    return EncodedFile(data=data, record=FileRecord(nbytes=len(data), crc32c=crc32c(data)), spans=spans)


# ---- reading: ranged, coalesced, concurrent; every byte read is verified --------------------

#: Ranged reads in flight at once in one :func:`read_boxes` call (threads: local
#: ``preadv`` and object-store GETs both release the GIL).
READ_WORKERS = 8
#: Ranges of one file that touch are merged into one request up to this many bytes.
MAX_MERGED_READ_NBYTES = 32 * 2**20
#: Scratch bytes (for pieces that cannot be read straight into their destination) one
#: :func:`read_boxes` call holds at once; beyond it the reads planned so far are run first.
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


def _strides(lengths: tuple[int, ...]) -> list[int]:
    """Row-major element strides of a contiguous tensor of shape ``lengths``."""
    strides = [1] * len(lengths)
    for d in range(len(lengths) - 2, -1, -1):
        strides[d] = strides[d + 1] * lengths[d + 1]
    return strides


def _chunk_groups(saved: Box, common: Box, itemsize: int, chunk: int, a: int, b: int) -> list[tuple[int, int]]:
    """Runs ``[c0, c1)`` of consecutive checksum chunks of ``saved`` holding bytes of ``common``.

    ``[a, b)`` is the byte span of ``common`` in the saved shard. When the gaps between the
    intersection's rows are at least a chunk long, the chunks that hold only gap bytes are
    left out (e.g. a TP column slice of a saved row slice with long rows); otherwise one group.
    """
    whole = [(a // chunk, -(-b // chunk))]
    strides = _strides(saved.lengths)
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
    view = _byte_view(out)
    if not box.lengths:
        return [view]
    strides = _strides(box.lengths)
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
    first, last = row_major_span((), saved, common)
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
    src = elems.as_strided(piece.common.lengths, _strides(piece.saved.lengths)) if piece.common.lengths \
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


def read_boxes(store: Store, manifest: Manifest, requests: Sequence[tuple[str, Box, torch.Tensor | None]],
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
    if manifest.tensor_format == "zarr":                      # one array per tensor, see zarr_format
        from shardsmith.storage.zarr_read import read_zarr_boxes
        return read_zarr_boxes(store, manifest, requests, stats, source)
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


def read_box(store: Store, manifest: Manifest, fqn: str, box: Box, out: torch.Tensor | None = None,
             stats: ReadStats | None = None, source: str = "") -> torch.Tensor:
    """Assemble ``box`` of logical tensor ``fqn`` from a checkpoint's shards (see
    :func:`read_boxes`, which batches many boxes into fewer, concurrent reads).

    Args:
        store: the step directory's store (shard file paths are relative to it).
        manifest: the parsed manifest of that step.
        fqn: logical tensor name.
        box: global offsets/lengths wanted (elements).
        out: optional destination of shape ``box.lengths`` and the tensor's dtype (else new).
        stats: optional counters updated with bytes read and needed.

    Returns:
        Tensor of shape ``box.lengths`` (``out`` when given).

    Raises:
        KeyError: ``fqn`` is not in the checkpoint.
        IntegrityError: a read byte does not match its checksum, or a file it touches is
            truncated, oversized or has a safetensors header that disagrees with the manifest.
    """
    return read_boxes(store, manifest, [(fqn, box, out)], stats, source)[0]


def safetensors_header(entries: list[tuple[str, torch.Tensor]],
                       metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header for ``entries`` laid out in the given order, back to back.

    Format (https://github.com/huggingface/safetensors#format): 8-byte little-endian
    header length N, N bytes of JSON ``{key: {dtype, shape, data_offsets}}`` padded with
    spaces to a multiple of 8, then the data. Zero-element entries must be filtered out.

    Returns:
        (the 8 + N header bytes, key -> (absolute byte offset, nbytes) of its data).
    """
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, t in entries:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    spans = {key: (len(prefix) + h["data_offsets"][0], h["data_offsets"][1] - h["data_offsets"][0])  # type: ignore[index]
             for key, h in header.items() if key != "__metadata__"}
    return prefix, spans


def _byte_view(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bfloat16 or flat.dtype == torch.float16:
        flat = flat.view(torch.int16)
    elif flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def write_shard_file(store: Store, key: str, entries: list[tuple[str, torch.Tensor]], chunk_nbytes: int,
                     box_of: dict[str, Box]) -> tuple[FileRecord, dict[str, ShardRecord]]:
    """Stream one safetensors shard file to ``store`` (header, then each tensor's bytes) and
    return its manifest records. No serialized copy of the file is built in memory, and the
    checksums are computed by a second thread while the bytes are written (one pass each).

    Args:
        store: the step directory store; ``key`` is checkpoint-relative (``shards/...``).
        entries: (fqn, contiguous CPU tensor) in file order; empty tensors are skipped.
        chunk_nbytes: checksum chunk size.
        box_of: fqn -> the global box each tensor holds.

    Raises:
        StorageError / OSError: the write failed (after the store's retries).
    """
    entries = [(k, t.contiguous()) for k, t in entries if t.numel() > 0]
    prefix, spans = safetensors_header(entries)
    views = [_byte_view(t) for _, t in entries]
    with ThreadPoolExecutor(1, thread_name_prefix="shardsmith-crc") as pool:
        checksums = pool.submit(_file_checksums, prefix, views, chunk_nbytes)
        crash_point("shard.before_write")                           # test hook; inert normally
        store.write_parts(key, [memoryview(prefix), *views])
        crash_point("shard.after_write")
        file_crc, chunk_crcs = checksums.result()
    records: dict[str, ShardRecord] = {}
    for (fqn, _), crcs in zip(entries, chunk_crcs):
        start, nbytes = spans[fqn]
        box = box_of[fqn]
        records[fqn] = ShardRecord(offsets=list(box.offsets), lengths=list(box.lengths), file=key,
                                   key=fqn, byte_offset=start, nbytes=nbytes, crc32c=crcs)
    total = len(prefix) + sum(len(v) for v in views)
    return FileRecord(nbytes=total, crc32c=file_crc), records


def _file_checksums(prefix: bytes, views: list[memoryview], chunk_nbytes: int) -> tuple[int, list[list[int]]]:
    """(CRC-32C of the whole file, per-entry chunk CRC-32Cs) in one pass over the bytes: the
    file's CRC is combined from the chunks' (crc32c releases the GIL on large buffers)."""
    file_crc = crc32c(prefix)
    out = []
    for view in views:
        crcs = []
        for i in range(0, len(view), chunk_nbytes):
            piece = view[i:i + chunk_nbytes]
            crcs.append(crc32c(piece))
            file_crc = crc32c_combine(file_crc, crcs[-1], len(piece))
        out.append(crcs)
    return file_crc, out


def encode_and_record(tensors: dict[str, tuple[torch.Tensor, Box]], file_name: str,
                      chunk_nbytes: int) -> tuple[EncodedFile, dict[str, ShardRecord]]:
    """Encode one rank's shards (``fqn -> (local tensor, box)``) and build their manifest records.

    The safetensors key of each entry is its FQN (a rank holds one box per tensor).
    """
    encoded = encode_shard_file({fqn: t for fqn, (t, _) in tensors.items()}, chunk_nbytes)
    records: dict[str, ShardRecord] = {}
    for fqn, (t, box) in tensors.items():
        if t.numel() == 0:
            continue
        start, nbytes, crcs = encoded.spans[fqn]
        records[fqn] = ShardRecord(offsets=list(box.offsets), lengths=list(box.lengths),
                                   file=file_name, key=fqn, byte_offset=start, nbytes=nbytes,
                                   crc32c=crcs)
    return encoded, records
