"""The headline benches in one go: one table of every peer ratio with its spread, one JSON line.

    OMP_NUM_THREADS=1 python bench/summary.py [--gb 1] [--repeats 5] [--rounds 3] [--quick]

Runs, one after the other, each in its own process:

* bench/checkpoint_vs_dcp.py ``--megatron --bytecheckpoint`` (save, load, async stall vs DCP,
  Megatron-Core and ByteCheckpoint, shipped and patched);
* bench/train_vs_peers.py (tokens/s and peak RSS vs torchtitan, step time vs a plain loop);
* bench/reshard_bench.py (offline reshard vs DCP and ``cp``).

Each bench pairs its rivals within rounds (bench/robust.py); this prints, for every headline
ratio, the median of per-round ratios, its IQR and min-max, the goal and the verdict (met,
missed, within noise), with the load average, then one JSON object: ``ratios`` (key -> median),
``spread``, ``within_noise``, ``verdicts``, ``load_average`` and any bench that failed.
``--quick`` runs small sizes (a smoke run: figures are not results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import robust

BENCH = Path(__file__).resolve().parent
#: key -> (bench, op, goal): the issue's goals (medians of paired rounds on a quiet machine).
GOALS: dict[str, tuple[str, str, float]] = {
    **{
        f"save_speedup_vs_{p}": ("checkpoint", ">=", 1.3)
        for p in ("dcp", "megatron", "bytecheckpoint")
    },
    **{
        f"load_speedup_vs_{p}": ("checkpoint", ">=", 1.3)
        for p in ("dcp", "megatron", "bytecheckpoint")
    },
    **{f"stall_vs_{p}": ("checkpoint", "<=", 0.1) for p in ("dcp", "megatron", "bytecheckpoint")},
    **{
        f"{k}_vs_bytecheckpoint_{m}": ("checkpoint", op, g)
        for m in ("shipped", "patched")
        for k, op, g in (
            ("save_speedup", ">=", 1.3),
            ("load_speedup", ">=", 1.3),
            ("stall", "<=", 0.1),
        )
    },
    "tokens_per_s_vs_torchtitan": ("train", ">=", 1.0),
    "peak_rss_vs_torchtitan": ("train", "<=", 0.8),
    "step_time_vs_plain_loop": ("train", "<=", 1.1),
    "speedup_vs_dcp": ("reshard", ">=", 2.0),
    "fraction_of_raw_copy": ("reshard", ">=", 0.6),
    "reshard_cpu_vs_copy": ("reshard", "<=", 1.3),
}


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    py = sys.executable
    if args.quick:
        return {
            "checkpoint": [
                py,
                str(BENCH / "checkpoint_vs_dcp.py"),
                "--gb",
                "0.05",
                "--repeats",
                "2",
                "--megatron",
                "--bytecheckpoint",
            ],
            "train": [
                py,
                str(BENCH / "train_vs_peers.py"),
                "--rounds",
                "1",
                "--steps",
                "4",
                "--warmup",
                "1",
                "--layers",
                "2",
                "--hidden",
                "128",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--ffn",
                "256",
                "--seq",
                "64",
                "--batch",
                "4",
                "--micro-batch",
                "2",
            ],
            "reshard": [py, str(BENCH / "reshard_bench.py"), "--gb", "0.1", "--runs", "2"],
        }
    return {
        "checkpoint": [
            py,
            str(BENCH / "checkpoint_vs_dcp.py"),
            "--gb",
            str(args.gb),
            "--repeats",
            str(args.repeats),
            "--megatron",
            "--bytecheckpoint",
        ],
        "train": [py, str(BENCH / "train_vs_peers.py"), "--rounds", str(args.rounds)],
        "reshard": [
            py,
            str(BENCH / "reshard_bench.py"),
            "--gb",
            str(args.reshard_gb),
            "--runs",
            str(args.repeats),
        ],
    }


def run_bench(name: str, cmd: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """The bench's last stdout line as JSON, or (None, why)."""
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired:
        return None, f"{name}: timed out after {timeout:.0f} s"
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]), ""
    except (IndexError, json.JSONDecodeError):
        return None, f"{name}: rc {proc.returncode}: {proc.stderr.strip()[-400:]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint bench state, GiB")
    p.add_argument("--reshard-gb", type=float, default=1.0)
    p.add_argument(
        "--repeats", type=int, default=5, help="rounds of the checkpoint and reshard benches"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of train_vs_peers")
    p.add_argument("--only", default="checkpoint,train,reshard", help="comma-separated subset")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not results")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench")
    args = p.parse_args(argv)
    results, failed = {}, {}
    for name, cmd in commands(args).items():
        if name in args.only.split(","):
            print(f"running {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            results[name], why = run_bench(name, cmd, args.timeout)
            if why:
                failed[name] = why
    goals: dict[str, Any] = {}
    for key, (bench, op, goal) in GOALS.items():
        spread = ((results.get(bench) or {}).get("spread") or {}).get(key)
        goals[key] = (spread, op, goal)
    lines, noise = robust.judge(goals)
    print(
        f"{'ratio':36s}{'median':>8s}  spread, goal, verdict (medians of per-round ratios, rivals alternating)"
    )
    print("\n".join(lines))
    for name, why in failed.items():
        print(f"{name} failed: {why}")
    print(
        json.dumps(
            {
                "ratios": {k: (v[0]["median"] if v[0] else None) for k, v in goals.items()},
                "spread": {k: v[0] for k, v in goals.items() if v[0]},
                "within_noise": noise,
                "verdicts": {k: robust.verdict(v[0], v[1], v[2]) for k, v in goals.items() if v[0]},
                "load_average": robust.load_average(),
                "failed": failed,
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
