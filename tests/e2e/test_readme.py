"""The README's "main job, step by step" block, run verbatim: the commands work as written and
the LR stays on one schedule across the reshard (read back from both runs' metrics.jsonl)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from shardsmith.trainer.observe.metrics import iter_json_lines
from shardsmith.trainer.optim import OptimConfig, lr_lambda

README = REPO_ROOT / "README.md"


def main_job_commands() -> list[list[str]]:
    """The shell lines of the README's "The main job, step by step" code block."""
    text = README.read_text()
    block = re.search(r"## The main job, step by step\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no 'The main job, step by step' bash block"
    return [
        shlex.split(line)
        for line in block.group(1).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_the_block_is_parsed() -> None:
    commands = main_job_commands()
    assert all(c[0] == "shardsmith" for c in commands) and len(commands) >= 3


@pytest.mark.distributed
@pytest.mark.slow
def test_readme_main_job_runs_and_keeps_one_lr_schedule(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    for command in main_job_commands():
        proc = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, (
            f"{shlex.join(command)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        assert "Traceback" not in proc.stderr and '{"time"' not in proc.stdout + proc.stderr
    steps = {}
    for run in ("a", "b"):
        records = list(iter_json_lines(str(tmp_path / "runs" / run / "metrics.jsonl")))
        assert not [r for r in records if r.get("event") == "schedule_change"], run
        steps.update({r["step"]: r["lr"] for r in records if "event" not in r})
    decay = int(main_job_commands()[0][main_job_commands()[0].index("--lr-decay-steps") + 1])
    optim = OptimConfig(decay_steps=decay)
    factor = lr_lambda(optim, decay)
    assert sorted(steps) == list(range(1, max(steps) + 1))
    for step, lr in steps.items():  # the LR of step s is the schedule's at s - 1
        assert lr == pytest.approx(optim.lr * factor(step - 1), rel=1e-6), step
    assert (tmp_path / "runs" / "b" / "loss.png").exists()
