"""A resume does exactly what was asked, or says why not, before a worker starts (issue 29),
without processes: the launcher's resolution of the step (relative paths, an older step of
the job's own root, corrupt-marked steps), data and batch changes, dtypes, the agreed read
failure, the "go on with" command, and torch-free ``--help`` and layout errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_factory import flip_byte, full_tensors, save_offline
from click.testing import CliRunner
from conftest import TINY_MODEL, tiny_train_config

from shardsmith.cli.main import cli
from shardsmith.errors import (
    CheckpointError,
    CheckpointMismatch,
    CheckpointNotFound,
    ConfigError,
    IntegrityError,
)
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import commit, read_manifest, step_dir
from shardsmith.storage.gc import describe_steps
from shardsmith.storage.lineage import CORRUPT_NAME, corrupt_mark, loadable_steps, mark_corrupt
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint.resume import COMMAND_ENV, command_with, way_forward
from shardsmith.trainer.checkpoint.run_checks import resume_changes
from shardsmith.trainer.checkpoint.save_load import raise_agreed
from shardsmith.trainer.observe.console import event_line
from shardsmith.trainer.observe.metrics import EventLog, MetricsWriter, iter_json_lines
from shardsmith.trainer.runtime.preflight import resolve

RUN = "a" * 32


def _root(path: Path, steps=(2, 4), *, config: dict | None = None) -> Store:
    """Committed steps of TINY_MODEL (optimizer state included) of run ``RUN``."""
    root = Store(str(path))
    for step in steps:
        manifest = save_offline(
            root,
            step,
            ParallelDims(),
            full_tensors(TINY_MODEL, step, with_optimizer=True),
            TINY_MODEL,
        )
        state = {
            **manifest.state,
            "run": {"id": RUN, "seed": 1, "parent": None, "events": []},
            "data": {"sample_index": 8 * step},
        }
        commit(root, dataclasses.replace(manifest, state=state, config=config or manifest.config))
    return root


def _cfg(url: str, data: str = "data.txt", **ckpt) -> object:
    cfg = tiny_train_config(ParallelDims(), data)
    return dataclasses.replace(
        cfg, steps=10, checkpoint=dataclasses.replace(cfg.checkpoint, url=url, **ckpt)
    )


def test_an_older_step_of_the_jobs_own_root_given_relatively_resolves_to_exactly_that_step(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cfg0 = _cfg("r")
    _root(tmp_path / "r", config=cfg0.to_json())
    cfg, found = resolve(_cfg("r", resume="r/./step-000000002/"))
    assert found.resume_step == 2
    assert cfg.checkpoint.resume_step == str(
        tmp_path / "r" / "step-000000002"
    )  # absolute, normalized
    cfg, found = resolve(_cfg(str(tmp_path / "r"), resume="r/step-000000002"))  # mixed spellings
    assert found.resume_step == 2 and found.notes == []
    cfg, found = resolve(_cfg("r"))  # auto: the newest
    assert found.resume_step == 4 and cfg.checkpoint.resume_step.endswith("r/step-000000004")
    assert "resume_step" not in cfg.to_json()["checkpoint"]  # never in a manifest
    cfg, found = resolve(_cfg(str(tmp_path / "new")))
    assert found.resume_step is None and cfg.checkpoint.resume_step == ""  # resolved: nothing


def test_a_corrupt_mark_is_listed_skipped_by_auto_and_named_by_an_explicit_resume(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    root = _root(tmp_path / "r", config=_cfg("r").to_json())
    mark_corrupt(
        root.child(step_dir(4)),
        step=4,
        error="rank-00000.safetensors: checksum mismatch",
        found_by="resume",
    )
    assert corrupt_mark(root.child(step_dir(4)))["found_by"] == "resume"
    assert loadable_steps(root, {RUN}) == [2] and loadable_steps(root, None, below=2) == []
    steps = {s.step: s for s in describe_steps(root)}
    assert (
        steps[4].status == "corrupt" and "checksum mismatch" in steps[4].error and steps[2].latest
    )
    out = CliRunner().invoke(cli, ["ls", "r"]).output
    assert "corrupt" in out and "checksum mismatch" in out
    cfg, found = resolve(_cfg("r"))
    assert (
        found.resume_step == 2
        and "skipping" in found.notes[0]
        and "step-000000004" in found.notes[0]
    )
    cfg, found = resolve(_cfg("r", resume="r/step-000000004"))  # explicit: as asked
    assert found.resume_step == 4 and "marked corrupt" in found.notes[0]
    mark_corrupt(root.child(step_dir(2)), step=2, error="x", found_by="resume")
    with pytest.raises(CheckpointNotFound, match="every committed step .* is marked corrupt"):
        resolve(_cfg("r"))
    (tmp_path / "r" / step_dir(4) / CORRUPT_NAME).unlink()  # restored: loadable again
    assert resolve(_cfg("r"))[1].resume_step == 4


def test_the_way_forward_names_the_users_own_command_with_the_older_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(
        COMMAND_ENV,
        json.dumps(
            ["shardsmith", "train", "--tp", "2", "--resume", "c/step-000000004", "--ckpt", "c2"]
        ),
    )
    assert (
        command_with("--resume", "c/step-000000002")
        == "shardsmith train --tp 2 --ckpt c2 --resume c/step-000000002"
    )
    monkeypatch.setenv(COMMAND_ENV, json.dumps(["shardsmith", "train", "--load=x"]))
    assert command_with("--resume", "y") == "shardsmith train --resume y"
    older = (Store(str(tmp_path / "c" / "step-000000002")), 2)
    msg = way_forward(
        "f.safetensors: checksum mismatch", str(tmp_path / "c" / "step-000000004"), older
    )
    assert "c/step-000000004 is now marked corrupt" in msg and msg.endswith(
        "--resume c/step-000000002"
    )
    assert "restore its files" in way_forward("bad", str(tmp_path / "c" / "step-000000004"), None)
    line = event_line(
        {
            "event": "corrupt_step",
            "step": 4,
            "url": str(tmp_path / "c" / "step-000000004"),
            "error": "f.safetensors: checksum mismatch",
            "fallback_step": 2,
        }
    )
    assert (
        line.startswith("warning: step 4 (c/step-000000004) is corrupt: f.safetensors")
        and "loading step 2" in line
    )
    assert (
        event_line(
            {"event": "corrupt_step", "step": 4, "url": "u", "error": "e", "fallback_step": None}
        )
        == ""
    )


def test_a_read_failure_on_any_rank_raises_the_same_error_on_every_rank():
    raise_agreed(["", ""])
    with pytest.raises(IntegrityError, match="^f: checksum$"):
        raise_agreed(["Cno route", "", "If: checksum"])  # integrity wins: all can fall back
    with pytest.raises(CheckpointError, match="rank 1: no route"):
        raise_agreed(["", "Cno route"])


def test_a_data_change_is_refused_before_workers_unless_said_and_a_batch_change_is_reported(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    _root(tmp_path / "r", config=_cfg("r").to_json())
    with pytest.raises(ConfigError) as exc:
        resolve(_cfg("r", data="other.txt"))
    msg = str(exc.value)
    assert (
        "--data data.txt" in msg and "--data other.txt" in msg and "global sample index 32" in msg
    )
    assert (
        "--data-change continue" in msg
        and "--data-change restart" in msg
        and "r/step-000000004" in msg
    )
    for how, index in (("continue", 32), ("restart", 0)):
        cfg, _ = resolve(_cfg("r", data="other.txt", data_change=how))
        manifest = read_manifest(Store(cfg.checkpoint.resume_step))
        changes = resume_changes(manifest, cfg, "u", 4, 32)
        assert changes == [
            {
                "event": "data_change",
                "step": 4,
                "how": how,
                "from": "--data data.txt",
                "to": "--data other.txt",
                "saved_sample_index": 32,
                "sample_index": index,
            }
        ]
    bigger = dataclasses.replace(_cfg("r"), global_batch_size=16)
    assert resume_changes(manifest, bigger, "u", 4, 32) == [
        {"event": "batch_change", "step": 4, "from": 8, "to": 16, "sample_index": 32}
    ]
    assert "8 -> 16 samples" in event_line(resume_changes(manifest, bigger, "u", 4, 32)[0])
    assert resume_changes(manifest, _cfg("r"), "u", 4, 32) == []
    with pytest.raises(ConfigError, match="checkpoint.data_change='sideways'"):
        _cfg("r", data_change="sideways")


def test_a_resume_refuses_other_weight_dtypes_before_workers_and_init_from_accepts_them(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    from shardsmith.reshard.api import reshard
    from shardsmith.reshard.planner import ReshardOptions

    src = _root(tmp_path / "r", steps=(4,), config=_cfg("r").to_json())
    reshard(
        src.child(step_dir(4)),
        "b/step-000000004",
        ParallelDims(),
        options=ReshardOptions(dtype="BF16", model_only=True),
    )
    with pytest.raises(CheckpointMismatch) as exc:
        resolve(_cfg("n", resume="b/step-000000004"))
    assert "BF16 weights" in str(
        exc.value
    ) and "shardsmith reshard b/step-000000004 NEW_DIR --dtype f32" in str(exc.value)
    assert "(then --resume NEW_DIR --reset-optimizer)" in str(exc.value)  # a model-only copy
    assert not (tmp_path / "n").exists()  # the refused job's new root is not left behind
    reshard(  # the advice, followed, resumes: no second refusal
        src.child(step_dir(4)),
        "f/step-000000004",
        ParallelDims(),
        options=ReshardOptions(dtype="F32", model_only=True),
    )
    _, found = resolve(_cfg("n", resume="f/step-000000004", reset_optimizer=True))
    assert found.resume_step == 4
    cfg, found = resolve(_cfg("n", init_from="b"))
    assert (
        cfg.checkpoint.init_from == str(tmp_path / "b" / "step-000000004")
        and found.resume_step is None
    )
    assert "BF16 upcast to F32, exact" in event_line(
        {
            "event": "init_from",
            "from": "b",
            "source_step": 4,
            "saved_layout": None,
            "upcast_from": ["BF16"],
        }
    )


def test_a_lying_model_record_is_named_before_another_shape(tmp_path, monkeypatch):
    from shardsmith.storage.manifest.records import MANIFEST_NAME
    from shardsmith.storage.manifest.v2 import dumps_manifest

    monkeypatch.chdir(tmp_path)
    root = _root(tmp_path / "r", steps=(4,), config=_cfg("r").to_json())
    step = root.child(step_dir(4))
    manifest = read_manifest(step)
    manifest.model["ffn_hidden_size"] *= 2  # the record lies; the tensors and the job agree
    step.write(MANIFEST_NAME, dumps_manifest(manifest))
    for how in ({"resume": "r/step-000000004"}, {"init_from": "r/step-000000004"}):
        with pytest.raises(CheckpointMismatch) as exc:
            resolve(_cfg("n", **how))
        message = str(exc.value)
        assert "model record contradicts its tensors" in message and "ffn_hidden_size=" in message
        assert "another shape" not in message, message


#: Every command's --help, then a layout error, in one fresh interpreter; torch must stay out.
_NO_TORCH = """
import sys
from click.testing import CliRunner
from shardsmith.cli.main import cli
runner = CliRunner()
names = sorted(cli.commands)
for name in [None, *names]:
    result = runner.invoke(cli, ([name] if name else []) + ["--help"])
    assert result.exit_code == 0, (name, result.output)
assert "torch" not in sys.modules, "--help imported torch"
result = runner.invoke(cli, ["train", "--nproc-per-node", "3", "--tp", "3", "--num-attention-heads", "4",
                             "--num-kv-heads", "2", "--hidden-size", "64", "--ckpt", "x"])
assert result.exit_code == 1 and "tp=3 does not divide num_attention_heads=4" in result.output, result.output
assert "torch" not in sys.modules, "a layout error imported torch"
print(len(names))
"""


def test_help_of_every_command_and_a_layout_error_never_import_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) >= 15  # every command was asked


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    from conftest import TINY_TRAIN_FLAGS

    cmd = [sys.executable, "-m", "shardsmith", "train", *TINY_TRAIN_FLAGS, *args]
    return subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _events(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == kind]


@pytest.mark.distributed
@pytest.mark.slow
def test_launched_jobs_load_exactly_the_step_asked_and_fall_back_only_from_auto(
    tmp_path, data_path
):
    """Items 1, 2, 3, 4, 6 through `shardsmith train --nproc-per-node` with relative paths."""
    two = ["--nproc-per-node", "2", "--dp-shard", "2", "--data", data_path]
    first = _train(tmp_path, *two, "--steps", "4", "--save-interval", "2", "--ckpt", "r")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train(
        tmp_path,
        *two,
        "--steps",
        "5",
        "--save-interval",
        "100",
        "--ckpt",
        "r",
        "--resume",
        "r/step-000000002",
    )
    assert again.returncode == 0 and "resumed step 2 " in again.stderr + again.stdout, again.stderr[
        -3000:
    ]
    losses = [
        (r["step"], r["loss"])
        for r in map(json.loads, (tmp_path / "r/metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert [loss for step, loss in losses if step == 3][0] == [
        loss for step, loss in losses if step == 3
    ][1]
    # A corrupt newest step: auto loads the run's previous step, says so, marks it; with a
    # batch change and a data change (restart) said on the command line.
    # Resuming step 2 of its own root left step 4 on an abandoned timeline (issue 42); the copy
    # below makes it eligible again (deleting the marker) to test the corrupt-step fallback.
    assert (tmp_path / "r/step-000000004/abandoned.json").exists()
    subprocess.run(["cp", "-r", "r", "c"], cwd=tmp_path, check=True)
    subprocess.run(["rm", "-rf", "c/step-000000005"], cwd=tmp_path, check=True)
    (tmp_path / "c/step-000000004/abandoned.json").unlink()
    shard = tmp_path / "c/step-000000004/shards/rank-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    (tmp_path / "other.txt").write_text("hello world\n" * 4000)
    fallback = _train(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--dp-shard",
        "2",
        "--data",
        "other.txt",
        "--data-change",
        "restart",
        "--global-batch-size",
        "16",
        "--steps",
        "5",
        "--ckpt",
        "c",
    )
    out = fallback.stderr + fallback.stdout
    assert fallback.returncode == 0, out[-3000:]
    assert (
        "resumed step 2 " in out
        and "step 4 (c/step-000000004) is corrupt" in out
        and "rank-00000" in out
    )
    metrics = tmp_path / "c/metrics.jsonl"
    assert _events(metrics, "corrupt_step")[-1]["fallback_step"] == 2
    assert _events(metrics, "batch_change")[-1] == {
        **_events(metrics, "batch_change")[-1],
        "from": 8,
        "to": 16,
    }
    assert _events(metrics, "data_change")[-1]["sample_index"] == 0
    assert (tmp_path / "c/step-000000004" / CORRUPT_NAME).exists()
    events = read_manifest(Store(str(tmp_path / "c/step-000000005"))).state["run"]["events"]
    assert [e["how"] for e in events if e["event"] == "data_change"] == ["restart"]
    # An explicit step never falls back; its error names the command that goes on.
    explicit = _train(
        tmp_path, *two, "--steps", "5", "--ckpt", "c2", "--resume", "c/step-000000004"
    )
    assert explicit.returncode != 0 and "resumed step" not in explicit.stderr
    assert "--ckpt c2 --resume c/step-000000002" in explicit.stderr, explicit.stderr[-3000:]
    # --init-from a bf16 copy upcasts (exact) and says so.
    bf16 = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "reshard",
            "r/step-000000004",
            "b/step-000000004",
            "--model-only",
            "--dtype",
            "bf16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert bf16.returncode == 0, bf16.stderr
    init = _train(
        tmp_path,
        "--nproc-per-node",
        "1",
        "--data",
        data_path,
        "--steps",
        "1",
        "--ckpt",
        "n",
        "--init-from",
        "b/step-000000004",
    )
    assert init.returncode == 0 and "BF16 upcast to F32, exact" in init.stderr + init.stdout, (
        init.stderr[-3000:]
    )


@pytest.mark.distributed
def test_a_refused_explicit_resume_of_a_corrupt_step_writes_no_metrics(tmp_path, data_path):
    """`train --resume r/step-000000004` of a step whose data fails its checksum (found while
    loading): the error names the way forward, the step is marked corrupt, and the run
    directory holds no metrics.jsonl: a refused start leaves no record of a run."""
    root = _root(tmp_path / "r", config=_cfg("r", data_path).to_json())
    flip_byte(root, f"{step_dir(4)}/shards/rank-00000.safetensors", -100, 0xFF)
    out = _train(
        tmp_path,
        *("--nproc-per-node", "1", "--data", data_path, "--steps", "6", "--ckpt", "r"),
        *("--resume", "r/step-000000004"),
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "checksum mismatch" in out.stderr and "go on from step 2 with: " in out.stderr
    assert (tmp_path / "r" / step_dir(4) / CORRUPT_NAME).exists()
    assert sorted(os.listdir(tmp_path / "r")) == ["latest", step_dir(2), step_dir(4)]


def test_records_held_back_reach_the_file_only_when_released(tmp_path) -> None:
    """EventLog.hold: records reach metrics.jsonl in order at release, and a close before it
    (the start of a job whose resume failed) writes nothing."""
    events = EventLog(MetricsWriter(str(tmp_path / "a"), tensorboard=False), rank=0)
    events.hold()
    events({"event": "start"})
    events({"event": "resume", "step": 4})
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    events.release()
    events({"step": 5, "loss": 1.0})
    events.close()
    records = list(iter_json_lines(str(tmp_path / "a" / "metrics.jsonl")))
    assert [r.get("event", r.get("step")) for r in records] == ["start", "resume", 5]
    refused = EventLog(MetricsWriter(str(tmp_path / "b"), tensorboard=False), rank=0)
    refused.hold()
    refused({"event": "start"})
    refused.close()
    assert os.listdir(tmp_path / "b") == []


@pytest.mark.parametrize("writer", ["tensorboard", "wandb"])
def test_a_refused_start_creates_no_tensorboard_or_wandb_files(tmp_path, monkeypatch, writer):
    """The TensorBoard and wandb writers are made at the first record that reaches the file:
    a start refused while its records are held back (a corrupt ``--resume`` step) leaves the
    run directory as it was; a run that starts gets them (``<run_dir>/<writer>``)."""
    pytest.importorskip(writer, reason=f"{writer} is not installed")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "r").mkdir()

    def events() -> EventLog:
        on = {"tensorboard": writer == "tensorboard", "wandb": writer == "wandb"}
        return EventLog(MetricsWriter(str(tmp_path / "r"), **on, config={"steps": 1}), rank=0)

    refused = events()
    refused.hold()
    refused({"event": "start"})
    refused.close()
    assert os.listdir(tmp_path / "r") == []
    started = events()
    started({"event": "start"})
    started({"step": 1, "loss": 1.0})
    started.close()
    assert sorted(os.listdir(tmp_path / "r")) == ["metrics.jsonl", writer]


def test_messages_name_the_nearest_valid_batch_sizes_and_every_manifest_version_read():
    from shardsmith.errors import ManifestError
    from shardsmith.storage.manifest.parse import parse_manifest
    from shardsmith.storage.manifest.records import FORMAT_NAME
    from shardsmith.trainer.config import TrainConfig

    with pytest.raises(
        ConfigError, match=r"x dp=128 = 128; the nearest valid sizes are \[128, 256\]"
    ):
        TrainConfig(
            parallel=ParallelDims(dp_shard=128), global_batch_size=8, micro_batch_size=1
        ).num_microbatches()
    with pytest.raises(ConfigError, match=r"the nearest valid sizes are \[88, 96, 104\]"):
        TrainConfig(
            parallel=ParallelDims(dp_shard=8), global_batch_size=100, micro_batch_size=1
        ).num_microbatches()
    for version in (1, 3):  # a v1-shaped document of an unknown version, and a newer one
        raw = json.dumps(
            {"format": FORMAT_NAME, "version": version + 10, "tensors": {}, "files": {}}
        ).encode()
        with pytest.raises(ManifestError, match=r"reads versions \[1, 2, 3\]"):
            parse_manifest(raw, "m.json")


def test_leftovers_a_decimal_storage_option_is_a_number_and_plot_writes_0644(tmp_path):
    from shardsmith.storage.store.options import parse_storage_options

    assert parse_storage_options(["connect_timeout=2.5", "retries=3", "region=eu-1", "x=inf"]) == {
        "connect_timeout": 2.5,
        "retries": 3,
        "region": "eu-1",
        "x": "inf",
    }
    pytest.importorskip("matplotlib")
    from shardsmith.trainer.observe.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    for r in ({"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}):
        writer.write(r)
    old = os.umask(0o022)
    try:
        assert CliRunner().invoke(cli, ["plot", str(tmp_path)]).exit_code == 0
    finally:
        os.umask(old)
    assert (tmp_path / "loss.png").stat().st_mode & 0o777 == 0o644
