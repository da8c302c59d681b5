"""shardsmith's trainer vs torchtitan and vs a minimal plain-PyTorch loop, same model, data and layout.

    OMP_NUM_THREADS=1 python bench/train_vs_peers.py [--rounds 3] [--layouts 1.1.2.2,2.1.1.2]

Three systems train the same Llama-style model (``--layers``/``--hidden``/``--heads``/
``--kv-heads``/``--ffn``, vocab ``--vocab``, sequence ``--seq``; fp32; causal SDPA attention)
on the same byte-level text (a JSONL corpus of standard-library sources, one token per byte),
the same global batch (``--batch`` sequences, micro-batches of ``--micro-batch``) and the same
layout (``pp.dp_replicate.dp_shard.tp``, 4 ranks, gloo):

* ``ours``: shardsmith's ``Trainer`` (bench/train_ranks.py);
* ``torchtitan`` 0.3.0 in its own interpreter (``.venv-titan``, built by bench/peers/setup.sh;
  env ``SHARDSMITH_TITAN_PYTHON``) with the CPU shim of bench/peers/titan_ranks.py; skipped,
  with the reason printed, without it; it trains fp32 too (``mixed_precision_param``, whose
  default bf16 would be FSDP's compute dtype), and a run in which any of its ranks' parameters
  lacks a gradient at the last step counts as failed (torch 2.13 runs torchtitan 0.3.0's pipeline
  only through the shim, and a shim that skipped a stage's backward once went unnoticed);
* ``plain``: torch's FSDP2 + DTensor TP around the same module, no checkpointing, no metrics,
  no pipeline (layouts with ``pp`` = 1 only): the step time nothing can beat on this machine.

Each round runs every system once per layout, in an order that rotates every round (A B C,
B C A, ...), each in fresh processes. Per run: the step time is the median over the steps after
``--warmup`` of rank 0's step wall time (start-up excluded); tokens/s = batch x seq / step time;
CPU s = the median over those steps of the CPU seconds all ranks spent in the step (what the
step costs whatever the machine's load); peak RSS = the largest rank's ``VmHWM``; after the last step each trainer saves once async
(seconds blocked, seconds until committed) and once sync, on the trained state. Ratios are the
median of per-round ratios with their spread (bench/robust.py); the last line is one JSON
object with ``tokens_per_s_vs_torchtitan`` (worst layout), ``peak_rss_vs_torchtitan`` (worst
layout), ``step_time_vs_plain_loop``, the save ratios, ``spread`` and ``within_noise``.
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

BENCH = Path(__file__).resolve().parent
GOALS = {
    "tokens_per_s_vs_torchtitan": (">=", 1.0),
    "peak_rss_vs_torchtitan": ("<=", 0.8),
    "step_time_vs_plain_loop": ("<=", 1.1),
}


def titan_python() -> str:
    return os.environ.get(
        "SHARDSMITH_TITAN_PYTHON", str(BENCH.parent / ".venv-titan" / "bin" / "python")
    )


def write_corpus(path: Path) -> None:
    """A JSONL corpus (field ``text``), one document per standard-library module source."""
    import argparse as a
    import json as j
    import statistics as st
    import textwrap as t
    import typing as ty

    with open(path, "w") as f:
        for mod in (j, a, t, ty, st):
            f.write(json.dumps({"text": Path(mod.__file__).read_text()}) + "\n")


def flops_per_step(args: argparse.Namespace) -> float:
    """Training FLOPs of one step: 6 x (matmul parameters) x tokens + causal attention
    12 x layers x seq x hidden per token (PaLM, Chowdhery et al. 2022, appendix B)."""
    hd = args.hidden // args.heads
    per_layer = (
        2 * args.hidden * args.hidden
        + 2 * args.hidden * args.kv_heads * hd
        + 3 * args.hidden * args.ffn
    )
    params = args.layers * per_layer + args.vocab * args.hidden
    tokens = args.batch * args.seq
    return 6 * params * tokens + 12 * args.layers * args.seq * args.hidden * tokens


def run_once(
    system: str, layout: str, args: argparse.Namespace, tmp: Path
) -> dict[str, Any] | None:
    """One training run of ``system``; its figures, or None (the reason printed) on failure."""
    work = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=tmp))
    micro = args.micro_batch if layout.startswith("1.") else max(1, args.micro_batch // 2)
    spec = {
        "model": {
            k: getattr(args, k)
            for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")
        },
        "layout": layout,
        "batch": args.batch,
        "micro_batch": micro,
        "steps": args.steps,
        "data": str(tmp / "corpus.jsonl"),
        "ckpt_dir": str(work / "ckpt"),
        "nproc": 4,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    py = titan_python() if system == "titan" else sys.executable
    t0 = time.perf_counter()
    proc = subprocess.run(
        [py, str(BENCH / "train_ranks.py"), system, str(work / "spec.json"), str(work / "out")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    wall = time.perf_counter() - t0
    ranks = (
        [json.loads(p.read_text()) for p in sorted((work / "out").glob("rank*.json"))]
        if (work / "out").exists()
        else []
    )
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode or len(ranks) != 4:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        print(
            f"  {system} {layout} failed (rc {proc.returncode}): {' | '.join(errors[-3:])[:600] or proc.stderr[-600:]}",
            file=sys.stderr,
            flush=True,
        )
        return None
    if untrained := without_gradients(ranks):
        print(
            f"  {system} {layout} failed: parameters without a gradient at the last step ({'; '.join(untrained)})",
            file=sys.stderr,
            flush=True,
        )
        return None
    step = statistics.median(ranks[0]["step_s"][args.warmup :])
    cpu = statistics.median(
        sum(r["cpu_s"][i] for r in ranks) for i in range(args.warmup, len(ranks[0]["cpu_s"]))
    )
    out = {
        "step_s": step,
        "cpu_s": cpu,
        "tokens_per_s": args.batch * args.seq / step,
        "rss_mib": max(r["hwm_mib"] for r in ranks),
        "wall_s": wall,
        "steps_s": round(sum(ranks[0]["step_s"]), 2),
    }
    if "ckpt" in ranks[0]:
        out.update({k: max(r["ckpt"][k] for r in ranks) for k in ranks[0]["ckpt"]})
    return out


def without_gradients(ranks: list[dict[str, Any]]) -> list[str]:
    """``"rank R: K of N"`` for each rank whose figures say that only K of its N parameters had a
    gradient at the last optimizer step (a stage that ran no backward); ranks that do not report
    ``grads`` are not judged."""
    return [
        f"rank {r}: {g['with_grad']} of {g['params']}"
        for r, g in enumerate(x.get("grads") for x in ranks)
        if g and g["with_grad"] < g["params"]
    ]


def systems_for(layout: str, have_titan: bool) -> list[str]:
    return (
        ["ours"]
        + (["titan"] if have_titan else [])
        + (["plain"] if layout.startswith("1.1.") else [])
    )


def measure(args: argparse.Namespace, tmp: Path, have_titan: bool) -> dict[str, dict[str, list]]:
    """``{layout: {system: [figures or None per round]}}``, systems alternating within rounds."""
    runs: dict[str, dict[str, list]] = {}
    for r in range(args.rounds):
        for layout in args.layouts.split(","):
            for system in robust.rotated(systems_for(layout, have_titan), r):
                fig = run_once(system, layout, args, tmp)
                runs.setdefault(layout, {}).setdefault(system, []).append(fig)
                print(
                    f"round {r} {layout} {system}: "
                    + (", ".join(f"{a}={b:.4g}" for a, b in fig.items()) if fig else "failed")
                    + f" (load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def col(runs: dict[str, list], system: str, key: str) -> list[float | None]:
    return [f[key] if f and key in f else None for f in runs.get(system, [])]


def paired_or_none(num: list, den: list) -> dict[str, Any] | None:
    try:
        return robust.paired(num, den)
    except ValueError:
        return None


def ratios(runs: dict[str, dict[str, list]]) -> dict[str, dict[str, Any] | None]:
    """Per-layout paired stats and the headline ones: the worst layout among those where both
    ours and torchtitan completed at least one round (the others are listed by :func:`report`
    as ``torchtitan_failed_layouts``)."""
    stats: dict[str, dict[str, Any] | None] = {}
    tok, rss = [], []
    for layout, by in runs.items():
        stats[f"tokens_per_s_vs_torchtitan.{layout}"] = paired_or_none(
            col(by, "ours", "tokens_per_s"), col(by, "titan", "tokens_per_s")
        )
        stats[f"peak_rss_vs_torchtitan.{layout}"] = paired_or_none(
            col(by, "ours", "rss_mib"), col(by, "titan", "rss_mib")
        )
        stats[f"sync_save_speedup_vs_torchtitan.{layout}"] = paired_or_none(
            col(by, "titan", "sync_s"), col(by, "ours", "sync_s")
        )
        stats[f"async_stall_vs_torchtitan.{layout}"] = paired_or_none(
            col(by, "ours", "async_blocked"), col(by, "titan", "async_blocked")
        )
        tok.append(stats[f"tokens_per_s_vs_torchtitan.{layout}"])
        rss.append(stats[f"peak_rss_vs_torchtitan.{layout}"])
        if "plain" in by:
            stats[f"step_time_vs_plain_loop.{layout}"] = paired_or_none(
                col(by, "ours", "step_s"), col(by, "plain", "step_s")
            )
            stats["step_time_vs_plain_loop"] = stats[f"step_time_vs_plain_loop.{layout}"]
    tok, rss = (
        [t for t in tok if t],
        [r for r in rss if r],
    )  # layouts torchtitan could not run drop out
    stats["tokens_per_s_vs_torchtitan"] = min(tok, key=lambda s: s["median"]) if tok else None
    stats["peak_rss_vs_torchtitan"] = max(rss, key=lambda s: s["median"]) if rss else None
    stats.setdefault("step_time_vs_plain_loop", None)
    return stats


def report(
    args: argparse.Namespace, runs: dict[str, dict[str, list]], titan_why: str
) -> dict[str, Any]:
    """Print the table of medians and the paired ratios; return the JSON summary."""
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} kv), ffn {args.ffn}, "
        f"vocab {args.vocab}, seq {args.seq}; batch {args.batch} x {args.seq} tokens; fp32; "
        f"{flops_per_step(args) / 1e9:.1f} GFLOP/step; {args.steps} steps, first {args.warmup} excluded; "
        f"{args.rounds} rounds, systems alternating"
    )
    print(
        f"{'layout':10s}{'system':8s}{'step s':>9s}{'CPU s':>8s}{'tok/s':>9s}{'RSS MiB':>9s}{'sync s':>9s}{'async blk':>10s}"
        f"{'async s':>9s}{'run s':>8s}"
    )
    for layout, by in runs.items():
        for system, figs in by.items():
            done = [f for f in figs if f]
            if not done:
                print(f"{layout:10s}{system:8s}  failed every round")
                continue

            def med(key: str) -> str:
                vals = [f[key] for f in done if key in f]
                return f"{statistics.median(vals):9.3f}" if vals else f"{'-':>9s}"

            print(
                f"{layout:10s}{system:8s}{med('step_s')}{med('cpu_s')[1:]}{med('tokens_per_s')}{med('rss_mib')}{med('sync_s')}"
                f"{med('async_blocked'):>10s}{med('async_s')}{med('wall_s')[:-1]:>8s}"
            )
    if titan_why:
        print(f"torchtitan: skipped: {titan_why}")
    for layout, by in runs.items():
        if "titan" in by and not any(by["titan"]):
            print(
                f"torchtitan: failed every round at {layout} (its errors are printed above): "
                "the headline ratios cover the other layouts"
            )
    stats = ratios(runs)
    goals = {k: (stats[k], *GOALS[k]) for k in GOALS}
    lines, noise = robust.judge(goals)
    print("\npaired rounds (median of per-round ratios):")
    for key, s in stats.items():
        if "." in key and s:
            print(
                f"  {key:48s}{s['median']:8.3f}  IQR {s['q1']:.3f}-{s['q3']:.3f}  min-max {s['min']:.3f}-{s['max']:.3f}"
            )
    print("\n".join(lines))
    return {
        **{k: (v["median"] if v else None) for k, v in stats.items()},
        "spread": {k: v for k, v in stats.items() if v},
        "within_noise": noise,
        "load_average": robust.load_average(),
        "gflop_per_step": round(flops_per_step(args) / 1e9, 2),
        "torchtitan_skipped": titan_why or None,
        "torchtitan_failed_layouts": [
            layout for layout, by in runs.items() if "titan" in by and not any(by["titan"])
        ],
        "medians": {
            f"{layout}.{system}": {
                k: round(statistics.median(f[k] for f in figs if f), 4)
                for k in next(f for f in figs if f)
            }
            for layout, by in runs.items()
            for system, figs in by.items()
            if any(figs)
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--layouts", default="1.1.2.2,2.1.1.2", help="pp.dp_replicate.dp_shard.tp, 4 ranks each"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the step time")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    p.add_argument(
        "--micro-batch", type=int, default=4, help="micro-batch (halved under pipeline parallelism)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--no-titan", action="store_true", help="skip torchtitan")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    titan_why = (
        "not requested (--no-titan)"
        if args.no_titan
        else (
            ""
            if os.path.exists(titan_python())
            else f"no torchtitan interpreter at {titan_python()} (bash bench/peers/setup.sh titan, or set SHARDSMITH_TITAN_PYTHON)"
        )
    )
    tmp = Path(tempfile.mkdtemp(prefix="train-vs-peers-"))
    try:
        write_corpus(tmp / "corpus.jsonl")
        runs = measure(args, tmp, not titan_why)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not titan_why and not any(f for by in runs.values() for f in by.get("titan", [])):
        titan_why = "every torchtitan run failed (its errors are printed above)"
    print(json.dumps(report(args, runs, titan_why)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
