"""In-process restarts (``shardsmith train --restart in-process``): survivors rejoin, warm spares
replace the dead, the local tier feeds the reload.

Unit tests first (no processes): which errors mean "a peer is gone", and that severing this
process's connections makes the peer at the other end see EOF while the supervisor's stays up.

Then one chaos pair on gloo (4 processes, tp2 x dp_shard2, 2 simulated nodes, the local tier
every step with buddy copies): ``reference`` uninterrupted (no spares: they change nothing it
computes), ``chaos`` with 2 warm spares and five faults at steps 3, 5, 7, 9, 11: one of each
kind (one rank SIGKILLed as a step starts, a whole simulated node lost with its local tier, a
rank killed inside its local-tier save, a rank killed before its buddy replication) plus a
fifth of a kind drawn at random, in an order and on ranks drawn from a seed the test prints
(``SHARDSMITH_CHAOS_SEED`` replays it). Each fault is one in-process restart; every step
record's loss and the final checkpoint must be bitwise equal to the reference.
``bench/recovery_bench.py`` measures the times.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_TRAIN_FLAGS, assert_tensors_bitwise_equal, read_full_tensors
from train_runs import Run  # a finished launch: exit code, output, root, records

from shardsmith.errors import SaveError
from shardsmith.storage.commit import step_dir
from shardsmith.trainer.runtime.inprocess import peer_gone_line, peer_lost, sever_connections

STEPS = 12
KINDS = ("rank", "node", "local-save", "replicate")
GLOO_RESET = (
    "[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


# ---- unit tests ------------------------------------------------------------------------------


def test_peer_lost_knows_gloo_and_store_failures_and_nothing_else() -> None:
    assert peer_lost(RuntimeError(GLOO_RESET))
    assert peer_lost(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5"))
    wrapped = SaveError("background checkpoint save failed")
    wrapped.__cause__ = RuntimeError(GLOO_RESET)
    assert peer_lost(wrapped)  # a save that failed on its group
    assert not peer_lost(ValueError("Connection reset by peer"))  # not a collective's error
    assert not peer_lost(RuntimeError("CUDA out of memory"))
    assert not peer_lost(SaveError("disk full"))


def test_the_rejoin_line_carries_the_whole_gloo_line() -> None:
    # gloo's own line, as torch 2.13 raises it from a pair whose peer was SIGKILLed: 207
    # characters, the words at its end included (it was cut at 160, mid-word)
    gloo = "[/pytorch/" + GLOO_RESET[1:] + " or crashing, check the other ranks' logs."
    exc = RuntimeError(
        gloo + "\nException raised from recv at pair.cc:537 (most recent call first):"
    )
    assert peer_gone_line(1, 0, exc) == (
        f"rank 1: a peer of generation 0 is gone ({gloo}); rejoining"
    )


FAR_END = """
import socket, sys
a, b = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
print(a.getsockname()[1], b.getsockname()[1], flush=True)
(ca, _), (cb, _) = a.accept(), b.accept()
cb.settimeout(10)
print("cut:", cb.recv(1) == b"", flush=True)          # EOF: this end was severed
ca.sendall(b"x")                                       # the kept link still works
"""


def test_sever_connections_closes_peers_but_keeps_the_supervisor() -> None:
    far = subprocess.Popen([sys.executable, "-c", FAR_END], stdout=subprocess.PIPE, text=True)
    try:
        assert far.stdout is not None
        keep_port, cut_port = (int(p) for p in far.stdout.readline().split())
        kept = socket.create_connection(("127.0.0.1", keep_port))
        cut = socket.create_connection(("127.0.0.1", cut_port))
        assert sever_connections(keep_port=keep_port) >= 1
        assert far.stdout.readline().strip() == "cut: True"  # the far end saw EOF at once
        kept.settimeout(10)
        assert kept.recv(1) == b"x"
        kept.close()
        cut.close()
    finally:
        far.wait(timeout=10)


def test_the_supervisor_restart_line_says_what_the_launcher_line_says(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A restart of the supervisor, on real processes (no worker code: 3 members sleep, rank 1
    is SIGKILLed, one warm spare waits): its line has the launcher's form (attempt of how
    many, which rank died and of what), then what the supervisor did."""
    from shardsmith.trainer.runtime import supervisor as sup_module
    from shardsmith.trainer.runtime.supervisor import Supervisor

    monkeypatch.setattr(sup_module, "SETTLE_S", 0.5)  # rank 1 is dead, the others never die
    sup = Supervisor(str(tmp_path / "job.json"), 4, max_restarts=2, spares=1)
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    sup.procs = {f"w{i}": subprocess.Popen(sleep) for i in range(5)}
    sup.assigned = dict.fromkeys(sup.procs, 0)
    sup.members, sup.spares = ["w0", "w1", "w2", "w3"], ["w4"]
    try:
        sup.procs["w1"].kill()
        sup.procs["w1"].wait(timeout=30)
        sup._restart()
    finally:
        sup._stop_all()
    assert capsys.readouterr().err.splitlines() == [
        "restart 1 of 2: rank 1 died (SIGKILL); replaced by a warm spare, the other 3 ranks "
        "restart in place"
    ]
    assert sup.members == ["w0", "w4", "w2", "w3"]


def test_restart_lines_without_a_shrink_say_who_replaced_whom() -> None:
    from shardsmith.trainer.runtime.agent import restart_line
    from shardsmith.trainer.runtime.supervisor import replaced_words

    # a node's two ranks, one warm spare left: a new process takes the second slot
    assert restart_line(3, 5, {0: -9, 1: -9}, 4, then=replaced_words(2, 1, 4)) == (
        "restart 3 of 5: rank 0 died (SIGKILL), rank 1 died (SIGKILL); replaced by a warm "
        "spare and a new process, the other 2 ranks restart in place"
    )
    # no rank died: a member caught a failed collective (a timeout) and said so
    assert restart_line(1, 1, {}, 2, then=replaced_words(0, 1, 2)) == (
        "restart 1 of 1: no rank died (a member reported a failure); all 2 ranks restart in place"
    )
    assert replaced_words(3, 3, 4) == (
        "replaced by 3 warm spares, the other rank restarts in place"
    )


# ---- gloo: chaos vs reference ----------------------------------------------------------------


def train(root: Path, data_path: str, env: dict[str, str], max_restarts: int, spares: int) -> Run:
    cmd = [
        sys.executable,
        "-m",
        "shardsmith",
        "train",
        "--nproc-per-node",
        "4",
        "--tp",
        "2",
        *TINY_TRAIN_FLAGS,
        "--data",
        data_path,
        "--steps",
        str(STEPS),
        "--ckpt",
        str(root),
        "--save-interval",
        "5",
        "--local-ckpt",
        str(root.parent / f"{root.name}-local"),
        "--local-replicas",
        "1",
        "--simulate-nodes",
        "2",
        "--restart",
        "in-process",
        "--spares",
        str(spares),
        "--max-restarts",
        str(max_restarts),
    ]
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env},
    )
    (root.parent / f"{root.name}.log").write_text(proc.stdout)
    metrics = root / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return Run(
        proc.returncode, proc.stdout, root, [json.loads(line) for line in lines if line.strip()]
    )


def chaos_env(seed: int, markers: Path) -> tuple[dict[str, str], list[tuple[str, int, Any]]]:
    """Five faults at steps 3, 5, 7, 9, 11 (one per generation): every kind of :data:`KINDS`
    once plus one drawn again, in an order and on ranks drawn from ``seed``. Crash points
    (inside a save) fire in the one generation the fault is reached in (``..._GEN{G}``, G = its
    index); kills fire once (marker files)."""
    rng = random.Random(seed)
    steps = [
        3,
        5,
        7,
        9,
        11,
    ]  # 2 apart: a crash in the save of step s happens before step s + 2 starts
    kinds = [*KINDS, rng.choice(KINDS)]
    rng.shuffle(kinds)
    # spares refilled at once: a restart finding fewer warm spares than lost ranks would shrink
    env: dict[str, str] = {
        "SHARDSMITH_TEST_MARKER_DIR": str(markers),
        "SHARDSMITH_SPARES_REFILL_S": "0",
    }
    kills, lose, plan = [], [], []
    for gen, (kind, step) in enumerate(zip(kinds, steps)):
        if kind == "rank":
            who: Any = rng.randrange(4)
            kills.append(f"{who}:{step}")
        elif kind == "node":
            who = rng.randrange(2)
            lose += [f"{2 * who}:{step}", f"{2 * who + 1}:{step}"]
        else:
            who = rng.randrange(4)
            point = "local.before_write" if kind == "local-save" else "local.before_replicate"
            env["SHARDSMITH_TEST_CRASH_AT" + (f"_GEN{gen}" if gen else "")] = (
                f"{who}:{point}:{step}"
            )
        plan.append((kind, step, who))
    env["SHARDSMITH_TEST_KILL_AT"] = ",".join(kills)
    env["SHARDSMITH_TEST_LOSE_NODE_AT"] = ",".join(lose)
    return env, plan


def lost_steps(records: list[dict[str, Any]]) -> list[int]:
    """Per restart: the newest step finished before it - the step its recovery loaded."""
    lost, last, restarted = [], 0, False
    for r in records:
        if r.get("event") == "start" and r["restart_count"] > 0:
            restarted = True
        elif r.get("event") == "recovery" and restarted:
            lost.append(last - r["step"])
            restarted = False
        elif "event" not in r:
            last = r["step"]
    return lost


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inprocess")


@pytest.fixture(scope="module")
def reference(work: Path, data_path: str) -> Run:
    run = train(work / "reference", data_path, {}, 0, spares=0)
    assert run.returncode == 0, run.output[-6000:]
    return run


@pytest.mark.distributed
def test_chaos_in_process_restarts_end_bitwise_equal_to_an_uninterrupted_run(
    work: Path, data_path: str, reference: Run
) -> None:
    seed = int(os.environ.get("SHARDSMITH_CHAOS_SEED", random.randrange(2**31)))
    env, plan = chaos_env(seed, work / "markers")
    where = f"chaos seed {seed} (SHARDSMITH_CHAOS_SEED={seed} replays it), faults {plan}"
    print(where)  # shown with -s, and on failure
    chaos = train(work / "chaos", data_path, env, len(plan), spares=2)
    assert chaos.returncode == 0, f"{where}:\n{chaos.output[-8000:]}"
    kinds = [kind for kind, _, _ in plan]
    assert chaos.output.count("test hook: SIGKILL") == len(plan) - kinds.count("node"), (
        where
    )  # kills, crashes
    assert chaos.output.count("test hook: node lost") == 2 * kinds.count("node"), (
        where
    )  # both ranks
    restarts = [line for line in chaos.output.splitlines() if line.startswith("restart ")]
    assert len(restarts) == len(plan), f"{where}: {restarts}"  # one line per restart
    named = r"restart \d+ of \d+: rank \d+ died \(SIGKILL\)"
    assert all(re.match(named, r) for r in restarts), f"{where}: {restarts}"
    assert all("restart in place" in r for r in restarts), f"{where}: {restarts}"
    assert [e["restart_count"] for e in chaos.events("start")] == list(range(len(plan) + 1)), where
    lost = lost_steps(chaos.records)
    assert len(lost) == len(plan) and max(lost) <= 1, f"{where}: steps lost per restart {lost}"
    ref = reference.losses()
    assert sorted(ref) == list(range(1, STEPS + 1))
    for r in chaos.records:  # every step, each time it ran
        if "event" not in r:
            assert r["loss"] == ref[r["step"]], f"{where}: step {r['step']}"
    assert_tensors_bitwise_equal(
        read_full_tensors(str(chaos.root / step_dir(STEPS))),
        read_full_tensors(str(reference.root / step_dir(STEPS))),
        where,
    )
    diff = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "diff",
            str(chaos.root / step_dir(STEPS)),
            str(reference.root / step_dir(STEPS)),
        ],
        capture_output=True,
        text=True,
    )
    assert diff.returncode == 0, f"{where}: shardsmith diff:\n{diff.stdout}{diff.stderr}"


@pytest.mark.distributed
def test_a_node_lost_right_after_a_cut_replication_loses_no_step(
    work: Path, data_path: str, reference: Run
) -> None:
    """Rank 1 dies inside step 3's save, after writing its local copy and before sending it
    to its buddy: the restart loads step 3 from the node's own copies, but no buddy holds
    node 0's. The recovery sends them again, so losing all of node 0 as the re-run step 4
    starts (no save in flight) still loads step 3 from the survivors; without that it fell back
    to step 2 (and, with step 4's save in flight at the loss, lost two steps: the chaos test's
    seed 1912402129)."""
    markers = work / "markers-cut"
    env = {
        "SHARDSMITH_TEST_MARKER_DIR": str(markers),
        "SHARDSMITH_SPARES_REFILL_S": "0",
        "SHARDSMITH_TEST_CRASH_AT": "1:local.before_replicate:3",
        "SHARDSMITH_TEST_LOSE_NODE_AT": "0:4:1,1:4:1",  # step 4 re-run after the restart
    }
    run = train(work / "cut", data_path, env, 2, spares=2)
    assert run.returncode == 0, run.output[-8000:]
    # rank 1 may die of rank 0's loss before it reaches the hook: node 0 is gone either way
    assert "test hook: node lost at step 4" in run.output, run.output[-8000:]
    assert "replaced by 2 warm spares" in run.output, run.output[-8000:]
    recovered = [r["step"] for r in run.records if r.get("event") == "recovery"]
    assert recovered == [3, 3], run.output[-8000:]
    ref = reference.losses()
    assert run.losses() == ref
