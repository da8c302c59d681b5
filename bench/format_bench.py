"""Benchmark: safetensors vs zarr (raw, and zstd on the optimizer state) on the same state.

    python bench/format_bench.py [--mb 80] [--runs 3] [--dir /tmp/format-bench] [--codec zstd] [--keep]

``--rounds`` is ``--runs``.

1. Builds one model state in memory: a Llama-shaped model (hidden 512, 8 heads, 4 kv
   heads, FFN 1408, vocab 8192; layers scaled to about ``--mb`` MB of float32 parameters)
   plus AdamW state (``exp_avg`` ~ N(0, 1e-3), ``exp_avg_sq`` its square, step counters),
   so about 3x ``--mb`` MB in all.
2. For each format, once per round, ``--runs`` rounds, the order rotated each round
   (bench/robust.py; medians reported):
   - **save**: what the ranks of a ``--save-layout`` (default tp2·pp2) job write, each
     rank's boxes in turn in this one process (safetensors: one file per rank via
     ``SafetensorsFormat``; zarr: chunks and metadata via ``ZarrFormat``, storage/formats/registry.py), then the
     commit. The same process and writer order for every format, so the ratio is fair;
     a real job writes the ranks' shares in parallel.
   - **reshard-load**: every rank of ``--load-layout`` (default dp_shard=4, a different
     split of every matrix) reads its boxes with ``read_boxes`` (as ``load_into`` does),
     one rank after another; bytes read vs bytes needed give the read amplification
     (zarr reads whole chunks: they may be compressed).
   Objects and bytes stored are counted on disk (every file of the step, manifest included).
3. Prints a table and, as the last line, one JSON object: per format its numbers and the
   ratios to safetensors (the baseline measured in the same run); the time ratios
   (``save_s``, ``reshard_load_s``) are medians of per-round ratios, with ``spread``
   (``<format>.<key>``: IQR, min-max), ``load_average`` and ``within_noise``: there is no
   goal, so each is judged against parity (<= 1.0: the format no slower than safetensors)
   and ``within_noise`` names those this run cannot tell from safetensors.

Local disk, warm page cache: the times compare CPU and per-object costs, not a network.
Random mantissas hardly compress (zstd saves a few percent of the optimizer state);
real optimizer state compresses somewhat better. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import robust
import torch

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.assignment import write_assignment
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.storage.checksum import DEFAULT_CHUNK_NBYTES
from shardsmith.storage.commit import commit, read_manifest, step_dir
from shardsmith.storage.formats.registry import read_boxes
from shardsmith.storage.formats.registry import tensor_format as get_tensor_format
from shardsmith.storage.manifest.records import ManifestBuilder
from shardsmith.storage.reading.execute import ReadStats
from shardsmith.storage.store.fs import Store

STEP = 100
MB = 1_000_000


def model_config(mb: float) -> ModelConfig:
    """Layers (even, >= 2) so the float32 parameters come to about ``mb`` MB."""
    base = ModelConfig(
        num_layers=2,
        hidden_size=512,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=1408,
        vocab_size=8192,
        seq_length=256,
    )
    d, f, kv = base.hidden_size, base.ffn_hidden_size, base.num_kv_heads * base.head_dim
    layer = (2 * d * d + 2 * kv * d + 3 * d * f + 2 * d) * 4
    fixed = (2 * base.vocab_size * d + d) * 4
    layers = max(2, 2 * round(max(0.0, mb * MB - fixed) / layer / 2))
    return ModelConfig(**{**base.to_json(), "num_layers": layers})


def build_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    """Full logical tensors: parameters and AdamW state (see module docstring)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for fqn, spec in checkpoint_specs(model, ParallelDims()).items():
        if not spec.shape:
            out[fqn] = torch.tensor(float(STEP))
        elif fqn.startswith("optim.exp_avg_sq."):
            out[fqn] = out[fqn.replace("exp_avg_sq", "exp_avg")] ** 2
        elif fqn.startswith("optim.exp_avg."):
            out[fqn] = torch.randn(spec.shape, generator=g) * 1e-3
        else:
            out[fqn] = torch.randn(spec.shape, generator=g) * 0.02
    return out


def _piece(full: dict[str, torch.Tensor], fqn: str, box: Box) -> torch.Tensor:
    return full[fqn][box.relative_to(Box((0,) * len(box.lengths), tuple(full[fqn].shape)))]


def save(
    root: Store,
    full: dict[str, torch.Tensor],
    model: ModelConfig,
    dims: ParallelDims,
    tensor_format: str,
    codec: str,
) -> None:
    """Write and commit ``full`` as a ``dims`` job would, one rank's share after another."""
    specs = checkpoint_specs(model, dims)
    step_store = root.child(step_dir(STEP))
    fmt = get_tensor_format(tensor_format, codec)
    gathered = [
        fmt.write_rank(
            step_store,
            rank,
            [(fqn, _piece(full, fqn, box), box) for fqn, box in items],
            specs,
            dims,
            DEFAULT_CHUNK_NBYTES,
        )
        for rank, items in sorted(write_assignment(specs, dims).items())
    ]
    builder = ManifestBuilder(
        step=STEP,
        dims=dims,
        model=model.to_json(),
        config={},
        state={"step": STEP},
        tensors={f: (s.shape, s.dtype) for f, s in specs.items()},
        chunk_nbytes=DEFAULT_CHUNK_NBYTES,
        tensor_format=fmt.name,
    )
    fmt.add_records(builder, gathered, step_store, specs, dims)
    commit(root, builder.build())


def reshard_load(step_store: Store, model: ModelConfig, dims: ParallelDims) -> ReadStats:
    """Every rank of ``dims`` reads its boxes (as ``load_into``), one rank after another."""
    manifest = read_manifest(step_store)
    specs = checkpoint_specs(model, dims)
    stats = ReadStats()
    for rank in range(dims.world_size):
        boxes = [(f, b, None) for f, b in rank_boxes(specs, dims, rank).items() if not b.is_empty]
        read_boxes(step_store, manifest, boxes, stats=stats)
    return stats


def on_disk(path: Path) -> tuple[int, int]:
    """(objects, bytes) of every file under ``path``."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_config(args.mb)
    save_dims = ParallelDims(**json.loads(args.save_layout))
    load_dims = ParallelDims(**json.loads(args.load_layout))
    full = build_state(model)
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    print(
        f"state: {model.num_layers} layers, {len(full)} tensors, {nbytes / MB:.0f} MB; save in "
        f"{save_dims.describe()}, load in {load_dims.describe()}",
        file=sys.stderr,
    )
    variants = {
        "safetensors": ("safetensors", ""),
        "zarr": ("zarr", ""),
        f"zarr+{args.codec}": ("zarr", args.codec),
    }
    base = Path(args.dir or tempfile.mkdtemp(prefix="format-bench-"))
    sizes: dict[str, dict[str, int]] = {}

    def one_format(name: str) -> Any:
        fmt, codec = variants[name]

        def run_once(r: int) -> dict[str, float]:
            root = base / f"{name}-{r}"
            t0 = time.perf_counter()
            save(Store(str(root)), full, model, save_dims, fmt, codec)
            saved = time.perf_counter() - t0
            t0 = time.perf_counter()
            stats = reshard_load(Store(str(root)).child(step_dir(STEP)), model, load_dims)
            loaded = time.perf_counter() - t0
            objects, stored = on_disk(root / step_dir(STEP))
            sizes[name] = {
                "objects": objects,
                "bytes_stored": stored,
                "bytes_read": stats.nbytes_read,
                "bytes_needed": stats.nbytes_needed,
            }
            print(
                f"  run {r + 1} {name:<14} save {saved:6.2f}s  load {loaded:6.2f}s", file=sys.stderr
            )
            if not args.keep:
                shutil.rmtree(root)
            return {"save": saved, "load": loaded}

        return run_once

    try:
        results = robust.alternate({name: one_format(name) for name in variants}, args.runs)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return summarize(args, save_dims, load_dims, full, nbytes, results, sizes)


def summarize(
    args: argparse.Namespace,
    save_dims: ParallelDims,
    load_dims: ParallelDims,
    full: dict[str, torch.Tensor],
    nbytes: int,
    results: dict[str, list[dict[str, float]]],
    sizes: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """The JSON summary: per format its medians and ratios to safetensors (time ratios: medians of
    per-round ratios, bench/robust.py), ``spread``, ``within_noise``, ``load_average``."""
    out: dict[str, Any] = {
        "state_bytes": nbytes,
        "num_tensors": len(full),
        "save_layout": save_dims.describe(),
        "load_layout": load_dims.describe(),
        "runs": args.runs,
        "formats": {},
    }
    for name, runs in results.items():
        out["formats"][name] = {
            **sizes[name],
            "save_s": statistics.median(r["save"] for r in runs),
            "reshard_load_s": statistics.median(r["load"] for r in runs),
        }
    ref, goals = out["formats"]["safetensors"], {}
    for name, f in out["formats"].items():
        f["ratio_vs_safetensors"] = {k: f[k] / ref[k] for k in ("objects", "bytes_stored")}
        for key, part in (("save_s", "save"), ("reshard_load_s", "load")):
            stat = robust.paired(
                [r[part] for r in results[name]], [r[part] for r in results["safetensors"]]
            )
            f["ratio_vs_safetensors"][key] = stat["median"]
            if name != "safetensors":
                goals[f"{name}.{key}"] = (stat, "<=", 1.0)
    out["robust"] = goals
    return out


def print_table(out: dict[str, Any]) -> None:
    print(
        f"\n{out['state_bytes'] / MB:.0f} MB state ({out['num_tensors']} tensors), saved in "
        f"{out['save_layout']}, loaded in {out['load_layout']}; medians of {out['runs']} runs"
    )
    print(
        f"{'format':<16}{'objects':>9}{'MB stored':>11}{'save s':>9}{'load s':>9}{'MB read':>10}"
        f"   vs safetensors (objects, bytes, save, load)"
    )
    for name, f in out["formats"].items():
        r = f["ratio_vs_safetensors"]
        print(
            f"{name:<16}{f['objects']:>9}{f['bytes_stored'] / MB:>11.1f}{f['save_s']:>9.2f}"
            f"{f['reshard_load_s']:>9.2f}{f['bytes_read'] / MB:>10.1f}   "
            f"{r['objects']:.0f}x {r['bytes_stored']:.3f}x {r['save_s']:.2f}x {r['reshard_load_s']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mb", type=float, default=80, help="MB of float32 parameters (state is ~3x)"
    )
    parser.add_argument(
        "--runs", "--rounds", dest="runs", type=int, default=3, help="rounds, every format in each"
    )
    parser.add_argument("--dir", default="", help="work directory (default: a temporary one)")
    parser.add_argument("--codec", default="zstd", help="zarr codec of the optimizer state")
    parser.add_argument(
        "--save-layout", default='{"pp": 2, "tp": 2}', help="ParallelDims fields as JSON"
    )
    parser.add_argument(
        "--load-layout", default='{"dp_shard": 4}', help="ParallelDims fields as JSON"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    out = run(parser.parse_args())
    print_table(out)
    goals = out.pop("robust")
    out.update(
        robust.report(
            "\npaired rounds (time vs safetensors: median of per-round ratios; judged against "
            "parity, not a goal):",
            goals,
        )
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
