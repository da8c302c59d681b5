"""Housekeeping: ``ls`` (describe_steps) and ``gc`` retention, incomplete steps, safety."""

from __future__ import annotations

import json
import logging
import time

import pytest
from ckpt_factory import FILE0, build_manifest, make_checkpoint, memory_root
from click.testing import CliRunner

from shardsmith.storage.commit import find_latest_committed, list_steps, step_dir
from shardsmith.storage.gc import delete_step, describe_steps, gc, gc_after_commit, plan_gc
from shardsmith.storage.manifest.records import MANIFEST_NAME
from shardsmith.storage.store.fs import Store

FAR_FUTURE = time.time() + 10**6  # every file is "old"


def committed_steps(root: Store) -> list[int]:
    return [s.step for s in list_steps(root) if s.committed]


def all_steps(root: Store) -> list[int]:
    return [s.step for s in list_steps(root)]


@pytest.fixture(params=["memory", "local"])
def root(request, tmp_path) -> Store:
    return memory_root() if request.param == "memory" else Store(str(tmp_path / "ckpt"))


def test_describe_steps(root) -> None:
    for step in (10, 20, 30):
        make_checkpoint(root, step)
    build_manifest(root, 40)  # data written, no manifest
    root.write(f"{step_dir(25)}/{MANIFEST_NAME}", b"{not json")  # a broken manifest
    steps = describe_steps(root)
    assert [(s.step, s.status) for s in steps] == [
        (10, "committed"),
        (20, "committed"),
        (25, "invalid"),
        (30, "committed"),
        (40, "incomplete"),
    ]
    assert [s.step for s in steps if s.latest] == [30]
    s10 = steps[0]
    data = (FILE0, "shards/rank-00001.safetensors")  # and their chunk-CRC sidecars
    expected = sum(
        root.size(f"{step_dir(10)}/{k}")
        for k in (*data, *(f + ".crc32c" for f in data), MANIFEST_NAME)
    )
    assert (s10.nbytes, s10.num_files, s10.layout) == (expected, 5, "pp1·dpr1·dps2·tp1")
    assert steps[-1].layout == "" and steps[-1].num_files == 4 and steps[-1].nbytes > 0
    assert "not valid JSON" in steps[2].error
    assert all(s.mtime is not None for s in steps)


def test_retention_keep_last(root) -> None:
    for step in range(1, 6):
        make_checkpoint(root, step)
    assert gc(root, keep_last=2, now=FAR_FUTURE) == [1, 2, 3]
    assert all_steps(root) == [4, 5]
    assert find_latest_committed(root) == 5


def test_retention_keep_every(root) -> None:
    for step in range(1, 8):
        make_checkpoint(root, step)
    assert gc(root, keep_last=1, keep_every=3, now=FAR_FUTURE) == [1, 2, 4, 5]
    assert all_steps(root) == [3, 6, 7]


def test_keep_every_alone_keeps_newest(root) -> None:
    for step in (2, 4, 5):
        make_checkpoint(root, step)
    assert gc(root, keep_every=4, now=FAR_FUTURE) == [2]
    assert all_steps(root) == [4, 5]


def test_no_retention_deletes_only_incomplete(root) -> None:
    for step in (1, 2, 3):
        make_checkpoint(root, step)
    build_manifest(root, 0)  # step 0 incomplete, older
    assert gc(root, now=FAR_FUTURE) == [0]
    assert all_steps(root) == [1, 2, 3]


def test_never_deletes_newest_committed(root) -> None:
    make_checkpoint(root, 7)
    assert gc(root, keep_last=1, keep_every=1000, now=FAR_FUTURE) == []
    assert committed_steps(root) == [7]


def test_incomplete_steps(root) -> None:
    """Older incomplete steps go; newer ones (a save in progress) and recent ones stay."""
    make_checkpoint(root, 5)
    build_manifest(root, 3)  # crashed save, older than the newest committed
    build_manifest(root, 9)  # maybe being written right now
    decisions = {d.step: d for d in plan_gc(root, now=FAR_FUTURE)}
    assert {s: d.delete for s, d in decisions.items()} == {3: True, 5: False, 9: False}
    assert "save in progress" in decisions[9].reason
    recent = {d.step: d for d in plan_gc(root, now=time.time() + 1, grace_seconds=600)}
    assert not recent[3].delete and "grace" in recent[3].reason
    assert gc(root, now=FAR_FUTURE, grace_seconds=0) == [3]
    assert all_steps(root) == [5, 9]


def test_incomplete_without_any_commit_is_kept(root) -> None:
    build_manifest(root, 1)
    assert gc(root, keep_last=1, now=FAR_FUTURE) == []
    assert all_steps(root) == [1]


def test_dry_run_deletes_nothing(root) -> None:
    for step in (1, 2, 3):
        make_checkpoint(root, step)
    assert gc(root, keep_last=1, dry_run=True, now=FAR_FUTURE) == [1, 2]
    assert committed_steps(root) == [1, 2, 3]


def test_committed_step_deleted_manifest_first() -> None:
    root = memory_root()
    make_checkpoint(root, 1)
    deleted: list[tuple[str, bool]] = []
    original = root.delete

    def recording(key: str, recursive: bool = False) -> None:
        deleted.append((key, recursive))
        original(key, recursive)

    root.delete = recording  # type: ignore[method-assign]
    delete_step(root, step_dir(1))
    assert deleted[0] == (f"{step_dir(1)}/{MANIFEST_NAME}", False)
    assert all_steps(root) == []


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": 0}, {"grace_seconds": -1}])
def test_bad_arguments(kwargs) -> None:
    root = memory_root()
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        gc(root, **kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        gc_after_commit(root, **kwargs)


def test_gc_after_commit(caplog) -> None:
    root = memory_root()
    for step in (1, 2, 3):
        make_checkpoint(root, step)
    assert gc_after_commit(root, keep_last=2) == [1]
    make_checkpoint(root, 4)

    def broken(key: str, recursive: bool = False) -> None:
        raise OSError("storage down")

    root.delete = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="shardsmith.storage.gc"):
        assert gc_after_commit(root, keep_last=2) == []
    assert "storage down" in caplog.text and "retry after the next commit" in caplog.text
    assert committed_steps(root) == [2, 3, 4]


# ---- CLI ----------------------------------------------------------------------------------


def test_cli_ls_and_gc(tmp_path) -> None:
    from shardsmith.cli.main import cli

    root = Store(str(tmp_path / "ckpt"))
    for step in (1, 2, 3):
        make_checkpoint(root, step)
    build_manifest(root, 4)
    runner = CliRunner()
    out = runner.invoke(cli, ["ls", root.url])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert (
        lines[3].startswith("*") and "3  committed" in lines[3] and "pp1·dpr1·dps2·tp1" in lines[3]
    )
    assert "4  incomplete" in lines[4]
    listed = json.loads(runner.invoke(cli, ["ls", "--json", root.url]).output)
    assert [(s["step"], s["status"], s["latest"]) for s in listed["steps"]] == [
        (1, "committed", False),
        (2, "committed", False),
        (3, "committed", True),
        (4, "incomplete", False),
    ]
    dry = runner.invoke(cli, ["gc", root.url, "--keep-last", "1", "--dry-run"])
    assert dry.exit_code == 0 and "would delete 2 of 4 steps" in dry.output, dry.output
    assert all_steps(root) == [1, 2, 3, 4]
    done = runner.invoke(cli, ["gc", root.url, "--keep-last", "2", "--grace-seconds", "0"])
    assert done.exit_code == 0 and "deleted 1 of 4 steps" in done.output, done.output
    assert all_steps(root) == [2, 3, 4]  # step 4 is newer than every commit: kept
    bad = runner.invoke(cli, ["gc", root.url, "--keep-last", "0"])
    assert bad.exit_code == 2
