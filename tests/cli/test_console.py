"""The console people read: preflight before workers, Ctrl-C, human console lines, plot.

Pure tests first; one tiny distributed test sends Ctrl-C to a real two-process job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_factory import RESHARD_SRC_DIMS as SRC_DIMS
from ckpt_factory import full_state, full_tensors, make_checkpoint, save_direct, save_offline
from click.testing import CliRunner
from conftest import TINY_MODEL, tiny_train_config

from shardsmith.errors import CheckpointMismatch, CheckpointNotFound
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import commit, list_steps, step_dir
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint.config import CheckpointConfig
from shardsmith.trainer.checkpoint.resume import schedule_change
from shardsmith.trainer.checkpoint.save_outcomes import retention_after_commit
from shardsmith.trainer.fault.preemption import PreemptionHandler
from shardsmith.trainer.observe.console import EtaClock, event_line, layout_name, step_line
from shardsmith.trainer.observe.metrics import EventLog, MetricsWriter, iter_json_lines
from shardsmith.trainer.runtime import launch as launcher
from shardsmith.trainer.runtime.preflight import preflight
from shardsmith.trainer.runtime.worker import report_error

RECORD = {
    "step": 41,
    "loss": 5.1234,
    "lr": 2.95e-4,
    "grad_norm": 1.234,
    "tokens_per_s": 12345.0,
    "seconds": 0.31,
    "skipped": False,
    "steps": 60,
    "tokens_seen": 1_300_000,
    "peak_mem_nbytes": 1_200_000_000,
    "mfu": 0.412,
    "eta_s": 372.0,
}


def test_step_line_carries_every_field() -> None:
    line = step_line(RECORD)
    assert line.startswith(
        "step 41/60  loss 5.1234  lr 2.95e-04  grad 1.234  12,345 tok/s  310 ms/step"
    )
    assert "  1.3M tok  mem 1.1 GiB  MFU 41.2%  ETA 6m12s" in line
    bad = step_line({**RECORD, "loss": None, "skipped": True, "step": 7})
    assert bad.startswith("step  7/60  loss nan") and bad.endswith("SKIPPED (non-finite)")


def test_eta_uses_the_median_step() -> None:
    clock = EtaClock(window=3)
    clock.eta_s(10.0, 5)  # the first step's start-up cost ...
    clock.eta_s(1.0, 4)
    assert clock.eta_s(1.0, 3) == 3.0  # ... does not skew the estimate


def test_events_are_human_lines_on_the_console_and_json_in_the_file(tmp_path: Path, caplog) -> None:
    events = EventLog(MetricsWriter(str(tmp_path), tensorboard=False), rank=0)
    resume = {
        "event": "resume",
        "reason": "resume",
        "step": 40,
        "from": "runs/a/step-000000040",
        "saved_layout": {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2},
        "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1},
        "resharded": True,
        "rng": {"x": list(range(600))},
        "seconds": 1.5,
        "nbytes_read": 3 << 20,
    }
    save = {
        "event": "save",
        "step": 40,
        "url": "runs/b/step-000000040",
        "nbytes": 600 << 20,
        "seconds": 1.0,
        "blocked_seconds": 0.31,
    }
    with caplog.at_level(logging.INFO, logger="shardsmith.trainer.observe.metrics"):
        events(resume)
        events(save)
        events({"event": "start", "restart_count": 0})
    assert caplog.messages == [
        "resumed step 40 from runs/a/step-000000040 (layout pp2·tp2 → dps2; 3.0 MiB read by all ranks in 1.5 s)",
        "saved step 40 → runs/b/step-000000040 (600.0 MiB, 0.3 s blocked)",
    ]
    assert [r["event"] for r in iter_json_lines(str(tmp_path / "metrics.jsonl"))] == [
        "resume",
        "save",
        "start",
    ]
    assert event_line({"event": "new_kind", "a": 1}) == "new_kind: a 1"
    hsdp = {
        **resume,
        "resharded": False,
        "layout": {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 1},
        "replicas_sharing_reads": 2,
    }
    assert event_line(hsdp) == (
        "resumed step 40 from runs/a/step-000000040 (layout dpr2·dps2; 3.0 MiB read by all "
        "ranks, tensors of 1 MiB or more read by 1 of 2 replicas in 1.5 s)"
    )
    tp = {
        **resume,
        "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 4},
        "tp_siblings_share_reads": True,
    }
    assert event_line(tp).endswith(
        "(layout pp2·tp2 → tp4; 3.0 MiB read by all ranks, "
        "chunks the TP group shares read once in 1.5 s)"
    )
    assert layout_name({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}) == "1 rank"


def test_a_restart_is_said_by_the_launcher_alone() -> None:
    """The launcher prints a restart's line (which attempt, which rank died and how); the
    restarted workers' ``start`` event adds no second line for the same restart."""
    dps4 = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    for restart in (0, 1, 3):
        record = {"event": "start", "restart_count": restart, "world_size": 4, "layout": dps4}
        assert event_line(record) == "", restart


def _checkpoint(tmp_path: Path, model: dict, config: dict) -> str:
    """A committed step 4 of TINY_MODEL's tensors (optimizer state included) with the model
    record ``model`` and the training config ``config``."""
    root = Store(str(tmp_path / "src"))
    manifest = save_offline(
        root, 4, ParallelDims(), full_tensors(TINY_MODEL, with_optimizer=True), TINY_MODEL
    )
    commit(root, dataclasses.replace(manifest, model=model, config=config))
    return str(tmp_path / "src")


def test_preflight_refuses_a_missing_file_or_mismatched_resume_source(tmp_path: Path) -> None:
    cfg = tiny_train_config(ParallelDims(dp_shard=2), "unused")
    ckpt = dataclasses.replace(cfg.checkpoint, url=str(tmp_path / "out"))
    with pytest.raises(CheckpointNotFound, match="--resume nope: .*nope does not exist"):
        preflight(dataclasses.replace(cfg, checkpoint=dataclasses.replace(ckpt, resume="nope")))
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(CheckpointNotFound, match="is a file, not a checkpoint directory"):
        preflight(
            dataclasses.replace(
                cfg, checkpoint=dataclasses.replace(ckpt, resume=str(tmp_path / "README.md"))
            )
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint"):
        preflight(
            dataclasses.replace(
                cfg, checkpoint=dataclasses.replace(ckpt, resume=str(tmp_path / "empty"))
            )
        )
    wider = {**dataclasses.asdict(TINY_MODEL), "hidden_size": 64}
    src = _checkpoint(tmp_path, wider, cfg.to_json())
    with pytest.raises(  # its record lies (its tensors are the job's shape): named as such
        CheckpointMismatch,
        match="model record contradicts .*hidden_size=64 where the tensor implies 32",
    ):
        preflight(dataclasses.replace(cfg, checkpoint=dataclasses.replace(ckpt, resume=src)))
    assert not (
        tmp_path / "out"
    ).exists()  # created to probe it, removed: a refused job leaves no trace


def test_preflight_finds_the_resume_step(tmp_path: Path) -> None:
    cfg = tiny_train_config(ParallelDims(dp_shard=2), "unused")
    src = _checkpoint(tmp_path, dataclasses.asdict(TINY_MODEL), cfg.to_json())
    found = preflight(
        dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, url=src))
    )
    assert (
        found.resume_step == 4 and found.resume_url.endswith("step-000000004") and found.notes == []
    )


def test_launch_checks_before_starting_workers_and_a_finished_run_starts_none(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(launcher, "run_agent", lambda *a, **k: pytest.fail("workers started"))
    cfg = tiny_train_config(ParallelDims(dp_shard=2), "unused")
    missing = dataclasses.replace(
        cfg.checkpoint, url=str(tmp_path / "out"), resume=str(tmp_path / "nope")
    )
    with pytest.raises(CheckpointNotFound):
        launcher.launch(dataclasses.replace(cfg, checkpoint=missing), 2)
    src = _checkpoint(tmp_path, dataclasses.asdict(TINY_MODEL), cfg.to_json())
    done = dataclasses.replace(
        cfg, steps=4, checkpoint=dataclasses.replace(cfg.checkpoint, url=src)
    )
    assert launcher.launch(done, 2) == 0


def test_retention_says_each_deleted_step_once_with_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--keep-last`` during training: one line per deleted step, its path as the root was
    given (relative here), and no second report of it (the log line with the absolute path
    gc used to add)."""
    monkeypatch.chdir(tmp_path)
    root = Store("r")
    for step in (1, 2, 3):
        make_checkpoint(root, step)
    events = EventLog(MetricsWriter("", tensorboard=False), rank=0)
    with caplog.at_level(logging.INFO):
        record = retention_after_commit(root, CheckpointConfig(url="r", keep_last=1), None)
        assert record is not None
        events(record)
    assert record["deleted_steps"] == [1, 2]
    assert "\n".join(caplog.messages).splitlines() == [
        "deleted r/step-000000001 (committed, outside the retention)",
        "deleted r/step-000000002 (committed, outside the retention)",
    ]
    assert [s.step for s in list_steps(root)] == [3]


def test_schedule_change_is_one_line_naming_the_fix() -> None:
    cfg = tiny_train_config(ParallelDims(), "unused")  # decay_steps 6
    saved = cfg.to_json()
    assert schedule_change(saved, cfg, 4) == ""
    longer = dataclasses.replace(cfg, steps=20, optim=dataclasses.replace(cfg.optim, decay_steps=0))
    saved_open = {**saved, "optim": {**saved["optim"], "decay_steps": 0}, "steps": 10}
    assert schedule_change(saved_open, longer, 10) == (
        "the LR schedule changes at the resume of step 10: decay ends at step 10 -> 20 "
        "(pass --lr-decay-steps 10 to keep it)"
    )
    assert (
        schedule_change(
            saved_open,
            dataclasses.replace(longer, optim=dataclasses.replace(cfg.optim, decay_steps=10)),
            10,
        )
        == ""
    )


def test_ctrl_c_checkpoints_and_a_second_one_exits_at_once() -> None:
    exits: list[int] = []
    now = [0.0]
    handler = PreemptionHandler(60.0, exit_fn=exits.append, clock=lambda: now[0])
    handler._handle(signal.SIGINT, None)
    assert handler.requested == signal.SIGINT and not exits
    now[0] = 0.2
    handler._handle(signal.SIGINT, None)  # the agent's forward of the same Ctrl-C
    assert not exits
    now[0] = 2.0
    handler._handle(signal.SIGINT, None)  # the user's second Ctrl-C
    assert exits == [130]
    handler.done()


def test_a_failure_is_reported_once_by_the_first_rank(tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "error.txt"
    monkeypatch.setenv(launcher.ERROR_FILE_ENV, str(path))
    report_error("rank 1: CheckpointNotFound: no committed checkpoint under x")
    report_error("rank 0: CheckpointNotFound: no committed checkpoint under x")
    assert path.read_text() == "rank 1: CheckpointNotFound: no committed checkpoint under x\n"
    assert capsys.readouterr().err == ""


def test_ls_and_gc_of_a_missing_root_fail(tmp_path: Path) -> None:
    from shardsmith.cli.main import cli

    for args in (
        ["ls", str(tmp_path / "nope")],
        ["gc", str(tmp_path / "nope"), "--keep-last", "1"],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and "no such checkpoint root" in result.output, args


def test_plot_draws_several_runs_as_one_curve(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shardsmith.cli.main import cli
    from shardsmith.trainer.observe.plot import loss_segments, read_runs

    first, second = tmp_path / "a", tmp_path / "b"
    for run, records in (
        (first, [{"step": 1, "loss": 3.0, "lr": 1e-3}, {"step": 2, "loss": 2.0, "lr": 2e-3}]),
        (
            second,
            [
                {"event": "resume", "reason": "resume", "step": 2, "resharded": True},
                {"step": 3, "loss": 1.9, "lr": 1.5e-3},
            ],
        ),
    ):
        writer = MetricsWriter(str(run), tensorboard=False)
        for r in records:
            writer.write(r)
    records = read_runs([str(first), str(second)])
    assert loss_segments(records) == [[(1, 3.0), (2, 2.0), (3, 1.9)]]
    assert loss_segments(records, "lr") == [[(1, 1e-3), (2, 2e-3), (3, 1.5e-3)]]
    result = CliRunner().invoke(
        cli, ["plot", str(first), str(second), "--out", str(tmp_path / "p.png")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "p.png"]  # no temporary left behind


def test_plot_legend_names_the_abandoned_timeline_of_a_rollback_in_the_same_root(
    tmp_path: Path,
) -> None:
    """Steps 1-8, then a resume of step 4 in the same root (its later steps abandoned) that
    trains 5-6, then a crash at 6 resumed from the checkpoint at 5: the legend says which
    curve is which, with their steps (each stretch has a colour of its own)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from shardsmith.trainer.observe.plot import draw_runs, read_runs, timelines

    run = tmp_path / "r"
    writer = MetricsWriter(str(run), tensorboard=False)
    for step in range(1, 9):
        writer.write({"step": step, "loss": 10.0 - step})
    writer.write({"event": "resume", "reason": "resume", "step": 4})
    writer.write({"event": "timeline", "resumed_step": 4, "abandoned_steps": [6, 8]})
    for step in (5, 6):
        writer.write({"step": step, "loss": 20.0 - step})
    writer.write({"event": "resume", "reason": "resume", "step": 5, "restart_count": 1})
    writer.write({"step": 6, "loss": 13.5})
    current, left = timelines(read_runs([str(run)]))
    assert current == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 15.0), (6, 13.5)]
    assert [(p.label, p.points) for p in left] == [
        ("abandoned timeline (steps 5-8)", [(4, 6.0), (5, 5.0), (6, 4.0), (7, 3.0), (8, 2.0)]),
        ("run again after a restart (step 6)", [(5, 15.0), (6, 14.0)]),
    ]
    fig = draw_runs([str(run)])
    try:
        legend = fig.axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()] == [
            "abandoned timeline (steps 5-8)",
            "run again after a restart (step 6)",
            "loss (current timeline)",
            "restart",
        ]
        assert len({h.get_color() for h in legend.legend_handles[:3]}) == 3
    finally:
        plt.close(fig)


@pytest.mark.distributed
def test_ctrl_c_saves_and_exits_130(tmp_path: Path, data_path: str) -> None:
    flags = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--ffn-hidden-size",
        "64",
        "--seq-length",
        "32",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--data",
        data_path,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "c.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardsmith",
                "train",
                "--nproc-per-node",
                "2",
                "--dp-shard",
                "2",
                *flags,
                "--steps",
                "500",
                "--ckpt",
                str(tmp_path / "c"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while (
        not re.search(r"step +3/500", log_path.read_text())
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, log_path.read_text()[-3000:]
    out = log_path.read_text()
    assert "Traceback" not in out and '{"time"' not in out, out
    assert "interrupted at step" in out and out.count("Ctrl-C: checkpointing") == 1, out
    committed = [p.name for p in (tmp_path / "c").iterdir() if (p / "manifest.json").exists()]
    assert committed, out


@pytest.mark.distributed
def test_second_ctrl_c_stops_workers_that_cannot_checkpoint(tmp_path: Path, data_path: str) -> None:
    """Rank 1 hangs inside step 3 (test hook; not yet a suspected hang) and rank 0 waits in
    a collective, so the first Ctrl-C's checkpoint cannot come. The second Ctrl-C interrupts
    the agent's wait; it stops the workers with SIGTERM, which they take as the second
    Ctrl-C: they exit at once, not at the --preempt-deadline. (``SHARDSMITH_DEBUG`` keeps
    the agent's log lines, which say when it forwards each signal.)"""
    flags = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--ffn-hidden-size",
        "64",
        "--seq-length",
        "32",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--data",
        data_path,
        "--hang-min-seconds",
        "600",
        "--preempt-deadline",
        "60",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "SHARDSMITH_TEST_HANG_AT": "1:3",
        "SHARDSMITH_DEBUG": "1",
    }
    log_path = tmp_path / "c.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardsmith",
                "train",
                "--nproc-per-node",
                "2",
                "--dp-shard",
                "2",
                *flags,
                "--steps",
                "500",
                "--ckpt",
                str(tmp_path / "c"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 120
        while (
            text not in log_path.read_text() and time.monotonic() < deadline and proc.poll() is None
        ):
            time.sleep(0.2)

    try:
        wait_for("test hook: hanging in step 3")
        os.killpg(proc.pid, signal.SIGINT)
        wait_for("closing signal SIGINT")  # the agent forwarded the first Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log_path.read_text()
    assert "closing signal SIGTERM" in out, out[-3000:]  # the second, forwarded
    assert "not committed within --preempt-deadline" not in out, out[-3000:]
    assert "interrupted again: stopped the workers without a checkpoint" in out, out[-3000:]
    assert not (tmp_path / "c" / "step-000000003").exists()


def test_rng_state_is_compact_and_the_old_form_still_loads() -> None:
    import json

    import torch

    from shardsmith.trainer.rng import capture_rng, restore_rng

    torch.manual_seed(3)
    state = capture_rng()
    assert isinstance(state["cpu"], str) and len(json.dumps(state)) < 7000
    first = torch.rand(4)
    restore_rng(state)
    assert torch.equal(torch.rand(4), first)
    restore_rng(
        {"cpu": torch.tensor(bytearray(__import__("base64").b64decode(state["cpu"]))).tolist()}
    )
    assert torch.equal(torch.rand(4), first)  # integer lists: checkpoints before this
    with pytest.raises(ValueError, match="expected base64 text or a byte list"):
        restore_rng({"cpu": 7})


def test_reshard_refuses_its_source_root_and_names_the_target_run(tmp_path: Path) -> None:
    import json

    from shardsmith.cli.main import cli
    from shardsmith.storage.manifest.records import MANIFEST_NAME

    root = Store(str(tmp_path / "src"))
    manifest = save_direct(root, full_state(), SRC_DIMS)
    from shardsmith.storage.commit import read_manifest

    step_store = root.child(step_dir(manifest.step))
    saved = read_manifest(step_store)
    saved.config["checkpoint"] = {"url": str(tmp_path / "src")}
    step_store.write(MANIFEST_NAME, dumps_manifest(saved))
    same = CliRunner().invoke(
        cli, ["reshard", str(tmp_path / "src"), str(tmp_path / "src"), "--dp-shard", "4"]
    )
    assert same.exit_code == 1 and "is the source's own checkpoint root" in same.output, same.output
    out = CliRunner().invoke(
        cli, ["reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--dp-shard", "4", "-q"]
    )
    assert out.exit_code == 0, out.output
    assert "resuming" not in out.output and "resharded step" in out.output
    got = json.loads((tmp_path / "out" / step_dir(manifest.step) / MANIFEST_NAME).read_text())
    assert got["config"]["checkpoint"]["url"] == str(tmp_path / "out")


def test_inspect_of_a_file_says_so(tmp_path: Path) -> None:
    from shardsmith.cli.main import cli

    (tmp_path / "README.md").write_text("# hi")
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "README.md")])
    assert result.exit_code == 1 and "is a file, not a checkpoint" in result.output, result.output


def test_inspect_summarizes_and_lists_tensors_on_request(tmp_path: Path) -> None:
    import json

    from shardsmith.cli.main import cli

    save_direct(Store(str(tmp_path)), full_state(), SRC_DIMS)
    summary = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert summary.exit_code == 0, summary.output
    assert (
        "largest 8 tensors (--tensors: all)" in summary.output
        and "data was not checked" in summary.output
    )
    assert "model " in summary.output and "optim.exp_avg " in summary.output
    full = CliRunner().invoke(cli, ["inspect", str(tmp_path), "--tensors"])
    assert full.output.count("\n") > summary.output.count("\n")
    data = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path), "--json"]).output)
    assert (
        "tensors" not in data
        and data["groups"]["model"]["num_tensors"] > 0
        and "verify" in data["checked"]
    )


def test_an_unreachable_object_store_fails_fast_in_one_line(tmp_path: Path, monkeypatch) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.delenv("SHARDSMITH_STORAGE_TIMEOUT", raising=False)
    env = {
        **os.environ,
        "SHARDSMITH_STORAGE_MAX_ATTEMPTS": "3",
        "SHARDSMITH_STORAGE_BACKOFF_S": "0.1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "ls",
            "s3://bucket/run",
            "--storage-timeout",
            "3",
            "--storage-option",
            f"client_kwargs.endpoint_url=http://127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "unreachable" in lines[-1], lines
    # fast = bounded: our 3 attempts (2 retry lines, then the error), none of botocore's own
    assert all("; retry " in line for line in lines[:-1]) and len(lines) <= 3, lines
    monkeypatch.setenv("SHARDSMITH_STORAGE_TIMEOUT", "4")
    store = Store(
        "s3://bucket/run",
        {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}},
        max_attempts=2,
    )
    assert store.storage_options["config_kwargs"]["connect_timeout"] == 2.0
    assert store.storage_options["config_kwargs"]["retries"] == {
        "max_attempts": 1,
        "mode": "standard",
    }


def test_ctrl_c_during_a_reshard_says_the_target_is_incomplete(tmp_path: Path, monkeypatch) -> None:
    from shardsmith.cli.main import cli
    from shardsmith.reshard import api

    save_direct(Store(str(tmp_path / "src")), full_state(), SRC_DIMS)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "execute", interrupted)
    result = CliRunner().invoke(
        cli, ["reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--dp-shard", "4"]
    )
    assert result.exit_code == 130, result.output
    assert (
        "is incomplete (nothing committed); run the same command again to resume" in result.output
    )
    assert "Aborted" not in result.output and "Traceback" not in result.output


def test_another_ranks_fresh_progress_is_not_an_interrupted_run(tmp_path: Path, caplog) -> None:
    import json

    from shardsmith.reshard.progress import load_progress

    dst = Store(str(tmp_path))
    dst.write(
        ".reshard-progress-00001.json",
        json.dumps(
            {"plan_id": "p", "files": {"shards/rank-00001.safetensors": {"nbytes": 1, "crc32c": 2}}}
        ).encode(),
    )
    with caplog.at_level(logging.INFO, logger="shardsmith.reshard.progress"):
        assert load_progress(dst, "p", {"shards/rank-00000.safetensors"}) == {}
        assert list(load_progress(dst, "p", {"shards/rank-00001.safetensors"})) == [
            "shards/rank-00001.safetensors"
        ]
    assert [m for m in caplog.messages if "resuming" in m] == [
        "resuming: 1 target file was written by an interrupted run"
    ]


def test_diff_names_the_state_fields_that_differ() -> None:
    """`shardsmith diff`'s note on the non-tensor state names the differing fields (a reshard
    records its parent), not the steps, which are equal."""
    from shardsmith.reshard.diff import differing_keys as _differing_keys

    a = {"step": 30, "run": {"id": "r1", "parent": None}, "rng": [1, 2]}
    b = {
        "step": 30,
        "run": {"id": "r1", "parent": "demo-run/a/step-000000030"},
        "rng": [1, 2],
        "extra": 1,
    }
    assert _differing_keys(a, b) == ["state.extra", "state.run.parent"]
    assert _differing_keys(a, dict(a)) == []
