"""Bytes per step on the real training step, by process group, beside the cost model's formula.

Runs the trainer's own step (:class:`shardsmith.trainer.train.Trainer`, a tiny Llama, fp32, gloo)
on 8 processes in two layouts, ``tp2·pp2·dp_shard2`` and ``pp2·dp_replicate2·dp_shard2``, for
M = 2, 4, 8 microbatches, V = 1, 2 virtual stages and both FSDP exchange policies
(``--fsdp-reshard-after-forward default``: once per step under pipelining; ``always``: per
microbatch). Every collective and send the step issues is seen by a ``TorchDispatchMode`` over
PyTorch's c10d operators (the process-group tables of
``torch.distributed._tools.fake_collectives``): FSDP2's all-gathers and reduce-scatters, the
HSDP all-reduce, DTensor's TP collectives and the pipeline's sends. Each is counted in bus bytes
(nccl-tests' convention, :mod:`shardsmith.sizing.traffic`) under the kind of its group (the mesh
axes its ranks differ in). The first step (the schedule's shape inference) is not counted; two
steps are, each printed per rank beside :func:`shardsmith.sizing.step_traffic` for the same job.

The last line is JSON: ``fsdp_bytes_growth_with_microbatches`` (dp_shard + dp_replicate bytes per
step at M=8 over M=2 under the default policy, the largest over layouts, V and ranks; goal <=
1.05), ``max_rel_error_vs_cost_model`` (the dp_shard, dp_replicate, pp and tp kinds; goal <=
0.05), ``tp_max_rel_error`` (the tp kind alone: four collectives per layer and microbatch plus
the embedding's and the output projection's), ``always_over_default_at_m8``
(what the per-microbatch exchange moves more) and ``ok``.

    OMP_NUM_THREADS=1 python bench/comm_volume.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardsmith.layout import ModelConfig, ParallelDims, reshards_after_forward
from shardsmith.sizing import GROUP_KINDS, step_traffic

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)
LAYOUTS = {
    "tp2·pp2·dp_shard2": ParallelDims(tp=2, pp=2, dp_shard=2),
    "pp2·dp_replicate2·dp_shard2": ParallelDims(pp=2, dp_replicate=2, dp_shard=2),
}
MICROBATCHES = (2, 4, 8)
VIRTUAL = (1, 2)
POLICIES = ("default", "always")
JUDGED = ("dp_shard", "dp_replicate", "pp", "tp")
STEPS = 2


def bus_nbytes(func: Any, args: tuple, group_size: int) -> float:
    """Bus bytes of one c10d operator call on this rank (nccl-tests' convention; receives 0)."""
    import torch

    n, name = group_size, str(func).split(".")[1] if "." in str(func) else str(func)

    def nbytes(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(nbytes(y) for y in x) if isinstance(x, (list, tuple)) else 0

    part = (n - 1) / n
    table = {
        "_allgather_base_": lambda: part * nbytes(args[0]),
        "_reduce_scatter_base_": lambda: part * nbytes(args[1]),
        "allreduce_": lambda: 2 * part * nbytes(args[0]),
        "allgather_": lambda: (n - 1) * nbytes(args[1]),
        "reduce_scatter_": lambda: (n - 1) * nbytes(args[0]),
        "broadcast_": lambda: nbytes(args[0]),
        "send": lambda: nbytes(args[0]),
        "alltoall_base_": lambda: part * nbytes(args[1]),
        "all_reduce": lambda: 2 * part * nbytes(args[0]),
        "all_gather_into_tensor": lambda: (n - 1) * nbytes(args[0]),
        "reduce_scatter_tensor": lambda: part * nbytes(args[0]),
        "all_to_all_single": lambda: part * nbytes(args[0]),
    }
    return float(table[name]()) if name in table else 0.0


def group_kind(ranks: tuple[int, ...], dims: ParallelDims) -> str:
    """The kind of a process group: the mesh axis its ranks differ in (FSDP's flattened
    ``dp_shard * cp`` group is ``dp_shard``); ``world`` for several."""
    coords = [dims.coords(r) for r in ranks]
    axes = {a for a in coords[0] if len({c[a] for c in coords}) > 1}
    if axes and axes <= {"dp_shard", "cp"} and "dp_shard" in axes:
        return "dp_shard"
    return next(iter(axes)) if len(axes) == 1 else "world"


def recorder(dims: ParallelDims) -> Any:
    """A ``TorchDispatchMode`` adding up bus bytes per group kind in ``.nbytes``."""
    import torch.distributed as dist
    from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.nbytes: dict[str, float] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func in collective_ops and "barrier" not in str(func):
                try:
                    ranks = tuple(
                        dist.get_process_group_ranks(CollectiveOp.get_process_group(func, args))
                    )
                except TypeError:  # wait_tensor and the like: no group, no bytes
                    return out
                kind = group_kind(ranks, dims)
                self.nbytes[kind] = self.nbytes.get(kind, 0.0) + bus_nbytes(func, args, len(ranks))
            return out

    return Recorder()


def worker(spec_path: str) -> None:
    """One launch: every case of one layout; each rank writes its bytes per step and case."""
    import dataclasses
    import gc

    import torch.distributed as dist

    from shardsmith.trainer.config import DataConfig, OptimConfig, TrainConfig
    from shardsmith.trainer.train import Trainer

    spec = json.loads(Path(spec_path).read_text())
    base = ParallelDims.from_json(spec["parallel"])
    out: list[dict[str, Any]] = []
    for v in VIRTUAL:
        dims = dataclasses.replace(base, virtual_stages=v)
        for m in MICROBATCHES:
            for policy in POLICIES:
                cfg = TrainConfig(
                    model=MODEL,
                    parallel=dims,
                    optim=OptimConfig(lr=1e-3),
                    data=DataConfig(sources=(spec["data"],)),
                    global_batch_size=m * dims.dp,
                    micro_batch_size=1,
                    steps=STEPS + 1,
                    fsdp_reshard_after_forward=policy,
                )
                trainer = Trainer.create(cfg)
                trainer.train_step()  # the schedule's shape inference: not counted
                steps = []
                for _ in range(STEPS):
                    with recorder(dims) as rec:
                        trainer.train_step()
                    steps.append(rec.nbytes)
                out.append(
                    {"v": v, "m": m, "policy": policy, "rank": dist.get_rank(), "steps": steps}
                )
                del trainer
                gc.collect()
    Path(spec["out"], f"rank-{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def corpus(path: Path) -> str:
    """A few hundred KB of real text (standard-library sources), tokenized as bytes."""
    import argparse as a
    import textwrap as t

    path.write_bytes(b"\n\n".join(Path(mod.__file__).read_bytes() for mod in (json, a, t)))
    return str(path)


def launch(name: str, dims: ParallelDims, work: Path, data: str) -> list[dict[str, Any]]:
    """Run :func:`worker` for one layout on ``dims.world_size`` gloo processes."""
    out = work / name
    out.mkdir()
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"parallel": dims.to_json(), "data": data, "out": str(out)}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={dims.world_size}",
        __file__,
        "--worker",
        str(spec),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{name}: launch failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [r for f in sorted(out.glob("rank-*.json")) for r in json.loads(f.read_text())]


def predicted(dims: ParallelDims, row: dict[str, Any]) -> dict[str, float]:
    """:func:`shardsmith.sizing.step_traffic` of the row's job and rank."""
    import dataclasses

    job = dataclasses.replace(dims, virtual_stages=row["v"])
    return step_traffic(
        MODEL,
        job,
        pp_rank=job.coords(row["rank"])["pp"],
        micro_batch_size=1,
        num_microbatches=row["m"],
        mixed_precision="fp32",
        reshard_after_forward=reshards_after_forward(row["policy"], job.pp),
    )


def rel_error(got: float, want: float) -> float:
    return 0.0 if got == want else abs(got - want) / max(abs(want), 1.0)


def report(name: str, dims: ParallelDims, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Print one layout's table; return its worst errors and growth."""
    worst = {"judged": 0.0, "tp": 0.0, "growth": 0.0, "always_over_default": 0.0}
    fsdp: dict[tuple, float] = {}
    print(
        f"\n{name}: bus bytes per step and rank, measured / cost model (kinds: {', '.join(GROUP_KINDS)})"
    )
    for row in sorted(rows, key=lambda r: (r["v"], r["m"], r["policy"], r["rank"])):
        want = predicted(dims, row)
        for i, got in enumerate(row["steps"], 2):
            cells = []
            for kind in GROUP_KINDS + ("world",):
                g, w = got.get(kind, 0.0), want.get(kind, 0.0)
                if g or w:
                    cells.append(f"{kind} {g:,.0f}/{w:,.0f}")
                if kind in JUDGED:
                    worst["judged"] = max(worst["judged"], rel_error(g, w))
                if kind == "tp":
                    worst["tp"] = max(worst["tp"], rel_error(g, w))
            print(
                f"  V={row['v']} M={row['m']} {row['policy']:<7} rank {row['rank']} step {i}: "
                + "; ".join(cells)
            )
        fsdp[(row["v"], row["m"], row["policy"], row["rank"])] = sum(
            row["steps"][-1].get(k, 0.0) for k in ("dp_shard", "dp_replicate")
        )
    for (v, m, policy, rank), nbytes in fsdp.items():
        if (
            m == MICROBATCHES[-1]
            and policy == "default"
            and fsdp[(v, MICROBATCHES[0], policy, rank)]
        ):
            worst["growth"] = max(
                worst["growth"], nbytes / fsdp[(v, MICROBATCHES[0], policy, rank)]
            )
            if nbytes:
                worst["always_over_default"] = max(
                    worst["always_over_default"], fsdp[(v, m, "always", rank)] / nbytes
                )
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="comm-volume-") as tmp:
        work = Path(tmp)
        data = corpus(work / "corpus.txt")
        for i, (name, dims) in enumerate(LAYOUTS.items()):
            results[name] = report(name, dims, launch(f"layout{i}", dims, work, data))
    growth = max(r["growth"] for r in results.values())
    error = max(r["judged"] for r in results.values())
    print(
        json.dumps(
            {
                "fsdp_bytes_growth_with_microbatches": growth,
                "max_rel_error_vs_cost_model": error,
                "tp_max_rel_error": max(r["tp"] for r in results.values()),
                "always_over_default_at_m8": max(
                    r["always_over_default"] for r in results.values()
                ),
                "layouts": results,
                "seconds": time.perf_counter() - t0,
                "ok": growth <= 1.05 and error <= 0.05,
            }
        )
    )


if __name__ == "__main__":
    main()
