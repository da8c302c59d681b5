"""Per-rank peak memory of building and training a model no rank may hold whole (issue 17).

    OMP_NUM_THREADS=1 python bench/init_memory.py            # tp2·pp2·dp_shard2, 8 processes

Launches the real trainer (:class:`shardsmith.trainer.train.Trainer`) on ``--layout``
under ``torch.distributed.run`` (gloo, CPU), trains ``--steps`` optimizer steps of a model
whose full fp32 parameters are >= 1.5 GB, and has every worker report its peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, KiB on Linux; the worker is its own exec'd
process, so the figure is its own) next to its *share*: the bytes of the parameter boxes it
holds under :mod:`shardsmith.layout.sharding` (fp32) times 4 (parameters, gradients, AdamW
``exp_avg`` and ``exp_avg_sq``), plus the 4-byte AdamW step counters.

Target (issue 17): on every rank ``peak <= 1.3 * share + 600 MiB``, and the peak while
building (``Trainer.create``) below the full model's bytes (a rank that built the whole
model once would exceed it). Workers run with
``MALLOC_ARENA_MAX=2`` (glibc otherwise keeps one arena per thread, and freed memory of
the gloo threads' arenas stays resident), ``MALLOC_MMAP_THRESHOLD_=65536`` (see
:data:`shardsmith.trainer.runtime.launch.MALLOC_ENV`, as `shardsmith train` sets them) and ``OMP_NUM_THREADS=1``.

Prints a per-rank table, the "before" figure measured on the code that built the full
model on every rank (see bench/README.md), and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout.sharding import checkpoint_specs, param_specs, rank_boxes
from shardsmith.trainer.config import DataConfig, OptimConfig, TrainConfig
from shardsmith.trainer.runtime.launch import MALLOC_ENV  # the launcher's glibc malloc settings

MIB = 2**20
#: "Before": this bench on commit 1f5db9a (the full fp32 model built and initialized on
#: every rank, then the stage copied out), 2026-11-30, same machine and malloc settings:
#: ``--layout 2.1.1.2 --num-layers 16 --hidden-size 1024 --num-attention-heads 8
#: --num-kv-heads 8 --ffn-hidden-size 4096`` (full model 1026 MiB). The default model here
#: cannot be run that way on this 23 GiB machine (8 ranks x > 3 GiB).
BEFORE = {
    "model": "16 layers, hidden 1024, ffn 4096, pp2·tp2 on 4 processes (full model 1026 MiB)",
    "built_peak_rss_bytes_max": 1867 * MIB,
    "peak_rss_bytes_max": 1867 * MIB,
    "after_built_peak_rss_bytes_max": 598 * MIB,
    "after_peak_rss_bytes_max": 1414 * MIB,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default="2.1.2.2", help="pp.dp_replicate.dp_shard.tp")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=1536)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--num-kv-heads", type=int, default=12)
    p.add_argument("--ffn-hidden-size", type=int, default=6144)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mixed-precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def layout(name: str) -> ParallelDims:
    """``pp.dp_replicate.dp_shard.tp`` -> ParallelDims."""
    pp, dpr, dps, tp = (int(x) for x in name.split("."))
    return ParallelDims(pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp)


def share_nbytes(cfg: ModelConfig, dims: ParallelDims, rank: int) -> int:
    """Bytes of this rank's parameters + gradients + AdamW state under the plan (fp32):
    every box of :func:`checkpoint_specs` (parameters, exp_avg, exp_avg_sq, step) it holds,
    plus its parameter boxes once more for the gradients."""

    def total(specs: dict) -> int:
        return sum(
            box.numel * DTYPE_NBYTES[specs[f].dtype]
            for f, box in rank_boxes(specs, dims, rank).items()
        )

    return total(checkpoint_specs(cfg, dims)) + total(param_specs(cfg, dims))


def full_model_nbytes(cfg: ModelConfig) -> int:
    """Bytes of the whole model's fp32 parameters (canonical shapes, no padding)."""
    return sum(s.nbytes for s in param_specs(cfg, ParallelDims()).values())


def train_config(args: argparse.Namespace, data: str) -> TrainConfig:
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_kv_heads=args.num_kv_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=256,
        seq_length=args.seq_length,
    )
    dims = layout(args.layout)
    return TrainConfig(
        model=model,
        parallel=dims,
        optim=OptimConfig(lr=1e-4, warmup_steps=1),
        data=DataConfig(sources=(data,)),
        steps=args.steps,
        seed=0,
        global_batch_size=2 * dims.pp * dims.dp,
        micro_batch_size=1,
        mixed_precision=args.mixed_precision,
        log_interval=1,
    )


def worker(spec_path: str) -> None:
    """One rank: build, train, write ``{rank, peak_rss_bytes, share_bytes}`` next to the spec."""
    import torch.distributed as dist

    from shardsmith.trainer.train import Trainer

    cfg = TrainConfig.from_json(json.loads(Path(spec_path).read_text()))
    trainer = Trainer.create(cfg)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steps: list[int] = []
    iteration = trainer._iteration

    def measured_iteration() -> None:
        iteration()
        steps.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    trainer._iteration = measured_iteration  # peak after each step
    trainer.run()
    rank = dist.get_rank()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "rank": rank,
        "coords": cfg.parallel.coords(rank),
        "peak_rss_bytes": peak,
        "built_peak_rss_bytes": built,
        "step_peak_rss_bytes": steps,
        "share_bytes": share_nbytes(cfg.model, cfg.parallel, rank),
    }
    Path(spec_path).with_name(f"rank-{rank:05d}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def launch(cfg: TrainConfig, work: Path) -> list[dict]:
    """Run :func:`worker` on ``cfg.parallel.world_size`` processes; the per-rank reports."""
    spec = work / "spec.json"
    spec.write_text(json.dumps(cfg.to_json()))
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.parallel.world_size}",
        __file__,
        "--worker",
        str(spec),
    ]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        errors = [line for line in proc.stdout.splitlines() if "Error" in line][:10]
        sys.exit(
            f"training failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
            + "\n".join(errors)
        )
    return [json.loads(p.read_text()) for p in sorted(work.glob("rank-*.json"))]


def report(cfg: TrainConfig, ranks: list[dict]) -> dict:
    """Print the table and return the summary (the last line's JSON)."""
    full = full_model_nbytes(cfg.model)
    print(
        f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, ffn "
        f"{cfg.model.ffn_hidden_size}: full fp32 params {full / MIB:.0f} MiB; layout "
        f"{cfg.parallel.describe()}, {cfg.steps} steps, {cfg.mixed_precision}"
    )
    print(
        f"{'rank':>4} {'pp,dps,tp':>10} {'share MiB':>10} {'built MiB':>10} {'peak MiB':>9} {'goal MiB':>9} "
        f"{'ratio':>6}"
    )
    ok = True
    for r in ranks:
        goal = 1.3 * r["share_bytes"] + 600 * MIB
        good = r["peak_rss_bytes"] <= goal and r["built_peak_rss_bytes"] < full
        ok &= good
        c = r["coords"]
        print(
            f"{r['rank']:>4} {c['pp']:>6},{c['dp_shard']},{c['tp']} {r['share_bytes'] / MIB:>10.0f} "
            f"{r['built_peak_rss_bytes'] / MIB:>10.0f} {r['peak_rss_bytes'] / MIB:>9.0f} {goal / MIB:>9.0f} "
            f"{r['peak_rss_bytes'] / r['share_bytes']:>6.2f}{'' if good else '  OVER'}  steps: "
            + " ".join(f"{b / MIB:.0f}" for b in r["step_peak_rss_bytes"])
        )
    peak = max(r["peak_rss_bytes"] for r in ranks)
    print(
        f"before/after on {BEFORE['model']}: peak RSS after build "
        f"{BEFORE['built_peak_rss_bytes_max'] / MIB:.0f} -> {BEFORE['after_built_peak_rss_bytes_max'] / MIB:.0f}"
        f" MiB, over 2 steps {BEFORE['peak_rss_bytes_max'] / MIB:.0f} -> "
        f"{BEFORE['after_peak_rss_bytes_max'] / MIB:.0f} MiB (per rank, max)"
    )
    peak = max(r["peak_rss_bytes"] for r in ranks)
    return {
        "peak_rss_bytes_max": peak,
        "share_bytes_max": max(r["share_bytes"] for r in ranks),
        "full_model_bytes": full,
        "ok": ok,
        "ranks": len(ranks),
        "layout": cfg.parallel.describe(),
        "steps": cfg.steps,
        "malloc_env": MALLOC_ENV,
        "built_peak_rss_bytes_max": max(r["built_peak_rss_bytes"] for r in ranks),
        "before": BEFORE,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    with tempfile.TemporaryDirectory(prefix="init-memory-") as tmp:
        data = Path(tmp) / "corpus.txt"
        data.write_bytes(
            b"".join(Path(m.__file__).read_bytes() for m in (json, argparse, tempfile))
        )
        cfg = train_config(args, str(data))
        summary = report(cfg, launch(cfg, Path(tmp)))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
