"""The manifest: the versioned JSON record that makes a checkpoint step exist.

Written last by the coordinator; its presence is the commit. Every read goes
through :func:`parse_manifest`, which refuses anything malformed, inconsistent
or pointing outside the checkpoint before any byte of data is touched.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from math import prod
from typing import Any

from shardsmith.errors import ManifestError

FORMAT_NAME = "shardsmith.checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

#: Bytes per element of the dtypes a checkpoint may hold (safetensors names).
DTYPE_NBYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1,
}


@dataclass
class ShardRecord:
    """One stored piece of a logical tensor.

    Attributes:
        offsets, lengths: the box, global element coordinates.
        file: checkpoint-relative path of the file holding it.
        key: name of the entry inside the file (safetensors key / zarr array).
        byte_offset: first byte of the shard's data inside the file.
        nbytes: data bytes (``numel * itemsize``).
        crc32c: CRC-32C of each ``chunk_nbytes`` piece of the data.
    """

    offsets: list[int]
    lengths: list[int]
    file: str
    key: str
    byte_offset: int
    nbytes: int
    crc32c: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"offsets": self.offsets, "lengths": self.lengths, "file": self.file, "key": self.key,
                "byte_offset": self.byte_offset, "nbytes": self.nbytes, "crc32c": self.crc32c}


@dataclass
class TensorRecord:
    """A logical tensor: global shape, dtype and its shards."""

    shape: list[int]
    dtype: str
    shards: list[ShardRecord] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_NBYTES[self.dtype]


@dataclass
class FileRecord:
    """A data file of the checkpoint: total size and CRC-32C of all its bytes."""

    nbytes: int
    crc32c: int


@dataclass
class Manifest:
    """Everything about one committed step. See ``README.md`` (checkpoint layout) for the JSON."""

    step: int
    layout: dict[str, Any]
    model: dict[str, Any]
    config: dict[str, Any]
    state: dict[str, Any]
    tensors: dict[str, TensorRecord]
    files: dict[str, FileRecord]
    tensor_format: str = "safetensors"
    chunk_nbytes: int = 4 * 1024 * 1024
    created: str = ""
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "version": self.version, "step": self.step,
            "created": self.created, "tensor_format": self.tensor_format,
            "checksum": {"algorithm": "crc32c", "chunk_nbytes": self.chunk_nbytes},
            "layout": self.layout, "model": self.model, "config": self.config, "state": self.state,
            "tensors": {fqn: {"shape": t.shape, "dtype": t.dtype,
                              "shards": [s.to_json() for s in t.shards]}
                        for fqn, t in sorted(self.tensors.items())},
            "files": {name: {"nbytes": f.nbytes, "crc32c": f.crc32c}
                      for name, f in sorted(self.files.items())},
        }

    def dumps(self) -> bytes:
        """UTF-8 JSON bytes, indented for humans."""
        return json.dumps(self.to_json(), indent=1).encode()

    @property
    def nbytes(self) -> int:
        """Total bytes of the data files."""
        return sum(f.nbytes for f in self.files.values())


def _err(where: str, what: str, source: str) -> ManifestError:
    return ManifestError(f"{source}: {where}: {what}; the checkpoint is damaged or was not "
                         "written by shardsmith — do not load it")


def _int_list(value: Any, where: str, source: str, *, min_value: int = 0) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= min_value for v in value):
        raise _err(where, f"expected a list of integers >= {min_value}, got {value!r:.80}", source)
    return value


def _safe_relpath(path: Any, where: str, source: str) -> str:
    """Accept only a normalized relative path inside the checkpoint."""
    if not isinstance(path, str) or not path:
        raise _err(where, f"expected a relative file path, got {path!r:.80}", source)
    if ("://" in path or path.startswith(("/", "\\")) or "\\" in path or ":" in path
            or posixpath.normpath(path) != path or path.split("/")[0] == ".."
            or ".." in path.split("/")):
        raise _err(where, f"file path {path!r} points outside the checkpoint", source)
    return path


def _check_type(data: Any, kind: type, where: str, source: str) -> Any:
    if not isinstance(data, kind) or (kind is int and isinstance(data, bool)):
        raise _err(where, f"expected {kind.__name__}, got {type(data).__name__}", source)
    return data


def _parse_shard(data: Any, where: str, source: str) -> ShardRecord:
    _check_type(data, dict, where, source)
    missing = {"offsets", "lengths", "file", "key", "byte_offset", "nbytes", "crc32c"} - set(data)
    if missing:
        raise _err(where, f"missing fields {sorted(missing)}", source)
    return ShardRecord(
        offsets=_int_list(data["offsets"], where + ".offsets", source),
        lengths=_int_list(data["lengths"], where + ".lengths", source),
        file=_safe_relpath(data["file"], where + ".file", source),
        key=_check_type(data["key"], str, where + ".key", source),
        byte_offset=_check_type(data["byte_offset"], int, where + ".byte_offset", source),
        nbytes=_check_type(data["nbytes"], int, where + ".nbytes", source),
        crc32c=_int_list(data["crc32c"], where + ".crc32c", source),
    )


def _check_coverage(fqn: str, rec: TensorRecord, source: str) -> None:
    """Boxes inside the shape, disjoint, and covering it exactly once."""
    ndim = len(rec.shape)
    total = 0
    boxes = []
    for i, s in enumerate(rec.shards):
        where = f"tensors[{fqn!r}].shards[{i}]"
        if len(s.offsets) != ndim or len(s.lengths) != ndim:
            raise _err(where, f"box rank {len(s.offsets)} does not match shape {rec.shape}", source)
        if any(o + n > d for o, n, d in zip(s.offsets, s.lengths, rec.shape)):
            raise _err(where, f"box offsets={s.offsets} lengths={s.lengths} outside shape {rec.shape}",
                       source)
        numel = prod(s.lengths)
        if s.nbytes != numel * DTYPE_NBYTES[rec.dtype]:
            raise _err(where, f"nbytes={s.nbytes} but box holds {numel} {rec.dtype} elements "
                       f"({numel * DTYPE_NBYTES[rec.dtype]} bytes)", source)
        total += numel
        boxes.append((s.offsets, s.lengths, i))
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            (ao, al, ai), (bo, bl, bi) = boxes[a], boxes[b]
            if all(max(x0, y0) < min(x0 + xn, y0 + yn) for x0, xn, y0, yn in zip(ao, al, bo, bl)) \
                    and prod(al) and prod(bl):
                raise _err(f"tensors[{fqn!r}]", f"shards {ai} and {bi} overlap", source)
    if total != prod(rec.shape):
        raise _err(f"tensors[{fqn!r}]", f"shards cover {total} of {prod(rec.shape)} elements "
                   "(missing coverage)", source)


def parse_manifest(raw: bytes, source: str = "manifest.json") -> Manifest:
    """Parse and validate a manifest; never trusts its contents.

    Args:
        raw: the JSON bytes.
        source: URL or path used in error messages.

    Raises:
        ManifestError: invalid JSON, unknown format or version, a missing or mistyped
            field, a file path outside the checkpoint, a box outside its tensor's shape,
            overlapping or missing coverage, a byte count that does not match its box,
            a shard outside its file.
    """
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err("document", f"not valid JSON ({exc})", source) from exc
    _check_type(data, dict, "document", source)
    if data.get("format") != FORMAT_NAME:
        raise _err("format", f"expected {FORMAT_NAME!r}, got {data.get('format')!r:.80}", source)
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise _err("version", f"unknown format version {version!r}; this shardsmith reads version "
                   f"{FORMAT_VERSION} — upgrade shardsmith", source)
    for key, kind in (("step", int), ("layout", dict), ("model", dict), ("config", dict),
                      ("state", dict), ("tensors", dict), ("files", dict), ("checksum", dict),
                      ("tensor_format", str)):
        if key not in data:
            raise _err(key, "missing", source)
        _check_type(data[key], kind, key, source)
    chunk = data["checksum"].get("chunk_nbytes")
    if data["checksum"].get("algorithm") != "crc32c" or type(chunk) is not int or chunk < 1:
        raise _err("checksum", f"expected crc32c with chunk_nbytes >= 1, got {data['checksum']!r:.80}",
                   source)
    files: dict[str, FileRecord] = {}
    for name, f in data["files"].items():
        where = f"files[{name!r}]"
        _safe_relpath(name, where, source)
        _check_type(f, dict, where, source)
        files[name] = FileRecord(nbytes=_check_type(f.get("nbytes"), int, where + ".nbytes", source),
                                 crc32c=_check_type(f.get("crc32c"), int, where + ".crc32c", source))
    tensors: dict[str, TensorRecord] = {}
    for fqn, t in data["tensors"].items():
        where = f"tensors[{fqn!r}]"
        _check_type(t, dict, where, source)
        dtype = t.get("dtype")
        if dtype not in DTYPE_NBYTES:
            raise _err(where + ".dtype", f"unknown dtype {dtype!r:.40}; known {sorted(DTYPE_NBYTES)}", source)
        shards = [_parse_shard(s, f"{where}.shards[{i}]", source)
                  for i, s in enumerate(_check_type(t.get("shards"), list, where + ".shards", source))]
        rec = TensorRecord(shape=_int_list(t.get("shape"), where + ".shape", source), dtype=dtype,
                           shards=shards)
        _check_coverage(fqn, rec, source)
        for i, s in enumerate(shards):
            sw = f"{where}.shards[{i}]"
            if s.file not in files:
                raise _err(sw + ".file", f"{s.file!r} is not listed in files", source)
            if s.byte_offset < 0 or s.byte_offset + s.nbytes > files[s.file].nbytes:
                raise _err(sw, f"bytes [{s.byte_offset}, {s.byte_offset + s.nbytes}) lie outside "
                           f"{s.file} ({files[s.file].nbytes} bytes)", source)
            expected_chunks = -(-s.nbytes // chunk)
            if len(s.crc32c) != expected_chunks:
                raise _err(sw + ".crc32c", f"{len(s.crc32c)} checksums for {expected_chunks} chunks",
                           source)
        tensors[fqn] = rec
    return Manifest(step=data["step"], layout=data["layout"], model=data["model"],
                    config=data["config"], state=data["state"], tensors=tensors, files=files,
                    tensor_format=data["tensor_format"], chunk_nbytes=chunk,
                    created=str(data.get("created", "")), version=version)
