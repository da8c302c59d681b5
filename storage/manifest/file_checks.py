"""Checks of one file of a step against its manifest (used by loads and ``shardsmith verify``).

* :func:`check_file_once` — cheap, run by every load the first time it touches a data
  file: the file's size and its safetensors header (keys, dtypes, shapes, byte ranges)
  must agree with the manifest. Ranged reads then verify every byte they read against
  the per-chunk checksums.
* :func:`file_problems` — everything about one file: presence, size, header, whole-file
  CRC-32C and every shard's chunk checksums (from the manifest or the file's sidecar),
  streamed in bounded blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from shardsmith.errors import IntegrityError
from shardsmith.storage.checksum import crc32c_update
from shardsmith.storage.formats.safetensors import read_header
from shardsmith.storage.manifest.records import SIDECAR_SUFFIX, FileRecord, Manifest, ShardRecord
from shardsmith.storage.manifest.sidecar import load_chunk_crcs
from shardsmith.storage.store.fs import Store

#: Bytes read per request when streaming a file for its checksums (bounds memory).
DEFAULT_BLOCK_NBYTES = 8 * 1024 * 1024
#: (fqn, dtype, shard) of one shard stored in a file.
FileShard = tuple[str, str, ShardRecord]


# ---- headers ------------------------------------------------------------------------------


def _same_ints(value: Any, want: list[int]) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value) and value == want


def shards_in_file(manifest: Manifest, file: str) -> list[FileShard]:
    """(fqn, dtype, shard) of every non-empty shard ``manifest`` places in ``file`` (one pass
    over the manifest builds the map of every file, kept on the manifest)."""
    if manifest.file_shards is None:
        by_file: dict[str, list[FileShard]] = {}
        for fqn, rec in manifest.tensors.items():
            for s in rec.shards:
                if s.nbytes:
                    by_file.setdefault(s.file, []).append((fqn, rec.dtype, s))
        manifest.file_shards = by_file
    return manifest.file_shards.get(file, [])


def header_problems(
    shards: Sequence[FileShard],
    file_nbytes: int,
    data_start: int,
    header: dict[str, Any],
    *,
    complete: bool = True,
) -> list[str]:
    """Where a parsed safetensors header disagrees with the manifest (pure).

    Checks, for every shard the manifest places in the file (``shards``): the entry exists
    under its key with the tensor's dtype, the box's lengths as shape, and exactly the
    manifest's byte range; with ``complete`` (``shards`` are all of the file's, not those of
    a partial manifest) also that the header lists nothing else and that its data region
    ends at the file's recorded size.
    """
    problems = []
    keys = set()
    for fqn, dtype, s in shards:
        keys.add(s.key)
        entry = header.get(s.key)
        if not isinstance(entry, dict):
            problems.append(f"header has no entry {s.key!r} (tensor {fqn})")
            continue
        if entry.get("dtype") != dtype:
            problems.append(
                f"header says {s.key!r} is {entry.get('dtype')!r:.20}, the manifest {dtype}"
            )
        if not _same_ints(entry.get("shape"), s.lengths):
            problems.append(
                f"header says {s.key!r} has shape {entry.get('shape')!r:.60}, the manifest "
                f"box lengths {s.lengths}"
            )
        want = [s.byte_offset - data_start, s.byte_offset - data_start + s.nbytes]
        if not _same_ints(entry.get("data_offsets"), want):
            problems.append(
                f"header says {s.key!r} lies at data_offsets {entry.get('data_offsets')!r:.60}, "
                f"the manifest at {want} (bytes [{s.byte_offset}, {s.byte_offset + s.nbytes}))"
            )
    if not complete:
        return problems
    extra = sorted(set(header) - keys - {"__metadata__"})
    if extra:
        problems.append(f"header lists entries the manifest does not: {extra[:5]}")
    ends = [
        e["data_offsets"][1]
        for k, e in header.items()
        if k in keys
        and isinstance(e, dict)
        and isinstance(e.get("data_offsets"), list)
        and len(e["data_offsets"]) == 2
        and type(e["data_offsets"][1]) is int
    ]
    if ends and not problems and data_start + max(ends) != file_nbytes:
        problems.append(
            f"header's data ends at byte {data_start + max(ends)} but the manifest "
            f"records {file_nbytes} bytes"
        )
    return problems


def _size_problem(size: int, want: int) -> str:
    kind = "truncated" if size < want else "oversized"
    return f"{kind}: {size} bytes on storage, the manifest records {want}"


def check_file_once(store: Store, manifest: Manifest, file: str, source: str = "") -> None:
    """Check a data file's size and safetensors header against the manifest, once per
    manifest object (remembered in ``manifest.checked_files``). Any rank may call it.

    Costs one size query and one or two small ranged reads per file; the data itself
    is verified chunk by chunk as it is read. With a partial manifest only the entries of
    the tensors it holds are compared.

    Raises:
        IntegrityError: naming the file, when it is missing, truncated or oversized, or
            its header disagrees with the manifest.
    """
    if file in manifest.checked_files:
        return
    url = f"{source}/{file}" if source else store.url_of(file)
    want = manifest.files[file].nbytes
    try:
        size = store.size(file)
    except FileNotFoundError as exc:
        raise IntegrityError(
            f"{url}: missing, but the manifest lists it ({want} bytes); the checkpoint "
            "is incomplete — resume from another step (`shardsmith ls`) or restore "
            "the file"
        ) from exc
    if size != want:
        raise IntegrityError(
            f"{url}: {_size_problem(size, want)}; the file is damaged — resume from "
            "another step (`shardsmith ls`) or restore it"
        )
    if manifest.traits.file_headers and not file.endswith(SIDECAR_SUFFIX):
        data_start, header = read_header(store, file, want)
        problems = header_problems(
            shards_in_file(manifest, file), want, data_start, header, complete=not manifest.partial
        )
        if problems:
            raise IntegrityError(
                f"{url}: safetensors header disagrees with the manifest: "
                + "; ".join(problems[:10])
                + " — the file is damaged or was replaced; "
                "resume from another step or restore it"
            )
    manifest.checked_files.add(file)


# ---- streaming checksums ------------------------------------------------------------------


@dataclass
class _Chunk:
    start: int  # absolute byte range in the file
    end: int
    expected: int
    shard: int  # index into the file's shard list
    crc: int = 0


def _file_chunks(chunk_nbytes: int, shards: Sequence[FileShard]) -> list[_Chunk]:
    chunks = []
    for i, (_, _, s) in enumerate(shards):
        for c, expected in enumerate(s.crc32c):
            begin = s.byte_offset + c * chunk_nbytes
            chunks.append(
                _Chunk(begin, min(begin + chunk_nbytes, s.byte_offset + s.nbytes), expected, i)
            )
    return sorted(chunks, key=lambda ch: ch.start)


def _stream_problems(
    store: Store,
    file: str,
    record: FileRecord,
    shards: Sequence[FileShard],
    chunk_nbytes: int,
    size: int,
    block_nbytes: int,
) -> tuple[list[str], int]:
    """Whole-file CRC-32C and every shard chunk's CRC-32C in one streaming pass.

    Returns (problems, bytes read). Memory: one block (and the file's chunk list).
    """
    chunks = _file_chunks(chunk_nbytes, shards)
    bad: dict[int, list[_Chunk]] = {}
    file_crc, pos, nxt = 0, 0, 0
    while pos < size:
        data = store.read_range(file, pos, min(pos + block_nbytes, size))
        if not data:
            break
        view = memoryview(data)
        end = pos + len(data)
        file_crc = crc32c_update(view, file_crc)
        while nxt < len(chunks) and chunks[nxt].start < end:
            ch = chunks[nxt]
            lo, hi = max(ch.start, pos), min(ch.end, end)
            if hi > lo:
                ch.crc = crc32c_update(view[lo - pos : hi - pos], ch.crc)
            if ch.end > end:
                break
            if ch.crc != ch.expected:
                bad.setdefault(ch.shard, []).append(ch)
            nxt += 1
        pos = end
    problems = []
    if pos == record.nbytes and int(file_crc) != record.crc32c:
        problems.append(
            f"whole-file CRC-32C is {int(file_crc):#010x}, the manifest records {record.crc32c:#010x}"
        )
    for ch in chunks[nxt:]:
        bad.setdefault(ch.shard, []).append(ch)
    for i, chs in sorted(bad.items()):
        fqn, _, s = shards[i]
        past_end = sum(ch.end > pos for ch in chs)
        what = (
            f"{past_end} of them past the end of the file"
            if past_end
            else "checksum mismatch"
            + (" (the data or its sidecar is damaged)" if s.crc_index >= 0 else "")
        )
        problems.append(
            f"tensor {fqn} (key {s.key!r}): {len(chs)} of {len(s.crc32c)} checksum chunks "
            f"bad ({what}), first at bytes [{chs[0].start}, {chs[0].end})"
        )
    return problems, pos


def file_problems(
    store: Store,
    manifest: Manifest,
    file: str,
    shards: Sequence[FileShard],
    block_nbytes: int = DEFAULT_BLOCK_NBYTES,
) -> tuple[list[str], int]:
    """Everything wrong with one file of ``manifest`` (``shards``: every shard stored in it):
    presence, size, safetensors header, whole-file CRC-32C, chunk CRC-32Cs (fetched from
    its sidecar when they are there). Memory: the file's metadata and one block.

    Returns (problems, bytes read).
    """
    want = manifest.files[file].nbytes
    try:
        size = store.size(file)
    except FileNotFoundError:
        return [f"missing (the manifest records {want} bytes)"], 0
    problems = [] if size == want else [_size_problem(size, want)]
    if manifest.traits.file_headers and not file.endswith(SIDECAR_SUFFIX):
        try:
            data_start, header = read_header(store, file, min(size, want))
            problems += header_problems(shards, want, data_start, header)
        except IntegrityError as exc:
            problems.append(str(exc).split(": ", 1)[-1])
    try:
        load_chunk_crcs(store, manifest.chunk_nbytes, [s for _, _, s in shards])
    except IntegrityError as exc:
        return problems + [f"its checksum sidecar cannot be read: {str(exc).split(': ', 1)[-1]}"], 0
    streamed, nbytes = _stream_problems(
        store,
        file,
        manifest.files[file],
        shards,
        manifest.chunk_nbytes,
        min(size, want),
        block_nbytes,
    )
    return problems + streamed, nbytes
