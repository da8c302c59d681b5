"""Checkpoint metadata at scale, simulated without tensors (issue 17).

Runs the real product functions on the metadata of a save, a commit and a resume of a
large job, with no process group and no data bytes:

* plan: ``checkpoint_specs`` + ``write_assignment`` (who writes which box);
* save, per writing rank: ``encode_header`` / ``shard_records`` for its file, synthetic
  chunk CRCs (one per ``chunk_nbytes`` of data), ``write_sidecar`` into an in-memory store
  that keeps only sizes, ``SafetensorsFormat.rank_records`` (what the rank gathers to rank 0);
* commit, rank 0 (timed: ``commit_seconds``): decode every rank's gathered JSON,
  ``SafetensorsFormat.add_records`` into the ``ManifestBuilder``, ``commit`` (serialize the
  version-3 manifest, whose tensors carry shard grids (:mod:`shardsmith.storage.manifest.grid`),
  validate all of it with ``parse_manifest``, write it) — without the
  data-file size checks, which are storage round trips;
* resume, per sampled rank (one rank per pipeline stage and mesh corner of the loading
  layout): ``ManifestReader`` (head, then the entries of the tensors the rank loads, through
  an instrumented store that counts every byte), ``intersecting_shards`` +
  ``load_chunk_crcs`` (the sidecar ranges), plus the safetensors header probe of each data
  file the rank touches — in the saving layout and resharding to ``--reshard``.

Prints a growth table (64 -> 1,024 -> 16,384 ranks) and, last, one JSON line for the main
configuration (default: the 1,024-GPU example of issue 17, ~410B parameters with AdamW).

    OMP_NUM_THREADS=1 python bench/scale_sim.py              # table + JSON of the 1,024-rank job
    python bench/scale_sim.py --only main                      # just the 1,024-rank job
    python bench/scale_sim.py --tp 8 --pp 32 --dp-shard 64     # any layout of the 405B-class model
                                                               # (= --only xl), its JSON last
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.assignment import write_assignment
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes, shard_file_name
from shardsmith.storage.checksum import DEFAULT_CHUNK_NBYTES
from shardsmith.storage.commit import commit, step_dir
from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.formats.registry import SafetensorsFormat
from shardsmith.storage.formats.safetensors import (
    _HEADER_PROBE_NBYTES,
    encode_header,
    file_order,
    shard_records,
)
from shardsmith.storage.manifest.read import ManifestReader
from shardsmith.storage.manifest.records import MANIFEST_NAME, FileRecord, ManifestBuilder
from shardsmith.storage.manifest.sidecar import load_chunk_crcs, write_sidecar
from shardsmith.storage.reading.spans import intersections

STEP = 1000


@dataclass
class Counter:
    """Bytes and requests read through a :class:`SimStore`."""

    nbytes: int = 0
    num_reads: int = 0


@dataclass
class SimStore:
    """An in-memory stand-in for :class:`shardsmith.storage.store.fs.Store`: the manifest and
    ``latest`` are kept, every other object only as its size (reads return zeros)."""

    files: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""
    counter: Counter = field(default_factory=Counter)

    @property
    def url(self) -> str:
        return "sim://" + self.prefix.rstrip("/")

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}"

    def child(self, key: str) -> "SimStore":
        return SimStore(self.files, f"{self.prefix}{key}/", self.counter)

    def write(self, key: str, data: Any) -> None:
        keep = key.endswith((MANIFEST_NAME, "latest"))
        self.files[self.prefix + key] = bytes(data) if keep else len(data)

    def _get(self, key: str) -> Any:
        if self.prefix + key not in self.files:
            raise FileNotFoundError(self.url_of(key))
        return self.files[self.prefix + key]

    def size(self, key: str) -> int:
        data = self._get(key)
        return data if isinstance(data, int) else len(data)

    def exists(self, key: str) -> bool:
        return self.prefix + key in self.files

    def read(self, key: str) -> bytes:
        return self.read_range(key, 0, self.size(key))

    def read_range(self, key: str, start: int, end: int) -> bytes:
        data = self._get(key)
        end = min(end, data if isinstance(data, int) else len(data))
        out = bytes(max(0, end - start)) if isinstance(data, int) else data[start:end]
        self.counter.nbytes += len(out)
        self.counter.num_reads += 1
        return out


@dataclass
class Config:
    """One simulated job: model, saving layout, resharding layout."""

    name: str
    model: ModelConfig
    dims: ParallelDims
    reshard: ParallelDims


def _model(
    layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int = 128256
) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=4096,
    )


CONFIGS = {
    "small": Config(
        "64 ranks, 8B-class",
        _model(32, 4096, 32, 8, 14336),
        ParallelDims(tp=8, pp=2, dp_shard=4),
        ParallelDims(tp=4, pp=2, dp_shard=8),
    ),
    "main": Config(
        "1,024 ranks, 410B",
        _model(128, 16384, 128, 8, 53248),
        ParallelDims(tp=8, pp=16, dp_shard=8),
        ParallelDims(tp=8, pp=8, dp_shard=16),
    ),
    "large": Config(
        "16,384 ranks, 405B-class (HSDP)",
        _model(126, 16384, 128, 8, 53248),
        ParallelDims(tp=8, pp=16, dp_replicate=8, dp_shard=16),
        ParallelDims(tp=8, pp=8, dp_replicate=8, dp_shard=32),
    ),
    "xl": Config(
        "16,384 ranks, 405B-class (FSDP)",
        _model(126, 16384, 128, 8, 53248),
        ParallelDims(tp=8, pp=32, dp_shard=64),
        ParallelDims(tp=8, pp=16, dp_shard=128),
    ),
}


def custom_config(tp: int, pp: int, dp_shard: int, dp_replicate: int) -> Config:
    """The 405B-class model saved in ``--tp --pp --dp-shard [--dp-replicate]`` and resharded to
    half the pipeline stages and twice the sharding (the same layout when ``pp`` is 1)."""
    dims = ParallelDims(tp=tp, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard)
    half = pp // 2 if pp > 1 and pp % 2 == 0 else pp
    reshard = ParallelDims(
        tp=tp, pp=half, dp_replicate=dp_replicate, dp_shard=dp_shard * pp // half
    )
    return Config(
        f"{dims.world_size:,} ranks, 405B-class, {dims.describe()}",
        CONFIGS["xl"].model,
        dims,
        reshard,
    )


def simulate_save(cfg: Config, step_store: SimStore, chunk: int) -> tuple[dict, list[bytes], float]:
    """Plan, then every writing rank's file records and sidecar; (specs, gathered JSON, plan s)."""
    t0 = time.process_time()
    specs = checkpoint_specs(cfg.model, cfg.dims)
    assignment = write_assignment(specs, cfg.dims)
    plan_seconds = time.process_time() - t0
    gathered = []
    for rank, items in sorted(assignment.items()):
        if not items:
            gathered.append(json.dumps({"error": ""}).encode())
            continue
        entries = sorted(
            ((fqn, specs[fqn].dtype, box) for fqn, box in items),
            key=lambda e: file_order(e[0], e[1]),
        )
        sizes = [box.numel * 4 for _, _, box in entries]
        header, _ = encode_header(
            [(fqn, dtype, box.lengths, n) for (fqn, dtype, box), n in zip(entries, sizes)]
        )
        crcs = [[rank & 0xFFFFFFFF] * (-(-n // chunk)) for n in sizes]  # synthetic chunk CRCs
        name = shard_file_name(rank)
        shards = shard_records(
            name, [(fqn, box, n) for (fqn, _, box), n in zip(entries, sizes)], len(header), crcs
        )
        record = FileRecord(nbytes=len(header) + sum(sizes), crc32c=rank)
        step_store.files[step_store.prefix + name] = record.nbytes
        step_store.files[step_store.prefix + name + ".header"] = len(header)
        side = write_sidecar(step_store, name, shards)
        gathered.append(
            json.dumps(
                {"error": "", **SafetensorsFormat.rank_records(name, record, side, shards)}
            ).encode()
        )
    return specs, gathered, plan_seconds


def simulate_commit(
    cfg: Config, root: SimStore, specs: dict, gathered: list[bytes], chunk: int
) -> float:
    """Rank 0's CPU for a commit: decode, build, serialize, validate, write (seconds)."""
    t0 = time.process_time()
    with cycle_gc_paused():  # as the trainer's gather_json_to_root decodes them
        records = [json.loads(g) for g in gathered]
    builder = ManifestBuilder(
        step=STEP,
        dims=cfg.dims,
        model=cfg.model.to_json(),
        config={"parallel": cfg.dims.to_json()},
        state={"step": STEP, "tokens_seen": STEP * 4096 * 1024},
        chunk_nbytes=chunk,
        tensors={f: (s.shape, s.dtype) for f, s in specs.items()},
    )
    SafetensorsFormat().add_records(builder, records, root.child(step_dir(STEP)), specs, cfg.dims)
    commit(root, builder.build(), check_files=False)  # type: ignore[arg-type]
    return time.process_time() - t0


def sample_ranks(dims: ParallelDims) -> list[int]:
    """One rank per pipeline stage at each corner of the (dp_replicate, dp_shard, tp) mesh."""
    out = set()
    for pp in range(dims.pp):
        for dpr, dps, tp in ((0, 0, 0), (dims.dp_replicate - 1, dims.dp_shard - 1, dims.tp - 1)):
            out.add(dims.rank_of({"pp": pp, "dp_replicate": dpr, "dp_shard": dps, "tp": tp}))
    return sorted(out)


def simulate_load(
    cfg: Config, step_store: SimStore, dims: ParallelDims, rank: int
) -> tuple[int, float, list[int]]:
    """Metadata bytes one rank reads to resume in ``dims``, its CPU seconds, and the bytes by
    kind: [manifest, sidecars, headers, data files touched, read requests]."""
    counter = step_store.counter
    counter.nbytes = counter.num_reads = 0
    t0 = time.process_time()
    reader = ManifestReader(step_store)  # type: ignore[arg-type]
    with_optim = any(f.startswith("optim.") for f in reader.tensor_names)
    specs = checkpoint_specs(cfg.model, dims, with_optimizer=with_optim)
    boxes = rank_boxes(specs, dims, rank)
    manifest = reader.manifest(boxes)
    parts = [counter.nbytes]
    shards = [
        s
        for f, b in boxes.items()
        if b.numel and f in manifest.tensors
        for s, _, _ in intersections(manifest.tensors[f], b)
    ]
    load_chunk_crcs(step_store, manifest.chunk_nbytes, shards)  # type: ignore[arg-type]
    parts.append(counter.nbytes - parts[0])
    files = {s.file for s in shards}
    for file in files:  # read_header's probe of each data file touched
        step_store.read_range(
            file + ".header", 0, max(_HEADER_PROBE_NBYTES, step_store.size(file + ".header"))
        )
    parts += [counter.nbytes - sum(parts), len(files), counter.num_reads]
    return counter.nbytes, time.process_time() - t0, parts


def run(cfg: Config, chunk: int, dump: str | None = None) -> dict[str, Any]:
    """Every figure of one configuration."""
    root = SimStore()
    step_store = root.child(step_dir(STEP))
    specs, gathered, plan_seconds = simulate_save(cfg, step_store, chunk)
    commit_seconds = simulate_commit(cfg, root, specs, gathered, chunk)
    del gathered
    gc.collect()
    manifest_nbytes = step_store.size(MANIFEST_NAME)
    if dump:
        with open(dump, "wb") as f:
            f.write(step_store.files[f"{step_store.prefix}{MANIFEST_NAME}"])
    sidecars = sum(v for k, v in step_store.files.items() if k.endswith(".crc32c"))
    headers = sum(v for k, v in step_store.files.items() if k.endswith(".header"))
    same = [simulate_load(cfg, step_store, cfg.dims, r) for r in sample_ranks(cfg.dims)]
    moved = [simulate_load(cfg, step_store, cfg.reshard, r) for r in sample_ranks(cfg.reshard)]
    num_shards = sum(
        len(t["shards"]) for t in json.loads(step_store.read(MANIFEST_NAME))["tensors"].values()
    )
    return {
        "config": cfg.name,
        "ranks": cfg.dims.world_size,
        "layout": cfg.dims.describe(),
        "reshard_layout": cfg.reshard.describe(),
        "shards": num_shards,
        "checkpoint_bytes": sum(
            v for k, v in step_store.files.items() if k.endswith(".safetensors")
        )
        + sidecars,
        "manifest_bytes": manifest_nbytes,
        "sidecar_bytes": sidecars,
        "header_bytes": headers,
        "metadata_bytes_total": manifest_nbytes + sidecars + headers,
        "max_rank_metadata_read_bytes": max(n for n, _, _ in same),
        "reshard_rank_metadata_read_bytes": max(n for n, _, _ in moved),
        "read_parts_same": max(same)[2],
        "read_parts_reshard": max(moved)[2],
        "plan_seconds": round(plan_seconds, 2),
        "commit_seconds": round(commit_seconds, 2),
        "parse_seconds_per_rank": round(max(s for _, s, _ in same + moved), 3),
        "sampled_ranks": len(same) + len(moved),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def verify_rss(path: str, mode: str) -> dict[str, Any]:
    """Peak RSS of verifying the metadata of a manifest (``path``) in a fresh process:
    ``stream`` runs ``verify_checkpoint`` (versions 2 and 3: tensor by tensor, 256 files per pass)
    with the per-file data checks stubbed out (no data here); ``whole`` parses the manifest
    whole (what verify held in memory before)."""
    from shardsmith.storage import verify
    from shardsmith.storage.manifest.parse import parse_manifest

    raw = open(path, "rb").read()
    store = SimStore({f"{step_dir(STEP)}/{MANIFEST_NAME}": raw}).child(step_dir(STEP))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.process_time()
    if mode == "stream":
        verify.file_problems = lambda *a, **k: ([], 0)  # type: ignore[assignment]
        store.walk = lambda: {}  # type: ignore[attr-defined]
        del raw
        report = verify.verify_checkpoint(store)  # type: ignore[arg-type]
        assert report.ok, report.problems[:3]
    else:
        parse_manifest(raw, "manifest.json")
    return {
        "mode": mode,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_bytes": base,
        "seconds": round(time.process_time() - t0, 2),
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("ranks", "ranks", str),
        ("layout", "layout", str),
        ("shards", "shards", lambda v: f"{v:,}"),
        ("data", "checkpoint_bytes", lambda v: f"{v / 1e12:,.2f} TB"),
        ("manifest", "manifest_bytes", _mb),
        ("sidecars", "sidecar_bytes", _mb),
        ("rank reads", "max_rank_metadata_read_bytes", _mb),
        ("reshard reads", "reshard_rank_metadata_read_bytes", _mb),
        ("plan s", "plan_seconds", str),
        ("commit s", "commit_seconds", str),
        ("parse s/rank", "parse_seconds_per_rank", str),
        ("peak RSS", "peak_rss_bytes", _mb),
    ]
    cells = [[h for h, _, _ in cols]] + [[f(r[k]) for _, k, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        choices=sorted(CONFIGS),
        help="run one configuration (default: small, main, large)",
    )
    ap.add_argument("--chunk-nbytes", type=int, default=DEFAULT_CHUNK_NBYTES)
    for flag in ("--tp", "--pp", "--dp-shard", "--dp-replicate"):
        ap.add_argument(
            flag,
            type=int,
            help="a layout of the 405B-class model (with the others; default 1) "
            "instead of the named configurations; e.g. --tp 8 --pp 32 --dp-shard 64",
        )
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)  # child: print one row
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # child: keep the manifest here
    ap.add_argument("--verify-rss", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.verify_rss:
        print(json.dumps(verify_rss(*args.verify_rss)))
        return
    layout = [args.tp, args.pp, args.dp_shard, args.dp_replicate]
    custom = (
        [
            "--tp",
            str(args.tp or 1),
            "--pp",
            str(args.pp or 1),
            "--dp-shard",
            str(args.dp_shard or 1),
            "--dp-replicate",
            str(args.dp_replicate or 1),
        ]
        if any(layout)
        else []
    )
    if args.row:
        t0 = time.perf_counter()
        cfg = custom_config(*(v or 1 for v in layout)) if custom else CONFIGS[args.only]
        row = run(cfg, args.chunk_nbytes, args.dump)
        print(json.dumps({**row, "sim_seconds": round(time.perf_counter() - t0, 1)}))
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        names = ["custom"] if custom else [args.only] if args.only else ["small", "main", "large"]
        for name in names:  # own processes: own peak RSS
            rows[name] = _child(
                (custom or ["--only", name])
                + [
                    "--row",
                    "--chunk-nbytes",
                    str(args.chunk_nbytes),
                    "--dump",
                    f"{tmp}/{name}.json",
                ]
            )
        print_table(list(rows.values()))
        for name in (
            n for n in rows if rows[n]["ranks"] <= 1024
        ):  # 16,384 ranks: too slow for a shared box
            stream, whole = (
                _child(["--verify-rss", f"{tmp}/{name}.json", m]) for m in ("stream", "whole")
            )
            print(
                f"verify metadata, {rows[name]['ranks']} ranks: streamed peak RSS {_mb(stream['peak_rss_bytes'])} "
                f"({stream['seconds']} s CPU); whole-manifest parse peak RSS {_mb(whole['peak_rss_bytes'])} "
                f"({whole['seconds']} s CPU); empty interpreter {_mb(stream['rss_before_bytes'])}"
            )
            rows[name]["verify_stream_peak_rss_bytes"] = stream["peak_rss_bytes"]
    main_row = rows.get("main", next(iter(rows.values())))
    print(
        json.dumps(
            {
                k: main_row.get(k)
                for k in (
                    "config",
                    "ranks",
                    "layout",
                    "reshard_layout",
                    "shards",
                    "checkpoint_bytes",
                    "manifest_bytes",
                    "metadata_bytes_total",
                    "max_rank_metadata_read_bytes",
                    "reshard_rank_metadata_read_bytes",
                    "plan_seconds",
                    "commit_seconds",
                    "parse_seconds_per_rank",
                    "read_parts_same",
                    "read_parts_reshard",
                    "peak_rss_bytes",
                    "verify_stream_peak_rss_bytes",
                    "sim_seconds",
                )
            }
        )
    )


def _child(argv: list[str]) -> dict[str, Any]:
    """Run this script with ``argv`` in a fresh process; its last line, decoded."""
    out = subprocess.run(
        [sys.executable, __file__, *argv], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
