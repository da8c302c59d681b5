"""Torch tensors <-> checkpoint files: the dtype maps and the safetensors writers for tensors.

The byte-level format lives in :mod:`shardsmith.storage.formats.safetensors`; this module only
turns CPU tensors into the raw buffers it writes (without copies) and builds the
manifest records of a rank's file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardsmith.layout import DTYPES, Box
from shardsmith.storage.checksum import chunk_crc32c, crc32c
from shardsmith.storage.formats import safetensors
from shardsmith.storage.manifest.records import FileRecord, ShardRecord
from shardsmith.storage.store.fs import Store

#: torch dtype of each checkpoint dtype (from the one table, :mod:`shardsmith.layout.dtypes`).
TORCH_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, d.torch_name) for n, d in DTYPES.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def byte_view(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bfloat16 or flat.dtype == torch.float16:
        flat = flat.view(torch.int16)
    elif flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _entries(
    tensors: list[tuple[str, torch.Tensor]],
) -> list[tuple[str, str, tuple[int, ...], memoryview]]:
    kept = [(k, t.detach().contiguous()) for k, t in tensors if t.numel() > 0]
    return [(k, DTYPE_NAMES[t.dtype], tuple(t.shape), byte_view(t)) for k, t in kept]


def write_shard_file(
    store: Store,
    key: str,
    entries: list[tuple[str, torch.Tensor]],
    chunk_nbytes: int,
    box_of: dict[str, Box],
) -> tuple[FileRecord, dict[str, ShardRecord]]:
    """Stream one rank's safetensors shard file to ``store`` and return its manifest records
    (see :func:`shardsmith.storage.formats.safetensors.write_buffers`: no serialized copy in memory,
    checksums computed while the bytes are written). Called by each writing rank.

    Args:
        store: the step directory store; ``key`` is checkpoint-relative (``shards/...``).
        entries: (fqn, CPU tensor) in file order; empty tensors are skipped.
        chunk_nbytes: checksum chunk size (bytes).
        box_of: fqn -> the global box (elements) each tensor holds.

    Raises:
        StorageError / OSError: the write failed (after the store's retries).
    """
    items = _entries(entries)
    file_rec, crcs = safetensors.write_buffers(store, key, items, chunk_nbytes)
    header, _ = safetensors.encode_header([(k, d, s, len(v)) for k, d, s, v in items])
    records = safetensors.shard_records(
        key, [(k, box_of[k], len(v)) for k, _, _, v in items], len(header), crcs
    )
    return file_rec, records


@dataclass
class EncodedFile:
    """A shard file built in memory: its bytes and what the manifest records of it."""

    data: bytes
    record: FileRecord


def encode_and_record(
    tensors: dict[str, tuple[torch.Tensor, Box]], file_name: str, chunk_nbytes: int
) -> tuple[EncodedFile, dict[str, ShardRecord]]:
    """One rank's shards (``fqn -> (local tensor, box)``) as the bytes of a safetensors file
    in :func:`~shardsmith.storage.formats.safetensors.file_order` (what ``safetensors.torch.save``
    writes), and their manifest records. For tests and small files: the whole file is held
    in memory; jobs stream with :func:`write_shard_file`.
    """
    boxes = {fqn: box for fqn, (_, box) in tensors.items()}
    items = sorted(
        _entries([(fqn, t) for fqn, (t, _) in tensors.items()]),
        key=lambda e: safetensors.file_order(e[0], e[1]),
    )
    header, _ = safetensors.encode_header([(k, d, s, len(v)) for k, d, s, v in items])
    data = header + b"".join(v for *_, v in items)
    crcs = [chunk_crc32c(v, chunk_nbytes) for *_, v in items]
    records = safetensors.shard_records(
        file_name, [(k, boxes[k], len(v)) for k, _, _, v in items], len(header), crcs
    )
    return EncodedFile(data, FileRecord(nbytes=len(data), crc32c=crc32c(data))), records
