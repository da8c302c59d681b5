"""Integrity: corruption is detected by load and by verify, naming the file; the commit
protocol's reader side (``latest`` is a hint, a step without manifest does not exist)."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket

import pytest
import torch
from ckpt_factory import (
    FILE0,
    FILE1,
    build_manifest,
    data_start,
    flip_byte,
    make_checkpoint,
    memory_root,
)
from click.testing import CliRunner

from shardsmith.errors import CheckpointNotFound, IntegrityError, ManifestError, SaveError
from shardsmith.layout.box import Box
from shardsmith.storage.commit import (
    LATEST_NAME,
    commit,
    find_latest_committed,
    list_steps,
    read_manifest,
    resolve_checkpoint,
    step_dir,
)
from shardsmith.storage.formats.registry import read_box
from shardsmith.storage.lineage import CORRUPT_NAME
from shardsmith.storage.manifest.records import MANIFEST_NAME, ShardRecord
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import check_file_once, verify_checkpoint
from shardsmith.trainer.checkpoint.save_load import load_into

STEP = 3


@pytest.fixture
def ckpt() -> tuple[Store, Store, dict[str, torch.Tensor]]:
    """(root, step store, logical tensors) of a fresh committed step in memory."""
    root = memory_root()
    full = make_checkpoint(root, STEP)
    return root, root.child(step_dir(STEP)), full


def read_all(step_store: Store) -> dict[str, torch.Tensor]:
    manifest = read_manifest(step_store)
    return {
        fqn: read_box(step_store, manifest, fqn, Box((0,) * len(r.shape), tuple(r.shape)))
        for fqn, r in manifest.tensors.items()
    }


def load_all(step_store: Store, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Through the trainer's load path (every tensor whole, one 'rank')."""
    manifest = read_manifest(step_store)
    dest = {fqn: torch.zeros_like(t) for fqn, t in full.items()}
    boxes = {fqn: Box((0,) * t.dim(), tuple(t.shape)) for fqn, t in full.items()}
    load_into(step_store, manifest, dest, boxes, {fqn: tuple(t.shape) for fqn, t in full.items()})
    return dest


# ---- intact -------------------------------------------------------------------------------


def test_intact_checkpoint_loads_and_verifies(ckpt) -> None:
    root, step_store, full = ckpt
    for got in (read_all(step_store), load_all(step_store, full)):
        assert all(got[f].dtype == full[f].dtype and torch.equal(got[f], full[f]) for f in full)
    report = verify_checkpoint(step_store)
    assert report.ok, report.problems
    assert (report.step, report.num_files, report.num_tensors) == (
        STEP,
        4,
        4,
    )  # 2 data files + sidecars
    assert report.nbytes_checked == sum(
        step_store.size(f) for f in (FILE0, FILE1, FILE0 + ".crc32c", FILE1 + ".crc32c")
    )
    assert report.extra_files == []


def test_verify_streams_in_bounded_blocks(tmp_path) -> None:
    """A ~1 MB file is checked in reads no larger than the block, and still fully."""
    root = Store(str(tmp_path))
    manifest, _ = build_manifest(root, 1, chunk_nbytes=4096)
    big = torch.arange(256 * 1024, dtype=torch.float32)
    from shardsmith.storage.formats.tensor_files import encode_and_record

    encoded, records = encode_and_record(
        {"big": (big, Box((0,), (big.numel(),)))}, "shards/big.safetensors", 4096
    )
    root.child(step_dir(1)).write("shards/big.safetensors", encoded.data)
    manifest.files["shards/big.safetensors"] = encoded.record
    from shardsmith.storage.manifest.records import TensorRecord

    manifest.tensors["big"] = TensorRecord(
        shape=[big.numel()], dtype="F32", shards=[records["big"]]
    )
    commit(root, manifest)
    step_store = root.child(step_dir(1))
    sizes: list[int] = []
    original = Store.read_range

    def recording(self, key, start, end):
        sizes.append(end - start)
        return original(self, key, start, end)

    Store.read_range = recording
    try:
        report = verify_checkpoint(step_store, block_nbytes=100_000)
    finally:
        Store.read_range = original
    assert report.ok, report.problems
    assert report.nbytes_checked == sum(f.nbytes for f in manifest.files.values()) > 1_000_000
    assert max(sizes) <= 100_000
    flip_byte(step_store, "shards/big.safetensors", 600_001)
    bad = verify_checkpoint(step_store, block_nbytes=100_000)
    assert bad.bad_files == ["shards/big.safetensors"]
    assert "1 of 256 checksum chunks bad" in bad.problems[-1].what


# ---- corruption: detected by load and by verify, the file named ----------------------------


@pytest.mark.parametrize("block", [7, 8 * 1024 * 1024])
def test_flipped_data_byte(ckpt, block) -> None:
    root, step_store, full = ckpt
    flip_byte(step_store, FILE1, -3)  # inside the last entry's data
    with pytest.raises(IntegrityError, match=f"{FILE1}: checksum mismatch"):
        read_all(step_store)
    with pytest.raises(IntegrityError, match=FILE1):
        load_all(step_store, full)
    report = verify_checkpoint(step_store, block_nbytes=block)
    assert report.bad_files == [FILE1]
    whats = " | ".join(p.what for p in report.problems)
    assert "whole-file CRC-32C" in whats and "1 of" in whats and "checksum mismatch" in whats


def test_every_flipped_header_byte_is_detected(ckpt) -> None:
    """Any single-bit flip anywhere in a safetensors header (length prefix included) is
    refused by load (before reading data) and reported by verify."""
    root, step_store, full = ckpt
    original = step_store.read(FILE0)
    end = data_start(step_store, FILE0)
    for offset in range(end):
        for mask in (0x01, 0x20, 0x80):
            step_store.write(
                FILE0, original[:offset] + bytes([original[offset] ^ mask]) + original[offset + 1 :]
            )
            manifest = read_manifest(step_store)
            with pytest.raises(IntegrityError, match=FILE0):
                check_file_once(step_store, manifest, FILE0)
            assert FILE0 not in manifest.checked_files
    step_store.write(FILE0, original)
    flip_byte(step_store, FILE0, 20)
    with pytest.raises(
        IntegrityError, match=f"{FILE0}: (corrupt safetensors header|safetensors header disagrees)"
    ):
        load_all(step_store, full)
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE0]
    assert any("whole-file CRC-32C" in p.what for p in report.problems)


def test_truncated_shard_file(ckpt) -> None:
    root, step_store, full = ckpt
    data = step_store.read(FILE0)
    step_store.write(FILE0, data[:-10])
    with pytest.raises(
        IntegrityError,
        match=f"{FILE0}: truncated: {len(data) - 10} bytes on storage, "
        f"the manifest records {len(data)}",
    ):
        read_all(step_store)
    with pytest.raises(IntegrityError, match=f"{FILE0}: truncated"):
        load_all(step_store, full)
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE0]
    whats = [p.what for p in report.problems]
    assert whats[0].startswith("truncated:")
    assert any("past the end of the file" in w for w in whats)


def test_truncated_to_nothing(ckpt) -> None:
    root, step_store, full = ckpt
    step_store.write(FILE1, b"")
    with pytest.raises(IntegrityError, match=f"{FILE1}: truncated: 0 bytes"):
        read_all(step_store)
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE1]


def test_oversized_shard_file(ckpt) -> None:
    """Bytes appended after the data: every entry still checksums, the size does not."""
    root, step_store, full = ckpt
    data = step_store.read(FILE1)
    step_store.write(FILE1, data + b"\0" * 5)
    with pytest.raises(IntegrityError, match=f"{FILE1}: oversized: {len(data) + 5} bytes"):
        read_all(step_store)
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE1]
    assert [p.what.split(":")[0] for p in report.problems] == ["oversized"]


def test_missing_shard_file(ckpt) -> None:
    root, step_store, full = ckpt
    step_store.delete(FILE1)
    with pytest.raises(IntegrityError, match=f"{FILE1}: missing, but the manifest lists it"):
        read_all(step_store)
    with pytest.raises(IntegrityError, match=FILE1):
        load_all(step_store, full)
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE1]
    assert report.problems[0].what.startswith("missing")


def test_only_touched_files_are_read(ckpt) -> None:
    """A box inside file 0 loads even when file 1 is gone: loads check what they read."""
    root, step_store, full = ckpt
    step_store.delete(FILE1)
    manifest = read_manifest(step_store)
    got = read_box(step_store, manifest, "w", Box((0, 0), (3, 4)))
    assert torch.equal(got, full["w"][:3])
    assert manifest.checked_files == {FILE0}


def test_verify_lists_every_bad_file(ckpt) -> None:
    root, step_store, full = ckpt
    flip_byte(step_store, FILE0, -1)
    step_store.delete(FILE1)
    step_store.write("shards/leftover.safetensors", b"x")
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE0, FILE1]
    assert report.extra_files == ["shards/leftover.safetensors"]
    assert not report.ok and report.to_json()["bad_files"] == [FILE0, FILE1]


def test_deleted_manifest_means_not_committed(ckpt) -> None:
    root, step_store, full = ckpt
    make_checkpoint(root, STEP + 1, seed=1)
    root.delete(f"{step_dir(STEP + 1)}/{MANIFEST_NAME}")
    assert find_latest_committed(root) == STEP
    _, resolved, step = resolve_checkpoint(root.url)
    assert (resolved.url, step) == (step_store.url, STEP)
    with pytest.raises(
        CheckpointNotFound, match=f"{step_dir(STEP + 1)} is not a committed checkpoint"
    ):
        read_manifest(root.child(step_dir(STEP + 1)))
    report = verify_checkpoint(root.child(step_dir(STEP + 1)))
    assert report.bad_files == [MANIFEST_NAME] and "not committed" in report.problems[0].what
    root.delete(f"{step_dir(STEP)}/{MANIFEST_NAME}")
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint"):
        resolve_checkpoint(root.url)


# ---- commit: validated before, latest is a hint -------------------------------------------


def test_commit_refuses_bad_coverage_and_commits_nothing(ckpt) -> None:
    root, _, _ = ckpt
    manifest, _ = build_manifest(root, STEP + 1)
    manifest.tensors["w"].shards.pop()  # half of w not covered
    with pytest.raises(ManifestError, match=r"tensors\['w'\].shards: .*missing coverage"):
        commit(root, manifest)
    assert not root.exists(f"{step_dir(STEP + 1)}/{MANIFEST_NAME}")
    assert find_latest_committed(root) == STEP
    assert root.read(LATEST_NAME).decode().strip() == step_dir(STEP)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_commit_refuses_unwritten_files(ckpt, damage) -> None:
    root, _, _ = ckpt
    manifest, _ = build_manifest(root, STEP + 1)
    step_store = root.child(step_dir(STEP + 1))
    if damage == "delete":
        step_store.delete(FILE1)
    else:
        step_store.write(FILE1, step_store.read(FILE1)[:-1])
    with pytest.raises(SaveError, match=f"step {STEP + 1} not committed: .*{FILE1}"):
        commit(root, manifest)
    assert [s.step for s in list_steps(root) if s.committed] == [STEP]


def test_commit_of_older_step_keeps_latest(ckpt) -> None:
    root, _, _ = ckpt
    make_checkpoint(root, STEP + 5)
    make_checkpoint(root, STEP - 1)
    assert root.read(LATEST_NAME).decode().strip() == step_dir(STEP + 5)


@pytest.mark.parametrize(
    "hint",
    [None, "", "step-000000001", "step-000000009", "step-000000007", "garbage\n", "../../etc"],
)
def test_latest_hint_fallback(hint, caplog) -> None:
    """Missing, empty, stale, incomplete, nonexistent or garbage hints -> newest committed
    step, with a warning naming the hint."""
    root = memory_root()
    make_checkpoint(root, 1)
    make_checkpoint(root, 5)
    build_manifest(root, 7)  # incomplete: data, no manifest
    if hint is None:
        root.delete(LATEST_NAME)
    else:
        root.write(LATEST_NAME, hint.encode())
    with caplog.at_level(logging.WARNING, logger="shardsmith.storage.commit"):
        assert find_latest_committed(root) == 5
    assert any(
        "using newest committed step step-000000005" in r.getMessage() for r in caplog.records
    )
    assert [(s.step, s.committed) for s in list_steps(root)] == [(1, True), (5, True), (7, False)]


def test_latest_hint_current_is_silent(caplog) -> None:
    root = memory_root()
    make_checkpoint(root, 2)
    with caplog.at_level(logging.WARNING, logger="shardsmith.storage.commit"):
        assert find_latest_committed(root) == 2
    assert not caplog.records


def test_manifest_step_must_match_directory(ckpt) -> None:
    root, step_store, _ = ckpt
    other = root.child(step_dir(STEP + 1))
    for name in (FILE0, FILE1, MANIFEST_NAME):
        other.write(name, step_store.read(name))
    with pytest.raises(
        ManifestError, match=rf"{other.url}/manifest.json: step: the manifest says step {STEP}"
    ):
        read_manifest(other)


# ---- CLI ----------------------------------------------------------------------------------


def test_cli_verify(ckpt) -> None:
    from shardsmith.cli.main import cli

    root, step_store, _ = ckpt
    ok = CliRunner().invoke(cli, ["verify", root.url])
    assert ok.exit_code == 0 and f"ok: {step_store.url} step {STEP}: 4 files" in ok.output, (
        ok.output
    )
    flip_byte(step_store, FILE0, -2)
    step_store.delete(FILE1)
    bad = CliRunner().invoke(cli, ["verify", step_store.url])
    assert bad.exit_code == 1
    assert f"BAD {FILE0}: " in bad.output and f"BAD {FILE1}: missing" in bad.output
    as_json = CliRunner().invoke(cli, ["verify", "--json", step_store.url])
    import json

    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["bad_files"] == [FILE0, FILE1]


# ---- the trainer's own save/resume, in process (one gloo rank) ------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_group():
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.distributed
def test_trainer_resume_detects_corruption_and_falls_back(
    tmp_path, data_path, gloo_group, monkeypatch
) -> None:
    from conftest import tiny_train_config

    from shardsmith.layout import ParallelDims
    from shardsmith.trainer.config import CheckpointConfig
    from shardsmith.trainer.train import Trainer

    base = tiny_train_config(ParallelDims(), data_path)
    cfg = dataclasses.replace(
        base, steps=2, checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt"), async_save=False)
    )
    trainer = Trainer.create(cfg)
    for _ in range(2):
        trainer.train_step()
        trainer.save()
        trainer.wait_for_save()
    root = Store(cfg.checkpoint.url)
    assert verify_checkpoint(root.child(step_dir(2))).ok
    step2 = root.child(step_dir(2))
    manifest = read_manifest(step2)
    shard: ShardRecord = manifest.tensors["norm.weight"].shards[0]
    flip_byte(step2, shard.file, shard.byte_offset + 1)
    explicit = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=step2.url)
    )
    with pytest.raises(IntegrityError, match=shard.file):
        Trainer.create(explicit).resume()  # an explicit step never falls back
    assert step2.exists(CORRUPT_NAME)  # ... but the load marked it
    resumed = Trainer.create(cfg)  # --resume auto: the run's previous step
    monkeypatch.setattr(pickle, "loads", _pickle_trap)
    monkeypatch.setattr(pickle, "load", _pickle_trap)
    monkeypatch.setattr(torch, "load", _pickle_trap)
    assert resumed.resume() and resumed.step == 1
    monkeypatch.undo()
    got = {k: v.detach().clone() for k, v in resumed.model.state_dict().items()}
    want = read_all(root.child(step_dir(1)))
    assert all(torch.equal(got[k], want[k]) for k in got), "resumed weights differ from step 1"


def _pickle_trap(*args, **kwargs):
    raise AssertionError("resume tried to unpickle")
