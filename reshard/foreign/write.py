"""The one place the foreign-format importers write a shardsmith checkpoint.

Every importer (DCP, Megatron ``torch_dist``) describes what to write as a model config,
a target layout, a ``read(fqn, box)`` callback and the non-tensor state; this module turns
that into shard files and a committed manifest through today's storage API
(``write_shard_file`` + ``Manifest`` + ``commit``, as ``import-hf`` does). When the storage
API changes, this file is the only one of the importers to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardsmith.layout import (
    Box,
    ModelConfig,
    ParallelDims,
    checkpoint_specs,
    shard_file_name,
    write_assignment,
)
from shardsmith.storage import DEFAULT_CHUNK_NBYTES, ensure_not_committed, resolve_target, step_dir
from shardsmith.storage.commit import commit
from shardsmith.storage.formats import file_order, write_shard_file
from shardsmith.storage.manifest import (
    MANIFEST_NAME,
    ManifestBuilder,
    dumps_manifest,
    parse_manifest,
)

#: ``read(fqn, box)``: the box (global elements) of logical tensor ``fqn``, float32, contiguous.
BoxReader = Callable[[str, Box], torch.Tensor]


@dataclass
class WriteReport:
    """What :func:`write_checkpoint` committed."""

    target: str
    step: int
    num_files: int = 0
    nbytes_written: int = 0


def write_checkpoint(
    ckpt_url: str,
    model: ModelConfig,
    dims: ParallelDims,
    read: BoxReader,
    *,
    state: dict[str, Any],
    config: dict[str, Any],
    with_optimizer: bool,
    step: int | None = None,
    storage_options: dict | None = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
) -> WriteReport:
    """Write and commit one shardsmith checkpoint step in layout ``dims``.

    One shard file per rank of ``dims`` (the plan's :func:`write_assignment`), written one
    file at a time: peak memory is one target rank's share of the tensors. Data files
    first, the manifest last (the commit), then ``latest``.

    Args:
        ckpt_url: target root, or step directory ``.../step-NNNNNNNNN``.
        model, dims: the model shape and target layout.
        read: source of every (fqn, box) of :func:`checkpoint_specs`.
        state: the manifest's non-tensor state (``step`` is set to the committed step).
        config: root training config recorded in the manifest.
        with_optimizer: also write ``optim.exp_avg/exp_avg_sq/step.<fqn>``.
        step: step number (default: ``state["step"]``, or the one the target names).

    Raises:
        LayoutError: ``dims`` does not divide the model.
        FileExistsError: the target step is already committed.
        ManifestError: the manifest does not cover every tensor (a bug, checked before commit).
    """
    root, step = resolve_target(
        ckpt_url, step if step is not None else state.get("step"), storage_options
    )
    dst = root.child(step_dir(step))
    ensure_not_committed(dst)
    specs = checkpoint_specs(model, dims, with_optimizer=with_optimizer)
    builder = ManifestBuilder(
        step=step,
        dims=dims,
        model=model.to_json(),
        config=config,
        state={**state, "step": step},
        tensors={fqn: (s.shape, s.dtype) for fqn, s in specs.items()},
        chunk_nbytes=chunk_nbytes,
    )
    report = WriteReport(target=dst.url, step=step)
    for rank, items in write_assignment(specs, dims).items():
        if not items:
            continue
        key = shard_file_name(rank)
        items = sorted(items, key=lambda it: file_order(it[0], specs[it[0]].dtype))
        entries = [(fqn, read(fqn, box).to(torch.float32).contiguous()) for fqn, box in items]
        record, shards = write_shard_file(dst, key, entries, chunk_nbytes, dict(items))
        del entries
        builder.add_file(key, record, shards)
        report.num_files += 1
        report.nbytes_written += record.nbytes
    manifest = builder.build()
    parse_manifest(
        dumps_manifest(manifest), dst.url_of(MANIFEST_NAME)
    )  # coverage check before commit
    commit(root, manifest)
    return report
