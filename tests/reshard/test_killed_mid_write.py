"""A reshard killed in the middle of a streamed file write (crash point ``fs.mid_write``):
nothing is committed, the killed writer's hidden temporary file is left, and the next run
removes it and commits; ``gc`` removes only a dead writer's temporary files."""

from __future__ import annotations

import os
import subprocess
import sys

from ckpt_factory import MODEL, full_tensors, save_offline
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import find_latest_committed, step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.storage.store.posix import sweep_stale_tmp, tmp_name


def _tmp_files(path) -> list[str]:
    return sorted(p.name for p in path.rglob(".*.tmp-*"))


def test_a_reshard_killed_mid_write_commits_nothing_and_the_next_run_cleans_up(tmp_path) -> None:
    src = Store(str(tmp_path / "src"))
    save_offline(src, 4, ParallelDims(dp_shard=2), full_tensors(MODEL, 4), MODEL)
    env = {
        **os.environ,
        "SHARDSMITH_TEST_CRASH_AT": "0:fs.mid_write",
        "RANK": "0",
        "OMP_NUM_THREADS": "1",
    }
    killed = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "reshard",
            src.url,
            str(tmp_path / "out"),
            "--tp",
            "1",
            "--quiet",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9 and "crash point fs.mid_write" in killed.stderr, killed.stderr[
        -2000:
    ]
    out = tmp_path / "out"
    assert find_latest_committed(Store(str(out))) is None
    assert not (out / step_dir(4) / "manifest.json").exists()
    assert len(_tmp_files(out)) == 1  # the killed writer's, mid-file
    result = CliRunner().invoke(cli, ["reshard", src.url, str(out), "--tp", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    assert find_latest_committed(Store(str(out))) == 4 and _tmp_files(out) == []


def test_the_sweep_removes_dead_writers_files_only(tmp_path) -> None:
    live = tmp_name(str(tmp_path / "a.bin"))  # this process: alive
    dead = str(tmp_path / ".b.bin.tmp-{host}-{pid}-0123456789ab")
    child = subprocess.run(
        [sys.executable, "-c", "import os, socket; print(socket.gethostname(), os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host, pid = child.stdout.split()
    dead = dead.format(host=host, pid=pid)  # a process that has exited
    other_host = str(tmp_path / ".c.bin.tmp-elsewhere-1-0123456789ab")
    for path in (live, dead, other_host):
        open(path, "wb").close()
    assert sweep_stale_tmp(str(tmp_path)) == [dead]
    assert os.path.exists(live) and os.path.exists(other_host)
    assert sorted(sweep_stale_tmp(str(tmp_path), grace_s=-1)) == sorted(
        [live, other_host]
    )  # past the grace
