"""Run checks: refuse, never guess, without processes: run lineages, mixed roots, the model
record against its tensors, load checks, interrupted exports, ``ls``/``gc`` edge cases."""

from __future__ import annotations

import dataclasses

import pytest
from ckpt_factory import MODEL, full_tensors, save_offline
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.errors import CheckpointMismatch
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import (
    LATEST_NAME,
    commit,
    find_latest_committed,
    read_manifest,
    step_dir,
)
from shardsmith.storage.gc import describe_steps, plan_gc
from shardsmith.storage.lineage import check_new_run_root, current_run, remove_runs_except
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint
from shardsmith.trainer.checkpoint.run_checks import check_before_load
from shardsmith.trainer.config import CheckpointConfig, TrainConfig
from shardsmith.trainer.runtime.preflight import preflight

DIMS = ParallelDims()


def _step(root: Store, step: int, run: str | None, *, optim: bool = True, model=MODEL) -> None:
    """Commit a model-shaped step written by run ``run`` (None: an old checkpoint, no run id)."""
    manifest = save_offline(
        root, step, DIMS, full_tensors(model, step, with_optimizer=optim), model
    )
    if run is not None:
        manifest.state = {
            **manifest.state,
            "run": {"id": run, "seed": 1, "parent": None, "events": []},
        }
        commit(root, manifest)  # rewrite the manifest with the run record


def _cfg(root: str, model=MODEL, **ckpt) -> TrainConfig:
    return TrainConfig(
        model=model,
        parallel=DIMS,
        checkpoint=CheckpointConfig(url=root, **ckpt),
        global_batch_size=2,
        micro_batch_size=1,
    )


def test_new_run_into_another_runs_root_is_refused(tmp_path):
    root = Store(str(tmp_path / "r"))
    check_new_run_root(root, "none", False)  # empty root: fine
    _step(root, 4, "a" * 32)
    _step(root, 8, "a" * 32)
    with pytest.raises(CheckpointMismatch) as exc:
        check_new_run_root(root, "none", False)
    msg = str(exc.value)
    assert root.url in msg and "4, 8" in msg and "run aaaaaaaaaaaa" in msg
    assert "--resume auto" in msg and "--overwrite" in msg and "\n" not in msg
    check_new_run_root(root, "auto", False)  # continues that run
    check_new_run_root(root, "none", True)  # --overwrite
    check_new_run_root(root, "none", False, restarts=1)  # an elastic restart continues
    with pytest.raises(CheckpointMismatch, match="--overwrite"):
        preflight(_cfg(root.url, resume="none"))
    assert remove_runs_except(root, None) == [4, 8]
    assert describe_steps(root) == [] and not root.exists(LATEST_NAME)


def test_latest_and_retention_act_on_one_lineage(tmp_path):
    root = Store(str(tmp_path / "r"))
    old, new = "0" * 32, "1" * 32
    _step(root, 8, old)
    _step(root, 12, old)
    _step(root, 4, new)  # the running job: lower step numbers than the old run
    assert root.read(LATEST_NAME).decode().strip() == step_dir(4), (
        "latest stayed on another run's step"
    )
    assert current_run(root) == new
    assert find_latest_committed(root) == 4
    assert find_latest_committed(root, {old}) == 12
    decisions = {d.step: d for d in plan_gc(root, keep_last=1, runs={new})}
    assert not any(d.delete for d in decisions.values()), decisions
    assert "another run" in decisions[12].reason
    _step(root, 6, new)
    assert [d.step for d in plan_gc(root, keep_last=1) if d.delete] == [
        4
    ]  # runs=None: latest's run
    assert [s.run_id for s in describe_steps(root)] == [new, new, old, old]


def test_unnamed_old_checkpoints_are_one_lineage(tmp_path):
    root = Store(str(tmp_path / "r"))
    _step(root, 2, None)
    _step(root, 4, None)
    assert current_run(root) == ""
    assert [d.step for d in plan_gc(root, keep_last=1) if d.delete] == [2]
    assert find_latest_committed(root, {""}) == 4


def test_load_checks_name_the_difference(tmp_path):
    root = Store(str(tmp_path / "r"))
    _step(root, 8, "a" * 32)
    manifest = read_manifest(root.child(step_dir(8)))
    fewer = dataclasses.replace(MODEL, num_layers=1)
    with pytest.raises(CheckpointMismatch, match=r"num_layers: checkpoint 2, this job 1"):
        check_before_load(manifest, _cfg(root.url, fewer), "X", resume=True)
    with pytest.raises(CheckpointMismatch, match="tie_embeddings"):
        check_before_load(
            manifest,
            _cfg(root.url, dataclasses.replace(MODEL, tie_embeddings=True)),
            "X",
            resume=False,
        )
    longer = dataclasses.replace(MODEL, seq_length=MODEL.seq_length * 2)
    assert "seq_length" in check_before_load(manifest, _cfg(root.url, longer), "X", resume=True)[0]
    with pytest.raises(CheckpointMismatch, match="num_layers"):
        preflight(_cfg("", fewer, resume=root.url))  # before any worker starts


def test_resume_without_optimizer_state_is_refused(tmp_path):
    root = Store(str(tmp_path / "r"))
    _step(root, 4, "a" * 32, optim=False)
    manifest = read_manifest(root.child(step_dir(4)))
    with pytest.raises(CheckpointMismatch, match="--init-from.*--reset-optimizer"):
        check_before_load(manifest, _cfg(root.url), "X", resume=True)
    with pytest.raises(CheckpointMismatch, match="no optimizer state"):
        preflight(_cfg(root.url))
    assert check_before_load(manifest, _cfg(root.url), "X", resume=True, reset_optimizer=True) == []
    assert preflight(_cfg(root.url, reset_optimizer=True)).notes == []
    assert check_before_load(manifest, _cfg(root.url), "X", resume=False) == []  # --init-from


def test_verify_checks_the_model_record_against_the_tensors(tmp_path):
    root = Store(str(tmp_path / "r"))
    _step(root, 4, None)
    step = root.child(step_dir(4))
    assert verify_checkpoint(step).ok
    saved = read_manifest(step)
    saved.model["vocab_size"] = 10**12
    step.write("manifest.json", dumps_manifest(saved))
    report = verify_checkpoint(step)
    assert not report.ok
    assert any(
        "vocab_size=1000000000000" in p.what and "tok_embeddings" in p.what for p in report.problems
    ), report.problems
    result = CliRunner().invoke(cli, ["verify", step.url])
    assert result.exit_code == 1 and "vocab_size" in result.output
    result = CliRunner().invoke(cli, ["reshard", step.url, str(tmp_path / "out"), "--tp", "1"])
    assert result.exit_code != 0 and "1000000000000" in result.output


def test_ls_and_gc_of_a_missing_root_fail_with_one_line(tmp_path):
    for args in (["ls", str(tmp_path / "nope")], ["gc", str(tmp_path / "nope")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code != 0, args
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and "does not exist" in lines[0], result.output


def test_ls_shows_the_run_id(tmp_path):
    root = Store(str(tmp_path / "r"))
    _step(root, 4, "ab" * 16)
    result = CliRunner().invoke(cli, ["ls", root.url])
    assert result.exit_code == 0 and "abababababab" in result.output, result.output


def test_interrupted_hf_export_does_not_block_the_next(tmp_path):
    from shardsmith.reshard.foreign.hf_io import export_hf

    root = Store(str(tmp_path / "r"))
    _step(root, 4, None)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"\x00" * 10)  # what a killed export left
    report = export_hf(root.url, str(out))
    assert (out / "config.json").exists() and (
        out / "model.safetensors"
    ).stat().st_size == report.nbytes
    with pytest.raises(FileExistsError, match="already holds"):
        export_hf(root.url, str(out))  # a whole model is still refused
