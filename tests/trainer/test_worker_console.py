"""What a worker prints about paths: its error line and its log lines name a path under the
working directory relative to it, and a path the user typed as typed (the launcher makes
the checkpoint root absolute for the workers), while paths elsewhere stay whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardsmith.trainer.runtime import worker


def _places(tmp_path: Path) -> tuple[Path, str, str]:
    """(the working directory, a line naming paths in and around it, that line as the
    console should show it); the user typed ``--ckpt ../runs/a``."""
    work = tmp_path / "work"
    work.mkdir()
    line = (
        f"rank 1: SaveError: cannot write {work}/ckpt/step-000000004/shards/rank-00001.st: "
        f"Permission denied (root file://{work}/ckpt; before: {tmp_path}/runs/a/step-000000002; "
        f"not below: {work}2/x, /etc/hosts)"
    )
    shown = (
        "rank 1: SaveError: cannot write ckpt/step-000000004/shards/rank-00001.st: "
        "Permission denied (root ckpt; before: ../runs/a/step-000000002; "
        f"not below: {work}2/x, /etc/hosts)"
    )
    return work, line, shown


COMMAND = json.dumps(["shardsmith", "train", "--ckpt", "../runs/a"])


def test_a_worker_error_line_names_paths_as_the_user_sees_them(tmp_path, monkeypatch) -> None:
    work, line, shown = _places(tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setenv("SHARDSMITH_COMMAND", COMMAND)
    error_file = tmp_path / "error.txt"
    monkeypatch.setenv(worker.ERROR_FILE_ENV, str(error_file))
    worker.report_error(line)
    assert error_file.read_text() == shown + "\n"


def test_a_worker_log_line_names_paths_as_the_user_sees_them(tmp_path) -> None:
    work, line, shown = _places(tmp_path)
    code = (
        "import logging, sys\n"
        "from shardsmith.trainer.runtime.worker import setup_process\n"
        "setup_process()\n"
        "logging.getLogger('shardsmith.trainer.checkpoint').error('%s', sys.argv[1])\n"
    )
    env = {**os.environ, "RANK": "0", "SHARDSMITH_COMMAND": COMMAND}
    env.pop("SHARDSMITH_DEBUG", None)
    out = subprocess.run(
        [sys.executable, "-c", code, line], cwd=work, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == shown + "\n"
