"""Refuse, never guess, end to end through ``shardsmith train``: one base run, then
every refusal (before any worker starts) and the two ways forward, ``--reset-optimizer`` and
``--overwrite``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardsmith.storage.commit import list_steps, read_manifest, step_dir
from shardsmith.storage.store.fs import Store

pytestmark = pytest.mark.distributed

M = [
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
    "--vocab-size",
    "256",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--no-async-save",
]


def _ss(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "shardsmith", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stdout, proc.stdout[
        -3000:
    ]
    return lines[0]


def _run(root: Path, step: int) -> dict:
    return read_manifest(Store(str(root)).child(step_dir(step))).state["run"]


def test_refusals_and_ways_forward(tmp_path: Path, data_path: str) -> None:
    base = tmp_path / "base"
    train = ["train", "--nproc-per-node", "1", *M, "--data", data_path]
    proc = _ss(*train, "--steps", "4", "--save-interval", "2", "--seed", "3", "--ckpt", str(base))
    assert proc.returncode == 0, proc.stdout[-3000:]
    run = _run(base, 4)
    assert (
        len(run["id"]) == 32
        and run["seed"] == 3
        and run["parent"] is None
        and _run(base, 2)["id"] == run["id"]
    )

    # 1. another model shape: refused, naming every differing field and both values
    fewer = [a if a != "2" or i != 1 else "1" for i, a in enumerate(M)]
    line = _error_line(
        _ss(
            "train",
            "--nproc-per-node",
            "1",
            *fewer,
            "--data",
            data_path,
            "--steps",
            "5",
            "--ckpt",
            str(tmp_path / "c1"),
            "--resume",
            str(base / step_dir(4)),
        )
    )
    assert "num_layers: checkpoint 2, this job 1" in line, line
    line = _error_line(
        _ss(
            *train,
            "--tie-embeddings",
            "--steps",
            "5",
            "--ckpt",
            str(tmp_path / "c1b"),
            "--init-from",
            str(base),
        )
    )
    assert "tie_embeddings: checkpoint False, this job True" in line, line

    # 2. no optimizer state: refused; --reset-optimizer continues with a fresh AdamW, recorded
    mo = tmp_path / "mo"
    proc = _ss(
        "reshard", str(base / step_dir(4)), str(mo / step_dir(4)), "--tp", "1", "--model-only"
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert _run(mo, 4)["id"] == run["id"] and _run(mo, 4)["parent"]["via"] == "reshard"
    line = _error_line(_ss(*train, "--steps", "5", "--ckpt", str(mo)))
    assert "no optimizer state" in line and "--reset-optimizer" in line and "--init-from" in line, (
        line
    )
    proc = _ss(*train, "--steps", "5", "--ckpt", str(mo), "--reset-optimizer")
    assert proc.returncode == 0, proc.stdout[-3000:]
    events = [json.loads(x) for x in (mo / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "reset_optimizer"] == [4]
    resumed = _run(mo, 5)
    assert resumed["id"] == run["id"] and resumed["parent"]["step"] == 4
    assert [e["event"] for e in resumed["events"]] == ["reset_optimizer"]
    assert any(
        k.startswith("optim.") for k in read_manifest(Store(str(mo)).child(step_dir(5))).tensors
    )

    # 3. a new run into another run's root: refused, old steps intact; --overwrite replaces them
    c3 = tmp_path / "c3"
    shutil.copytree(base, c3)
    before = (c3 / step_dir(4) / "manifest.json").read_bytes()
    line = _error_line(
        _ss(
            *train,
            "--seed",
            "7",
            "--steps",
            "2",
            "--save-interval",
            "2",
            "--resume",
            "none",
            "--ckpt",
            str(c3),
        )
    )
    assert (
        str(c3) in line and "2, 4" in line and "--overwrite" in line and "--resume auto" in line
    ), line
    assert (c3 / step_dir(4) / "manifest.json").read_bytes() == before
    proc = _ss(
        *train, "--seed", "7", "--steps", "2", "--resume", "none", "--overwrite", "--ckpt", str(c3)
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert [s.step for s in list_steps(Store(str(c3)))] == [2]
    new = _run(c3, 2)
    assert new["id"] != run["id"] and new["seed"] == 7
    events = [json.loads(x) for x in (c3 / "metrics.jsonl").read_text().splitlines()]
    assert [e["deleted_steps"] for e in events if e.get("event") == "overwrite"] == [[2, 4]]
