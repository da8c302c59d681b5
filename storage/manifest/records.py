"""The manifest: the versioned JSON record that makes a checkpoint step exist.

Written last by the coordinator; its presence is the commit. The records live here and
are assembled by :class:`ManifestBuilder`; every read goes through
:func:`shardsmith.storage.manifest.parse.parse_manifest`, which refuses anything malformed,
inconsistent or pointing outside the checkpoint before any byte of data is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from math import prod
from typing import Any, Iterable, Mapping, Sequence

from shardsmith.layout import DTYPE_NBYTES, Box, ParallelDims
from shardsmith.storage.checksum import DEFAULT_CHUNK_NBYTES

FORMAT_NAME = "shardsmith.checkpoint"
#: The version this shardsmith writes (2: chunk CRCs in sidecars, head + index, see
#: :mod:`shardsmith.storage.manifest.v2`; 3: plus shard grids, so a rank reads the records of
#: its cells, see :mod:`shardsmith.storage.manifest.grid`). Versions 1 and 2 still load.
FORMAT_VERSION = 3
#: Versions this shardsmith reads.
READ_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class FormatTraits:
    """What code outside ``storage/formats/`` may know of a tensor format (its implementation,
    writes and reads, is :func:`shardsmith.storage.formats.registry.tensor_format`'s).

    Attributes:
        raw_shards: a shard's bytes in its file are its raw row-major elements from
            ``byte_offset`` (safetensors), so reads are planned as byte ranges (a read may be
            split by rows, siblings may read a union once) and a shard's ``nbytes`` is its
            box's size; False: encoded chunks (zarr).
        file_headers: every data file begins with a header naming its entries, checked
            against the manifest (safetensors).
    """

    raw_shards: bool
    file_headers: bool


#: Tensor formats a manifest may name, and their traits.
FORMAT_TRAITS = {
    "safetensors": FormatTraits(raw_shards=True, file_headers=True),
    "zarr": FormatTraits(raw_shards=False, file_headers=False),
}
TENSOR_FORMATS = tuple(FORMAT_TRAITS)
#: Suffix of a data file's chunk-checksum sidecar (:mod:`shardsmith.storage.manifest.sidecar`).
SIDECAR_SUFFIX = ".crc32c"


def sidecar_name(data_file: str) -> str:
    """Checkpoint-relative path of the chunk-CRC sidecar of ``data_file``."""
    return data_file + SIDECAR_SUFFIX


@dataclass
class ShardRecord:
    """One stored piece of a logical tensor.

    Attributes:
        offsets, lengths: the box, global element coordinates.
        file: checkpoint-relative path of the file holding it.
        key: name of the entry inside the file (safetensors key / zarr array).
        byte_offset: first byte of the shard's data inside the file.
        nbytes: data bytes (``numel * itemsize``).
        crc32c: CRC-32C of each ``chunk_nbytes`` piece of the data; with ``crc_index >= 0``
            empty until fetched from the file's sidecar
            (:func:`shardsmith.storage.manifest.sidecar.load_chunk_crcs`).
        crc_index: index of the shard's first chunk CRC in the sidecar of ``file``; -1 when
            the CRCs are in the manifest (version 1, zarr, small writers).
    """

    offsets: list[int]
    lengths: list[int]
    file: str
    key: str
    byte_offset: int
    nbytes: int
    crc32c: list[int]
    crc_index: int = -1

    @classmethod
    def from_box(
        cls, box: Box, *, file: str, key: str, byte_offset: int, nbytes: int, crc32c: list[int]
    ) -> "ShardRecord":
        """The record of ``box`` (global elements) stored at ``byte_offset`` of ``file``."""
        return cls(
            offsets=list(box.offsets),
            lengths=list(box.lengths),
            file=file,
            key=key,
            byte_offset=byte_offset,
            nbytes=nbytes,
            crc32c=crc32c,
        )

    @property
    def box(self) -> Box:
        """The shard's global box (offsets and lengths in elements)."""
        return Box(tuple(self.offsets), tuple(self.lengths))

    def num_chunks(self, chunk_nbytes: int) -> int:
        """Checksum chunks of the shard's data."""
        return -(-self.nbytes // chunk_nbytes)

    def to_json(self) -> dict[str, Any]:
        """The version-1 record (inline CRCs)."""
        return {
            "offsets": self.offsets,
            "lengths": self.lengths,
            "file": self.file,
            "key": self.key,
            "byte_offset": self.byte_offset,
            "nbytes": self.nbytes,
            "crc32c": self.crc32c,
        }

    def to_v2_json(self, itemsize: int) -> dict[str, Any]:
        """The version-2 record: the version-1 fields, with ``crc`` (the index of the
        shard's first chunk CRC in its file's sidecar) in place of ``crc32c`` when the CRCs
        live in a sidecar, and ``nbytes`` left out when it is the box's raw size (elements x
        ``itemsize`` bytes), as it always is for safetensors."""
        out: dict[str, Any] = {
            "file": self.file,
            "key": self.key,
            "offsets": self.offsets,
            "lengths": self.lengths,
            "byte_offset": self.byte_offset,
        }
        if self.nbytes != prod(self.lengths) * itemsize:
            out["nbytes"] = self.nbytes
        if self.crc_index >= 0:
            out["crc"] = self.crc_index
        else:
            out["crc32c"] = self.crc32c
        return out


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
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES
    created: str = ""
    version: int = FORMAT_VERSION
    #: Every tensor of the step when ``tensors`` holds only some (a partial read, see
    #: :class:`shardsmith.storage.manifest.read.ManifestReader`); not serialized.
    all_tensors: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    #: Data files whose size and header this process has already checked against the
    #: manifest (see :func:`shardsmith.storage.verify.check_file_once`); not serialized.
    checked_files: set[str] = field(default_factory=set, repr=False, compare=False)
    #: file -> (fqn, dtype, shard) of its non-empty shards, built on first use
    #: (:func:`shardsmith.storage.manifest.file_checks.shards_in_file`); not serialized.
    file_shards: dict[str, list[tuple[str, str, "ShardRecord"]]] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def partial(self) -> bool:
        """True when ``tensors`` holds only the tensors a reader asked for."""
        return self.all_tensors is not None

    @property
    def tensor_names(self) -> list[str]:
        """The FQN of every tensor of the step (also of a partial manifest)."""
        return list(self.all_tensors) if self.all_tensors is not None else list(self.tensors)

    def to_json(self) -> dict[str, Any]:
        """The version-1 document (every chunk CRC inline); kept for reading tests and tools."""
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "created": self.created,
            "tensor_format": self.tensor_format,
            "checksum": {"algorithm": "crc32c", "chunk_nbytes": self.chunk_nbytes},
            "layout": self.layout,
            "model": self.model,
            "config": self.config,
            "state": self.state,
            "tensors": {
                fqn: {"shape": t.shape, "dtype": t.dtype, "shards": [s.to_json() for s in t.shards]}
                for fqn, t in sorted(self.tensors.items())
            },
            "files": {
                name: {"nbytes": f.nbytes, "crc32c": f.crc32c}
                for name, f in sorted(self.files.items())
            },
        }

    @property
    def traits(self) -> FormatTraits:
        """The traits of this manifest's tensor format."""
        return FORMAT_TRAITS[self.tensor_format]

    @property
    def nbytes(self) -> int:
        """Total bytes of the data files."""
        return sum(f.nbytes for f in self.files.values())


def now_iso() -> str:
    """The ``created`` timestamp of a manifest written now (UTC, seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ManifestBuilder:
    """Assembles the manifest of one step saved in one layout: construct, ``add_file`` /
    ``add_shards`` for every data file, then :meth:`build` (shards sorted by offsets).

    Used by the coordinator of a save, a reshard, a format conversion and an HF import;
    pure (no I/O). :func:`~shardsmith.storage.commit.commit` validates what it builds.

    Args:
        step: the optimizer step.
        dims: the layout the files are written in (``layout`` = its JSON + ``world_size``).
        model, config, state: JSON-safe model config, root config, non-tensor state.
        tensors: fqn -> (global shape in elements, dtype name) of every logical tensor.
        chunk_nbytes: checksum chunk size of the shards (bytes).
        tensor_format: ``"safetensors"`` or ``"zarr"``.
        created: timestamp (default: now, UTC).
    """

    def __init__(
        self,
        *,
        step: int,
        dims: ParallelDims,
        model: dict[str, Any],
        config: dict[str, Any],
        state: dict[str, Any],
        tensors: Mapping[str, tuple[Sequence[int], str]],
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
        tensor_format: str = "safetensors",
        created: str | None = None,
    ) -> None:
        self.manifest = Manifest(
            step=step,
            layout={**dims.to_json(), "world_size": dims.world_size},
            model=model,
            config=config,
            state=state,
            tensors={
                fqn: TensorRecord(shape=list(shape), dtype=dtype)
                for fqn, (shape, dtype) in tensors.items()
            },
            files={},
            tensor_format=tensor_format,
            chunk_nbytes=chunk_nbytes,
            created=now_iso() if created is None else created,
        )

    @classmethod
    def relayout(
        cls,
        source: Manifest,
        dims: ParallelDims,
        tensors: Mapping[str, tuple[Sequence[int], str]],
        *,
        chunk_nbytes: int,
        tensor_format: str = "safetensors",
    ) -> "ManifestBuilder":
        """A builder for ``source``'s step rewritten in layout ``dims`` (reshard, conversion):
        same model, state and config, with the config's ``parallel`` section set to ``dims``."""
        config = dict(source.config)
        if "parallel" in config:
            config["parallel"] = dims.to_json()
        return cls(
            step=source.step,
            dims=dims,
            model=source.model,
            config=config,
            state=source.state,
            tensors=tensors,
            chunk_nbytes=chunk_nbytes,
            tensor_format=tensor_format,
        )

    def add_file(
        self,
        name: str,
        record: FileRecord,
        shards: Mapping[str, ShardRecord] | Iterable[ShardRecord] = (),
        sidecar: FileRecord | None = None,
    ) -> None:
        """A data file and the shards it holds (``fqn -> record``, or records keyed by ``key``),
        and its chunk-CRC sidecar when the shards' CRCs are there (``crc_index >= 0``)."""
        self.manifest.files[name] = record
        if sidecar is not None:
            self.manifest.files[sidecar_name(name)] = sidecar
        items = shards.items() if isinstance(shards, Mapping) else ((r.key, r) for r in shards)
        for fqn, rec in items:
            self.manifest.tensors[fqn].shards.append(rec)

    def add_shards(self, fqn: str, records: Iterable[ShardRecord]) -> None:
        """Shards of ``fqn`` in files added (or to be added) with :meth:`add_file`."""
        self.manifest.tensors[fqn].shards.extend(records)

    def build(self) -> Manifest:
        """The manifest, every tensor's shards sorted by global offsets."""
        for t in self.manifest.tensors.values():
            t.shards.sort(key=lambda s: s.offsets)
        return self.manifest
