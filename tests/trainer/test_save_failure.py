"""A failed checkpoint save costs a line and a retry, never a healthy run (issue 42), and a save's
blocking part makes no collective call.

One-rank trainers in this process (the ``gloo_group`` fixture) save through the fault-injecting
filesystem (``faulty::``, :mod:`shardsmith.storage.store.faults`) with permanent write faults on
chosen step directories: access revoked there, every other step fine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_train_config

from shardsmith.errors import SaveError
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import list_steps, read_manifest, step_dir
from shardsmith.storage.store import (
    Store,
    faults,  # noqa: F401  (registers the faulty:: protocol)
)
from shardsmith.trainer.checkpoint.config import CheckpointConfig
from shardsmith.trainer.rng import capture_rng
from shardsmith.trainer.train import Trainer


def _config(tmp_path: Path, data_path: str, *, fail: str, steps: int, **ckpt: Any) -> Any:
    """The tiny model, one rank, checkpoints to ``tmp_path/ckpt`` through ``faulty::`` with
    every write under the step directories matching ``fail`` refused; metrics in ``run/``."""
    options = {
        "faulty": {"mode": "permanent", "ops": ["write"], "match": f"*/{fail}/*"},
        "file": {},
    }
    checkpoint = CheckpointConfig(
        url=f"faulty::file://{tmp_path / 'ckpt'}", storage_options=options, resume="none", **ckpt
    )
    base = tiny_train_config(ParallelDims(), data_path)
    return dataclasses.replace(
        base, steps=steps, checkpoint=checkpoint, run_dir=str(tmp_path / "run"), log_interval=0
    )


def _committed(tmp_path: Path) -> list[int]:
    return [s.step for s in list_steps(Store(str(tmp_path / "ckpt"))) if s.committed]


def _events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == kind]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_save_failure_is_one_line_and_an_event_and_the_run_goes_on(
    gloo_group, tmp_path: Path, data_path: str, caplog, async_save: bool
) -> None:
    cfg = _config(
        tmp_path, data_path, fail=step_dir(2), steps=4, save_interval=1, async_save=async_save
    )
    with caplog.at_level(logging.INFO, logger="shardsmith"):
        history = Trainer.create(cfg).run()
    assert [m.step for m in history] == [1, 2, 3, 4]  # the run went on past the failure
    assert _committed(tmp_path) == [1, 3, 4]  # step 2 never committed; step 3 retried and did
    (failed,) = _events(tmp_path, "save_failed")
    assert failed["step"] == 2 and failed["consecutive"] == 1
    assert "PermissionError" in failed["error"] or "access denied" in failed["error"].lower()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "step 2 not committed" in lines[0], lines
    assert "access denied" in lines[0].lower() and "next save retries" in lines[0]
    assert [e["step"] for e in _events(tmp_path, "save")] == [1, 3, 4]
    (goodput,) = _events(tmp_path, "goodput")
    assert goodput["failed_saves"] == 1


def test_save_failure_n_in_a_row_stops_the_job_naming_the_newest_committed_step(
    gloo_group, tmp_path: Path, data_path: str
) -> None:
    cfg = _config(
        tmp_path, data_path, fail="step-00000000[2-9]", steps=6, save_interval=1, max_failed_saves=2
    )
    trainer = Trainer.create(cfg)
    with pytest.raises(SaveError, match=r"2 checkpoint saves in a row failed") as info:
        trainer.run()
    assert "newest committed step is 1" in str(info.value) and step_dir(1) in str(info.value)
    assert trainer.step == 4  # stopped when the next save joined the second failed one
    assert _committed(tmp_path) == [1]
    assert [e["consecutive"] for e in _events(tmp_path, "save_failed")] == [1, 2]


def test_save_failure_of_the_final_save_fails_the_run_saying_so(
    gloo_group, tmp_path: Path, data_path: str
) -> None:
    cfg = _config(tmp_path, data_path, fail=step_dir(3), steps=3, save_interval=2)
    with pytest.raises(SaveError, match=r"the final checkpoint \(step 3\) failed") as info:
        Trainer.create(cfg).run()
    assert "newest committed step is 2" in str(info.value)
    assert _committed(tmp_path) == [2]


#: Every collective of torch.distributed a save could make.
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)


def test_blocking_path_of_a_save_makes_no_collective_call(
    gloo_group, tmp_path: Path, data_path: str, monkeypatch
) -> None:
    """``CheckpointPolicy.save`` (what the training loop waits for) calls no collective; the
    agreement a save needs (RNG states, clearing a step saved before) happens in its
    background part, and the manifest holds the RNG state of the moment ``save`` was called."""
    cfg = _config(tmp_path, data_path, fail="never", steps=1)
    trainer = Trainer.create(cfg)
    trainer.train_step()
    calls: list[tuple[str, bool]] = []
    blocking = threading.Event()
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(
                (_name, blocking.is_set() and threading.current_thread() is threading.main_thread())
            )
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    expected = capture_rng()
    blocking.set()
    trainer.checkpointing.save()
    blocking.clear()
    torch.rand(8)  # the generator moves on while the save runs in the background
    trainer.wait_for_save()
    assert [name for name, in_save in calls if in_save] == []
    assert {"gather", "broadcast"} <= {name for name, _ in calls}  # the background part agreed
    manifest = read_manifest(Store(str(tmp_path / "ckpt")).child(step_dir(1)))
    assert manifest.state["rng"]["roles"]["pp0.tp0"] == expected


def test_metrics_of_an_object_store_run_go_to_a_stated_local_run_dir(
    data_path: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    from shardsmith.trainer.observe.metrics import announced_run_dir, run_dir, run_dir_note

    monkeypatch.chdir(tmp_path)
    base = tiny_train_config(ParallelDims(), data_path)
    s3 = dataclasses.replace(base, checkpoint=CheckpointConfig(url="s3://bucket/runs/70b"))
    assert run_dir(s3) == str(tmp_path / "shardsmith-runs" / "bucket-runs-70b")
    assert run_dir_note(s3) == (
        f"; metrics in {tmp_path}/shardsmith-runs/bucket-runs-70b (--ckpt is object storage; "
        "--run-dir picks another directory)"
    )
    monkeypatch.delenv(
        "SHARDSMITH_LAUNCH_TIME", raising=False
    )  # an external torchrun: rank 0 says it
    assert announced_run_dir(s3) == run_dir(s3)
    assert capsys.readouterr().err.startswith(f"metrics in {tmp_path}/shardsmith-runs/")
    chosen = dataclasses.replace(s3, run_dir=str(tmp_path / "mine"))
    assert run_dir(chosen) == str(tmp_path / "mine") and run_dir_note(chosen) == ""
    local = dataclasses.replace(base, checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt")))
    assert run_dir(local) == str(tmp_path / "ckpt") and run_dir_note(local) == ""
    memory = dataclasses.replace(base, checkpoint=CheckpointConfig(url="memory://x"))
    assert run_dir(memory) == "" and run_dir(dataclasses.replace(base)) == ""
