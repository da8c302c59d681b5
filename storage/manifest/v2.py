"""Manifest versions 2 and 3: one JSON document laid out so a reader can fetch only what it loads.

``manifest.json`` = HEAD + BODY, one valid JSON object::

    {"format":"shardsmith.checkpoint","version":2,"head_nbytes":        12345,
     "step":..,"created":..,"tensor_format":..,"checksum":{..},"layout":{..},"model":{..},
     "config":{..},"state":{..},
     "files":[[name, nbytes, crc32c], ...],             # sorted by name; shards refer by index
     "index":{fqn: [start, end], ...},                  # byte range of the tensor's entry in BODY
     "tensors":{                                        # <- HEAD ends here (head_nbytes bytes)
    "fqn":{"shape":[..],"dtype":"..","shards":[{"file":..,"key":..,"offsets":[..],"lengths":[..],
                                                "byte_offset":..,"crc":..}, ..]},
    ...}}                                               # BODY: entries joined by ",", then "}}"

Version 3 (written now) ends the tensors with ``},"grids":{`` and the grid entries of the
tensors that have one, joined by ``,``, then ``}}``; such a tensor's index entry is
``[start, end, grid start, grid end]`` (:mod:`shardsmith.storage.manifest.grid`).

``head_nbytes`` is right-aligned in a fixed 16-character field at a fixed offset, so the
first :data:`PREFIX_NBYTES` bytes say how long the head is. ``index`` ranges are relative to
the start of BODY and tile it: entry after entry, one ``,`` between, in natural FQN order
(``layers.2`` before ``layers.10``, so one stage's tensors are neighbours). A shard record
names its fields as version 1 does (so any JSON reader can find a shard's bytes: ``file``
relative to the step directory, safetensors ``key``, global ``offsets``/``lengths`` in
elements, ``byte_offset``/``nbytes`` in the file, ``nbytes`` left out when it is the box's
raw size, as it always is for safetensors); ``crc`` is the index of its first
chunk CRC in the file's sidecar (:mod:`shardsmith.storage.manifest.sidecar`), or, for writers without
sidecars, ``crc32c`` is the CRC list itself. The head's small sections (``layout``,
``model``, ``config``, ``state``) are written with ``json``'s default spacing for people
reading them; ``files``, ``index`` and the body are compact.

Manifests written before shard records were named (positional
``[file index, byte_offset, nbytes, crcs, offsets, lengths(, key)]``) still parse.

:func:`encode` writes it; :func:`parse_head`, :func:`parse_entry` read the pieces a rank
fetched (:class:`~shardsmith.storage.manifest.read.ManifestReader`); :func:`parse_whole`
reads a whole document and checks that the pieces tile it, so a partial reader and a full
reader always see the same tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Collection

from shardsmith.layout import DTYPE_NBYTES
from shardsmith.storage.manifest.checks import (
    Problems,
    check_bytes,
    check_coverage,
    check_files_disjoint,
    check_sidecars,
    check_type,
    err,
    fields,
    int_list,
    int_ok,
    ints_ok,
    load_json,
    parse_manifest_head,
    parse_tensor,
    relpath_ok,
    safe_relpath,
    to_int,
    to_str,
)
from shardsmith.storage.manifest.grid import (
    check_cell_nbytes,
    encode_entry,
    grid_bounds,
    parse_grid,
    parse_gridded_entry,
)
from shardsmith.storage.manifest.records import (
    FORMAT_NAME,
    FORMAT_TRAITS,
    FileRecord,
    Manifest,
    ShardRecord,
    TensorRecord,
)

#: The version written: 3 (version 2 plus the shard grids of :mod:`shardsmith.storage.manifest.grid`).
VERSION = 3
#: Versions laid out as head + body (both read).
INDEXED_VERSIONS = (2, 3)
PREFIXES = {
    v: f'{{"format":"{FORMAT_NAME}","version":{v},"head_nbytes":'.encode() for v in INDEXED_VERSIONS
}
PREFIX = PREFIXES[VERSION]
_WIDTH = 16
#: Bytes that say how long the head is (the prefix, the fixed-width number and a comma).
PREFIX_NBYTES = len(PREFIX) + _WIDTH + 1
_HEAD_END = b',"tensors":{'
_BODY_END = b"}}"
#: Version 3: the bytes between the last tensor entry and the first grid entry.
GRIDS_START = b'},"grids":{'


def indexed_version(raw: bytes) -> int:
    """2 or 3 when ``raw`` begins like a head + body manifest of that version, else 0."""
    return next((v for v, p in PREFIXES.items() if raw[: len(p)] == p), 0)


def natural_key(fqn: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", fqn)]


def encode(manifest: Manifest) -> bytes:
    """The version-2 ``manifest.json`` bytes of ``manifest`` (compact; json's C encoder)."""
    names = sorted(manifest.files)
    entries, grids, index, pos = [], [], {}, 0
    for fqn in sorted(manifest.tensors, key=natural_key):
        t = manifest.tensors[fqn]
        bounds = grid_bounds(t.shape, t.shards)
        if bounds is None:
            value = {
                "shape": t.shape,
                "dtype": t.dtype,
                "shards": [s.to_v2_json(DTYPE_NBYTES[t.dtype]) for s in t.shards],
            }
            entry = (json.dumps(fqn) + ":" + json.dumps(value, separators=(",", ":"))).encode()
        else:
            entry, grid = encode_entry(fqn, t, bounds)
            grids.append((fqn, grid))
        index[fqn] = [pos, pos + len(entry)]
        entries.append(entry)
        pos += len(entry) + 1
    pos += len(GRIDS_START) - 1 if entries else len(GRIDS_START)
    for fqn, grid in grids:
        index[fqn] += [pos, pos + len(grid)]
        pos += len(grid) + 1
    readable = {
        "step": manifest.step,
        "created": manifest.created,
        "tensor_format": manifest.tensor_format,
        "checksum": {"algorithm": "crc32c", "chunk_nbytes": manifest.chunk_nbytes},
        "layout": manifest.layout,
        "model": manifest.model,
        "config": manifest.config,
        "state": manifest.state,
    }
    compact = {
        "files": [[n, manifest.files[n].nbytes, manifest.files[n].crc32c] for n in names],
        "index": index,
    }
    tail = (
        json.dumps(readable)[1:-1] + "," + json.dumps(compact, separators=(",", ":"))[1:-1]
    ).encode() + _HEAD_END
    head_nbytes = PREFIX_NBYTES + len(tail)
    head = PREFIX + f"{head_nbytes:>{_WIDTH}},".encode() + tail
    return head + b",".join(entries) + GRIDS_START + b",".join(g for _, g in grids) + _BODY_END


def dumps_manifest(manifest: Manifest) -> bytes:
    """The ``manifest.json`` bytes of ``manifest``: version 3 (:func:`encode`), or version 1
    compact JSON for a manifest read from a version-1 checkpoint (rewritten as it was read)."""
    if manifest.version == 1:
        return json.dumps(manifest.to_json(), separators=(",", ":")).encode()
    return encode(manifest)


def head_nbytes_of(prefix: bytes, source: str) -> int:
    """The head's length from the first :data:`PREFIX_NBYTES` bytes of a version-2 or -3 manifest."""
    field = prefix[len(PREFIX) : PREFIX_NBYTES - 1]
    if (
        not indexed_version(prefix)
        or len(prefix) < PREFIX_NBYTES
        or prefix[PREFIX_NBYTES - 1 : PREFIX_NBYTES] != b","
        or not field.strip().isdigit()
    ):
        raise err("head_nbytes", "the document does not begin with a version-2 head", source)
    return to_int(int(field), "head_nbytes", source, min_value=PREFIX_NBYTES + len(_HEAD_END))


@dataclass
class Head:
    """The head of a version-2 manifest: everything but the tensors' shard records."""

    nbytes: int
    data: dict[str, Any]
    chunk_nbytes: int
    files: dict[str, FileRecord]
    file_names: list[str]
    #: fqn -> (start, end) of its entry in BODY, plus (start, end) of its grid entry (version 3).
    index: dict[str, tuple[int, ...]]
    version: int = VERSION

    def manifest(self, tensors: dict[str, TensorRecord], *, partial: bool) -> Manifest:
        """A :class:`Manifest` of this head and ``tensors`` (a partial one knows every FQN)."""
        d = self.data
        return Manifest(
            step=d["step"],
            layout=d["layout"],
            model=d["model"],
            config=d["config"],
            state=d["state"],
            tensors=tensors,
            files=self.files,
            tensor_format=d["tensor_format"],
            chunk_nbytes=self.chunk_nbytes,
            created=str(d.get("created", "")),
            version=self.version,
            all_tensors=tuple(self.index) if partial else None,
        )


def _parse_files(data: Any, source: str) -> tuple[list[str], dict[str, FileRecord]]:
    names, files = [], {}
    for i, f in enumerate(check_type(data, list, "files", source)):
        where = f"files[{i}]"
        if not isinstance(f, list) or len(f) != 3:
            raise err(where, f"expected [name, nbytes, crc32c], got {f!r:.80}", source)
        name = safe_relpath(f[0], where + "[0]", source)
        if name in files:
            raise err(where, f"{name!r:.80} is listed twice", source)
        names.append(name)
        files[name] = FileRecord(
            nbytes=to_int(f[1], where + ".nbytes", source),
            crc32c=to_int(f[2], where + ".crc32c", source, max_value=2**32 - 1),
        )
    return names, files


def _parse_index(data: Any, version: int, source: str) -> dict[str, tuple[int, ...]]:
    """fqn -> [start, end) in BODY, non-empty, in increasing order; version 3 may add the
    [start, end) of the tensor's grid entry, also in increasing order."""
    index: dict[str, tuple[int, ...]] = {}
    last = [-1, -1]
    for fqn, span in check_type(data, dict, "index", source).items():
        where = f"index[{fqn!r:.120}]"
        if not fqn:
            raise err(where, "empty tensor name", source)
        if not isinstance(span, list) or len(span) not in ((2, 4) if version >= 3 else (2,)):
            raise err(
                where,
                f"expected a byte range [start, end){' (and its grid entry)' if version >= 3 else ''}, "
                f"got {span!r:.60}",
                source,
            )
        pairs = [
            (to_int(span[k], where, source), to_int(span[k + 1], where, source))
            for k in range(0, len(span), 2)
        ]
        for k, (start, end) in enumerate(pairs):
            if end <= start:
                raise err(
                    where,
                    f"expected a byte range [start, end) with start < end, got {span!r:.60}",
                    source,
                )
            if start <= last[k]:
                raise err(
                    where,
                    f"bytes [{start}, {end}) overlap or precede the previous tensor's (ending "
                    f"at {last[k]})",
                    source,
                )
            last[k] = end
        index[fqn] = tuple(span)
    return index


def parse_head(raw: bytes, source: str) -> Head:
    """Parse and validate the first ``head_nbytes`` bytes of a version-2 manifest.

    Raises:
        ManifestError: see :func:`shardsmith.storage.manifest.parse.parse_manifest`; also a
            head that does not end where ``head_nbytes`` says, an index range that is empty,
            overlaps or is out of order, a file listed twice.
    """
    nbytes = head_nbytes_of(raw[:PREFIX_NBYTES], source)
    if len(raw) != nbytes or not raw.endswith(_HEAD_END):
        raise err(
            "head_nbytes",
            f"{nbytes} bytes of head, but the head read has {len(raw)} bytes or does not "
            "end where the tensors begin",
            source,
        )
    data = load_json(raw[: -len(_HEAD_END)] + b"}", source)
    version, chunk = parse_manifest_head(
        data, source, INDEXED_VERSIONS, (("files", list), ("index", dict))
    )
    names, files = _parse_files(data["files"], source)
    return Head(
        nbytes, data, chunk, files, names, _parse_index(data["index"], version, source), version
    )


_SHARD_FIELDS = ("file", "key", "offsets", "lengths", "byte_offset")


def _parse_shard(
    data: Any, fqn: str, itemsize: int, head: Head, where: str, source: str
) -> ShardRecord:
    """A named record; a missing ``nbytes`` is the box's raw size (elements x ``itemsize``)."""
    if isinstance(data, list):
        return _parse_positional_shard(data, fqn, head, where, source)
    record = _valid_shard(data, itemsize)
    if record is not None:
        return record
    fields(data, _SHARD_FIELDS, where, source)  # not valid: find the field to name
    if ("crc" in data) == ("crc32c" in data):
        raise err(
            where,
            "expected exactly one of crc (index into the sidecar) and crc32c (inline CRC list)",
            source,
        )
    file = safe_relpath(data["file"], where + ".file", source)
    inline = "crc32c" in data
    lengths = int_list(data["lengths"], where + ".lengths", source)
    return ShardRecord(
        offsets=int_list(data["offsets"], where + ".offsets", source),
        lengths=lengths,
        file=file,
        key=to_str(data["key"], where + ".key", source),
        byte_offset=to_int(data["byte_offset"], where + ".byte_offset", source),
        nbytes=to_int(data["nbytes"], where + ".nbytes", source)
        if "nbytes" in data
        else prod(lengths) * itemsize,
        crc32c=int_list(data["crc32c"], where + ".crc32c", source, max_value=2**32 - 1)
        if inline
        else [],
        crc_index=-1 if inline else to_int(data["crc"], where + ".crc", source),
    )


def _valid_shard(data: Any, itemsize: int) -> ShardRecord | None:
    """The record of a named shard entry that passes every check of :func:`_parse_shard`, or
    ``None`` (then :func:`_parse_shard` finds the field to name). One pass, no per-field
    calls: a manifest has one such entry per saved shard (~180,000 at 1,024 ranks), parsed at
    every commit and every resume."""
    if type(data) is not dict:
        return None
    lengths: Any = data.get("lengths")
    file, key, byte_offset = data.get("file"), data.get("key"), data.get("byte_offset")
    offsets, crcs, crc = data.get("offsets"), data.get("crc32c"), data.get("crc")
    inline = "crc32c" in data
    if not (
        inline != ("crc" in data)
        and type(file) is str
        and file
        and relpath_ok(file)
        and type(key) is str
        and key
        and ints_ok(offsets)
        and ints_ok(lengths)
        and int_ok(byte_offset)
        and (ints_ok(crcs, 2**32 - 1) if inline else int_ok(crc))
    ):
        return None
    nbytes = data["nbytes"] if "nbytes" in data else prod(lengths) * itemsize
    if not int_ok(nbytes):
        return None
    checked: dict[str, Any] = {  # each validated above
        "offsets": offsets,
        "byte_offset": byte_offset,
        "crc32c": crcs if inline else [],
        "crc_index": -1 if inline else crc,
    }
    return ShardRecord(lengths=lengths, file=file, key=key, nbytes=nbytes, **checked)


def _parse_positional_shard(
    data: list[Any], fqn: str, head: Head, where: str, source: str
) -> ShardRecord:
    """A record of the first version-2 writers: ``[file index, byte_offset, nbytes, crcs,
    offsets, lengths(, key)]``."""
    if len(data) not in (6, 7):
        raise err(
            where,
            f"expected [file, byte_offset, nbytes, crcs, offsets, lengths(, key)], got {data!r:.80}",
            source,
        )
    f = to_int(data[0], where + "[0]", source, max_value=len(head.file_names) - 1)
    crcs = data[3]
    inline = isinstance(crcs, list)
    return ShardRecord(
        offsets=int_list(data[4], where + ".offsets", source),
        lengths=int_list(data[5], where + ".lengths", source),
        file=head.file_names[f],
        key=to_str(data[6], where + ".key", source) if len(data) == 7 else fqn,
        byte_offset=to_int(data[1], where + ".byte_offset", source),
        nbytes=to_int(data[2], where + ".nbytes", source),
        crc32c=int_list(crcs, where + ".crc32c", source, max_value=2**32 - 1) if inline else [],
        crc_index=-1 if inline else to_int(crcs, where + ".crc32c", source),
    )


def parse_entry(raw: bytes, fqn: str, head: Head, source: str) -> TensorRecord:
    """Parse the bytes ``index[fqn]`` names: exactly ``"fqn":{shape, dtype, shards}``."""
    where = f"tensors[{fqn!r:.120}]"
    data = load_json(b"{" + raw + b"}", source)
    if list(data) != [fqn]:
        raise err(
            f"index[{fqn!r:.120}]",
            f"points at the entry of {list(data)[:1]!r:.120}, not of this tensor",
            source,
        )
    t = check_type(data[fqn], dict, where, source)
    if sorted(t) != ["dtype", "shape", "shards"]:
        raise err(where, f"expected fields shape, dtype, shards; got {sorted(t)!r:.80}", source)
    itemsize = DTYPE_NBYTES.get(t["dtype"], 0) if isinstance(t.get("dtype"), str) else 0
    return parse_tensor(
        fqn, t, source, lambda d, w: _parse_shard(d, fqn, itemsize, head, w, source)
    )


def check_tensors(
    head: Head,
    tensors: dict[str, TensorRecord],
    source: str,
    *,
    whole: bool,
    partial: Collection[str] = (),
) -> None:
    """Consistency of the tensors read (all of them with ``whole``): coverage, byte ranges
    inside listed files, checksum counts and sidecar ranges, no two shards sharing bytes.
    Tensors in ``partial`` hold only the grid cells a reader asked for (their boxes were
    checked against the grid, which tiles the shape): their byte counts are checked, not coverage.

    Raises:
        ManifestError: listing every problem.
    """
    problems = Problems(source)
    raw_nbytes = FORMAT_TRAITS[head.data["tensor_format"]].raw_shards
    for fqn, rec in tensors.items():
        if fqn in partial:
            check_cell_nbytes(fqn, rec, problems, raw_nbytes=raw_nbytes)
        else:
            check_coverage(fqn, rec, problems, raw_nbytes=raw_nbytes)
        check_bytes(fqn, rec, head.files, head.chunk_nbytes, problems)
    check_files_disjoint(tensors, problems)
    check_sidecars(tensors, head.files, head.chunk_nbytes, problems, whole=whole)
    problems.raise_if_any()


def check_files(head: Head, tensors: dict[str, TensorRecord], source: str) -> None:
    """Across tensors, for files whose shards are all in ``tensors``: no two shards share
    bytes or a key, and the sidecars' checksum ranges tile them exactly.

    Raises:
        ManifestError: listing every problem.
    """
    problems = Problems(source)
    check_files_disjoint(tensors, problems)
    check_sidecars(tensors, head.files, head.chunk_nbytes, problems, whole=True)
    problems.raise_if_any()


def parse_tensor_at(
    body: Any, fqn: str, span: tuple[int, ...], head: Head, source: str
) -> TensorRecord:
    """The tensor whose index entry is ``span``, from ``body`` (the document's BODY, or any
    object whose slices at ``span``'s ranges are those bytes): a gridded entry (version 3)
    block by block against its grid, any other whole."""
    entry = bytes(body[span[0] : span[1]])
    if len(span) == 2:
        return parse_entry(entry, fqn, head, source)
    grid = parse_grid(bytes(body[span[2] : span[3]]), fqn, span[1] - span[0], source)
    return parse_gridded_entry(
        entry, fqn, grid, shard_parser(fqn, grid.dtype, head, source), source
    )


def shard_parser(
    fqn: str, dtype: str, head: Head, source: str
) -> Callable[[Any, str], ShardRecord]:
    """``parse_shard(data, where)`` for the records of tensor ``fqn`` of ``dtype``."""
    itemsize = DTYPE_NBYTES.get(dtype, 0)
    return lambda d, w: _parse_shard(d, fqn, itemsize, head, w, source)


def grids_tiling_problem(head: Head, tensors_end: int) -> str:
    """Why the grid entries (version 3) do not tile the body from ``tensors_end`` (where the
    last tensor entry ends) to the document's end, or ``""``; checks positions only."""
    if head.version < 3:
        return ""
    pos = tensors_end + len(GRIDS_START)
    for fqn, span in head.index.items():
        if len(span) == 4:
            if span[2] != pos:
                return f"the grid of {fqn!r:.120} starts at {span[2]}, expected {pos} (grids must follow each other)"
            pos = span[3] + 1
    return ""


def parse_whole(raw: bytes, source: str) -> Manifest:
    """Parse and validate a whole version-2 or -3 document: the head, every entry (a gridded
    one block by block, as a partial reader reads it), and that the index ranges tile the
    body exactly (so the document is the one JSON object a partial reader sees). Linear in
    the document's size."""
    head = parse_head(raw[: head_nbytes_of(raw[:PREFIX_NBYTES], source)], source)
    body = memoryview(raw)[head.nbytes :]
    pos, tensors = 0, {}
    for n, (fqn, span) in enumerate(head.index.items()):
        start, end = span[0], span[1]
        if start != pos or end > len(body) - len(_BODY_END):
            raise err(
                f"index[{fqn!r:.120}]",
                f"bytes [{start}, {end}) of the tensors: expected an entry starting "
                f"at {pos} inside the document; the index does not tile the tensors",
                source,
            )
        tensors[fqn] = parse_tensor_at(body, fqn, span, head, source)
        if n + 1 < len(head.index) and body[end : end + 1] != b",":
            raise err(f"index[{fqn!r:.120}]", "the tensor's entry is not followed by ','", source)
        pos = end + 1
    tensors_end = max(pos - 1, 0)
    problem = grids_tiling_problem(head, tensors_end)
    if head.version >= 3 and not problem:
        gridded = [span for span in head.index.values() if len(span) == 4]
        seps = [bytes(body[s[3] : s[3] + 1]) for s in gridded[:-1]]
        tail = gridded[-1][3] if gridded else tensors_end + len(GRIDS_START)
        if bytes(body[tensors_end : tensors_end + len(GRIDS_START)]) != GRIDS_START or any(
            c != b"," for c in seps
        ):
            problem = (
                "expected '},\"grids\":{' right after the last indexed tensor (every tensor must be in "
                "the index) and ',' between grid entries"
            )
        tensors_end = tail
    if problem or bytes(body[tensors_end:]) != _BODY_END:
        raise err(
            "tensors",
            problem
            or "the document does not end right after the last indexed tensor (or grid): "
            "every tensor must be in the index",
            source,
        )
    check_tensors(head, tensors, source, whole=True)
    return head.manifest(tensors, partial=False)
