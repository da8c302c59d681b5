"""Crash consistency: kill -9 of one rank, the coordinator (rank 0) or the other one, at
named points inside a save (see :mod:`shardsmith.storage.crashpoints`): before and after
each file, mid-write (a local temp file; an S3 multipart upload with one part up), before
a file is published, between the manifest and ``latest``; sync and async saves; local
disk and the loopback S3 server.

Every kill case trains a tiny model on 2 processes (dp_shard=2: both ranks write a shard
file), saving every step, and one rank SIGKILLs itself at its crash point inside the
save of step 2 (step 1 is committed). Afterwards:

* the newest committed step is 1, or 2 exactly when the manifest of step 2 may have been
  written by then (deterministically so for the coordinator's own points); ``latest``
  names step 2 only once the coordinator wrote it; a step-2 directory without a manifest
  is listed as incomplete; a file being written never appears under its final name; and
  no surviving rank was told "not committed" about a step that is committed;
* that step verifies (``verify_checkpoint``) and every tensor of it loads (checksummed
  reads) and equals, bitwise, the same step of an uninterrupted reference run;
* a ``--resume auto`` run on a copy of the root resumes from that step (its
  ``metrics.jsonl`` ``resume`` event), never from 0, trains on, and its steps verify and
  equal the reference's bitwise. One of these is a real ``shardsmith train`` launch
  (torchrun's agent); the others run the same worker body in forked processes.

Cost: process start-up dominates (importing torch and the trainer: ~4 CPU seconds; a
torchrun launch: ~10). So the 2-rank groups run in processes forked from a
multiprocessing *forkserver* that imported the trainer once: the ranks are real
processes with their own gloo connections and a real SIGKILL, and this test is their
launcher (a group's survivors get :data:`GRACE_S` to fail on the closed connections, then
are killed, as torchrun's teardown would). Two groups run at a time.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_tensors_bitwise_equal

from shardsmith.layout.box import Box
from shardsmith.storage import crashpoints
from shardsmith.storage.commit import (
    find_latest_committed,
    list_steps,
    read_latest_hint,
    read_manifest,
    step_dir,
)
from shardsmith.storage.formats.registry import read_boxes
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint
from shardsmith.trainer.observe.metrics import iter_json_lines

NPROC = 2
CRASH_STEP = 2
FINAL_STEP = CRASH_STEP + 1
#: ``shardsmith train`` flags of every run here (model size, --ckpt, --steps ... added).
#: A fixed LR schedule (decay over 6 steps) so runs of different lengths train alike.
COMMON_FLAGS = [
    "--dp-shard",
    "2",
    "--num-layers",
    "2",
    "--num-attention-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--vocab-size",
    "256",
    "--seq-length",
    "16",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "1",
    "--lr-decay-steps",
    "6",
    "--seed",
    "1234",
    "--save-interval",
    "1",
    "--preempt-deadline",
    "3",
    "--collective-timeout",
    "60",
    "--init-timeout",
    "60",
    "--resume",
    "auto",
]
#: Model widths: tiny on local disk; on S3 big enough that each rank's shard file (~12.6 MB)
#: goes up as a multipart upload of two parts (``storage.fs.DEFAULT_PART_NBYTES``: 8 MiB).
MODEL_FLAGS = {
    "local": ["--hidden-size", "32", "--ffn-hidden-size", "64"],
    "s3": ["--hidden-size", "256", "--ffn-hidden-size", "1024"],
}
#: A group whose first process died gets this long before the rest are killed (a safety
#: bound: survivors normally fail at once on the closed gloo connections).
GRACE_S = 20.0
GROUP_TIMEOUT_S = 180.0

COORDINATOR_COMMITTED = {
    "commit.after_manifest",
    "fs.before_publish@latest",
    "commit.after_latest",
    "save.end",
    "async.after_commit",
}
LATEST_MOVED = {"commit.after_latest", "save.end", "async.after_commit"}


def _shard(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class Case:
    """One kill: ``rank`` SIGKILLs itself at ``point`` during the save of step 2."""

    rank: int
    point: str
    async_save: bool
    backend: str = "local"

    @property
    def name(self) -> str:
        prefix = "" if self.backend == "local" else f"{self.backend}-"
        return f"{prefix}{'async' if self.async_save else 'sync'}-r{self.rank}-{self.point}"

    @property
    def may_commit(self) -> bool:
        """Could step 2's manifest have been written by the time this rank died?"""
        if self.rank == 0:
            return self.point in COORDINATOR_COMMITTED
        return self.point in ("save.after_gather", "save.end", "async.after_commit")

    @property
    def must_commit(self) -> bool:
        """Had step 2's manifest certainly been written (this rank made or saw the commit)?"""
        return self.may_commit and self.point != "save.after_gather"

    @property
    def in_flight_file(self) -> str:
        """The file this rank was writing when killed (must not exist under its final name)."""
        base = self.point.partition("@")[2]
        if not self.point.startswith("fs.") or base == "latest":
            return ""
        return f"{step_dir(CRASH_STEP)}/{'shards/' if base.endswith('.safetensors') else ''}{base}"

    @property
    def leaves_partial_step(self) -> bool:
        """Has this rank itself put something under step 2 (a published shard file; locally
        also a temp file), and not committed it?"""
        if self.may_commit:
            return False
        published = self.point in (
            "shard.after_write",
            "save.after_gather",
            "commit.before_check",
            "commit.before_manifest",
        ) or self.point.endswith("@manifest.json")
        return published or (self.backend == "local" and bool(self.in_flight_file))


SYNC_R0 = [
    "save.begin",
    "shard.before_write",
    f"fs.mid_write@{_shard(0)}",
    f"fs.before_publish@{_shard(0)}",
    "shard.after_write",
    "save.after_gather",
    "commit.before_check",
    "commit.before_manifest",
    "fs.before_publish@manifest.json",
    "commit.after_manifest",
    "fs.before_publish@latest",
    "commit.after_latest",
    "save.end",
]
SYNC_R1 = [
    "save.begin",
    "shard.before_write",
    f"fs.mid_write@{_shard(1)}",
    f"fs.before_publish@{_shard(1)}",
    "shard.after_write",
    "save.after_gather",
    "save.end",
]
ASYNC_R0 = [
    "async.before_snapshot",
    "async.after_snapshot",
    f"fs.before_publish@{_shard(0)}",
    "commit.after_manifest",
    "commit.after_latest",
    "async.after_commit",
]
ASYNC_R1 = [
    "async.before_snapshot",
    "async.after_snapshot",
    f"fs.mid_write@{_shard(1)}",
    "save.after_gather",
    "async.after_commit",
]
S3_CASES = [
    Case(0, f"fs.mid_write@{_shard(0)}", False, "s3"),
    Case(0, f"fs.before_publish@{_shard(0)}", True, "s3"),
    Case(1, f"fs.mid_write@{_shard(1)}", True, "s3"),
    Case(0, "commit.after_manifest", False, "s3"),
]
CASES = (
    [Case(0, p, False) for p in SYNC_R0]
    + [Case(1, p, False) for p in SYNC_R1]
    + [Case(0, p, True) for p in ASYNC_R0]
    + [Case(1, p, True) for p in ASYNC_R1]
    + S3_CASES
)
#: The case resumed by a real ``shardsmith train --resume auto`` launch (the rest: forked workers):
#: the coordinator died mid-write, leaving an incomplete step 2 with a temp file in it.
CLI_RESUMED = Case(0, f"fs.mid_write@{_shard(0)}", False).name


# ---- unit tests of the hook (no process group) ---------------------------------------------


def test_crash_spec_is_checked() -> None:
    for bad in ("0", "x:save.begin", "0:save.begin:two", "0::2", "0:a:1:2"):
        with pytest.raises(ValueError, match=crashpoints.ENV_VAR):
            crashpoints.configure(bad, rank=0)
    crashpoints.configure("", rank=0)


def test_crash_point_fires_only_for_its_rank_point_file_and_step() -> None:
    code = (
        "from shardsmith.storage.crashpoints import crash_point as c\n"
        "c('save.begin', step=1); c('fs.mid_write', key='s/shards/rank-00001.safetensors')\n"
        "c('save.begin', step=3); c('commit.after_manifest'); c('fs.mid_write', key='s/manifest.json')\n"
        "print('alive', flush=True)\n"
        "c('fs.mid_write', key='s/shards/rank-00000.safetensors'); print('not reached', flush=True)\n"
    )
    spec = "1:commit.after_manifest,0:save.begin:2,0:fs.mid_write@rank-00000.safetensors:3"
    env = {**os.environ, crashpoints.ENV_VAR: spec, "RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.split() == ["alive"]
    assert "crash point fs.mid_write@rank-00000.safetensors (rank 0, step 3)" in proc.stderr
    env.pop(crashpoints.ENV_VAR)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["alive", "not", "reached"], proc.stderr


def test_at_least_20_distinct_kill_points_on_both_ranks_sync_and_async() -> None:
    assert len(set(CASES)) == len(CASES)
    assert len({(c.rank, c.point) for c in CASES}) >= 20
    assert {c.rank for c in CASES} == {0, 1} and {c.async_save for c in CASES} == {False, True}


# ---- the launcher: forked ranks ------------------------------------------------------------


def _rank_main(cfg_path: str, rank: int, port: int, crash: str, log_path: str) -> None:
    """Body of one forked rank: torchrun's environment, the crash spec, then the worker."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(NPROC),
            "LOCAL_WORLD_SIZE": str(NPROC),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            crashpoints.ENV_VAR: crash,
        }
    )
    crashpoints.configure()
    torch.set_num_threads(1)
    from shardsmith.trainer.runtime import worker

    sys.exit(worker.main([cfg_path]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Serializes process starts and exit-code reads across the launcher's threads (see :func:`_exitcode`).
_MP_LOCK = threading.Lock()


@dataclass
class Group:
    """A finished 2-rank run: exit codes by rank (-9 = SIGKILL), each rank's output, and where
    its checkpoints and metrics went."""

    name: str
    root: Store
    run_dir: Path
    exitcodes: list[int | None]
    logs: list[str]
    seconds: float = 0.0
    timed_out: bool = False

    def describe(self) -> str:
        return (
            f"{self.name}: exit codes {self.exitcodes} after {self.seconds:.1f} s"
            f"{' (timed out)' if self.timed_out else ''}\n"
            + "\n".join(f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(self.logs))
        )

    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return list(iter_json_lines(str(path))) if path.exists() else []


class Launcher:
    """Runs 2-rank training groups in processes forked from a forkserver that imported the
    trainer once (see the module docstring). Thread-safe."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(
            [
                "shardsmith.trainer.train",
                "shardsmith.trainer.runtime.worker",
                "s3fs",
                "test_crash_consistency",
            ]
        )

    def _config_file(self, name: str, flags: list[str]) -> str:
        """The config ``shardsmith train FLAGS`` runs, as the launcher hands it to workers."""
        from shardsmith.cli.main import train, train_config
        from shardsmith.trainer.runtime.launch import config_payload

        ctx = train.make_context("train", list(flags))
        path = self.workdir / f"{name}.config.json"
        path.write_text(json.dumps(config_payload(train_config(ctx.params, NPROC))))
        return str(path)

    def run(self, name: str, root: Store, flags: list[str], crash: str = "") -> Group:
        """Run one group to its end (``flags`` without --ckpt/--run-dir)."""
        run_dir = self.workdir / f"{name}.run"
        cfg = self._config_file(name, [*flags, "--ckpt", root.url, "--run-dir", str(run_dir)])
        port = _free_port()
        t0 = time.monotonic()
        logs = [self.workdir / f"{name}.rank{r}.log" for r in range(NPROC)]
        with _MP_LOCK:
            procs = [
                self.ctx.Process(
                    target=_rank_main,
                    args=(cfg, r, port, crash, str(logs[r])),
                    name=f"{name}-rank{r}",
                )
                for r in range(NPROC)
            ]
            for p in procs:
                p.start()
        timed_out = _wait(procs)
        return Group(
            name,
            root,
            run_dir,
            [_exitcode(p) for p in procs],
            [path.read_text(errors="replace") if path.exists() else "" for path in logs],
            time.monotonic() - t0,
            timed_out,
        )


def _exitcode(proc: Any) -> int | None:
    """``proc.exitcode``, read under :data:`_MP_LOCK`.

    With the forkserver start method, the exit code of a child travels over a pipe that is
    read once; ``Process.start()`` in another thread polls *every* child of this process
    (``multiprocessing.process._cleanup``), and two unlocked readers of one pipe leave one
    of them at EOF, which CPython reports as exit code 255 (cpython#140867). That is how a
    rank that SIGKILLed itself was once recorded as 255 instead of -9 here.
    """
    with _MP_LOCK:
        return proc.exitcode


def _wait(procs: list[Any]) -> bool:
    """Wait for every process; once one failed the rest get :data:`GRACE_S`, then SIGKILL.
    Returns True when the group ran past :data:`GROUP_TIMEOUT_S` (all killed)."""
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    while any(_exitcode(p) is None for p in procs):
        failed = any(_exitcode(p) not in (None, 0) for p in procs)
        limit = min(deadline, time.monotonic() + GRACE_S) if failed else deadline
        alive = [p.sentinel for p in procs if _exitcode(p) is None]
        if not alive:  # the last one ended since the loop's test: wait([]) would sleep to the limit
            break
        multiprocessing.connection.wait(alive, timeout=max(0.0, limit - time.monotonic()))
        if time.monotonic() >= limit:
            for p in procs:
                if _exitcode(p) is None:
                    p.kill()
                    with _MP_LOCK:
                        p.join()
            return not failed
    return False


def _run_cli(name: str, root: Store, flags: list[str], workdir: Path) -> Group:
    """A real ``shardsmith train`` launch (torchrun's agent), for a local root."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    env.pop(crashpoints.ENV_VAR, None)
    run_dir = workdir / f"{name}.run"
    cmd = [
        sys.executable,
        "-m",
        "shardsmith",
        "train",
        "--nproc-per-node",
        str(NPROC),
        *flags,
        "--ckpt",
        root.url,
        "--run-dir",
        str(run_dir),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=GROUP_TIMEOUT_S,
    )
    return Group(name, root, run_dir, [proc.returncode], [proc.stdout], time.monotonic() - t0)


def _copy_root(src: Store, dst: Store) -> None:
    """Copy a checkpoint root as it is (local: temp-file leftovers included)."""
    if src.is_posix:
        shutil.copytree(src.url, dst.url)
        return
    for key in src.walk():
        dst.write(key, src.read(key))


def _read_step(step_store: Store) -> dict[str, torch.Tensor]:
    """Every logical tensor of a committed step, whole (checksummed reads)."""
    manifest = read_manifest(step_store)
    fqns = sorted(manifest.tensors)
    boxes = [
        Box((0,) * len(manifest.tensors[f].shape), tuple(manifest.tensors[f].shape)) for f in fqns
    ]
    return dict(
        zip(fqns, read_boxes(step_store, manifest, [(f, b, None) for f, b in zip(fqns, boxes)]))
    )


# ---- the runs (once per module) ------------------------------------------------------------


@dataclass
class Runs:
    """Reference tensors by backend and step; each case's crashed and resumed group."""

    reference: dict[str, dict[int, dict[str, torch.Tensor]]]
    crashed: dict[str, Group] = field(default_factory=dict)
    resumed: dict[str, Group] = field(default_factory=dict)


def _flags(backend: str, steps: int, async_save: bool, s3: Any) -> list[str]:
    out = [
        *COMMON_FLAGS,
        *MODEL_FLAGS[backend],
        "--steps",
        str(steps),
        "--async-save" if async_save else "--no-async-save",
    ]
    if backend == "s3":
        out += [
            f"--storage-option={k}={v}"
            for k, v in (
                ("key", s3.storage_options["key"]),
                ("secret", s3.storage_options["secret"]),
                ("client_kwargs.endpoint_url", s3.endpoint_url),
                ("client_kwargs.region_name", s3.storage_options["client_kwargs"]["region_name"]),
            )
        ]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_path: str) -> Runs:
    """Reference runs, every kill case, then a ``--resume auto`` run on a copy of each root."""
    from s3server import shared_server

    work = tmp_path_factory.mktemp("crash")
    s3 = shared_server() if any(c.backend == "s3" for c in CASES) else None
    prefix = f"crash-{uuid.uuid4().hex[:8]}"
    launcher = Launcher(work)

    def root(backend: str, name: str) -> Store:
        if backend == "local":
            return Store(str(work / name))
        return Store(s3.url(f"{prefix}/{name}"), s3.storage_options)

    def flags(backend: str, steps: int, async_save: bool) -> list[str]:
        return [*_flags(backend, steps, async_save, s3), "--data", data_path]

    def reference(backend: str) -> dict[int, dict[str, torch.Tensor]]:
        ref_root = Store(str(work / f"reference-{backend}"))
        group = launcher.run(f"reference-{backend}", ref_root, flags(backend, FINAL_STEP, False))
        assert group.exitcodes == [0, 0], group.describe()
        return {s: _read_step(ref_root.child(step_dir(s))) for s in range(1, FINAL_STEP + 1)}

    def crash(case: Case) -> Group:
        return launcher.run(
            case.name,
            root(case.backend, case.name),
            flags(case.backend, CRASH_STEP, case.async_save),
            crash=f"{case.rank}:{case.point}:{CRASH_STEP}",
        )

    def resume(case: Case) -> Group:
        name = f"{case.name}.resumed"
        dst = root(case.backend, name)
        _copy_root(out.crashed[case.name].root, dst)
        if case.name == CLI_RESUMED:
            return _run_cli(name, dst, flags(case.backend, FINAL_STEP, False), work)
        return launcher.run(name, dst, flags(case.backend, FINAL_STEP, case.async_save))

    with ThreadPoolExecutor(2) as pool:
        out = Runs(dict(zip(MODEL_FLAGS, pool.map(reference, MODEL_FLAGS))))
        out.crashed = dict(zip((c.name for c in CASES), pool.map(crash, CASES)))
        out.resumed = dict(zip((c.name for c in CASES), pool.map(resume, CASES)))
    groups = [*out.crashed.values(), *out.resumed.values()]
    (work / "seconds.txt").write_text("".join(f"{g.seconds:6.1f} {g.name}\n" for g in groups))
    return out


# ---- the checks ----------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kill_leaves_newest_committed_step_verified_and_loadable(runs: Runs, case: Case) -> None:
    group = runs.crashed[case.name]
    marker = f"crash point {case.point} (rank {case.rank}, step {CRASH_STEP})"
    assert marker in group.logs[case.rank], f"the crash point never fired\n{group.describe()}"
    assert group.exitcodes[case.rank] == -9, group.describe()
    root = group.root
    steps = {s.step: s.committed for s in list_steps(root)}
    newest = find_latest_committed(root)
    assert steps.get(1) is True, f"step 1 must stay committed: {steps}\n{group.describe()}"
    want = {2} if case.must_commit else {1, 2} if case.may_commit else {1}
    assert newest in want, f"newest committed step {newest}, expected one of {want}: {steps}"
    if case.leaves_partial_step:
        assert steps.get(CRASH_STEP) is False, (
            f"the interrupted step 2 must be listed as incomplete: {steps}"
        )
    if case.in_flight_file:
        assert not root.exists(case.in_flight_file), (
            f"{case.in_flight_file} appeared before it was complete"
        )
    if case.rank == 0:
        assert read_latest_hint(root) == step_dir(2 if case.point in LATEST_MOVED else 1)
    if newest == CRASH_STEP:  # survivors must not call a committed step uncommitted
        told = [
            log for r, log in enumerate(group.logs) if r != case.rank and "not committed" in log
        ]
        assert not told, (
            f"a survivor was told step {newest} is not committed, but it is:\n{told[0][-2000:]}"
        )
    report = verify_checkpoint(root.child(step_dir(newest)))
    assert report.ok and report.step == newest, report.to_json()
    assert_tensors_bitwise_equal(
        _read_step(root.child(step_dir(newest))),
        runs.reference[case.backend][newest],
        f"{case.name}: step {newest}",
    )


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_resume_auto_after_kill_continues_from_newest_committed_step(
    runs: Runs, case: Case
) -> None:
    crashed, group = runs.crashed[case.name], runs.resumed[case.name]
    assert all(code == 0 for code in group.exitcodes), group.describe()
    newest = find_latest_committed(crashed.root)
    assert newest is not None and newest > 0
    records = group.records()
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [(r["step"], r["reason"]) for r in resumes] == [(newest, "resume")], group.describe()
    trained = [r["step"] for r in records if "event" not in r]
    assert trained == list(range(newest + 1, FINAL_STEP + 1)), trained
    assert find_latest_committed(group.root) == FINAL_STEP
    for step in range(newest, FINAL_STEP + 1):
        step_store = group.root.child(step_dir(step))
        report = verify_checkpoint(step_store)
        assert report.ok, report.to_json()
        assert_tensors_bitwise_equal(
            _read_step(step_store),
            runs.reference[case.backend][step],
            f"{case.name} resumed: step {step}",
        )
