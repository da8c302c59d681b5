"""Shard files: encode local tensors as one safetensors file; read boxes back by ranged reads.

Writing: :func:`encode_shard_file` turns ``{key: tensor}`` into the file's bytes plus
the per-key byte ranges and chunked CRC-32C checksums that go into the manifest.

Reading: :func:`read_box` fills a target box of a logical tensor from the saved
shards it intersects, reading for each only the contiguous byte span covering the
intersection (widened to checksum-chunk boundaries so every byte read is verified).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as safetensors_save

from shardsmith.errors import IntegrityError
from shardsmith.storage.boxes import Box, row_major_span
from shardsmith.storage.checksum import chunk_crc32c, crc32c
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import DTYPE_NBYTES, FileRecord, Manifest, ShardRecord

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
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


def _read_verified(store: Store, shard: ShardRecord, first: int, last: int, chunk_nbytes: int,
                   source: str) -> tuple[bytes, int]:
    """Read shard data bytes covering ``[first, last)`` (relative to the shard), widened to
    checksum chunks and verified. Returns (bytes, relative offset of the bytes)."""
    c0, c1 = first // chunk_nbytes, -(-last // chunk_nbytes)
    rel_start, rel_end = c0 * chunk_nbytes, min(c1 * chunk_nbytes, shard.nbytes)
    data = store.read_range(shard.file, shard.byte_offset + rel_start, shard.byte_offset + rel_end)
    if len(data) != rel_end - rel_start:
        raise IntegrityError(f"{source}/{shard.file}: truncated — expected {rel_end - rel_start} bytes "
                             f"at offset {shard.byte_offset + rel_start}, got {len(data)}; "
                             "the file is damaged, resume from another step")
    view = memoryview(data)
    for i, c in enumerate(range(c0, c1)):
        piece = view[i * chunk_nbytes:(i + 1) * chunk_nbytes]
        if crc32c(piece) != shard.crc32c[c]:
            raise IntegrityError(f"{source}/{shard.file}: checksum mismatch in {shard.key!r} bytes "
                                 f"[{c * chunk_nbytes}, {c * chunk_nbytes + len(piece)}) — the file is "
                                 "corrupt; resume from another step or restore the file")
    return data, rel_start


@dataclass
class ReadStats:
    """Bytes read from storage vs bytes the caller needed, for read amplification."""

    nbytes_read: int = 0
    nbytes_needed: int = 0


def read_box(store: Store, manifest: Manifest, fqn: str, box: Box, out: torch.Tensor | None = None,
             stats: ReadStats | None = None, source: str = "") -> torch.Tensor:
    """Assemble ``box`` of logical tensor ``fqn`` from a checkpoint's shards.

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
        IntegrityError: a read byte does not match its checksum or a file is truncated.
    """
    rec = manifest.tensors[fqn]
    dtype = TORCH_DTYPES[rec.dtype]
    itemsize = DTYPE_NBYTES[rec.dtype]
    if out is None:
        out = torch.empty(box.lengths, dtype=dtype)
    filled = 0
    for shard in rec.shards:
        saved = Box(tuple(shard.offsets), tuple(shard.lengths))
        common = saved.intersect(box) if box.lengths else saved
        if common is None or common.numel == 0:
            continue
        first, last = row_major_span(tuple(rec.shape), saved, common)
        data, rel = _read_verified(store, shard, first * itemsize, last * itemsize,
                                   manifest.chunk_nbytes, source or store.url)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        elems = flat[first * itemsize - rel:last * itemsize - rel].view(dtype)
        # elems covers saved's row-major storage from element `first`: view it through
        # the saved box's strides, starting at the intersection's first element.
        strides = [1] * len(saved.lengths)
        for d in range(len(saved.lengths) - 2, -1, -1):
            strides[d] = strides[d + 1] * saved.lengths[d + 1]
        piece = elems.as_strided(common.lengths, strides) if common.lengths else elems.view(())
        out[common.relative_to(box)] = piece
        filled += common.numel
        if stats is not None:
            stats.nbytes_read += len(data)
            stats.nbytes_needed += common.numel * itemsize
    if filled != box.numel:
        raise IntegrityError(f"{source or store.url}: saved shards of {fqn!r} cover {filled} of the "
                             f"{box.numel} elements of box {box}")
    return out


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
    return memoryview(flat.numpy()).cast("B")


def write_shard_file(store: Store, key: str, entries: list[tuple[str, torch.Tensor]], chunk_nbytes: int,
                     box_of: dict[str, Box]) -> tuple[FileRecord, dict[str, ShardRecord]]:
    """Stream one safetensors shard file to ``store`` (header, then each tensor's bytes) and
    return its manifest records. No serialized copy of the file is built in memory.

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
    file_crc = crc32c(prefix)
    records: dict[str, ShardRecord] = {}
    for (fqn, _), view in zip(entries, views):
        file_crc = _crc32c_update(view, file_crc)
        start, nbytes = spans[fqn]
        box = box_of[fqn]
        records[fqn] = ShardRecord(offsets=list(box.offsets), lengths=list(box.lengths), file=key,
                                   key=fqn, byte_offset=start, nbytes=nbytes,
                                   crc32c=chunk_crc32c(view, chunk_nbytes))
    store.write_parts(key, [memoryview(prefix), *views])
    total = len(prefix) + sum(len(v) for v in views)
    return FileRecord(nbytes=total, crc32c=file_crc), records


def _crc32c_update(data: memoryview, value: int) -> int:
    import crc32c as _lib

    return int(_lib.crc32c(data, value))


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
