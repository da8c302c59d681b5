"""``shardsmith train`` launches of the tiny model with tp=2, shared by the fault-tolerance,
local-tier and multi-node tests, and what they leave behind (:class:`Run`).

The uninterrupted 4-process, 8-step run they all compare against is one session fixture
(``tp2_reference`` in conftest.py): saving, async saving, the local tier and ``--steps``
(the LR schedule is fixed by ``--lr-decay-steps`` in :data:`TINY_TRAIN_FLAGS`) change no
loss and no weight, so one launch serves every module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import TINY_TRAIN_FLAGS

from shardsmith.storage.commit import list_steps
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.observe.metrics import iter_json_lines

#: Steps and save interval of the shared reference run.
REFERENCE_STEPS = 8
REFERENCE_SAVE_EVERY = 2
RECOVERED = re.compile(r"recovered step (\d+) from (local|buddy|persistent)")


@dataclass
class Run:
    """One ``shardsmith train`` launch: exit code, output, checkpoint root, and the
    metrics.jsonl records this launch wrote (all its elastic restarts included)."""

    returncode: int
    output: str
    root: Path
    records: list[dict[str, Any]]

    def check(self) -> "Run":
        assert self.returncode == 0, (
            f"launch failed (exit {self.returncode}):\n{self.output[-8000:]}"
        )
        return self

    def losses(self) -> dict[int, float]:
        """Step -> loss of the last time each step ran (re-run steps overwrite)."""
        return {r["step"]: r["loss"] for r in self.records if "event" not in r}

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == kind]

    def committed(self) -> list[int]:
        return [s.step for s in list_steps(Store(str(self.root))) if s.committed]

    def recovered(self) -> list[tuple[int, str]]:
        """(step, tier) of every "recovered step N from TIER" line, in order."""
        return [(int(s), src) for s, src in RECOVERED.findall(self.output)]


def train_tp2(
    root: Path, nproc: int, data_path: str, *flags: str, env: dict[str, str] | None = None
) -> Run:
    """``shardsmith train`` of the tiny model on ``nproc`` processes (tp=2, dp_shard from the
    world size) with checkpoints in ``root``; ``flags`` add ``--steps`` and the rest. The
    output goes to ``root``-N.log beside ``root`` (N counts the launches into ``root``)."""
    return train_tiny(root, nproc, data_path, "--tp", "2", *flags, env=env)


def train_tiny(
    root: Path, nproc: int, data_path: str, *flags: str, env: dict[str, str] | None = None
) -> Run:
    """As :func:`train_tp2`, with the layout left to ``flags``."""
    metrics = root / "metrics.jsonl"
    before = len(list(iter_json_lines(str(metrics)))) if metrics.exists() else 0
    cmd = [
        sys.executable,
        "-m",
        "shardsmith",
        "train",
        "--nproc-per-node",
        str(nproc),
        *TINY_TRAIN_FLAGS,
        "--data",
        data_path,
        "--ckpt",
        str(root),
        *flags,
    ]
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})},
    )
    root.parent.mkdir(parents=True, exist_ok=True)
    launches = len(list(root.parent.glob(f"{root.name}-*.log")))
    (root.parent / f"{root.name}-{launches}.log").write_text(proc.stdout)
    records = list(iter_json_lines(str(metrics)))[before:] if metrics.exists() else []
    return Run(proc.returncode, proc.stdout, root, records)


def reference_run(root: Path, data_path: str) -> Run:
    """The uninterrupted reference: 4 processes (tp2·dp_shard2), :data:`REFERENCE_STEPS` steps,
    a checkpoint every :data:`REFERENCE_SAVE_EVERY`."""
    return train_tp2(
        root,
        4,
        data_path,
        "--steps",
        str(REFERENCE_STEPS),
        "--save-interval",
        str(REFERENCE_SAVE_EVERY),
    ).check()
