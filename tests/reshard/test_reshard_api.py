"""The library's ``reshard()`` owns the orchestration and ``shardsmith reshard`` only maps flags onto
it: the same refusals either way (a model record that contradicts its tensors, DST the source's
root), verify in the library, and a scale-out worker that dies is named, not waited for."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from ckpt_factory import RESHARD_SRC_DIMS, RESHARD_STEP, full_state, save_direct
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.errors import CheckpointError, CheckpointMismatch, ConfigError
from shardsmith.layout import ParallelDims
from shardsmith.reshard.api import prepare, reshard
from shardsmith.reshard.planner import ReshardOptions
from shardsmith.reshard.scaleout import Share, gather, publish_for_dead
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.manifest.records import MANIFEST_NAME
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.store.fs import Store

LYING = "the manifest's model record contradicts its tensors"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A committed tp2·pp2 checkpoint; its root."""
    root = Store(str(tmp_path_factory.mktemp("src")))
    save_direct(root, full_state(), RESHARD_SRC_DIMS)
    return root


def _lying_copy(source: Store, tmp_path: Path) -> Store:
    """A copy of ``source`` whose manifest's model record claims one layer fewer than its tensors
    hold (the command used to reshard it, silently dropping the last layer as "optimizer state")."""
    root = Store(str(tmp_path / "lying"))
    src_step, dst_step = source.child(step_dir(RESHARD_STEP)), root.child(step_dir(RESHARD_STEP))
    for name in src_step.list_dir("shards"):
        dst_step.write(f"shards/{name}", src_step.read(f"shards/{name}"))
    manifest = read_manifest(src_step)
    manifest.model["num_layers"] -= 1
    dst_step.write(MANIFEST_NAME, dumps_manifest(manifest))
    return root


def test_a_lying_model_record_is_refused_by_the_library_and_the_command_alike(
    source, tmp_path
) -> None:
    lying = _lying_copy(source, tmp_path)
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointMismatch, match=LYING):
        reshard(lying.child(step_dir(RESHARD_STEP)), out, ParallelDims(dp_shard=4))
    with pytest.raises(CheckpointMismatch, match=LYING):
        reshard(lying.url, out, ParallelDims(dp_shard=4), tensor_format="zarr")
    for extra in ([], ["--format", "zarr"], ["--dry-run"], ["--nproc-per-node", "2"]):
        result = CliRunner().invoke(cli, ["reshard", lying.url, out, "--dp-shard", "4", *extra])
        assert result.exit_code == 1 and LYING in result.output, (extra, result.output)
    assert not Path(out).exists()  # refused before a byte is written


def test_the_library_refuses_the_source_root_and_verifies(source, tmp_path) -> None:
    with pytest.raises(ConfigError, match="is the source's own checkpoint root"):
        prepare(source.url, source.url, ParallelDims(dp_shard=4))
    with pytest.raises(ConfigError, match="--zarr-codec needs --format zarr"):
        prepare(source.url, str(tmp_path / "x"), ParallelDims(dp_shard=4), codec="zstd")
    seen: list[str] = []
    report = reshard(
        source.url,
        str(tmp_path / "out"),
        ParallelDims(tp=2),
        options=ReshardOptions(workers=2),
        verify=True,
        on_tensor=lambda fqn, found: seen.append(fqn),
    )
    assert (
        report.committed and report.verified.equal and report.verified.num_compared == len(seen) > 0
    )
    assert report.verified.state_keys  # a reshard records its parent


class _Exited:
    """A worker process that has already exited with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


def test_a_worker_that_dies_without_publishing_is_named(source, tmp_path) -> None:
    job = prepare(source.url, str(tmp_path / "out"), ParallelDims(dp_shard=2))
    assert job.plan is not None
    share = Share(rank=0, world_size=3, attempt="a1")
    dst = job.dst_root.child(step_dir(RESHARD_STEP))
    stop = threading.Event()
    publish_for_dead(
        {1: _Exited(-9), 2: _Exited(0)}, dst, share, job.plan.plan_id, stop, poll_s=0.0
    )  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="rank 1 failed: the process exited with code -9"):
        gather(dst, share, job.plan, timeout_s=60.0)


# ---- the default worker count --------------------------------------------------------------


@pytest.mark.parametrize(
    "cores, local, processes, want",
    [
        (2, True, 1, 2),
        (1, True, 1, 1),
        (2, False, 1, 4),
        (1, False, 1, 4),  # a small VM
        (96, True, 1, 16),
        (96, False, 1, 16),  # a GPU node: capped
        (12, True, 1, 12),
        (12, False, 1, 16),
        (6, False, 1, 12),
        (96, True, 8, 12),
        (96, False, 8, 16),
        (16, True, 8, 2),
        (16, False, 8, 4),  # processes share the cores
        (4, True, 8, 1),
    ],
)
def test_default_workers_come_from_cores_storage_and_processes(
    cores, local, processes, want
) -> None:
    from shardsmith.reshard.planner import MAX_AUTO_WORKERS, default_workers

    assert MAX_AUTO_WORKERS == 16
    assert default_workers(cores, local, processes) == want


def test_workers_given_override_the_default(source, tmp_path, monkeypatch) -> None:
    import shardsmith.reshard.planner as planner

    monkeypatch.setattr(planner, "usable_cores", lambda: 96)
    assert (
        ReshardOptions().threads(local=True) == 16 and ReshardOptions().threads(local=False) == 16
    )
    assert (
        ReshardOptions(workers=3).threads(local=False)
        == 3
        == ReshardOptions(workers=3).threads(local=True)
    )
    assert ReshardOptions(workers=200).threads(local=True) == 96  # local: at most one per core
    assert ReshardOptions().threads(local=True, processes=8) == 12
    with pytest.raises(ConfigError, match="workers=-1"):
        ReshardOptions(workers=-1)
    out = str(tmp_path / "out")
    auto = CliRunner().invoke(cli, ["reshard", source.url, out, "--dp-shard", "4", "--dry-run"])
    given = CliRunner().invoke(
        cli, ["reshard", source.url, out, "--dp-shard", "4", "--dry-run", "--workers", "3"]
    )
    assert auto.exit_code == 0 and given.exit_code == 0, auto.output + given.output
    assert "slabs, 16 workers)" in auto.output and "slabs, 3 workers)" in given.output
    help_text = CliRunner().invoke(cli, ["reshard", "--help"]).output
    assert "default: auto" in help_text


def test_a_safetensors_reshard_imports_no_torch() -> None:
    """The streaming path needs no torch (seconds of start-up in every scale-out worker):
    format conversion, ``--dtype`` and verify import it when they run."""
    import subprocess
    import sys

    code = (
        "import sys, shardsmith.reshard.api, shardsmith.cli.reshard_commands\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
