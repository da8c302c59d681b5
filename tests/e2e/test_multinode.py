"""Losing a node: two ``torchrun`` agents on loopback as two "nodes", one of them killed.

``torchrun --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d --max-restarts 1`` twice
(agent A hosts the rendezvous store, agent B joins it), each running ``python -m shardsmith
train --tp 2 --dp-shard -1``: one job of 4 processes (tp2·dp_shard2), a checkpoint every 2
steps. As step ``KILL_STEP`` starts, a rank of node B hangs (test hook) so the job stops
there, and the test SIGKILLs agent B and its two workers (the whole "node"). Node A's
workers fail on the broken connections; agent A restarts its group, the rendezvous re-forms
with one node (B's heartbeats stop), the workers re-derive ``dp_shard`` = 1 for the world
of 2 (tp2·dp_shard1) and resume the newest committed checkpoint by resharding.

Reference: the same job uninterrupted on 4 processes (``shardsmith train --nproc-per-node
4``, the same model, data and schedule flags: conftest's ``tp2_reference``, shared with
other modules). After the resume every step's loss matches the reference's within
1e-4 (relative): the curve continues, only the reduction order changed.

Rendezvous settings (``--rdzv-conf``): a dead node is dropped after ``keep_alive_interval``
× ``keep_alive_max_attempt`` (2 s × 3), and the survivor's new round completes with one node
``last_call_timeout`` (5 s) after it joins. Both agents get
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each worker group hosts its own store; sharing the
agent's store makes restarted groups read stale keys in torch 2.13, pytorch#135712).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_TRAIN_FLAGS

from shardsmith.storage.commit import list_steps
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.observe.metrics import iter_json_lines

STEPS = 6
SAVE_EVERY = 2
KILL_STEP = 5  # after the save of step 4: the survivor resumes step 4 on 2 processes
HUNG_RANK = 3  # a rank of node B (torchrun orders nodes by (host, agent pid): A started first)
TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_flags(root: Path, data_path: str) -> list[str]:
    return [
        "train",
        "--tp",
        "2",
        "--dp-shard",
        "-1",
        *TINY_TRAIN_FLAGS,
        "--data",
        data_path,
        "--steps",
        str(STEPS),
        "--save-interval",
        str(SAVE_EVERY),
        "--no-async-save",
        "--ckpt",
        str(root),
    ]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **extra,
    }


def _agent(
    port: int, is_host: bool, flags: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen:
    conf = (
        f"is_host={int(is_host)},keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-nodes",
        "--rdzv-conf",
        conf,
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        "-m",
        "shardsmith",
        *flags,
    ]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun starts each worker in its own session,
    so killing the agent's process group would miss them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _kill_node(agent: subprocess.Popen) -> int:
    """SIGKILL an agent, then its workers; the number of workers killed."""
    workers = _children(agent.pid)
    agent.kill()
    agent.wait()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(workers)


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise AssertionError(
                f"{path.name} never appeared (exit codes {[p.poll() for p in procs]})"
            )
        time.sleep(0.2)


def _wait_for_store(port: int, host: subprocess.Popen, timeout: float) -> None:
    """Block until the rendezvous store of the agent ``host`` accepts a client (a TCPStore
    client retries its connection until ``timeout``)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, TimeoutError) as e:
        raise AssertionError(
            f"node A's rendezvous store never came up on port {port} "
            f"(its exit code: {host.poll()}): {e}"
        ) from e


def _losses(root: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in iter_json_lines(str(root / "metrics.jsonl"))
        if "event" not in r
    }


@pytest.fixture(scope="module")
def reference(tp2_reference) -> dict[int, float]:
    """Losses of steps 1..STEPS of the session's uninterrupted 4-process run of the same job
    (``conftest.tp2_reference``: 8 steps; its LR schedule is fixed by ``--lr-decay-steps``,
    so its first 6 steps are this job's)."""
    return {step: loss for step, loss in tp2_reference.losses().items() if step <= STEPS}


@pytest.mark.distributed
def test_losing_a_node_reshards_onto_the_survivor(
    tmp_path: Path, data_path: str, reference: dict[int, float]
) -> None:
    root, markers = tmp_path / "ckpt", tmp_path / "markers"
    env = _env(
        SHARDSMITH_TEST_HANG_AT=f"{HUNG_RANK}:{KILL_STEP}", SHARDSMITH_TEST_MARKER_DIR=str(markers)
    )
    # a short --preempt-deadline: if A held rank 3 (pid wrap-around), its hung rank would wait
    # that long for a checkpoint when A's agent stops its group, then exit
    port, flags = _free_port(), [*_train_flags(root, data_path), "--preempt-deadline", "10"]
    node_a = _agent(port, True, flags, env, tmp_path / "node-a.log")
    _wait_for_store(port, node_a, TIMEOUT)  # A hosts the rendezvous store: B joins it
    node_b = _agent(port, False, flags, env, tmp_path / "node-b.log")
    try:
        _wait_for(markers / f"hang-rank{HUNG_RANK}-step{KILL_STEP}", [node_a, node_b], TIMEOUT)
        assert _kill_node(node_b) == 2
        node_a.wait(timeout=TIMEOUT)
    finally:
        for agent in (node_a, node_b):
            if agent.poll() is None:
                _kill_node(agent)
    output = (tmp_path / "node-a.log").read_text()
    assert node_a.returncode == 0, output[-8000:]
    records = list(iter_json_lines(str(root / "metrics.jsonl")))
    starts = [r for r in records if r.get("event") == "start"]
    assert [(s["restart_count"], s["world_size"]) for s in starts] == [(0, 4), (1, 2)], starts
    [resume] = [r for r in records if r.get("event") == "resume"]
    assert resume["step"] == KILL_STEP - 1 and resume["resharded"], resume
    assert (resume["saved_layout"]["world_size"], resume["saved_layout"]["dp_shard"]) == (4, 2), (
        resume
    )
    assert (resume["layout"]["dp_shard"], resume["layout"]["tp"]) == (1, 2), resume  # re-derived
    losses = _losses(root)
    assert sorted(reference) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # before the kill exact, after it within 1e-4
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=0), step
    assert max(s.step for s in list_steps(Store(str(root))) if s.committed) == STEPS
