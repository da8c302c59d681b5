"""Chunk-checksum sidecars: the per-chunk CRC-32Cs of a data file, beside it (manifest version 2).

``shards/rank-00000.safetensors.crc32c`` holds the CRC-32C of every ``chunk_nbytes`` piece of
every shard of ``shards/rank-00000.safetensors``: little-endian uint32, shard after shard in
file order. Each shard record keeps the index of its first chunk CRC (``crc_index``); the
sidecar's size and whole-file CRC are in the manifest's file table, so ``verify`` and the
commit's file checks cover it like any data file.

A reader fetches by range exactly the CRCs of the shards it reads (:func:`load_chunk_crcs`:
one ranged read per run of neighbouring shards of one sidecar), never the whole step's.
A damaged sidecar cannot let damaged data through: the data it describes then fails its
check (the message says the data or its sidecar is damaged).
"""

from __future__ import annotations

import array
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping

from shardsmith.errors import IntegrityError
from shardsmith.storage.checksum import crc32c, require_full_read
from shardsmith.storage.manifest.records import FileRecord, ShardRecord, sidecar_name
from shardsmith.storage.store.fs import Store

#: Bytes of one chunk CRC in a sidecar.
CRC_NBYTES = 4
#: Two runs of one sidecar closer than this are fetched in one read.
_MERGE_GAP_NBYTES = 4096
#: Sidecar reads in flight at once.
_READ_WORKERS = 8


def encode_crcs(crcs: Iterable[Iterable[int]]) -> bytes:
    """The sidecar bytes of shards' chunk CRCs (in file order): little-endian uint32."""
    out = array.array("I")
    for values in crcs:
        out.extend(values)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def decode_crcs(data: bytes) -> list[int]:
    """Inverse of :func:`encode_crcs` (``len(data)`` must be a multiple of 4)."""
    out = array.array("I")
    out.frombytes(data)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tolist()


def write_sidecar(
    store: Store, data_file: str, shards: Mapping[str, ShardRecord] | Iterable[ShardRecord]
) -> FileRecord:
    """Write the sidecar of ``data_file`` from its shards' chunk CRCs and set each shard's
    ``crc_index`` (its CRCs are then read from the sidecar, not the manifest). Called by the
    rank that wrote ``data_file``, right after it; atomic like every store write.

    Returns:
        The sidecar's record (size, whole-file CRC-32C) for the manifest's file table.

    Raises:
        StorageError / OSError: the write failed (after the store's retries).
    """
    records = list(shards.values()) if isinstance(shards, Mapping) else list(shards)
    records.sort(key=lambda s: s.byte_offset)
    index = 0
    for s in records:
        s.crc_index = index
        index += len(s.crc32c)
    data = encode_crcs(s.crc32c for s in records)
    store.write(sidecar_name(data_file), data)
    return FileRecord(nbytes=len(data), crc32c=crc32c(data))


def _runs(wanted: list[ShardRecord], chunk_nbytes: int) -> list[tuple[int, int, list[ShardRecord]]]:
    """Byte runs ``[start, end)`` of one sidecar covering ``wanted``'s CRCs, neighbours merged."""
    runs: list[tuple[int, int, list[ShardRecord]]] = []
    for s in sorted(wanted, key=lambda s: s.crc_index):
        start = s.crc_index * CRC_NBYTES
        end = start + s.num_chunks(chunk_nbytes) * CRC_NBYTES
        if runs and start - runs[-1][1] <= _MERGE_GAP_NBYTES:
            lo, hi, members = runs[-1]
            runs[-1] = (lo, max(hi, end), members + [s])
        else:
            runs.append((start, end, [s]))
    return runs


def load_chunk_crcs(
    store: Store, chunk_nbytes: int, shards: Iterable[ShardRecord], source: str = ""
) -> int:
    """Fetch the chunk CRCs (``chunk_nbytes`` chunks) of ``shards`` from their sidecars (those
    whose CRCs are not in memory yet; version-1 shards carry them inline) into each record's
    ``crc32c``.

    Any rank, before reading the shards' data. One ranged read per run of neighbouring
    shards of a sidecar, concurrently.

    Returns:
        Sidecar bytes read.

    Raises:
        IntegrityError: a sidecar is missing or shorter than the manifest says.
    """
    by_sidecar: dict[str, dict[int, ShardRecord]] = {}
    for s in shards:
        if s.crc_index >= 0 and not s.crc32c and s.nbytes:
            by_sidecar.setdefault(sidecar_name(s.file), {})[id(s)] = s
    jobs = [
        (name, run)
        for name, found in sorted(by_sidecar.items())
        for run in _runs(list(found.values()), chunk_nbytes)
    ]
    if not jobs:
        return 0

    def one(job: tuple[str, tuple[int, int, list[ShardRecord]]]) -> int:
        name, (start, end, members) = job
        url = f"{source or store.url}/{name}"
        try:
            data = store.read_range(name, start, end)
        except FileNotFoundError as exc:
            raise IntegrityError(
                f"{url}: missing, but the manifest lists it; the checkpoint is incomplete — "
                "resume from another step (`shardsmith ls`) or restore the file"
            ) from exc
        require_full_read(len(data), end - start, start, url)
        for s in members:
            lo = s.crc_index * CRC_NBYTES - start
            s.crc32c = decode_crcs(data[lo : lo + s.num_chunks(chunk_nbytes) * CRC_NBYTES])
        return len(data)

    if len(jobs) == 1:
        return one(jobs[0])
    with ThreadPoolExecutor(
        min(_READ_WORKERS, len(jobs)), thread_name_prefix="shardsmith-crc"
    ) as pool:
        return sum(pool.map(one, jobs))
