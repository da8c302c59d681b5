"""Recovery after a kill: in-process restart + local tier vs torchrun restart + persistent store.

    OMP_NUM_THREADS=1 python bench/recovery_bench.py        (no arguments needed)

Every run is the real ``shardsmith train`` CLI on the tiny model of the tests, 4 processes,
tp2 x dp_shard2, 2 simulated nodes of 2 ranks (``--simulate-nodes 2``), in one bench run:

* ``baseline``: today's path: persistent store only (``--save-interval 5``), ``--max-restarts 1``
  by torchrun's elastic agent; rank 1 SIGKILLs itself as step ``--kill-step`` starts.
* ``new``: ``--restart in-process --spares 3``, the local tier every step with buddy copies
  (``--local-ckpt --local-replicas 1``), the same persistent store and interval; rank 1 is
  SIGKILLed as step ``--kill-step`` starts, then the whole node 1 (ranks 2 and 3, whose
  local tier is deleted: ``SHARDSMITH_TEST_LOSE_NODE_AT``) as step ``--node-step`` starts.
* goodput (:mod:`shardsmith.trainer.detect.goodput`: productive, lost, checkpoint, recovery,
  start-up, other, as fractions of the wall time, from each run's ``metrics.jsonl``): of the
  ``baseline`` and ``new`` runs above (their injected failures), always; and with
  ``--fail-every-s S`` (off by default: two more launches, which do not fit the acceptance's
  1200 s on the shared 2-core VM), the ``new`` path's flags run the same number of steps twice:
  without failures, then with rank 1 SIGKILLed after every S seconds of training
  (``SHARDSMITH_TEST_KILL_EVERY``: counted from each restart's first step);
  the steps are as many as ``--goodput-s`` seconds take at the ``new`` run's rate;
  MTTR and steps lost per failure as below.
* ``overhead``: ``--repeats`` pairs of uninterrupted runs, alternating which goes first: the
  local tier every step (the persistent store only at the end) vs no checkpoints; steps/s
  between the step records of ``metrics.jsonl`` after ``--warmup`` steps; the median of the
  pairs' ratios (each pair ran back to back, under one load).
* ``--rounds`` (default 1): rounds of one ``baseline`` and one ``new`` run, alternating, the
  order rotated each round (bench/robust.py); ``mttr_ratio`` is the median of per-round ratios
  (new / baseline MTTR), ``mttr_s``, ``baseline_mttr_s``, ``node_mttr_s``, ``goodput`` and
  ``baseline_goodput`` the medians over the rounds, ``lost_steps`` the worst round, the parts
  and sources those of the round with the median goodput (the lower of the two middle ones).

Measured from ``metrics.jsonl`` (rank 0 stamps every record with Unix time) and the kill
hooks' marker files (created just before the SIGKILL: their mtime is the kill time):
``mttr_s`` = the first step record after the restart's ``start`` - the kill; ``lost_steps`` = the
last step finished before the kill (the killed step - 1) - the step the restart loaded; ``source`` = the ``recovery`` event's
tier. The last stdout line is one JSON object; the targets are ``lost_steps <= 1``,
``mttr_s <= 0.3 * baseline_mttr_s`` and ``overhead >= 0.95``; ``goodput`` is the ``new`` run's
productive fraction (``baseline_goodput`` the baseline's), ``periodic_goodput`` the run with a
failure every ``--fail-every-s`` seconds (``periodic_goodput_no_failures`` the same run without).
``mttr_ratio`` (goal <= 0.3) and ``overhead`` (>= 0.95) are judged on their IQR: ``within_noise``
holds those whose IQR straddles the goal; ``spread`` holds both and the goodputs' spread over
the rounds; ``load_average`` the machine's load.

``--shrink`` runs only the "node lost, not replaced" row (``--shrink-rounds`` rounds, default 3,
the persistent store always on the loopback S3 server): tp2 x dp_shard2 on 4 simulated nodes of
one rank each, ``--local-save-interval 1 --local-replicas 1`` where a local tier is used, rank 1's
node lost as step ``--kill-step`` starts and not replaced, three runs per round: ``persistent``
(today: the job ends; the 2 survivors relaunch, a new torchrun, and load the persistent step),
``inprocess-persistent`` (``--restart in-process --spares 0`` without a local tier: the survivors
shrink in place to tp2 and load the persistent step) and ``peers`` (the same with the local tier:
they reshard the newest local step from each other's tiers). Per run: kill to the next finished
step, steps lost, checkpoint bytes read from the persistent store (the ``resume`` events'
``nbytes_read`` from ``s3://``; the listing and manifest head that say which tier is newer are
not counted) and bytes moved between ranks (``peer_reshard``). The JSON line holds
``shrink_p2p_vs_persistent`` (median of per-round peers / persistent times, goal <= 0.3),
``shrink_p2p_vs_inprocess_persistent`` (the data path's share), ``shrink_p2p_steps_lost`` and
``shrink_p2p_persistent_bytes_read`` (worst round), ``within_noise`` and ``spread``.

``--persistent s3``: every ``--ckpt`` (baseline, new, overhead) is an ``s3://`` prefix on the
tests' loopback moto server (``tests/helpers/s3server.py``, in this process), reached by the workers
through the standard ``AWS_*`` environment; the local tier stays on ``/dev/shm``. This is where
loading from the local tier instead of the persistent store is what saves time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import robust

MODEL_FLAGS = [
    "--tp",
    "2",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--ffn-hidden-size",
    "64",
    "--vocab-size",
    "256",
    "--seq-length",
    "16",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--simulate-nodes",
    "2",
]


def records(root: Path) -> list[dict[str, Any]]:
    path = root / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Persistent:
    """Where each run's ``--ckpt`` goes: a local directory, or a prefix on a loopback moto S3
    server started here (``--persistent s3``); ``env`` reaches it from the workers."""

    def __init__(self, kind: str) -> None:
        self.env: dict[str, str] = {}
        self.server: Any = None
        self.bucket = ""
        if kind == "s3":
            tests = Path(__file__).resolve().parent.parent / "tests"
            sys.path[:0] = [str(tests / "helpers"), str(tests)]
            from s3server import start_server  # the tests' moto server: one way to start it

            self.server, info = start_server("recovery-bench")
            self.env, self.bucket = info.env, info.bucket

    def url(self, root: Path) -> str:
        """``--ckpt`` of the run whose run directory is ``root``."""
        return f"s3://{self.bucket}/{root.name}" if self.server else str(root)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


STORE = Persistent("local")  # main() replaces it per --persistent


def train(
    root: Path,
    data: str,
    steps: int,
    *flags: str,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    nproc: int = 4,
    model_flags: list[str] = MODEL_FLAGS,
    check: bool = True,
) -> list[dict[str, Any]]:
    """One ``shardsmith train`` (``nproc`` processes); its metrics records. Raises on failure
    (unless not ``check``: a run meant to die)."""
    cmd = [
        sys.executable,
        "-m",
        "shardsmith",
        "train",
        "--nproc-per-node",
        str(nproc),
        *model_flags,
        "--data",
        data,
        "--steps",
        str(steps),
        "--lr-decay-steps",
        str(steps),
        "--run-dir",
        str(root),
        *flags,
    ]
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            **STORE.env,
            **(env or {}),
        },
    )
    log = root.parent / f"{root.name}.log"
    log.write_text(log.read_text() + proc.stdout if log.exists() else proc.stdout)
    if proc.returncode != 0 and check:
        raise SystemExit(f"{root.name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return records(root)


def recovery(recs: list[dict[str, Any]], kill_time: float, kill_step: int) -> dict[str, Any]:
    """MTTR, lost steps and source of the restart after the kill at ``kill_time``, as step
    ``kill_step`` started (so ``kill_step - 1`` had finished: rank 0 may log it just after)."""
    restart = next(r["time"] for r in recs if r.get("event") == "start" and r["time"] > kill_time)
    after = [r for r in recs if "event" not in r and "loss" in r and r["time"] > restart]
    if not after:
        raise SystemExit("no step finished after the restart")
    first = after[0]
    events = [r for r in recs if r.get("event") == "recovery" and r["time"] > restart]
    return {
        "mttr_s": round(first["time"] - kill_time, 3),
        "lost_steps": kill_step - first["step"],
        "source": events[0]["source"] if events else "persistent",
    }


def kill_time(markers: Path, kind: str, step: int) -> float:
    """The mtime of the hook's marker (written just before its SIGKILL); the earliest of a node."""
    found = sorted(markers.glob(f"{kind}-rank*-step{step}"))
    if not found:
        raise SystemExit(f"no {kind} marker for step {step} under {markers}")
    return min(p.stat().st_mtime for p in found)


def run_baseline(work: Path, data: str, args: argparse.Namespace, r: int = 0) -> dict[str, Any]:
    root, markers = work / f"baseline-{r}", work / f"baseline-{r}-markers"
    env = {
        "SHARDSMITH_TEST_KILL_AT": f"1:{args.kill_step}",
        "SHARDSMITH_TEST_MARKER_DIR": str(markers),
    }
    recs = train(
        root,
        data,
        args.kill_step + 3,
        "--ckpt",
        STORE.url(root),
        "--save-interval",
        str(args.save_interval),
        "--max-restarts",
        "1",
        env=env,
    )
    return {
        **recovery(recs, kill_time(markers, "kill", args.kill_step), args.kill_step),
        **goodput_of(recs),
    }


def run_new(
    work: Path, data: str, args: argparse.Namespace, r: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    root, markers, local = work / f"new-{r}", work / f"new-{r}-markers", work / f"new-{r}-local"
    env = {
        "SHARDSMITH_TEST_KILL_AT": f"1:{args.kill_step}",
        "SHARDSMITH_TEST_LOSE_NODE_AT": f"2:{args.node_step},3:{args.node_step}",
        "SHARDSMITH_TEST_MARKER_DIR": str(markers),
    }
    recs = train(
        root,
        data,
        args.node_step + 3,
        "--ckpt",
        STORE.url(root),
        "--save-interval",
        str(args.save_interval),
        "--local-ckpt",
        str(local),
        "--local-save-interval",
        "1",
        "--local-replicas",
        "1",
        "--restart",
        "in-process",
        "--spares",
        "3",
        "--max-restarts",
        "2",
        env=env,
    )
    args.rate = new_rate(recs)
    rank = recovery(recs, kill_time(markers, "kill", args.kill_step), args.kill_step)
    node = recovery(recs, kill_time(markers, "lose-node", args.node_step), args.node_step)
    return {**rank, **goodput_of(recs)}, node


def goodput_runs(work: Path, data: str, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """Goodput without failures and with one every ``--fail-every-s`` seconds (same steps)."""
    from shardsmith.trainer.detect.goodput import CATEGORIES, breakdown

    steps = min(max(int(args.goodput_s * rate), 20), 5000)
    flags = [
        "--save-interval",
        str(args.save_interval),
        "--local-save-interval",
        "1",
        "--local-replicas",
        "1",
        "--restart",
        "in-process",
        "--spares",
        "2",
        "--max-restarts",
        "20",
    ]
    out: dict[str, Any] = {"periodic_steps": steps, "periodic_fail_every_s": args.fail_every_s}
    for kind in ("clean", "failing"):
        root, markers = work / f"goodput-{kind}", work / f"goodput-{kind}-markers"
        env = (
            {
                "SHARDSMITH_TEST_KILL_EVERY": f"1:{args.fail_every_s}",
                "SHARDSMITH_TEST_MARKER_DIR": str(markers),
                # spares refilled at once: failures faster than the refill would shrink the job
                "SHARDSMITH_SPARES_REFILL_S": "0",
            }
            if kind == "failing"
            else {}
        )
        recs = train(
            root,
            data,
            steps,
            "--ckpt",
            STORE.url(root),
            "--local-ckpt",
            str(work / f"goodput-{kind}-local"),
            *flags,
            env=env,
        )
        g = breakdown(recs)
        print(f"  goodput {kind}: {g}", file=sys.stderr, flush=True)
        if kind == "clean":
            out["periodic_goodput_no_failures"] = g["goodput"]
            continue
        kills = sorted(markers.glob("kill-every-rank*-step*")) if markers.exists() else []
        each = [recovery(recs, p.stat().st_mtime, int(p.name.rsplit("step", 1)[1])) for p in kills]
        out.update(
            periodic_goodput=g["goodput"],
            periodic_parts={k: g[k] for k in CATEGORIES},
            periodic_wall_s=g["wall_s"],
            periodic_failures=len(kills),
            periodic_mttr_s=round(statistics.mean(r["mttr_s"] for r in each), 3) if each else None,
            periodic_steps_lost=sum(r["lost_steps"] for r in each),
        )
    return out


def goodput_of(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's goodput and its parts (fractions of its wall time; they sum to 1)."""
    from shardsmith.trainer.detect.goodput import CATEGORIES, breakdown

    g = breakdown(recs)
    return {
        "goodput": g["goodput"],
        "goodput_parts": {k: g[k] for k in CATEGORIES},
        "goodput_wall_s": g["wall_s"],
        "goodput_sum": round(sum(g[k] for k in CATEGORIES), 4),
    }


def new_rate(recs: list[dict[str, Any]]) -> float:
    """Steps/s of a run between its step records (median interval, restarts left out)."""
    times = [r["time"] for r in recs if "event" not in r and "loss" in r]
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    return 1.0 / gaps[len(gaps) // 2] if gaps else 1.0


def steps_per_s(recs: list[dict[str, Any]], warmup: int) -> float:
    times = [r["time"] for r in recs if "event" not in r and "loss" in r and r["step"] > warmup]
    return (len(times) - 1) / (times[-1] - times[0])


def run_overhead(work: Path, data: str, args: argparse.Namespace, t0: float) -> dict[str, Any]:
    """Steps/s with the local tier every step / without checkpoints (median of the pairs'
    ratios); no new pair starts once the bench has run ``--budget-s`` seconds (one always runs)."""
    rates: dict[str, list[float]] = {"local": [], "none": []}
    for i in range(args.repeats):
        if i and time.time() - t0 > args.budget_s:
            print(
                f"  overhead: {i} pair(s) only (--budget-s {args.budget_s} reached)",
                file=sys.stderr,
                flush=True,
            )
            break
        for kind in robust.rotated(["local", "none"], i):
            root = work / f"overhead-{kind}-{i}"
            flags = (
                [
                    "--ckpt",
                    STORE.url(root),
                    "--save-interval",
                    "0",
                    "--local-ckpt",
                    str(work / f"overhead-local-{i}"),
                    "--local-save-interval",
                    "1",
                ]
                if kind == "local"
                else []
            )
            recs = train(root, data, args.warmup + args.measure, *flags)
            rates[kind].append(steps_per_s(recs, args.warmup))
            print(
                f"  overhead run {i} {kind}: {rates[kind][-1]:.2f} steps/s",
                file=sys.stderr,
                flush=True,
            )
    # Each pair ran back to back, so its ratio sees one load; the load drifts between pairs by
    # more than the effect measured (x2 on this shared machine), hence the median of the ratios.
    stat = robust.paired(rates["local"], rates["none"])
    return {
        "overhead": round(stat["median"], 3),
        "overhead_pairs": [round(r, 3) for r in stat["rounds"]],
        "overhead_stat": stat,
        "steps_per_s_local": round(statistics.median(rates["local"]), 3),
        "steps_per_s_none": round(statistics.median(rates["none"]), 3),
    }


def corpus(path: Path) -> str:
    """~100 KB of real text (standard-library sources), tokenized as bytes."""
    import argparse as a
    import json as j
    import textwrap as t

    path.write_bytes(b"\n\n".join(Path(m.__file__).read_bytes() for m in (j, a, t)))
    return str(path)


# ---- the shrink row: a node lost and not replaced (--shrink) -----------------------------------

#: The shrink row's layout: tp2 x dp_shard2 on 4 simulated nodes of one rank each, so the lost
#: node's copy (its buddy's) lies on another survivor and the peer path moves it over the network.
SHRINK_NODES = ["--simulate-nodes", "4"]
SHRINK_MODEL = MODEL_FLAGS[: MODEL_FLAGS.index("--simulate-nodes")]


def shrink_run(
    work: Path, data: str, args: argparse.Namespace, kind: str, r: int
) -> dict[str, Any]:
    """One run of the shrink row: node 1 (rank 1) is lost as step ``--kill-step`` starts and
    not replaced. ``kind``: ``persistent`` (today: the job ends; the 2 survivors relaunch, a new
    torchrun, and load the persistent step), ``inprocess-persistent`` (the survivors shrink in
    place, no local tier: the persistent step) or ``peers`` (the survivors shrink in place and
    reshard the newest local step from their tiers). Kill to the next finished step, steps
    lost, bytes of checkpoint data read from the persistent store (the resume's ``nbytes_read``)
    and bytes moved between ranks."""
    root, markers = work / f"shrink-{kind}-{r}", work / f"shrink-{kind}-{r}-markers"
    env = {
        "SHARDSMITH_TEST_LOSE_NODE_AT": f"1:{args.kill_step}",
        "SHARDSMITH_TEST_MARKER_DIR": str(markers),
    }
    flags = ["--ckpt", STORE.url(root), "--save-interval", str(args.save_interval)]
    steps = args.kill_step + 2
    if kind == "persistent":
        model = SHRINK_MODEL
        train(root, data, steps, *flags, *SHRINK_NODES, env=env, model_flags=model, check=False)
        recs = train(root, data, steps, *flags, "--simulate-nodes", "2", nproc=2, model_flags=model)
    else:
        local = (
            [
                "--local-ckpt",
                str(work / f"shrink-{kind}-{r}-local"),
                "--local-save-interval",
                "1",
                "--local-replicas",
                "1",
            ]
            if kind == "peers"
            else []
        )
        recs = train(
            root,
            data,
            steps,
            *flags,
            *SHRINK_NODES,
            *local,
            "--restart",
            "in-process",
            "--spares",
            "0",
            "--max-restarts",
            "1",
            env=env,
            model_flags=SHRINK_MODEL,
        )
    killed = kill_time(markers, "lose-node", args.kill_step)
    out = recovery(recs, killed, args.kill_step)
    after = [x for x in recs if x.get("time", 0) > killed]
    out["persistent_bytes_read"] = sum(
        x.get("nbytes_read", 0)
        for x in after
        if x.get("event") == "resume" and str(x.get("from", "")).startswith("s3://")
    )
    out["peer_bytes"] = sum(
        x.get("nbytes_received", 0) for x in after if x.get("event") == "peer_reshard"
    )
    out["layout"] = next((x["layout"] for x in after if x.get("event") == "resume"), None)
    return out


def run_shrink(work: Path, data: str, args: argparse.Namespace) -> dict[str, Any]:
    """The shrink row: ``--shrink-rounds`` rounds of the three runs, alternating (robust.py);
    ``shrink_p2p_vs_persistent`` = the median of per-round (peers / persistent) times."""
    kinds = ("persistent", "inprocess-persistent", "peers")
    rounds = robust.alternate(
        {k: (lambda r, k=k: shrink_run(work, data, args, k, r)) for k in kinds},
        args.shrink_rounds,
        log=lambda r, k, out: print(
            f"round {r + 1} shrink {k}: {out}", file=sys.stderr, flush=True
        ),
    )
    secs = {k: [x["mttr_s"] for x in rounds[k]] for k in kinds}
    stats = {
        "shrink_p2p_vs_persistent": robust.paired(secs["peers"], secs["persistent"]),
        "shrink_p2p_vs_inprocess_persistent": robust.paired(
            secs["peers"], secs["inprocess-persistent"]
        ),
    }
    med = {k: round(statistics.median(v), 3) for k, v in secs.items()}
    lost = {k: max(x["lost_steps"] for x in rounds[k]) for k in kinds}
    read = {k: max(x["persistent_bytes_read"] for x in rounds[k]) for k in kinds}
    peer = {k: max(x["peer_bytes"] for x in rounds[k]) for k in kinds}
    print(
        f"node lost, not replaced (tp2·dp_shard2 on 4 simulated nodes -> tp2; medians of {args.shrink_rounds} "
        f"round(s); lost and bytes: the worst round)\n{'':34}{'kill->step s':>13}{'lost':>6}"
        f"{'persistent B':>14}{'peer B':>10}"
    )
    for k, name in zip(
        kinds,
        (
            "torchrun relaunch + persistent",
            "in-process shrink + persistent",
            "in-process shrink + peers",
        ),
    ):
        print(f"{name:34}{med[k]:>13}{lost[k]:>6}{read[k]:>14}{peer[k]:>10}")
    result = {
        "shrink_p2p_persistent_bytes_read": read["peers"],
        "shrink_p2p_steps_lost": lost["peers"],
        **robust.medians(stats),
        "shrink_p2p_s": med["peers"],
        "shrink_persistent_s": med["persistent"],
        "shrink_inprocess_persistent_s": med["inprocess-persistent"],
        "shrink_persistent_steps_lost": lost["persistent"],
        "shrink_persistent_bytes_read": read["persistent"],
        "shrink_p2p_peer_bytes": peer["peers"],
        "shrink_layouts": [rounds["peers"][0]["layout"]],
    }
    result.update(
        robust.report(
            "\npaired rounds (median of per-round ratios):",
            {
                "shrink_p2p_vs_persistent": (stats["shrink_p2p_vs_persistent"], "<=", 0.3),
                "shrink_p2p_vs_inprocess_persistent": (
                    stats["shrink_p2p_vs_inprocess_persistent"],
                    None,
                    None,
                ),
            },
        )
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-step", type=int, default=8, help="rank 1 dies as this step starts")
    parser.add_argument(
        "--node-step", type=int, default=13, help="node 1 (ranks 2, 3) dies as this step starts"
    )
    parser.add_argument(
        "--save-interval", type=int, default=5, help="persistent-store interval (both paths)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="overhead: pairs of runs")
    parser.add_argument(
        "--warmup", type=int, default=5, help="overhead: steps left out of the rate"
    )
    parser.add_argument("--measure", type=int, default=20, help="overhead: steps measured")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=780,
        help="overhead: start no new pair after this many seconds of the bench",
    )
    parser.add_argument(
        "--persistent",
        choices=("local", "s3"),
        default="local",
        help="the persistent store (--ckpt): /dev/shm, or the tests' loopback moto S3 server",
    )
    parser.add_argument(
        "--fail-every-s",
        type=float,
        default=0,
        help="goodput: also two runs, without failures and with one every this many seconds (e.g. 30)",
    )
    parser.add_argument(
        "--goodput-s",
        type=float,
        default=65,
        help="goodput: steps for about this many seconds at the new run's rate (2 failures at 30 s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of one baseline and one new run, alternating (MTTR ratio: median of rounds)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (its path is printed)"
    )
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="only the 'node lost, not replaced' row (the persistent store on the loopback S3)",
    )
    parser.add_argument(
        "--shrink-rounds", type=int, default=3, help="shrink row: rounds of its three runs"
    )
    args = parser.parse_args()
    global STORE
    STORE = Persistent("s3" if args.shrink else args.persistent)
    if args.shrink:
        return shrink_main(args)
    work = Path(
        tempfile.mkdtemp(
            prefix="recovery-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    t0 = time.time()
    try:
        data = corpus(work / "corpus.txt")
        rounds = robust.alternate(
            {
                "baseline": lambda r: run_baseline(work, data, args, r),
                "new": lambda r: run_new(work, data, args, r),
            },
            args.rounds,
            log=log_round,
        )
        good = goodput_runs(work, data, args, args.rate) if args.fail_every_s > 0 else {}
        over = run_overhead(work, data, args, t0)
    finally:
        STORE.stop()
        if args.keep:
            print(f"work directory: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    result = summarize(
        rounds["baseline"], [r for r, _ in rounds["new"]], [n for _, n in rounds["new"]], over, good
    )
    result.update(
        persistent=args.persistent,
        rounds=args.rounds,
        load_avg_1m=round(os.getloadavg()[0], 2),
        wall_s=round(time.time() - t0, 1),
    )
    print(json.dumps(result))


def shrink_main(args: argparse.Namespace) -> None:
    """``--shrink``: the shrink row alone; its JSON line last."""
    work = Path(
        tempfile.mkdtemp(
            prefix="shrink-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    t0 = time.time()
    try:
        result = run_shrink(work, corpus(work / "corpus.txt"), args)
    finally:
        STORE.stop()
        if args.keep:
            print(f"work directory: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    result.update(persistent="s3", wall_s=round(time.time() - t0, 1))
    print(json.dumps(result))


def log_round(r: int, kind: str, out: Any) -> None:
    if kind == "baseline":
        print(
            f"round {r + 1} baseline (torchrun, persistent store): {out}",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"round {r + 1} in-process + local tier: rank {out[0]}, node {out[1]}",
            file=sys.stderr,
            flush=True,
        )


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose goodput is the median (the lower middle one for an even count)."""
    g = statistics.median_low(r["goodput"] for r in runs)
    return next(r for r in runs if r["goodput"] == g)


def summarize(
    base: list[dict[str, Any]],
    rank: list[dict[str, Any]],
    node: list[dict[str, Any]],
    over: dict[str, Any],
    good: dict[str, Any],
) -> dict[str, Any]:
    """The JSON summary of the rounds (round order in each list), printed as a table with the
    paired ratios (bench/robust.py); see the module docstring for the keys."""

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 3)

    b, n = median_round(base), median_round(rank)
    stats = {
        "mttr_ratio": robust.paired([r["mttr_s"] for r in rank], [r["mttr_s"] for r in base]),
        "overhead": over.pop("overhead_stat"),
        "goodput": robust.spread([r["goodput"] for r in rank]),
        "baseline_goodput": robust.spread([r["goodput"] for r in base]),
    }
    result = {
        "mttr_s": med(rank, "mttr_s"),
        "lost_steps": max(r["lost_steps"] for r in rank + node),
        "source": n["source"],
        "node_mttr_s": med(node, "mttr_s"),
        "node_lost_steps": max(r["lost_steps"] for r in node),
        "node_source": node[rank.index(n)]["source"],
        "baseline_mttr_s": med(base, "mttr_s"),
        "baseline_lost_steps": max(r["lost_steps"] for r in base),
        "baseline_source": b["source"],
        "mttr_ratio": round(stats["mttr_ratio"]["median"], 3),
        **over,
        "goodput": med(rank, "goodput"),
        "goodput_parts": n["goodput_parts"],
        "goodput_sum": n["goodput_sum"],
        "baseline_goodput": med(base, "goodput"),
        "baseline_goodput_parts": b["goodput_parts"],
        **good,
    }
    print(
        f"{'':24}{'mttr_s':>8}{'lost':>6}  source   (medians of {len(rank)} round(s); lost: the worst)\n"
        f"{'torchrun + persistent':24}{result['baseline_mttr_s']:>8}{result['baseline_lost_steps']:>6}  "
        f"{b['source']}\n{'in-process, one rank':24}{result['mttr_s']:>8}"
        f"{max(r['lost_steps'] for r in rank):>6}  {n['source']}\n{'in-process, one node':24}"
        f"{result['node_mttr_s']:>8}{result['node_lost_steps']:>6}  {result['node_source']}\n"
        f"overhead (local every step / none): {over['overhead']}\n"
        f"goodput: new {result['goodput']} vs baseline {result['baseline_goodput']}"
        + (
            f"; {good['periodic_goodput']} with a failure every {good['periodic_fail_every_s']:g} s "
            f"({good['periodic_failures']} failures, MTTR {good['periodic_mttr_s']} s, "
            f"{good['periodic_steps_lost']} steps lost), {good['periodic_goodput_no_failures']} without"
            if good
            else ""
        )
    )
    result.update(
        robust.report(
            "\npaired rounds (median of per-round ratios; goodputs: median over rounds):",
            {
                "mttr_ratio": (stats["mttr_ratio"], "<=", 0.3),
                "overhead": (stats["overhead"], ">=", 0.95),
                "goodput": (stats["goodput"], None, None),
                "baseline_goodput": (stats["baseline_goodput"], None, None),
            },
        )
    )
    return result


if __name__ == "__main__":
    main()
