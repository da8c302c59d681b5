"""Parsing and validating a manifest: every read of a ``manifest.json`` goes through
:func:`parse_manifest` (a whole document, any version) or
:class:`~shardsmith.storage.manifest.read.ManifestReader` (version 2, the tensors a rank
loads), which refuse anything malformed, inconsistent or pointing outside the checkpoint
before any byte of data is touched. This module holds the version-1 schema and the checks
on a whole manifest.
"""

from __future__ import annotations

from typing import Any

from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.manifest.checks import (
    MAX_INT,
    Problems,
    check_bytes,
    check_coverage,
    check_files_disjoint,
    err,
    fields,
    int_list,
    load_json,
    parse_manifest_head,
    parse_tensor,
    reject_duplicate_keys,
    safe_relpath,
    to_int,
    to_str,
)
from shardsmith.storage.manifest.records import FORMAT_TRAITS, FileRecord, Manifest, ShardRecord

__all__ = ["parse_manifest", "reject_duplicate_keys", "MAX_INT"]


def _parse_shard(data: Any, where: str, source: str) -> ShardRecord:
    fields(
        data,
        ("offsets", "lengths", "file", "key", "byte_offset", "nbytes", "crc32c"),
        where,
        source,
    )
    return ShardRecord(
        offsets=int_list(data["offsets"], where + ".offsets", source),
        lengths=int_list(data["lengths"], where + ".lengths", source),
        file=safe_relpath(data["file"], where + ".file", source),
        key=to_str(data["key"], where + ".key", source),
        byte_offset=to_int(data["byte_offset"], where + ".byte_offset", source),
        nbytes=to_int(data["nbytes"], where + ".nbytes", source),
        crc32c=int_list(data["crc32c"], where + ".crc32c", source, max_value=2**32 - 1),
    )


def _parse_files(data: dict[str, Any], source: str) -> dict[str, FileRecord]:
    files: dict[str, FileRecord] = {}
    for name, f in data.items():
        where = f"files[{name!r:.80}]"
        safe_relpath(name, where, source)
        fields(f, ("nbytes", "crc32c"), where, source)
        files[name] = FileRecord(
            nbytes=to_int(f["nbytes"], where + ".nbytes", source),
            crc32c=to_int(f["crc32c"], where + ".crc32c", source, max_value=2**32 - 1),
        )
    return files


@cycle_gc_paused()
def parse_manifest(raw: bytes, source: str = "manifest.json") -> Manifest:
    """Parse and validate a manifest; never trusts its contents.

    Schema problems (types, ranges, paths) raise at the first one; consistency problems
    (coverage, byte ranges, checksum counts) are collected over every tensor and raised
    together.

    Args:
        raw: the JSON bytes.
        source: URL or path used in error messages.

    Raises:
        ManifestError: naming the field and ``source``, for: invalid JSON (or duplicate
            keys, NaN, nesting too deep), an unknown format, version or tensor format, a
            missing or mistyped field (a bool is not an integer), an integer outside
            ``[0, 2**63 - 1]`` (negative offsets, huge shapes), a file path outside the
            checkpoint (``..``, absolute, a URL, backslashes, empty), a box of the wrong
            rank or outside its tensor's shape, overlapping or missing coverage, a byte
            count that does not match its box, a shard outside its file or in a file not
            listed, two shards sharing a key or bytes of one file, a wrong checksum count.
    """
    from shardsmith.storage.manifest.v2 import (  # manifest_v2 imports this module
        indexed_version,
        parse_whole,
    )

    if indexed_version(raw):
        return parse_whole(raw, source)
    data = load_json(raw, source)
    if data.get("version") in (2, 3):
        raise err(
            "version",
            f"a version-{data['version']} manifest must begin with its head (format, version, "
            "head_nbytes); this one does not",
            source,
        )
    version, chunk = parse_manifest_head(data, source, (1,), (("tensors", dict), ("files", dict)))
    files = _parse_files(data["files"], source)
    tensors = {
        fqn: parse_tensor(fqn, t, source, lambda d, w: _parse_shard(d, w, source))
        for fqn, t in data["tensors"].items()
    }
    problems = Problems(source)
    for fqn, rec in tensors.items():
        check_coverage(
            fqn, rec, problems, raw_nbytes=FORMAT_TRAITS[data["tensor_format"]].raw_shards
        )
        check_bytes(fqn, rec, files, chunk, problems)
    check_files_disjoint(tensors, problems)
    problems.raise_if_any()
    return Manifest(
        step=data["step"],
        layout=data["layout"],
        model=data["model"],
        config=data["config"],
        state=data["state"],
        tensors=tensors,
        files=files,
        tensor_format=data["tensor_format"],
        chunk_nbytes=chunk,
        created=str(data.get("created", "")),
        version=version,
    )
