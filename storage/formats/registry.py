"""Tensor formats: how one step's logical tensors become files, behind one interface.

A :class:`TensorFormat` is used in three phases, like DCP's ``StorageWriter``/``StorageReader``:

1. every writing rank: :meth:`TensorFormat.write_rank` writes that rank's boxes and returns
   JSON-safe records (gathered to the coordinator; no pickle);
2. the coordinator only, before the commit: :meth:`TensorFormat.add_records` puts every
   rank's records (and any format metadata it writes) into the
   :class:`~shardsmith.storage.manifest.records.ManifestBuilder`;
3. any reader: :meth:`TensorFormat.read_boxes` reads boxes of a committed step;
   :func:`read_boxes` picks the format its manifest names.

:data:`FORMATS` is the one place that maps a format name to its implementation, and
:data:`~shardsmith.storage.manifest.records.FORMAT_TRAITS` the one place that says what other
modules may know of it (no module outside ``storage/formats/`` compares format names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from shardsmith.errors import ConfigError
from shardsmith.layout import (
    OPTIM_NAMESPACE,
    Box,
    ParallelDims,
    TensorSpec,
    shard_file_name,
    write_assignment,
)
from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.formats.tensor_files import write_shard_file
from shardsmith.storage.manifest.records import (
    TENSOR_FORMATS,
    FileRecord,
    Manifest,
    ManifestBuilder,
    ShardRecord,
)
from shardsmith.storage.manifest.sidecar import write_sidecar
from shardsmith.storage.reading.execute import ReadStats, destination, read_safetensors_boxes
from shardsmith.storage.reading.staging import on_host, read_staged
from shardsmith.storage.store.fs import Store

if TYPE_CHECKING:
    from shardsmith.storage.formats.zarr_format import ZarrArray

# The zarr modules (zarr, numcodecs: ~0.1-0.15 s of a process's start-up here) are imported
# by the zarr code paths below only, so a safetensors job's ranks never load them.

#: Prefix of the tensors the zarr codec compresses (optimizer state; parameters stay raw).
COMPRESSED_PREFIX = OPTIM_NAMESPACE
#: (fqn, local CPU tensor of shape ``box.lengths``, global box) of one shard a rank writes.
Entry = tuple[str, torch.Tensor, Box]
Request = tuple[str, Box, "torch.Tensor | None"]


class TensorFormat(Protocol):
    """How a checkpoint's tensors are laid out in files (see the module docstring for the phases)."""

    name: str

    def write_rank(
        self,
        step_store: Store,
        rank: int,
        entries: list[Entry],
        specs: dict[str, TensorSpec],
        dims: ParallelDims,
        chunk_nbytes: int,
    ) -> dict[str, Any]:
        """Every rank: write this rank's ``entries`` (possibly none); its JSON records."""
        ...

    def add_records(
        self,
        builder: ManifestBuilder,
        gathered: list[dict[str, Any]],
        step_store: Store,
        specs: dict[str, TensorSpec],
        dims: ParallelDims,
    ) -> None:
        """Coordinator only, before the commit: every rank's records (and format metadata) into ``builder``."""
        ...

    def gathered_nbytes(self, gathered: list[dict[str, Any]]) -> int:
        """Data bytes written by all ranks, from their gathered records."""
        ...

    def read_boxes(
        self,
        store: Store,
        manifest: Manifest,
        requests: Sequence[Request],
        stats: ReadStats | None,
        source: str,
    ) -> list[torch.Tensor]:
        """Any reader: the boxes ``requests`` name of a committed step in this format, into
        host tensors (see :func:`read_boxes` for the contract)."""
        ...


class SafetensorsFormat:
    """One safetensors file per writing rank (``shards/rank-NNNNN.safetensors``) and its
    chunk-CRC sidecar (``….safetensors.crc32c``, :mod:`shardsmith.storage.manifest.sidecar`)."""

    name = "safetensors"

    def write_rank(
        self,
        step_store: Store,
        rank: int,
        entries: list[Entry],
        specs: dict[str, TensorSpec],
        dims: ParallelDims,
        chunk_nbytes: int,
    ) -> dict[str, Any]:
        """Records: ``{"file": [name, nbytes, crc], "sidecar": [nbytes, crc], "shards": {fqn:
        [byte_offset, nbytes, crc_index, offsets, lengths]}}`` (no chunk CRCs: they are in the sidecar)."""
        if not entries:
            return {}
        name = shard_file_name(rank)
        record, shards = write_shard_file(
            step_store,
            name,
            [(fqn, t.detach().to("cpu")) for fqn, t, _ in entries],
            chunk_nbytes,
            {fqn: box for fqn, _, box in entries},
        )
        return self.rank_records(name, record, write_sidecar(step_store, name, shards), shards)

    @staticmethod
    def rank_records(
        name: str, record: FileRecord, sidecar: FileRecord, shards: dict[str, ShardRecord]
    ) -> dict[str, Any]:
        """What one rank sends the coordinator about the file it wrote (JSON-safe, no chunk CRCs)."""
        return {
            "file": [name, record.nbytes, record.crc32c],
            "sidecar": [sidecar.nbytes, sidecar.crc32c],
            "shards": {
                fqn: [r.byte_offset, r.nbytes, r.crc_index, r.offsets, r.lengths]
                for fqn, r in shards.items()
            },
        }

    def add_records(
        self,
        builder: ManifestBuilder,
        gathered: list[dict[str, Any]],
        step_store: Store,
        specs: dict[str, TensorSpec],
        dims: ParallelDims,
    ) -> None:
        with cycle_gc_paused():  # one record per shard, no storage call
            for g in gathered:
                if "file" in g:
                    name, nbytes, crc = g["file"]
                    builder.add_file(
                        name,
                        FileRecord(nbytes=nbytes, crc32c=crc),
                        {
                            fqn: ShardRecord(
                                offsets=o,
                                lengths=n,
                                file=name,
                                key=fqn,
                                byte_offset=b,
                                nbytes=size,
                                crc32c=[],
                                crc_index=c,
                            )
                            for fqn, (b, size, c, o, n) in g["shards"].items()
                        },
                        sidecar=FileRecord(*g["sidecar"]),
                    )

    def gathered_nbytes(self, gathered: list[dict[str, Any]]) -> int:
        return sum(g["file"][1] + g["sidecar"][0] for g in gathered if "file" in g)

    def read_boxes(
        self,
        store: Store,
        manifest: Manifest,
        requests: Sequence[Request],
        stats: ReadStats | None,
        source: str,
    ) -> list[torch.Tensor]:
        return read_safetensors_boxes(store, manifest, requests, stats, source)


class ZarrFormat:
    """One zarr v3 array per logical tensor, chunked on the layout's shard boundaries;
    ``codec`` compresses the optimizer state (see :func:`zarr_format.parse_codec`)."""

    name = "zarr"

    def __init__(self, codec: str = "") -> None:
        from shardsmith.storage.formats.zarr_format import parse_codec

        parse_codec(codec)
        self.codec = codec

    def write_rank(
        self,
        step_store: Store,
        rank: int,
        entries: list[Entry],
        specs: dict[str, TensorSpec],
        dims: ParallelDims,
        chunk_nbytes: int,
    ) -> dict[str, Any]:
        from shardsmith.storage.formats.zarr_format import write_chunks

        files, shards = write_chunks(
            step_store, layout_arrays(specs, dims, self.codec), entries, chunk_nbytes
        )
        return {
            "zarr": {
                "files": {k: [f.nbytes, f.crc32c] for k, f in files.items()},
                "shards": {fqn: [r.to_json() for r in recs] for fqn, recs in shards.items()},
            }
        }

    def add_records(
        self,
        builder: ManifestBuilder,
        gathered: list[dict[str, Any]],
        step_store: Store,
        specs: dict[str, TensorSpec],
        dims: ParallelDims,
    ) -> None:
        from shardsmith.storage.formats.zarr_format import write_metadata

        for name, record in write_metadata(
            step_store, layout_arrays(specs, dims, self.codec).values()
        ).items():
            builder.add_file(name, record)
        for g in gathered:
            part = g.get("zarr", {})
            for name, (nbytes, crc) in part.get("files", {}).items():
                builder.add_file(name, FileRecord(nbytes=nbytes, crc32c=crc))
            for fqn, recs in part.get("shards", {}).items():
                builder.add_shards(fqn, (ShardRecord(**r) for r in recs))

    def gathered_nbytes(self, gathered: list[dict[str, Any]]) -> int:
        return sum(f[0] for g in gathered for f in g.get("zarr", {}).get("files", {}).values())

    def read_boxes(
        self,
        store: Store,
        manifest: Manifest,
        requests: Sequence[Request],
        stats: ReadStats | None,
        source: str,
    ) -> list[torch.Tensor]:
        from shardsmith.storage.formats.zarr_read import read_zarr_boxes

        return read_zarr_boxes(store, manifest, requests, stats, source)


#: Every tensor format by the name a manifest records (``tensor_format``); its traits are
#: :data:`~shardsmith.storage.manifest.records.FORMAT_TRAITS`. A new format is one class here
#: (writes and reads), one entry in each of the two tables.
FORMATS: dict[str, Callable[[str], TensorFormat]] = {
    SafetensorsFormat.name: lambda codec: SafetensorsFormat(),
    ZarrFormat.name: ZarrFormat,
}


def tensor_format(name: str, codec: str = "") -> TensorFormat:
    """The implementation of format ``name`` (``codec``: zarr compression, ignored otherwise).

    Raises:
        ConfigError: an unknown format or codec.
    """
    if name not in FORMATS:
        raise ConfigError(f"tensor format {name!r}: choose one of {list(TENSOR_FORMATS)}")
    return FORMATS[name](codec)


def layout_arrays(
    specs: dict[str, TensorSpec], dims: ParallelDims, codec: str = ""
) -> dict[str, ZarrArray]:
    """The zarr array of every tensor saved in layout ``dims``. Pure.

    The chunk grid is :func:`~shardsmith.storage.formats.zarr_format.regular_chunks` of the
    distinct boxes the layout writes; ``codec`` compresses the optimizer state
    (``optim.*``, except 0-d step counters).

    Raises:
        ConfigError: an unknown codec.
    """
    from shardsmith.storage.formats.zarr_format import ZarrArray, parse_codec, regular_chunks

    name, level = parse_codec(codec)
    spec_codec = f"{name}:{level}" if name else ""
    boxes: dict[str, list[Box]] = {fqn: [] for fqn in specs}
    for items in write_assignment(specs, dims).values():
        for fqn, box in items:
            boxes[fqn].append(box)
    return {
        fqn: ZarrArray(
            fqn,
            s.shape,
            s.dtype,
            regular_chunks(s.shape, boxes[fqn]),
            spec_codec if fqn.startswith(COMPRESSED_PREFIX) and s.shape else "",
        )
        for fqn, s in specs.items()
    }


def read_boxes(
    store: Store,
    manifest: Manifest,
    requests: Sequence[Request],
    stats: ReadStats | None = None,
    source: str = "",
) -> list[torch.Tensor]:
    """Assemble boxes of logical tensors from a committed step, whatever its format
    (:func:`shardsmith.storage.reading.execute.read_safetensors_boxes` for the contract: shapes,
    destinations, verified ranged reads, errors raised). Any rank, any number of calls.

    Destinations off the CPU (e.g. CUDA tensors) are filled through a bounded, reused host
    buffer, batch by batch (:func:`shardsmith.storage.reading.staging.read_staged`)."""
    if not all(on_host(out) for _, _, out in requests):
        return _read_with_staging(store, manifest, requests, stats, source)
    return tensor_format(manifest.tensor_format).read_boxes(
        store, manifest, requests, stats, source
    )


def _read_with_staging(
    store: Store,
    manifest: Manifest,
    requests: Sequence[Request],
    stats: ReadStats | None,
    source: str,
) -> list[torch.Tensor]:
    """:func:`read_boxes` when some destinations are off the CPU: those through host staging."""

    def host_read(batch: Sequence[Request]) -> object:
        return read_boxes(store, manifest, batch, stats, source)

    host = iter(read_boxes(store, manifest, [r for r in requests if on_host(r[2])], stats, source))
    staged = [
        (fqn, box, destination(fqn, box, manifest.tensors[fqn].dtype, out))
        for fqn, box, out in requests
        if not on_host(out)
    ]
    read_staged(host_read, staged, split_rows=manifest.traits.raw_shards)
    devices = iter(out for _, _, out in staged)
    return [next(host) if on_host(out) else next(devices) for _, _, out in requests]


def read_box(
    store: Store,
    manifest: Manifest,
    fqn: str,
    box: Box,
    out: torch.Tensor | None = None,
    stats: ReadStats | None = None,
    source: str = "",
) -> torch.Tensor:
    """One box of ``fqn`` (global elements) as a tensor of shape ``box.lengths`` (``out`` when
    given); see :func:`read_boxes`."""
    return read_boxes(store, manifest, [(fqn, box, out)], stats, source)[0]
