"""A Ctrl-C at any moment of a launch stops it promptly, and no worker outlives the launcher
(issue 42's leftover: a Ctrl-C in the first seconds once left the launcher waiting ~5 minutes,
once left the workers training to the end).

Each case launches the tiny model on 2 processes under ``tests/helpers/interrupt_probe.py``,
a child subreaper (a worker the launcher loses becomes its child and is counted), and sends
SIGINT to the launcher at one early moment: when it prints its first line, when its first
worker exists (the agent may still be spawning the other), when both exist, and 1.5 s later
(the workers import torch, rendezvous, build). The launcher must exit 130 well within the
bound (a hang waits out the agent's shutdown timeout, the preemption deadline + 5 s) with
no process of its left alive, and the save policy holds: a job stopped before its first
step commits nothing, one stopped after it commits the step it was interrupted at.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_TRAIN_FLAGS

from shardsmith.storage.commit import list_steps
from shardsmith.storage.store.fs import Store

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "interrupt_probe.py"
#: Seconds the launcher may take to exit after the Ctrl-C: far above a prompt stop (about
#: one second here), far below the 305 s a worker that ignores it costs.
BOUND_S = 60


@pytest.mark.distributed
@pytest.mark.parametrize("moment", ["first_line", "first_worker", "all_workers", "all_workers+1.5"])
def test_a_ctrl_c_at_an_early_moment_stops_the_launcher_and_every_worker(
    moment: str, tmp_path: Path, data_path: str
) -> None:
    root = tmp_path / "ckpt"
    launcher = [sys.executable, "-m", "shardsmith", "train", "--nproc-per-node", "2"]
    flags = ["--data", data_path, "--ckpt", str(root), "--steps", "200", "--save-interval", "100"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    probe = subprocess.run(
        [sys.executable, str(PROBE), moment, str(BOUND_S), *launcher, *TINY_TRAIN_FLAGS, *flags],
        capture_output=True,
        text=True,
        timeout=BOUND_S + 120,
        env=env,
    )
    assert probe.returncode == 0, probe.stderr
    report = json.loads(probe.stdout.splitlines()[-1])
    where = f"Ctrl-C at {moment} (workers {report['workers']}):\n{report['output'][-4000:]}"
    assert report["returncode"] is not None, f"the launcher outlived {BOUND_S} s; {where}"
    assert report["returncode"] == 130, where
    assert report["survivors"] == [], f"the launcher left processes behind; {where}"
    committed = (
        [s.step for s in list_steps(Store(str(root))) if s.committed] if root.exists() else []
    )
    stopped_at = re.findall(r"interrupted at step (\d+): checkpoint committed", report["output"])
    assert committed == [int(s) for s in stopped_at], where
