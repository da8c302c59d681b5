"""Training throughput with async checkpoints every K steps vs no checkpoints, same run.

    OMP_NUM_THREADS=1 python bench/train_overhead.py --nproc 2 --layout 1.1.2.1 --steps 65

Launches the real trainer (``shardsmith.trainer.runtime.launch.launch``, torchrun's API, each time
in a fresh process) twice per repeat, alternating which goes first: once with async
checkpoints every ``--interval`` steps to a local directory and once without a checkpoint
root, same model, data, layout and length.
Throughput is steps per second of wall time between the step records of ``metrics.jsonl``
after ``--warmup`` steps (start-up excluded; the time between two step records includes
everything the loop did in between: the save's blocking part, and the background save
competing for the CPU). The run length is chosen so the last save lands before the last
measured step. Prints a table and, as the last line, one JSON object with
``throughput_ratio`` (with checkpoints / without; the target is >= 0.97): the median of the
per-round ratios (bench/robust.py: the two runs of a round alternate, rotating which goes
first), with ``spread`` (IQR, min-max), ``within_noise`` (a ratio whose IQR straddles its goal)
and ``load_average``. ``--rounds`` is ``--repeats``.

On a shared machine the load drifts between runs by more than the few percent measured,
so a second estimate comes from inside each checkpointing run: ``within_run_ratio``
compares the whole run's step rate with that of its steps far from any save (same run,
same load); the same number computed on the runs without checkpoints is its noise floor.

The trainer's blocked time per save (the ``save`` event's ``blocked_seconds``: the whole
``CheckpointPolicy.save`` plus snapshot waits) is reported next to the checkpointer's own part
(``saver_blocked_seconds``: ``AsyncCheckpointer.save``, what bench/checkpoint_vs_dcp.py
measures), as ``blocked_vs_checkpointer``: the median of the per-save ratios (goal <= 1.5).
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
from pathlib import Path
from typing import Any

import robust

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.trainer.config import CheckpointConfig, DataConfig, OptimConfig, TrainConfig


def parse_layout(name: str) -> ParallelDims:
    """``pp.dp_replicate.dp_shard.tp`` -> ParallelDims."""
    pp, dpr, dps, tp = (int(x) for x in name.split("."))
    return ParallelDims(pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp)


def corpus(path: Path) -> str:
    """A few hundred KB of real text (standard-library sources), tokenized as bytes."""
    import argparse as a
    import json as j
    import textwrap as t
    import typing as ty

    path.write_bytes(b"\n\n".join(Path(m.__file__).read_bytes() for m in (j, a, t, ty)))
    return str(path)


def make_config(args: argparse.Namespace, data: str, ckpt: str, run_dir: str) -> TrainConfig:
    model = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=args.ffn,
        vocab_size=256,
        seq_length=args.seq,
    )
    checkpoint = CheckpointConfig(
        url=ckpt,
        save_interval=args.interval if ckpt else 0,
        resume="none",
        save_final=False,
        async_save=not args.sync,
    )
    return TrainConfig(
        model=model,
        parallel=parse_layout(args.layout),
        data=DataConfig(sources=(data,)),
        optim=OptimConfig(lr=1e-3, warmup_steps=5),
        checkpoint=checkpoint,
        steps=args.steps,
        global_batch_size=args.batch,
        micro_batch_size=args.micro_batch,
        log_interval=0,
        run_dir=run_dir,
    )


def throughput(run_dir: str, warmup: int, interval: int) -> dict[str, Any]:
    """Steps/s between the step records after ``warmup`` and the last one; save events; and
    the within-run ratio (see :func:`within_run_ratio`)."""
    records = [
        json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line
    ]
    steps = [r for r in records if "step" in r and "event" not in r]
    saves = [r for r in records if r.get("event") == "save"]
    first, last = steps[warmup - 1], steps[-1]
    return {
        "steps_per_s": (last["step"] - first["step"]) / (last["time"] - first["time"]),
        "within_run_ratio": within_run_ratio(steps[warmup - 1 :], interval),
        "saves": len(saves),
        "nbytes": saves[0]["nbytes"] if saves else 0,
        "blocked_s": statistics.median(s["blocked_seconds"] for s in saves) if saves else 0.0,
        "saver_blocked_s": statistics.median(s.get("saver_blocked_seconds", 0.0) for s in saves)
        if saves
        else 0.0,
        "blocked_pairs": [(s["blocked_seconds"], s.get("saver_blocked_seconds")) for s in saves],
        "save_s": statistics.median(s["seconds"] for s in saves) if saves else 0.0,
    }


def within_run_ratio(steps: list[dict[str, Any]], interval: int) -> float:
    """Throughput of the whole run / throughput of its steps far from any save (the 2nd..
    last-but-one after each save point), from the wall time between step records.

    A save blocks before the step after its save point and its background work overlaps
    the next step or two; the other steps of the same run are the baseline, measured under
    the same machine load (a shared machine's load drifts between runs much more than the
    few percent this measures). On a run without checkpoints it shows the method's noise.
    """
    gaps = {b["step"]: b["time"] - a["time"] for a, b in zip(steps, steps[1:])}
    quiet = [g for step, g in gaps.items() if 3 <= (step - 1) % interval + 1 <= interval - 1]
    return statistics.mean(quiet) / statistics.mean(gaps.values())


def run_launch(cfg: TrainConfig, nproc: int, tmp: Path) -> None:
    """``launch(cfg, nproc)`` in a fresh Python process: launching again from one process
    makes later runs slower (3.7 -> 1.5 -> 0.9 steps/s over three launches here, the steps
    themselves unchanged), which would bias whichever configuration runs later."""
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg.to_json()))
    code = (
        "import json, sys; from shardsmith.trainer.config import TrainConfig; "
        "from shardsmith.trainer.runtime.launch import launch; "
        "launch(TrainConfig.from_json(json.load(open(sys.argv[1]))), int(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", code, str(path), str(nproc)], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layout", default="1.1.2.1", help="pp.dp_replicate.dp_shard.tp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=65)
    p.add_argument("--interval", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the measurement")
    p.add_argument(
        "--repeats",
        "--rounds",
        dest="repeats",
        type=int,
        default=2,
        help="rounds: one run with and one without checkpoints each, alternating",
    )
    p.add_argument("--sync", action="store_true", help="synchronous saves instead of async")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(tempfile.mkdtemp(prefix="train-overhead-"))
    try:
        data = corpus(tmp / "corpus.txt")

        def one_run(kind: str, rep: int) -> dict[str, Any]:
            run_dir = tmp / f"{kind}-{rep}"
            ckpt = str(run_dir / "ckpt") if kind == "ckpt" else ""
            run_launch(make_config(args, data, ckpt, str(run_dir)), args.nproc, tmp)
            try:
                return throughput(str(run_dir), args.warmup, args.interval)
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)

        results = robust.alternate(
            {"none": lambda r: one_run("none", r), "ckpt": lambda r: one_run("ckpt", r)},
            args.repeats,
            log=lambda r, kind, res: print(
                f"repeat {r} {kind}: {res}", file=sys.stderr, flush=True
            ),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summarize(args, results)))
    return 0


def summarize(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print the table and the paired ratios; return the JSON summary. ``throughput_ratio`` is
    the median of per-round ratios (ckpt / none steps/s); ``within_run_ratio`` and its control
    are the medians of each run's own figure, shown with their spread over the rounds."""
    none = statistics.median(r["steps_per_s"] for r in results["none"])
    ckpt = statistics.median(r["steps_per_s"] for r in results["ckpt"])
    saves = results["ckpt"][0]
    mode = "sync" if args.sync else "async"
    print(
        f"\n{args.nproc} ranks, layout {args.layout}, {args.steps} steps (first {args.warmup} excluded), "
        f"{mode} checkpoint every {args.interval} steps ({saves['nbytes'] / 2**20:.1f} MiB each); "
        f"medians of {args.repeats}"
    )
    print(f"{'':34s}{'steps/s':>10s}")
    print(f"{'no checkpoints':34s}{none:10.3f}")
    print(f"{mode + ' checkpoints':34s}{ckpt:10.3f}")
    stats = {
        "throughput_ratio": robust.paired(
            [r["steps_per_s"] for r in results["ckpt"]], [r["steps_per_s"] for r in results["none"]]
        ),
        "within_run_ratio": robust.spread([r["within_run_ratio"] for r in results["ckpt"]]),
        "within_run_ratio_control": robust.spread([r["within_run_ratio"] for r in results["none"]]),
        "blocked_vs_checkpointer": robust.paired(
            *zip(*(pair for r in results["ckpt"] for pair in r["blocked_pairs"]))
        ),
    }
    print(
        f"per save: trainer blocked {saves['blocked_s']:.4f} s (the checkpointer's save() alone, as "
        f"bench/checkpoint_vs_dcp.py measures it: {saves['saver_blocked_s']:.4f} s), until committed "
        f"{saves['save_s']:.3f} s, {saves['saves']} saves per run"
    )
    robust_out = robust.report(
        "\npaired rounds (throughput_ratio: median of per-round ratios; within-run ratios: median over runs; "
        "the control is the same measure on the runs without checkpoints):",
        {
            "throughput_ratio": (stats["throughput_ratio"], ">=", 0.97),
            "within_run_ratio": (stats["within_run_ratio"], ">=", 0.97),
            "within_run_ratio_control": (stats["within_run_ratio_control"], None, None),
            "blocked_vs_checkpointer": (stats["blocked_vs_checkpointer"], "<=", 1.5),
        },
    )
    return {
        **robust.medians(stats),
        "steps_per_s_none": none,
        "steps_per_s_ckpt": ckpt,
        "ratios": stats["throughput_ratio"]["rounds"],
        "saves_per_run": saves["saves"],
        "save_nbytes": saves["nbytes"],
        "blocked_s": saves["blocked_s"],
        "saver_blocked_s": saves["saver_blocked_s"],
        "save_s": saves["save_s"],
        "mode": mode,
        "nproc": args.nproc,
        "layout": args.layout,
        "steps": args.steps,
        "rounds": args.repeats,
        **robust_out,
    }


if __name__ == "__main__":
    sys.exit(main())
