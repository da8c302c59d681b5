"""Load-time reads of strided pieces (storage/reading): short row segments go through scratch,
verified in whole chunks and copied into place, and flushed scratch is reused; long segments
are read straight into the destination."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from ckpt_factory import RESHARD_MODEL as MODEL
from ckpt_factory import RESHARD_SRC_DIMS as SRC_DIMS
from ckpt_factory import RESHARD_STEP as STEP
from ckpt_factory import full_state, save_direct

import shardsmith.storage.reading.execute as execute
from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.manifest.records import ShardRecord
from shardsmith.storage.reading.execute import ReadStats, read_safetensors_boxes
from shardsmith.storage.reading.ranges import plan_piece
from shardsmith.storage.store.fs import Store


@pytest.mark.parametrize("cols,scratch", [(4096, False), (1024, True)])
def test_long_row_segments_are_read_in_place_short_ones_through_scratch(
    cols: int, scratch: bool
) -> None:
    """A saved [4, cols] fp32 shard that is a column slice of a [4, 2 * cols] destination:
    16 KiB segments (4096 columns) are read straight into the destination's rows, 4 KiB ones
    into scratch."""
    shard = ShardRecord(
        key="w",
        file="f",
        byte_offset=0,
        nbytes=4 * cols * 4,
        offsets=[0, cols],
        lengths=[4, cols],
        crc32c=[0] * 64,
    )
    saved, box = Box((0, cols), (4, cols)), Box((0, 0), (4, 2 * cols))
    out = torch.empty(4, 2 * cols)
    piece, parts = plan_piece(shard, saved, saved, box, out, 4, 256 << 10)
    assert (piece is not None) == scratch
    assert (
        len(parts) == 1 and parts[0].start == 0 and parts[0].end == 4 * cols * 4
    )  # the same bytes either way
    assert len(parts[0].dests) == (1 if scratch else 4)


def _dp_shard2_reads(tmp_path: Any) -> tuple[dict[str, torch.Tensor], Store, Any, list[Any]]:
    """(full tensors, step store, manifest, read requests of both dp_shard2 ranks' boxes) of a
    tp2·pp2 checkpoint saved with 128-byte chunks."""
    full = full_state(9)
    save_direct(Store(str(tmp_path / "src")), full, SRC_DIMS, chunk=128)
    step = Store(str(tmp_path / "src")).child(step_dir(STEP))
    manifest = read_manifest(step)
    dims = ParallelDims(dp_shard=2)
    specs = checkpoint_specs(MODEL, dims, with_optimizer=True)
    requests = [
        (fqn, box, None)
        for rank in range(2)
        for fqn, box in rank_boxes(specs, dims, rank).items()
        if box.numel and fqn in manifest.tensors
    ]
    return full, step, manifest, requests


def test_scratch_is_reused_across_flushes_and_the_values_are_exact(tmp_path, monkeypatch) -> None:
    """tp2·pp2 saved, read into both dp_shard2 ranks' boxes (row-parallel weights: column
    halves in 64-byte segments, through scratch) with an 8 KiB scratch budget: many flushes
    share few buffers; every value equals the saved tensor, and as many bytes are read as with
    the default budget."""
    full, step, manifest, requests = _dp_shard2_reads(tmp_path)

    def read(limit: int) -> tuple[list[torch.Tensor], ReadStats, list[torch.Tensor]]:
        handed: list[torch.Tensor] = []
        real = execute._Batch.scratch

        def scratch(self, nbytes: int) -> torch.Tensor:
            handed.append(real(self, nbytes))
            return handed[-1]

        monkeypatch.setattr(
            step.backend, "capabilities", dataclasses.replace(caps, scratch_nbytes=limit)
        )
        monkeypatch.setattr(execute._Batch, "scratch", scratch)
        stats = ReadStats()
        return read_safetensors_boxes(step, manifest, requests, stats), stats, handed

    caps = step.capabilities
    outs, stats, handed = read(8192)
    for (fqn, box, _), got in zip(requests, outs):
        assert torch.equal(
            got, full[fqn][box.relative_to(Box((0,) * len(box.lengths), tuple(full[fqn].shape)))]
        ), fqn
    storages = {t.untyped_storage().data_ptr() for t in handed}
    assert (
        len(handed) > 20 and len(storages) < len(handed) // 3
    )  # reused (each handed one is kept alive)
    _, default_stats, _ = read(caps.scratch_nbytes)
    assert (
        stats.nbytes_read == default_stats.nbytes_read
        and stats.nbytes_needed == default_stats.nbytes_needed
    )


@pytest.mark.parametrize("kind", ["node-local", "shared-fs"])
def test_node_local_reads_of_one_file_run_in_file_order_on_one_thread(
    tmp_path, monkeypatch, kind: str
) -> None:
    """On a node-local store every file's reads are one task, in offset order (concurrent reads
    of one file cost a page-cache disk more CPU); different files still read in parallel. On a
    shared filesystem (the same files, ``SHARDSMITH_STORAGE_KIND=shared-fs``) every ranged read
    is its own task, so several reads of one file are in flight. Every value is exact."""
    monkeypatch.setenv("SHARDSMITH_STORAGE_KIND", kind)
    full, step, manifest, requests = _dp_shard2_reads(tmp_path)
    assert step.capabilities.kind.value == kind
    seen: list[tuple[str, int, int]] = []
    real = Store.read_into

    def read_into(self, key, start, dests):  # type: ignore[no-untyped-def]
        seen.append((key, start, threading.get_ident()))
        return real(self, key, start, dests)

    pooled: list[int] = []

    class Pool(execute.ThreadPoolExecutor):
        def map(self, fn, *iterables, **kw):  # type: ignore[no-untyped-def, override]
            tasks = list(iterables[0])
            pooled.append(len(tasks))
            return super().map(fn, tasks, **kw)

    monkeypatch.setattr(Store, "read_into", read_into)
    monkeypatch.setattr(execute, "ThreadPoolExecutor", Pool)
    outs = read_safetensors_boxes(step, manifest, requests)
    for (fqn, box, _), got in zip(requests, outs):
        assert torch.equal(
            got, full[fqn][box.relative_to(Box((0,) * len(box.lengths), tuple(full[fqn].shape)))]
        ), fqn
    files = {key for key, _, _ in seen}
    assert len(files) > 1
    if kind == "shared-fs":
        assert pooled and max(pooled) == len(seen) > len(files)  # one task per read
        return
    for f in files:
        mine = [(start, thread) for key, start, thread in seen if key == f]
        assert len(mine) > 1 and len({t for _, t in mine}) == 1, f  # one thread per file
        assert [s for s, _ in mine] == sorted(s for s, _ in mine), f  # in file order
    assert pooled and max(pooled) == len(files)  # one task per file, in parallel
