"""Loads into destinations off the CPU go through a bounded host staging buffer.

This machine has no GPU: :func:`read_staged` is exercised with CPU destinations (its logic
does not depend on the device) and the routing of :func:`read_boxes` with ``meta`` tensors
(no storage: a byte view of them, what the direct path takes, would fail).
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import make_checkpoint, memory_root

from shardsmith.errors import IntegrityError
from shardsmith.layout.box import Box
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.formats.registry import read_boxes
from shardsmith.storage.reading import staging
from shardsmith.storage.reading.execute import ReadStats
from shardsmith.storage.reading.staging import read_staged
from shardsmith.trainer.checkpoint.save_load import load_into

STEP = 4


@pytest.fixture
def ckpt():
    root = memory_root()
    full = make_checkpoint(root, STEP, seed=3)
    step_store = root.child(step_dir(STEP))
    return step_store, read_manifest(step_store), full


def _whole(t: torch.Tensor) -> Box:
    return Box((0,) * t.dim(), tuple(t.shape))


def test_read_staged_cuts_rows_and_batches_within_the_budget(ckpt) -> None:
    step_store, manifest, full = ckpt
    budget = 40  # bytes: w (6x4 fp32) is 96
    calls: list[list[tuple[str, Box, int]]] = []

    def read(batch):
        calls.append([(fqn, box, host.numel() * host.element_size()) for fqn, box, host in batch])
        assert all(host.data_ptr() % 64 == 0 for _, _, host in batch)
        return read_boxes(step_store, manifest, batch)

    dest = {fqn: torch.full_like(t, 7) for fqn, t in full.items()}
    read_staged(read, [(fqn, _whole(t), dest[fqn]) for fqn, t in full.items()], budget=budget)
    for fqn, t in full.items():
        assert torch.equal(dest[fqn], t), fqn
    w_runs = [box for call in calls for fqn, box, _ in call if fqn == "w"]
    assert [b.lengths for b in w_runs] == [(2, 4), (2, 4), (2, 4)]  # 32-byte runs of whole rows
    assert [b.offsets[0] for b in w_runs] == [0, 2, 4]
    for call in calls:  # each batch fits the budget, 64-byte aligned
        assert sum(-(-n // 64) * 64 for _, _, n in call) <= max(budget, 64) or len(call) == 1


def test_read_staged_keeps_a_row_larger_than_the_budget_whole(ckpt) -> None:
    step_store, manifest, full = ckpt
    seen = []

    def read(batch):
        seen.extend(box.lengths for _, box, _ in batch)
        return read_boxes(step_store, manifest, batch)

    out = torch.zeros(6, 4)
    read_staged(read, [("w", _whole(full["w"]), out)], budget=8)  # a row is 16 bytes
    assert seen == [(1, 4)] * 6 and torch.equal(out, full["w"])
    seen.clear()
    out = torch.zeros(6, 4)
    read_staged(
        read,
        [("w", _whole(full["w"]), out), ("b", _whole(full["b"]), torch.zeros(5))],
        budget=8,
        split_rows=False,
    )  # zarr: boxes whole
    assert seen == [(6, 4), (5,)] and torch.equal(out, full["w"])


def test_read_boxes_routes_off_cpu_destinations_through_staging(ckpt, monkeypatch) -> None:
    step_store, manifest, full = ckpt
    staged = []
    real = staging.read_staged

    def spy(read, requests, budget=staging.STAGING_NBYTES, split_rows=True):
        assert split_rows  # safetensors: boxes may be cut
        staged.extend(fqn for fqn, _, _ in requests)
        return real(read, requests, budget, split_rows)

    monkeypatch.setattr("shardsmith.storage.formats.registry.read_staged", spy)
    cpu = torch.zeros(6, 4)
    meta = torch.empty(4, 4, dtype=torch.bfloat16, device="meta")
    stats = ReadStats()
    outs = read_boxes(
        step_store,
        manifest,
        [
            ("w", _whole(full["w"]), cpu),
            ("h", _whole(full["h"]), meta),
            ("b", _whole(full["b"]), None),
        ],
        stats=stats,
    )
    assert staged == ["h"]
    assert outs[0] is cpu and outs[1] is meta and torch.equal(outs[2], full["b"])
    assert torch.equal(cpu, full["w"])
    assert stats.nbytes_needed == (
        24 * 4 + 16 * 2 + 5 * 4
    )  # the staged box is read and counted too
    with pytest.raises(ValueError, match="destination is"):
        read_boxes(
            step_store, manifest, [("h", _whole(full["h"]), torch.empty(4, 4, device="meta"))]
        )


def test_staged_reads_are_verified(ckpt) -> None:
    step_store, manifest, full = ckpt
    shard = next(s for s in manifest.tensors["w"].shards)
    data = bytearray(step_store.read(shard.file))
    data[shard.byte_offset] ^= 0x40
    step_store.write(shard.file, bytes(data))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        read_staged(
            lambda batch: read_boxes(step_store, manifest, batch),
            [("w", _whole(full["w"]), torch.zeros(6, 4))],
            budget=32,
        )


def test_trainer_load_into_meta_tensors_reads_everything(ckpt) -> None:
    step_store, manifest, full = ckpt
    dest = {fqn: torch.empty_like(t, device="meta") for fqn, t in full.items()}
    stats = load_into(
        step_store,
        manifest,
        dest,
        {f: _whole(t) for f, t in full.items()},
        {f: tuple(t.shape) for f, t in full.items()},
    )
    assert stats.nbytes_needed == sum(t.numel() * t.element_size() for t in full.values())
    assert stats.nbytes_read >= stats.nbytes_needed
