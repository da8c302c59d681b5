"""Validation primitives shared by the manifest parsers of every version
(:mod:`shardsmith.storage.manifest.parse`, :mod:`shardsmith.storage.manifest.v2`): typed
field readers that raise at the first schema problem, and the consistency checks (coverage,
byte ranges, checksum counts) that collect every problem of a manifest into one error.
"""

from __future__ import annotations

import functools
import json
import posixpath
from math import prod
from typing import Any, Callable

from shardsmith.errors import ManifestError
from shardsmith.layout import DTYPE_NBYTES, MESH_AXES, REQUIRED_AXES
from shardsmith.storage.manifest.records import (
    FORMAT_NAME,
    MANIFEST_NAME,
    SIDECAR_SUFFIX,
    TENSOR_FORMATS,
    FileRecord,
    ShardRecord,
    TensorRecord,
    sidecar_name,
)

#: Largest integer a manifest may hold anywhere (int64; also bounds shapes and byte counts).
MAX_INT = 2**63 - 1
#: Most problems listed in one error message.
MAX_LISTED = 20


class Problems:
    """Collects consistency problems of one manifest so one error lists them all."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")

    def raise_if_any(self) -> None:
        if not self.items:
            return
        shown = "; ".join(self.items[:MAX_LISTED])
        more = f"; and {len(self.items) - MAX_LISTED} more" if len(self.items) > MAX_LISTED else ""
        head = f"{len(self.items)} problems: " if len(self.items) > 1 else ""
        raise ManifestError(f"{self.source}: {head}{shown}{more}; {_ADVICE}")


_ADVICE = "the checkpoint is damaged or was not written by shardsmith — do not load it"


def err(where: str, what: str, source: str) -> ManifestError:
    return ManifestError(f"{source}: {where}: {what}; {_ADVICE}")


def to_int(
    value: Any, where: str, source: str, *, min_value: int = 0, max_value: int = MAX_INT
) -> int:
    """An integer (never a bool or float) in ``[min_value, max_value]``."""
    if type(value) is not int:
        raise err(where, f"expected an integer, got {type(value).__name__} {value!r:.40}", source)
    if not min_value <= value <= max_value:
        raise err(where, f"{value!r:.40} is outside [{min_value}, {max_value}]", source)
    return value


def ints_ok(value: Any, max_value: int = MAX_INT) -> bool:
    """Whether ``value`` is a list of integers (never bools or floats) in ``[0, max_value]``:
    the common case of :func:`int_list`, checked without a call per element."""
    if not isinstance(value, list):
        return False
    for v in (
        value
    ):  # a loop, not all(<genexpr>): no generator frame per short list (python bench/scale_sim.py)
        if type(v) is not int or v < 0 or v > max_value:
            return False
    return True


def int_ok(value: Any) -> bool:
    """Whether ``value`` is an integer (never a bool or float) in ``[0, MAX_INT]``."""
    return type(value) is int and 0 <= value <= MAX_INT


def int_list(
    value: Any, where: str, source: str, *, min_value: int = 0, max_value: int = MAX_INT
) -> list[int]:
    if min_value == 0 and ints_ok(value, max_value):
        return value
    if not isinstance(value, list):
        raise err(
            where, f"expected a list of integers, got {type(value).__name__} {value!r:.40}", source
        )
    for i, v in enumerate(value):
        to_int(v, f"{where}[{i}]", source, min_value=min_value, max_value=max_value)
    return value


def relpath_ok(path: str) -> bool:
    """Whether the string ``path`` is a normalized relative path inside the checkpoint (not
    the manifest). Cached for paths of up to 256 characters: a manifest names each data file
    once per shard it holds (a hostile long name is checked, not kept)."""
    return _relpath_ok_cached(path) if len(path) <= 256 else _relpath_ok(path)


def _relpath_ok(path: str) -> bool:
    return not (
        "://" in path
        or path.startswith(("/", "\\", "~"))
        or "\\" in path
        or ":" in path
        or any(ord(c) < 32 for c in path)
        or posixpath.normpath(path) != path
        or ".." in path.split("/")
        or path == "."
        or path == MANIFEST_NAME
    )


_relpath_ok_cached = functools.lru_cache(maxsize=1 << 14)(_relpath_ok)


def safe_relpath(path: Any, where: str, source: str) -> str:
    """Accept only a normalized relative path inside the checkpoint."""
    if not isinstance(path, str) or not path:
        raise err(where, f"expected a relative file path, got {path!r:.80}", source)
    if not relpath_ok(path):
        raise err(
            where, f"file path {path!r:.80} points outside the checkpoint's data files", source
        )
    return path


def check_type(data: Any, kind: type, where: str, source: str) -> Any:
    if kind is int:
        return to_int(data, where, source, min_value=-MAX_INT)
    if not isinstance(data, kind):
        raise err(where, f"expected {kind.__name__}, got {type(data).__name__}", source)
    return data


def to_str(data: Any, where: str, source: str) -> str:
    if not isinstance(data, str) or not data:
        raise err(where, f"expected a non-empty string, got {data!r:.40}", source)
    return data


def fields(data: Any, required: tuple[str, ...], where: str, source: str) -> dict[str, Any]:
    if type(data) is dict and all(k in data for k in required):
        return data
    check_type(data, dict, where, source)
    missing = [k for k in required if k not in data]
    if missing:
        raise err(where, f"missing fields {missing}", source)
    return data


def overlapping_pairs(boxes: list[tuple[list[int], list[int], int]]) -> list[tuple[int, int]]:
    """Pairs of shard indices whose (non-empty) boxes intersect.

    Sweeps along the dim with the most distinct offsets, so boxes of a regular grid are
    compared only with their neighbours along that dim (not all pairs).
    """
    if not boxes:
        return []
    ndim = len(boxes[0][0])
    if ndim == 0:
        return [(boxes[0][2], b[2]) for b in boxes[1:]]
    if _grid_disjoint(boxes, ndim):
        return []
    d = max(range(ndim), key=lambda k: len({b[0][k] for b in boxes}))
    active: list[tuple[list[int], list[int], int]] = []
    pairs = []
    for box in sorted(boxes, key=lambda b: b[0][d]):
        offs, lens, idx = box
        active = [a for a in active if a[0][d] + a[1][d] > offs[d]]
        for ao, al, ai in active:
            if all(max(x, y) < min(x + xn, y + yn) for x, xn, y, yn in zip(ao, al, offs, lens)):
                pairs.append((min(ai, idx), max(ai, idx)))
        active.append(box)
    return sorted(pairs)


def _grid_disjoint(boxes: list[tuple[list[int], list[int], int]], ndim: int) -> bool:
    """Whether non-empty boxes are known disjoint without comparing pairs: along every dim any
    two of their extents are equal or disjoint, and no two boxes are equal. (Two boxes meet
    iff their extents overlap along every dim; extents that are equal or disjoint overlap only
    when equal, so two boxes meet only if they are equal.) True for every sharding plan's
    grid; ``False`` means "unknown", for the sweep in :func:`overlapping_pairs`."""
    for d in range(ndim):
        spans = sorted({(b[0][d], b[1][d]) for b in boxes})
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            if o1 + n1 > o2:
                return False
    return len({(*b[0], *b[1]) for b in boxes}) == len(boxes)


def check_coverage(
    fqn: str, rec: TensorRecord, problems: Problems, raw_nbytes: bool = True
) -> None:
    """Boxes of the tensor's rank, inside its shape, byte counts matching (``raw_nbytes``:
    safetensors; zarr records the bytes as stored, encoded), disjoint, covering it exactly once."""
    ndim = len(rec.shape)
    total = 0
    boxes = []
    shards = f"tensors[{fqn!r}].shards"  # a shard's location: f"{shards}[{i}]", for a problem
    for i, s in enumerate(rec.shards):
        if len(s.offsets) != ndim or len(s.lengths) != ndim:
            problems.add(
                f"{shards}[{i}]",
                f"box of rank {len(s.offsets)}/{len(s.lengths)} (offsets/lengths) "
                f"does not match shape {rec.shape}",
            )
            return
        if any(o + n > d for o, n, d in zip(s.offsets, s.lengths, rec.shape)):
            problems.add(
                f"{shards}[{i}]",
                f"box offsets={s.offsets} lengths={s.lengths} outside shape {rec.shape}",
            )
            return
        numel = prod(s.lengths)
        if raw_nbytes and s.nbytes != numel * DTYPE_NBYTES[rec.dtype]:
            problems.add(
                f"{shards}[{i}].nbytes",
                f"{s.nbytes} but the box holds {numel} {rec.dtype} "
                f"elements ({numel * DTYPE_NBYTES[rec.dtype]} bytes)",
            )
        total += numel
        if numel:
            boxes.append((s.offsets, s.lengths, i))
    for a, b in overlapping_pairs(boxes)[:MAX_LISTED]:
        problems.add(f"tensors[{fqn!r}].shards", f"shards {a} and {b} overlap")
    if total != prod(rec.shape):
        problems.add(
            f"tensors[{fqn!r}].shards",
            f"shards hold {total} elements but the shape "
            f"{rec.shape} has {prod(rec.shape)} (missing coverage)",
        )


def check_files_disjoint(tensors: dict[str, TensorRecord], problems: Problems) -> None:
    """Within a file, entry keys are unique and shard byte ranges do not overlap."""
    by_file: dict[str, list[tuple[int, int, str, str, int]]] = {}
    for fqn, rec in tensors.items():
        for i, s in enumerate(rec.shards):
            if s.nbytes:
                by_file.setdefault(s.file, []).append(
                    (s.byte_offset, s.byte_offset + s.nbytes, s.key, fqn, i)
                )

    for name, spans in sorted(by_file.items()):
        keys: dict[str, tuple[str, int]] = {}
        for _, _, key, fqn, i in spans:
            if key in keys:
                problems.add(
                    _where(fqn, i) + ".key",
                    f"key {key!r} of {name} is also used by {_where(*keys[key])}",
                )
            keys[key] = (fqn, i)
        for wa, wb in _overlapping_neighbours(spans):
            problems.add(wb + ".byte_offset", f"bytes of {name} overlap those of {wa}")


def _where(fqn: str, i: int) -> str:
    """A shard's location in messages (formatted only for a problem)."""
    return f"tensors[{fqn!r}].shards[{i}]"


def _overlapping_neighbours(spans: list[tuple[int, int, str, str, int]]) -> list[tuple[str, str]]:
    """(earlier, later) locations of neighbouring spans ``(begin, end, key, fqn, shard index)``
    that overlap, sorted by (begin, end, key, location text); sorts ``spans`` in place."""
    spans.sort()
    if all(b[0] >= a[1] for a, b in zip(spans, spans[1:])):
        return []
    spans.sort(key=lambda t: (*t[:3], _where(t[3], t[4])))  # ties named in location order
    return [(_where(*a[3:]), _where(*b[3:])) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` object hook refusing duplicate keys (a JSON object may not say a thing twice)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r:.80}")
            seen.add(key)
    return out


def load_json(raw: bytes, source: str) -> dict[str, Any]:
    try:
        data = json.loads(
            raw, object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError, TypeError) as exc:
        raise err("document", f"not valid JSON ({str(exc)[:200]})", source) from exc
    return check_type(data, dict, "document", source)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: Fields every manifest document has, with their JSON types (the tensors and files per version).
COMMON_FIELDS: tuple[tuple[str, type], ...] = (
    ("step", int),
    ("layout", dict),
    ("model", dict),
    ("config", dict),
    ("state", dict),
    ("checksum", dict),
    ("tensor_format", str),
)


def parse_manifest_head(
    data: dict[str, Any], source: str, versions: tuple[int, ...], more: tuple[tuple[str, type], ...]
) -> tuple[int, int]:
    """Format, version, checksum and the fields every version has (and ``more``, by
    version); returns (version, chunk_nbytes)."""
    if data.get("format") != FORMAT_NAME:
        raise err("format", f"expected {FORMAT_NAME!r}, got {data.get('format')!r:.80}", source)
    version = data.get("version")
    if type(version) is not int or version not in versions:
        from shardsmith.storage.manifest.records import (
            READ_VERSIONS,  # every version any parser reads
        )

        raise err(
            "version",
            f"unknown format version {version!r:.40}; this shardsmith reads versions "
            f"{list(READ_VERSIONS)} — upgrade shardsmith",
            source,
        )
    for key, kind in COMMON_FIELDS + more:
        if key not in data:
            raise err(key, "missing", source)
        check_type(data[key], kind, key, source)
    to_int(data["step"], "step", source)
    if data["tensor_format"] not in TENSOR_FORMATS:
        raise err(
            "tensor_format",
            f"unknown tensor format {data['tensor_format']!r:.40}; known {list(TENSOR_FORMATS)}",
            source,
        )
    for key in MESH_AXES:
        if key not in data["layout"]:
            if key not in REQUIRED_AXES:
                continue  # an optional axis absent: degree 1
            raise err(f"layout.{key}", "missing", source)
        to_int(data["layout"][key], f"layout.{key}", source, min_value=1)
    if data["checksum"].get("algorithm") != "crc32c":
        raise err(
            "checksum.algorithm",
            f"expected 'crc32c', got {data['checksum'].get('algorithm')!r:.40}",
            source,
        )
    chunk = to_int(
        data["checksum"].get("chunk_nbytes"), "checksum.chunk_nbytes", source, min_value=1
    )
    return version, chunk


def check_bytes(
    fqn: str, rec: TensorRecord, files: dict[str, FileRecord], chunk: int, problems: Problems
) -> None:
    """Each shard's bytes lie inside a listed data file, with one checksum per chunk: inline,
    or (``crc_index >= 0``) inside the file's listed sidecar."""
    for i, s in enumerate(rec.shards):
        data = files.get(s.file)  # the common case first: nothing to say
        if (
            data is not None
            and s.byte_offset + s.nbytes <= data.nbytes
            and not s.file.endswith(SIDECAR_SUFFIX)
        ):
            if s.crc_index < 0 and len(s.crc32c) == s.num_chunks(chunk):
                continue
            side = files.get(sidecar_name(s.file)) if s.crc_index >= 0 else None
            if (
                side is not None
                and not side.nbytes % 4
                and (s.crc_index + s.num_chunks(chunk)) * 4 <= side.nbytes
            ):
                continue
        where = _where(fqn, i)
        if s.file not in files:
            problems.add(where + ".file", f"{s.file!r} is not listed in files")
            continue
        if s.file.endswith(SIDECAR_SUFFIX):
            problems.add(where + ".file", f"{s.file!r} is a checksum sidecar, not a data file")
        if s.byte_offset + s.nbytes > files[s.file].nbytes:
            problems.add(
                where + ".byte_offset",
                f"bytes [{s.byte_offset}, {s.byte_offset + s.nbytes}) "
                f"lie outside {s.file} ({files[s.file].nbytes} bytes)",
            )
        expected_chunks = s.num_chunks(chunk)
        if s.crc_index < 0:
            if len(s.crc32c) != expected_chunks:
                problems.add(
                    where + ".crc32c",
                    f"{len(s.crc32c)} checksums for {expected_chunks} chunks of {chunk} bytes",
                )
            continue
        side = files.get(sidecar_name(s.file))
        if side is None:
            problems.add(
                where + ".crc32c",
                f"checksums in sidecar {sidecar_name(s.file)!r}, which is not listed in files",
            )
        elif side.nbytes % 4 or (s.crc_index + expected_chunks) * 4 > side.nbytes:
            problems.add(
                where + ".crc32c",
                f"checksums [{s.crc_index}, {s.crc_index + expected_chunks}) lie "
                f"outside sidecar {sidecar_name(s.file)} ({side.nbytes} bytes, 4 per checksum)",
            )


def check_sidecars(
    tensors: dict[str, TensorRecord],
    files: dict[str, FileRecord],
    chunk: int,
    problems: Problems,
    *,
    whole: bool,
) -> None:
    """Within a sidecar, shards' checksum ranges do not overlap; ``whole`` (every tensor of
    the step is in ``tensors``): they also cover every checksum of the sidecar exactly."""
    by_side: dict[str, list[tuple[int, int, str, str, int]]] = {}
    for fqn, rec in tensors.items():
        for i, s in enumerate(rec.shards):
            if s.crc_index >= 0 and s.nbytes:
                by_side.setdefault(sidecar_name(s.file), []).append(
                    (s.crc_index, s.crc_index + s.num_chunks(chunk), "", fqn, i)
                )
    for name, spans in sorted(by_side.items()):
        for wa, wb in _overlapping_neighbours(spans):
            problems.add(wb + ".crc32c", f"checksums in {name} overlap those of {wa}")
        side = files.get(name)
        if whole and side is not None and sum(e - b for b, e, *_ in spans) * 4 != side.nbytes:
            problems.add(
                f"files[{name!r}]",
                f"{side.nbytes} bytes but its shards have "
                f"{sum(e - b for b, e, *_ in spans)} checksums of 4 bytes",
            )


def parse_tensor(
    fqn: str, t: Any, source: str, parse_shard: Callable[[Any, str], ShardRecord]
) -> TensorRecord:
    """A tensor entry ``{shape, dtype, shards}`` of any version (``parse_shard(data, where)``
    reads one shard record of that version)."""
    where = f"tensors[{fqn!r:.120}]"
    if not fqn:
        raise err(where, "empty tensor name", source)
    fields(t, ("shape", "dtype", "shards"), where, source)
    dtype = t["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_NBYTES:
        raise err(
            where + ".dtype", f"unknown dtype {dtype!r:.40}; known {sorted(DTYPE_NBYTES)}", source
        )
    shape = int_list(t["shape"], where + ".shape", source)
    if prod(shape) * DTYPE_NBYTES[dtype] > MAX_INT:
        raise err(where + ".shape", f"{shape} of {dtype} is larger than {MAX_INT} bytes", source)
    shards = [
        parse_shard(s, f"{where}.shards[{i}]")
        for i, s in enumerate(check_type(t["shards"], list, where + ".shards", source))
    ]
    return TensorRecord(shape=shape, dtype=dtype, shards=shards)
