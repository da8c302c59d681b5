"""Safetensors files: the one header writer, the one header reader, the file writers.

Format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
header length N, N bytes of compact UTF-8 JSON ``{key: {dtype, shape, data_offsets}}``
(optionally preceded by ``__metadata__``), padded with spaces to a multiple of 8, then the
data, entries back to back. Checkpoint files (saves, reshards, conversions) order their
entries like ``safetensors.torch.save`` (:func:`file_order`: dtype alignment descending,
then key), so every writer produces the bytes a save in that layout produces.

Every writer here publishes atomically (:meth:`Store.write_parts` / :meth:`Store.open_writer`)
and returns the manifest records of what it wrote. No torch here: data are buffers.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterable, Iterator, Sequence

from shardsmith.errors import IntegrityError
from shardsmith.layout import SAFETENSORS_DTYPE_ORDER, Box
from shardsmith.storage.checksum import ChunkedCrc, chunk_crc32c, crc32c, crc32c_extend
from shardsmith.storage.crashpoints import crash_point
from shardsmith.storage.manifest.parse import reject_duplicate_keys
from shardsmith.storage.manifest.records import FileRecord, ShardRecord
from shardsmith.storage.store.fs import Store

#: safetensors refuses headers larger than this (100 MB); so do we.
MAX_HEADER_NBYTES = 100_000_000
#: First read of a file's header: all of it in one request up to a few hundred entries
#: (a 1,024-rank save's files have ~20 KB headers: two requests, ~no bytes beyond the header).
_HEADER_PROBE_NBYTES = 16 * 1024

#: (key, safetensors dtype name, shape, data bytes) of one entry.
HeaderEntry = tuple[str, str, Sequence[int], int]


def file_order(key: str, dtype: str) -> tuple[int, str]:
    """Sort key of an entry in a checkpoint file (dtype alignment descending, then key),
    the order ``safetensors.torch.save`` writes."""
    return SAFETENSORS_DTYPE_ORDER.index(dtype), key


def encode_header(
    entries: Sequence[HeaderEntry], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """The header bytes of a file holding ``entries`` back to back, in the given order.

    Args:
        entries: (key, dtype, shape, nbytes); zero-byte entries must be left out.
        metadata: optional ``__metadata__`` (string -> string), written first.

    Returns:
        (8-byte length + padded JSON, each entry's data offset relative to the data region).
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offsets, pos = [], 0
    for key, dtype, shape, nbytes in entries:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def header_span(prefix: bytes, url: str, file_nbytes: int) -> tuple[int, int]:
    """The header length from a file's first bytes; (header length, data start).

    Raises:
        IntegrityError: fewer than 8 bytes, or a length running past the file.
    """
    if len(prefix) < 8:
        raise IntegrityError(
            f"{url}: truncated: {len(prefix)} bytes, too short for a safetensors header"
        )
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if header_len > min(MAX_HEADER_NBYTES, file_nbytes - 8):
        raise IntegrityError(
            f"{url}: safetensors header length {header_len} runs past the file "
            f"({file_nbytes} bytes per the manifest): the header is corrupt"
        )
    return header_len, 8 + header_len


def read_header(store: Store, file: str, file_nbytes: int) -> tuple[int, dict[str, Any]]:
    """Read and parse the header of a safetensors file (at most two ranged reads).

    Args:
        store: the step directory.
        file: checkpoint-relative path.
        file_nbytes: the file's size per the manifest (bounds the header length).

    Returns:
        (data_start, header): absolute offset of the data region and the header object.

    Raises:
        IntegrityError: the file is too short, the length prefix is implausible, or the
            header is not a JSON object (naming the file).
        FileNotFoundError: the file is missing.
    """
    url = store.url_of(file)
    prefix = store.read_range(file, 0, min(file_nbytes, _HEADER_PROBE_NBYTES))
    header_len, data_start = header_span(prefix, url, file_nbytes)
    raw = prefix[8:data_start]
    if len(raw) < header_len:
        raw += store.read_range(file, len(prefix), data_start)
    if len(raw) != header_len:
        raise IntegrityError(
            f"{url}: truncated: the safetensors header needs {header_len} bytes, "
            f"the file has {len(raw)} after the length prefix"
        )
    try:
        header = json.loads(raw, object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise IntegrityError(f"{url}: corrupt safetensors header ({str(exc)[:120]})") from exc
    if not isinstance(header, dict):
        raise IntegrityError(f"{url}: corrupt safetensors header (not a JSON object)")
    return data_start, header


def shard_records(
    file: str, entries: Sequence[tuple[str, Box, int]], data_start: int, crcs: Sequence[list[int]]
) -> dict[str, ShardRecord]:
    """Manifest records of a file's entries ``(fqn, box, nbytes)`` laid out from ``data_start``."""
    records, pos = {}, data_start
    for (fqn, box, nbytes), chunk_crcs in zip(entries, crcs):
        records[fqn] = ShardRecord.from_box(
            box, file=file, key=fqn, byte_offset=pos, nbytes=nbytes, crc32c=chunk_crcs
        )
        pos += nbytes
    return records


#: Bytes a buffered write checksums just before writing them (a multiple of the chunk size):
#: small enough that the write's copy reads them from cache, large enough for few syscalls.
_HOT_PIECE_NBYTES = 4 << 20


def write_buffers(
    store: Store,
    key: str,
    entries: Sequence[tuple[str, str, Sequence[int], memoryview]],
    chunk_nbytes: int,
    metadata: dict[str, str] | None = None,
) -> tuple[FileRecord, list[list[int]]]:
    """Write a file whose entries are all in memory, as one atomic ``write_parts`` (no joined
    copy), each piece of a few MiB checksummed just before it is written, so the write's copy
    reads it from cache on a local store (one pass over memory instead of two; the file CRC is
    combined from the chunk CRCs). Other stores look at every part before writing (S3 sizes
    its upload first), so there the checksums are a separate pass.

    Args:
        entries: (key, dtype, shape, raw little-endian bytes) in file order; no empty ones.
        chunk_nbytes: checksum chunk size (bytes).

    Returns:
        (the file's record, each entry's chunk CRC-32Cs).

    Raises:
        StorageError / OSError: the write failed (after the store's retries).
    """
    prefix, _ = encode_header([(k, d, s, len(v)) for k, d, s, v in entries], metadata)
    step = max(chunk_nbytes, _HOT_PIECE_NBYTES // chunk_nbytes * chunk_nbytes)
    parts = _HotParts(memoryview(prefix), chunk_nbytes)
    for i, (*_, view) in enumerate(entries):
        for start in range(0, len(view), step):
            parts.add(memoryview(view)[start : start + step], i)
    crash_point("shard.before_write")  # test hook; inert normally
    store.write_parts(key, parts)
    crash_point("shard.after_write")
    chunk_crcs: list[list[int]] = [[] for _ in entries]
    for i in range(1, len(parts)):
        chunk_crcs[parts.owner[i]] += parts.crcs_of(i)
    file_crc = crc32c(prefix)
    for view, crcs in zip((v for *_, v in entries), chunk_crcs):
        file_crc = crc32c_extend(file_crc, crcs, len(view), chunk_nbytes)
    return FileRecord(
        nbytes=len(prefix) + sum(len(v) for *_, v in entries), crc32c=file_crc
    ), chunk_crcs


class _HotParts(Sequence[memoryview]):
    """A file's parts (the header, then pieces of entries) that checksum each piece as
    iteration hands it to the writer, so its copy into the page cache reads it from cache.
    Indexing does not checksum; :meth:`crcs_of` computes what iteration did not reach."""

    def __init__(self, header: memoryview, chunk_nbytes: int) -> None:
        self.parts, self.owner, self.chunk_nbytes = [header], [-1], chunk_nbytes
        self.crcs: dict[int, list[int]] = {}

    def add(self, piece: memoryview, entry: int) -> None:
        self.parts.append(piece)
        self.owner.append(entry)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # Sequence's int/slice overloads
        return self.parts[i]

    def __iter__(self) -> Iterator[memoryview]:
        for i, part in enumerate(self.parts):
            if i:
                self.crcs_of(i)
            yield part

    def crcs_of(self, i: int) -> list[int]:
        """Chunk CRC-32Cs of piece ``i`` (computed once)."""
        if i not in self.crcs:
            self.crcs[i] = chunk_crc32c(self.parts[i], self.chunk_nbytes)
        return self.crcs[i]


def write_stream(
    store: Store,
    key: str,
    header: bytes,
    data: Iterable[tuple[Any, ...]],
    num_entries: int,
    chunk_nbytes: int,
    nbytes_hint: int | None = None,
) -> tuple[FileRecord, list[list[int]]]:
    """Stream a file front to back: ``header`` (from :func:`encode_header`), then each
    ``(entry index, bytes)`` of ``data`` in file order (entry indices never decrease),
    checksummed as it goes: one CRC pass per byte, the file's CRC combined from the chunks'.
    An item ``(entry index, bytes, chunk CRCs)`` brings the CRCs of its bytes' chunks
    (:meth:`ChunkedCrc.update`'s ``known``), saving that pass; The file appears atomically
    when every byte is written, never on an error.

    Returns:
        (the file's record, each entry's chunk CRC-32Cs).

    Raises:
        StorageError / OSError: the write failed; whatever ``data`` raises.
        ValueError: an entry index decreased (a caller's bug: the file CRC assumes order).
    """
    crcs = [ChunkedCrc(chunk_nbytes) for _ in range(num_entries)]
    last = 0
    with store.open_writer(key, nbytes_hint=nbytes_hint) as f:
        f.write(header)
        for i, chunk, *known in data:
            if i < last:
                raise ValueError(
                    f"write_stream {key}: entry {i} after entry {last}; feed entries in file order"
                )
            last = i
            f.write(chunk)
            crcs[i].update(chunk, known[0] if known else None)
    file_crc = crc32c(header)
    for c in crcs:
        file_crc = c.extend_crc(file_crc)
    return FileRecord(nbytes=len(header) + sum(c.nbytes for c in crcs), crc32c=file_crc), [
        c.finish() for c in crcs
    ]
