"""The zarr format under a layout, and conversion between tensor formats (any layout).

:func:`layout_arrays` derives each logical tensor's zarr array (chunk grid on the saving
layout's box boundaries, codec) from the sharding plan; a save and a conversion to the
same layout agree on it. :func:`convert_format` rewrites a committed checkpoint of
either format in a layout and format of choice, streaming one target box at a time: each
box is read with :func:`~shardsmith.storage.formats.registry.read_box` (ranged, verified reads of
either source format) and written as zarr chunks or into the target rank's safetensors
file, so peak memory is about the largest tensor box (plus encoded chunks awaiting upload,
at most :data:`~shardsmith.storage.formats.zarr_format.MAX_PENDING_NBYTES`).

The safetensors-to-safetensors case is the streaming engine's
(:mod:`shardsmith.reshard.engine`, resumable, scale-out); this module covers every
conversion that involves zarr. A rerun after an interruption rewrites all files.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from shardsmith.errors import LayoutError
from shardsmith.layout import (
    DTYPE_NBYTES,
    Box,
    ModelConfig,
    ParallelDims,
    TensorSpec,
    checkpoint_specs,
    has_optim_state,
    shard_file_name,
    write_assignment,
)
from shardsmith.reshard.progress import ReshardReport
from shardsmith.storage import (
    DEFAULT_CHUNK_NBYTES,
    ensure_not_committed,
    read_manifest,
    resolve_target,
    step_dir,
)
from shardsmith.storage.commit import commit
from shardsmith.storage.formats import (
    SafetensorsFormat,
    ZarrFormat,
    byte_view,
    encode_header,
    file_order,
    layout_arrays,
    read_box,
    shard_records,
    write_chunks,
    write_metadata,
    write_stream,
)
from shardsmith.storage.formats import tensor_format as tensor_format_of
from shardsmith.storage.manifest import (
    SIDECAR_SUFFIX,
    FileRecord,
    Manifest,
    ManifestBuilder,
    ShardRecord,
    sidecar_name,
    write_sidecar,
)
from shardsmith.storage.reading import ReadStats
from shardsmith.storage.store import Store


def _target_specs(
    manifest: Manifest, dims: ParallelDims, model_only: bool, url: str
) -> dict[str, TensorSpec]:
    """Specs of the target layout, with the source's dtypes; checks the source fits."""
    model = ModelConfig.from_json(manifest.model)
    with_optim = not model_only and has_optim_state(manifest.tensors)
    specs = checkpoint_specs(model, dims, with_optimizer=with_optim)  # validates the layout
    bad = [
        f
        for f, s in specs.items()
        if f not in manifest.tensors or tuple(manifest.tensors[f].shape) != s.shape
    ]
    if bad:
        raise LayoutError(
            f"{url}: {len(bad)} tensors are missing or do not fit the model config, e.g. {bad[:5]}"
        )
    return {
        f: TensorSpec(
            f,
            s.shape,
            manifest.tensors[f].dtype,
            s.dim_axes,
            s.stages,
            s.pad_dim0_to,
            s.tp_replicas,
        )
        for f, s in specs.items()
    }


def _boxes(
    src: Store, manifest: Manifest, items: list[tuple[str, Box]], stats: ReadStats
) -> Iterator[tuple[str, torch.Tensor, Box]]:
    for fqn, box in items:
        yield fqn, read_box(src, manifest, fqn, box, stats=stats), box


def _write_zarr(
    src: Store,
    manifest: Manifest,
    dst: Store,
    specs: dict[str, TensorSpec],
    dims: ParallelDims,
    codec: str,
    chunk_nbytes: int,
    stats: ReadStats,
) -> tuple[dict, dict]:
    arrays = layout_arrays(specs, dims, codec)
    files: dict[str, FileRecord] = {}
    shards: dict[str, list[ShardRecord]] = {}
    for rank, items in sorted(write_assignment(specs, dims).items()):
        f, s = write_chunks(dst, arrays, _boxes(src, manifest, items, stats), chunk_nbytes)
        files.update(f)
        for fqn, recs in s.items():
            shards.setdefault(fqn, []).extend(recs)
    files.update(write_metadata(dst, arrays.values()))  # before the manifest
    return files, shards


def _write_safetensors_file(
    src: Store,
    manifest: Manifest,
    dst: Store,
    rank: int,
    items: list[tuple[str, Box]],
    specs: dict[str, TensorSpec],
    chunk_nbytes: int,
    stats: ReadStats,
) -> tuple[FileRecord, dict[str, ShardRecord]]:
    """Stream target ``rank``'s safetensors file: header, then each box as it is read
    (entries in ``safetensors.torch.save`` order, as a save in the target layout writes)."""
    items = sorted(items, key=lambda it: file_order(it[0], specs[it[0]].dtype))
    sizes = [
        (fqn, specs[fqn].dtype, box.lengths, box.numel * DTYPE_NBYTES[specs[fqn].dtype])
        for fqn, box in items
    ]
    header, _ = encode_header(sizes)
    name = shard_file_name(rank)
    data = (
        (i, byte_view(read_box(src, manifest, fqn, box, stats=stats)))
        for i, (fqn, box) in enumerate(items)
    )
    record, crcs = write_stream(
        dst, name, header, data, len(items), chunk_nbytes, len(header) + sum(s[3] for s in sizes)
    )
    return record, shard_records(
        name, [(fqn, box, s[3]) for (fqn, box), s in zip(items, sizes)], len(header), crcs
    )


def _write_safetensors(
    src: Store,
    manifest: Manifest,
    dst: Store,
    specs: dict[str, TensorSpec],
    dims: ParallelDims,
    codec: str,
    chunk_nbytes: int,
    stats: ReadStats,
) -> tuple[dict, dict]:
    files: dict[str, FileRecord] = {}
    shards: dict[str, list[ShardRecord]] = {}
    for rank, items in sorted(write_assignment(specs, dims).items()):
        if items:
            rec, recs = _write_safetensors_file(
                src, manifest, dst, rank, items, specs, chunk_nbytes, stats
            )
            files[shard_file_name(rank)] = rec
            files[sidecar_name(shard_file_name(rank))] = write_sidecar(
                dst, shard_file_name(rank), recs
            )
            for fqn, r in recs.items():
                shards.setdefault(fqn, []).append(r)
    return files, shards


#: The conversion writer of each tensor format (streaming: one box read at a time).
_WRITERS = {ZarrFormat.name: _write_zarr, SafetensorsFormat.name: _write_safetensors}


def convert_format(
    src: Store,
    dst_url: str,
    dims: ParallelDims,
    tensor_format: str,
    *,
    codec: str = "",
    model_only: bool = False,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    storage_options: dict | None = None,
) -> ReshardReport:
    """Rewrite the committed step in ``src`` in layout ``dims`` and ``tensor_format``; commit it.

    Single process. Files are written first, the zarr metadata next, the manifest last
    (:func:`~shardsmith.storage.commit.commit`), then ``latest``.

    Args:
        src: source step directory (either format).
        dst_url: target step directory (``.../step-NNNNNNNNN``, the source's step) or a root.
        dims: target layout.
        tensor_format: ``"safetensors"`` or ``"zarr"``.
        codec: zarr compression of the optimizer state (``""``, ``"zstd"``, ``"gzip:9"`` ...).
        model_only: drop the optimizer state.
        chunk_nbytes: checksum chunk size of the target (bytes).
        storage_options: fsspec options of the target.

    Returns:
        A :class:`~shardsmith.reshard.progress.ReshardReport` (``num_files``: data files).

    Raises:
        ConfigError: an unknown format or codec.
        LayoutError: ``dims`` does not fit the model, or ``dst_url`` names another step.
        TargetCommitted (a CheckpointError): the target is already committed; IntegrityError: a bad source byte.
    """
    tensor_format_of(tensor_format, codec)  # ConfigError: unknown format or codec
    t0 = time.perf_counter()
    manifest = read_manifest(src)
    specs = _target_specs(manifest, dims, model_only, src.url)
    root, _ = resolve_target(dst_url, manifest.step, storage_options)
    dst = root.child(step_dir(manifest.step))
    ensure_not_committed(dst)
    stats = ReadStats()
    files, shards = _WRITERS[tensor_format](
        src, manifest, dst, specs, dims, codec, chunk_nbytes, stats
    )
    builder = ManifestBuilder.relayout(
        manifest,
        dims,
        {fqn: (s.shape, s.dtype) for fqn, s in specs.items()},
        chunk_nbytes=chunk_nbytes,
        tensor_format=tensor_format,
    )
    for name, rec in files.items():
        builder.add_file(name, rec)
    for fqn, recs in shards.items():
        builder.add_shards(fqn, recs)
    commit(root, builder.build())
    return ReshardReport(
        step=manifest.step,
        target=dst.url,
        num_files=sum(not n.endswith(SIDECAR_SUFFIX) for n in files),
        nbytes_written=sum(f.nbytes for f in files.values()),
        nbytes_read=stats.nbytes_read,
        nbytes_needed=stats.nbytes_needed,
        seconds=time.perf_counter() - t0,
        committed=True,
    )
