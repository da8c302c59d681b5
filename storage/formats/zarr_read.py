"""Reading boxes of a zarr checkpoint (see :mod:`shardsmith.storage.formats.zarr_format`).

:func:`read_zarr_boxes` is what :func:`shardsmith.storage.reading.execute.read_safetensors_boxes` does for a
manifest whose ``tensor_format`` is ``zarr``: the same contract (any boxes, ranged and
verified reads, concurrent), with chunks as the saved shards. Uncompressed chunks are read
by byte range like safetensors shards (the zarr ``bytes`` codec is C-order little-endian
elements of the full chunk shape); compressed chunks are read whole and decoded by zarr.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Any, Sequence

import numpy as np
import torch
from zarr.core.buffer import default_buffer_prototype

from shardsmith.errors import IntegrityError
from shardsmith.layout import DTYPE_NBYTES, Box, row_major_span, row_major_strides
from shardsmith.storage.checksum import crc32c, require_full_read, verify_chunks
from shardsmith.storage.formats.zarr_format import (
    IO_WORKERS,
    MAX_PENDING_NBYTES,
    ZARR_DIR,
    ZarrArray,
    damaged,
    numpy_to_torch,
    parse_array_metadata,
)
from shardsmith.storage.manifest.records import Manifest, ShardRecord, TensorRecord
from shardsmith.storage.reading.execute import destination
from shardsmith.storage.reading.spans import chunk_span, intersections
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import check_file_once


def _load_array(
    store: Store, manifest: Manifest, fqn: str, rec: TensorRecord, source: str
) -> tuple[ZarrArray, int]:
    """The array description of ``fqn`` from its verified ``zarr.json``; (array, bytes read)."""
    key = f"{ZARR_DIR}/{fqn}/zarr.json"
    url = f"{source}/{key}"
    record = manifest.files.get(key)
    if record is None:
        raise damaged(f"{source}/manifest.json", f"no metadata file {key} listed for tensor {fqn}")
    try:
        raw = store.read(key)
    except FileNotFoundError as exc:
        raise IntegrityError(
            f"{url}: missing, but the manifest lists it; the checkpoint is incomplete — "
            "resume from another step or restore the file"
        ) from exc
    if len(raw) != record.nbytes or crc32c(raw) != record.crc32c:
        raise damaged(
            url,
            f"{len(raw)} bytes with CRC-32C {crc32c(raw):#010x}, the manifest records "
            f"{record.nbytes} bytes with {record.crc32c:#010x}",
        )
    return parse_array_metadata(raw, fqn, rec, url), len(raw)


def _check_chunk_record(
    array: ZarrArray, shard: ShardRecord, manifest: Manifest, source: str
) -> None:
    """A shard record must name the chunk file its box is, whole (byte offset 0, file size)."""
    saved = shard.box
    index = [o // c for o, c in zip(saved.offsets, array.chunks)]
    if array.chunk_region(index) != saved or array.chunk_key(saved) != shard.file:
        raise damaged(
            f"{source}/manifest.json",
            f"shard {saved} of {array.fqn} in {shard.file} is not a "
            f"chunk of the grid {array.chunks} (expected {array.chunk_key(saved)})",
        )
    if shard.byte_offset != 0 or shard.nbytes != manifest.files[shard.file].nbytes:
        raise damaged(
            f"{source}/manifest.json",
            f"shard of {array.fqn} in {shard.file} must span the whole "
            f"chunk file (byte offset 0, {manifest.files[shard.file].nbytes} bytes)",
        )


def _read_chunk(store: Store, manifest: Manifest, shard: ShardRecord, source: str) -> bytes:
    """A whole chunk file, its size and every checksum chunk verified."""
    check_file_once(store, manifest, shard.file, source)
    data = store.read(shard.file)
    url = f"{source}/{shard.file}"
    if len(data) != shard.nbytes:
        raise damaged(url, f"{len(data)} bytes, the manifest records {shard.nbytes}")
    verify_chunks(shard, 0, [data], manifest.chunk_nbytes, url)
    return data


_INTS = {
    1: np.int8,
    2: np.int16,
    4: np.int32,
    8: np.int64,
}  # element-size views: dtype-agnostic copies


@dataclass
class _Piece:
    """The part ``common`` of one raw (uncompressed) chunk that request ``index`` needs."""

    index: int
    array: ZarrArray
    shard: ShardRecord
    common: Box

    def span(self, chunk: int) -> tuple[int, int, int, int]:
        """(first byte, end byte) of ``common`` in the chunk's row-major storage (the full
        chunk shape: zarr stores edge chunks padded) and that span widened to checksum chunks."""
        itemsize = DTYPE_NBYTES[self.array.dtype]
        first, last = row_major_span(Box(tuple(self.shard.offsets), self.array.chunks), self.common)
        a, b = first * itemsize, last * itemsize
        return (a, b, *chunk_span(a, b, chunk, self.shard.nbytes))


def _read_piece(store: Store, manifest: Manifest, piece: _Piece, source: str) -> np.ndarray:
    """Ranged, verified read of a raw chunk's bytes covering ``piece.common``.

    The zarr v3 ``bytes`` codec stores a chunk as its elements in C order, little endian
    (https://zarr-specs.readthedocs.io/en/latest/v3/codecs/bytes/index.html), so the box is
    a strided view of that range. Returns an integer array of the element size, shape
    ``common.lengths``."""
    array, shard, chunk = piece.array, piece.shard, manifest.chunk_nbytes
    itemsize = DTYPE_NBYTES[array.dtype]
    url = f"{source}/{shard.file}"
    if shard.nbytes != prod(array.chunks) * itemsize:
        raise damaged(
            url,
            f"{shard.nbytes} bytes, but an uncompressed chunk of {array.chunks} {array.dtype} "
            f"holds {prod(array.chunks) * itemsize}",
        )
    check_file_once(store, manifest, shard.file, source)
    a, b, lo, hi = piece.span(chunk)
    data = store.read_range(shard.file, lo, hi)
    require_full_read(len(data), hi - lo, lo, url)
    verify_chunks(shard, lo // chunk, [data], chunk, url)
    seg = np.frombuffer(data, dtype=_INTS[itemsize], count=(b - a) // itemsize, offset=a - lo)
    strides = [s * itemsize for s in row_major_strides(array.chunks)]
    return np.lib.stride_tricks.as_strided(seg, piece.common.lengths, strides, writeable=False)


@dataclass
class _Request:
    """One requested box; ``shards``: the compressed chunks it needs (decoded by zarr)."""

    array: ZarrArray
    box: Box
    out: torch.Tensor
    shards: list[ShardRecord]


def _decode(request: _Request, chunk_bytes: dict[str, bytes]) -> None:
    """Decode the request's chunks with zarr and copy its box into ``out``."""
    array = request.array
    prototype = default_buffer_prototype()
    store = {
        s.file[len(array.path) + 1 :]: prototype.buffer.from_bytes(chunk_bytes[s.file])
        for s in request.shards
    }
    arr = array.in_memory(store)
    box = request.box
    data = arr[box.relative_to(Box((0,) * len(box.lengths), array.shape)) if box.lengths else ()]
    request.out.copy_(numpy_to_torch(np.asarray(data), array.dtype).reshape(box.lengths))


def read_zarr_boxes(
    store: Store,
    manifest: Manifest,
    requests: Sequence[tuple[str, Box, torch.Tensor | None]],
    stats: Any = None,
    source: str = "",
) -> list[torch.Tensor]:
    """:func:`shardsmith.storage.reading.execute.read_safetensors_boxes` for zarr checkpoints (same contract).

    Reads the ``zarr.json`` of each tensor touched (checked against the manifest), then
    for every requested box the chunks intersecting it, concurrently: from an uncompressed
    chunk only the checksum-chunk-aligned byte range holding the box's part (ranged read);
    a compressed chunk whole, decoded by zarr. Every byte read is verified against the
    manifest's checksums. Memory: about :data:`MAX_PENDING_NBYTES` of read bytes at
    once, plus the outputs.

    Raises:
        KeyError: an fqn is not in the checkpoint.
        ValueError: a destination has the wrong shape or dtype.
        IntegrityError: a file is missing, has the wrong size or checksum, its metadata
            disagrees with the manifest, or the saved chunks do not cover a box.
    """
    source = source or store.url
    arrays: dict[str, ZarrArray] = {}
    outs: list[torch.Tensor] = []
    batch: list[_Request] = []
    pieces: list[_Piece] = []
    pending = 0
    for fqn, box, out in requests:
        rec = manifest.tensors[fqn]
        out = destination(fqn, box, rec.dtype, out)
        outs.append(out)
        if fqn not in arrays:
            arrays[fqn], nbytes = _load_array(store, manifest, fqn, rec, source)
            if stats is not None:
                stats.nbytes_read += nbytes
        request = _Request(arrays[fqn], box, out.detach(), [])
        filled = 0
        for shard, _, common in intersections(rec, box):
            _check_chunk_record(request.array, shard, manifest, source)
            filled += common.numel
            if request.array.codec:
                request.shards.append(shard)
                pending += shard.nbytes
            else:
                pieces.append(_Piece(len(batch), request.array, shard, common))
                pending += common.numel * DTYPE_NBYTES[rec.dtype]
        if filled != box.numel:
            raise IntegrityError(
                f"{source}: saved chunks of {fqn!r} cover {filled} of the "
                f"{box.numel} elements of box {box}"
            )
        if stats is not None:
            stats.nbytes_needed += box.numel * DTYPE_NBYTES[rec.dtype]
        batch.append(request)
        if pending > MAX_PENDING_NBYTES:
            _run_batch(store, manifest, batch, pieces, stats, source)
            batch, pieces, pending = [], [], 0
    _run_batch(store, manifest, batch, pieces, stats, source)
    return outs


def _run_batch(
    store: Store,
    manifest: Manifest,
    batch: list[_Request],
    pieces: list[_Piece],
    stats: Any,
    source: str,
) -> None:
    """Read the batch's pieces and compressed chunk files concurrently, then fill every request."""
    compressed = {s.file: s for r in batch for s in r.shards}
    jobs: list[Any] = [lambda p=p: _read_piece(store, manifest, p, source) for p in pieces]
    jobs += [lambda s=s: _read_chunk(store, manifest, s, source) for s in compressed.values()]
    if not jobs:
        return
    with ThreadPoolExecutor(max(1, min(IO_WORKERS, len(jobs)))) as pool:
        results = list(pool.map(lambda job: job(), jobs))
    chunk_bytes = dict(zip(compressed, results[len(pieces) :]))
    if stats is not None:
        stats.nbytes_read += sum(
            p.span(manifest.chunk_nbytes)[3] - p.span(manifest.chunk_nbytes)[2] for p in pieces
        ) + sum(len(d) for d in chunk_bytes.values())
    with torch.no_grad():
        for piece, data in zip(pieces, results):
            request = batch[piece.index]
            dest = (
                request.out[piece.common.relative_to(request.box)]
                if request.box.lengths
                else request.out
            )
            dest.copy_(
                torch.from_numpy(data.copy()).view(request.out.dtype)
            )  # copy: C order, 0-d kept
        for request in batch:
            if request.shards:
                _decode(request, chunk_bytes)
