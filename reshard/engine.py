"""Offline resharding: convert a committed checkpoint to another layout, no process group.

Target boxes and writer assignment come from the sharding plan alone
(:mod:`shardsmith.reshard.plan`), so the result has the same files, keys and boxes
as a checkpoint saved directly by a job in the target layout. The target step is
committed like a save: data files first, manifest last, then the root's ``latest``.

Memory: one target file is assembled at a time (peak ~ the largest target file
plus the source spans read for it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import torch

from shardsmith.errors import LayoutError
from shardsmith.reshard.layout import ModelConfig, ParallelDims, validate_layout
from shardsmith.reshard.plan import checkpoint_specs, shard_file_name, write_assignment
from shardsmith.storage.checksum import DEFAULT_CHUNK_NBYTES
from shardsmith.storage.commit import commit, parse_step_dir, read_manifest, step_dir
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import FileRecord, Manifest, TensorRecord, parse_manifest
from shardsmith.storage.shards import ReadStats, encode_and_record, read_box

log = logging.getLogger(__name__)


@dataclass
class ReshardReport:
    """What a reshard did: files and bytes written, bytes read vs needed, seconds."""

    step: int
    target: str
    num_files: int = 0
    nbytes_written: int = 0
    stats: ReadStats = field(default_factory=ReadStats)
    seconds: float = 0.0


def split_step_url(url: str) -> tuple[str, int | None]:
    """``/x/run/step-000000040`` -> (``/x/run``, 40); a root URL gives (url, None)."""
    url = url.rstrip("/")
    name = url.rsplit("/", 1)[-1]
    step = parse_step_dir(name)
    return (url[: -len(name) - 1] or "/", step) if step is not None else (url, None)


def reshard(src: Store, dst_url: str, dims: ParallelDims, *, storage_options: dict | None = None,
            chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
            progress: Callable[[int, int], None] | None = None) -> ReshardReport:
    """Write the checkpoint in step directory ``src`` again under layout ``dims``.

    Args:
        src: the source step directory (committed).
        dst_url: target step directory (``.../step-NNNNNNNNN``, the step must match the
            source) or a root, under which ``step-NNNNNNNNN`` of the source step is created.
        dims: target layout.
        progress: called with (files done, files total) after each target file.

    Returns:
        A :class:`ReshardReport`.

    Raises:
        LayoutError: ``dims`` does not divide the model.
        CheckpointNotFound / ManifestError / IntegrityError: bad source.
    """
    t0 = time.perf_counter()
    manifest = read_manifest(src)
    model = ModelConfig.from_json(manifest.model)
    validate_layout(model, dims)
    dst_root_url, dst_step = split_step_url(dst_url)
    if dst_step is not None and dst_step != manifest.step:
        raise LayoutError(f"target {dst_url} names step {dst_step} but the source is step "
                          f"{manifest.step}; name the target {step_dir(manifest.step)} or give its root")
    dst_root = Store(dst_root_url, storage_options)
    dst = dst_root.child(step_dir(manifest.step))
    with_optim = any(k.startswith("optim.") for k in manifest.tensors)
    specs = checkpoint_specs(model, dims, with_optimizer=with_optim)
    for fqn, spec in specs.items():
        rec = manifest.tensors.get(fqn)
        if rec is None or tuple(rec.shape) != spec.shape:
            raise LayoutError(f"{src.url}: tensor {fqn} is {'missing' if rec is None else rec.shape} "
                              f"but the model config needs {spec.shape}")
    assignment = write_assignment(specs, dims)
    report = ReshardReport(step=manifest.step, target=dst.url)
    tensors = {fqn: TensorRecord(shape=list(s.shape), dtype=s.dtype) for fqn, s in specs.items()}
    files: dict[str, FileRecord] = {}
    ranks = [r for r in range(dims.world_size) if assignment[r]]
    for done, rank in enumerate(ranks, 1):
        name = shard_file_name(rank)
        local = {fqn: (read_box(src, manifest, fqn, box, stats=report.stats), box)
                 for fqn, box in assignment[rank]}
        encoded, records = encode_and_record(local, name, chunk_nbytes)
        del local
        dst.write(name, encoded.data)
        files[name] = encoded.record
        for fqn, rec in records.items():
            tensors[fqn].shards.append(rec)
        report.num_files += 1
        report.nbytes_written += encoded.record.nbytes
        if progress is not None:
            progress(done, len(ranks))
    for t in tensors.values():
        t.shards.sort(key=lambda s: s.offsets)
    config = dict(manifest.config)
    if "parallel" in config:
        config["parallel"] = dims.to_json()
    out = Manifest(step=manifest.step, layout={**dims.to_json(), "world_size": dims.world_size},
                   model=manifest.model, config=config, state=manifest.state, tensors=tensors,
                   files=files, chunk_nbytes=chunk_nbytes,
                   created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    parse_manifest(out.dumps(), dst.url_of("manifest.json"))     # coverage check before commit
    commit(dst_root, out)
    report.seconds = time.perf_counter() - t0
    return report
