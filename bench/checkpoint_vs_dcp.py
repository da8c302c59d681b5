"""shardsmith checkpointing vs PyTorch DCP on the same sharded state, storage and run.

    OMP_NUM_THREADS=1 python bench/checkpoint_vs_dcp.py --gb 1 --nproc 4 [--s3] [--fsync]

Builds one Llama-style state (parameters + AdamW ``exp_avg``/``exp_avg_sq``/``step``, about
``--gb`` GiB in all) on ``--nproc`` gloo processes with the real trainer model and
``parallelize`` (meta-device init, TP + FSDP2 DTensors), in ``--save-layout``
(``pp.dp_replicate.dp_shard.tp``, default ``1.1.2.2`` = tp2 x dp_shard2). Then, on the same
storage, with rivals back to back in an order that rotates every repeat (so each takes each
position equally often), it measures:

* sync save: ``save_checkpoint`` vs ``dcp.save``;
* async save: time the caller is blocked (``AsyncCheckpointer.save`` vs ``dcp.async_save``
  with a separate gloo group each) and until the save is committed;
* load with reshard into each ``--load-layouts`` layout: ``load_into`` (plus reading the
  manifest) vs ``dcp.load`` into DTensors of that layout; the loaded tensors are
  compared (CRC-32C of every local tensor) so both must agree bit for bit;
* raw fsspec references: every rank writes the bytes it saves as one file (next to the sync
  saves), and reads it back into memory it already holds (next to each layout's loads, as a
  load fills tensors that exist); also once into new memory (``f.read()``, ``raw.read_fresh``:
  that adds faulting in and zeroing fresh pages, which a load does not pay).

With ``--megatron`` (local disk), Megatron-Core's ``dist_checkpointing`` then runs on the same
state under megatron-core's own interpreter (bench/peers/megatron_peer.py; env
``SHARDSMITH_MCORE_PYTHON``): plain, fully parallel and async save, plain and fully parallel load
into each layout; keys ``save_speedup_vs_megatron``/``load_speedup_vs_megatron`` (ours vs its
best variant) and ``megatron_*``. Without it (or without the interpreter) they are null.

Also: shardsmith's bytes read / bytes needed (``ReadStats``), bytes read by syscalls
(``rchar`` of ``/proc/self/io``, local disk) for both, and the peak RSS of each rank during
each operation (``VmHWM``, reset through ``/proc/self/clear_refs`` before every operation).

Page cache: before every measured operation, rank 0 flushes (``os.sync``) and evicts the
bench's files (``posix_fadvise(DONTNEED)``; no root needed, other processes' cache is left
alone), so every write starts with no dirty backlog and every read is cold. Without
``--fsync`` nobody fsyncs inside the timed region (DCP gets ``sync_files=False``); with it,
DCP gets ``sync_files=True`` and the bench fsyncs shardsmith's and the raw files inside the
timed sync-save / raw-write region (shardsmith's store itself does not fsync).

Timings are the slowest rank's; the table shows medians over ``--repeats`` after
``--warmup`` untimed rounds (steady state: staging buffers exist). The last line printed is
one JSON object (ratios: >1 means shardsmith is faster, except ``stall_vs_dcp`` and
``read_amplification`` where lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from ckpt_state import build_model, parse_layout
from pagecache import flush_and_evict

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.storage.checksum import crc32c
from shardsmith.storage.commit import open_manifest, step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint.async_save import AsyncCheckpointer
from shardsmith.trainer.checkpoint.save_load import plan_local_writes, save_checkpoint
from shardsmith.trainer.checkpoint.shared_reads import (
    load_into_replicas,
    share_reader,
    shares_reads,
)

# ---- the state ---------------------------------------------------------------------------


def model_for_size(gib: float) -> ModelConfig:
    """A Llama-style shape (D=1024, 16 heads, 8 kv heads, SwiGLU 2816, vocab 8192) with the
    fewest layers whose parameters + AdamW moments (3 x 4 bytes per parameter) reach ``gib``."""
    d, f, v = 1024, 2816, 8192
    per_layer = 3 * d * d + 3 * d * f + 2 * d
    fixed = 2 * v * d + d
    layers = max(2, -(-(int(gib * 2**30) // 12 - fixed) // per_layer))
    return ModelConfig(
        num_layers=layers,
        hidden_size=d,
        num_attention_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=f,
        vocab_size=v,
        seq_length=128,
    )


def build_state(cfg: ModelConfig, dims: ParallelDims, fill: bool) -> tuple[dict, dict, dict, Any]:
    """This rank's state under ``dims``: (FQN -> DTensor or tensor for DCP, FQN -> local
    tensor for shardsmith, FQN -> global box, (the ``dp_replicate`` group, the ``tp`` group),
    each None when of one rank).
    Collective (builds a mesh).

    Values depend only on (FQN, box), so replicas agree and both systems save the same bytes.
    """
    mesh, model = build_model(cfg, dims)
    rank = dist.get_rank()
    boxes = rank_boxes(checkpoint_specs(cfg, dims), dims, rank)
    dcp_state: dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters():
        dcp_state[fqn] = p.detach()
        dcp_state[f"optim.exp_avg.{fqn}"] = torch.zeros_like(p.detach())
        dcp_state[f"optim.exp_avg_sq.{fqn}"] = torch.zeros_like(p.detach())
        dcp_state[f"optim.step.{fqn}"] = torch.tensor(7.0)
    local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in dcp_state.items()}
    if fill:
        for fqn, t in local.items():
            if t.ndim:
                gen = torch.Generator().manual_seed(zlib.crc32(f"{fqn}{boxes[fqn]}".encode()))
                t.uniform_(-1, 1, generator=gen)
    replicas = mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 else None
    siblings = mesh["tp"].get_group() if dims.tp > 1 else None
    return dcp_state, local, boxes, (replicas, siblings)


def state_crcs(local: dict[str, torch.Tensor]) -> list[int]:
    """CRC-32C of every local tensor's bytes, in FQN order."""
    return [
        crc32c(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        if t.ndim
        else int(t.item())
        for _, t in sorted(local.items())
    ]


# ---- measuring -----------------------------------------------------------------------------


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            return int(re.search(r"rchar:\s+(\d+)", f.read()).group(1))
    except OSError:
        return 0


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and its waited-for children."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def settle(base: str, local_disk: bool) -> None:
    """Flush dirty pages and evict the bench's files from the page cache (rank 0), then barrier."""
    if dist.get_rank() == 0 and local_disk:
        flush_and_evict(base)
    dist.barrier()


def log(msg: str) -> None:
    """Progress on stderr (rank 0, with --verbose)."""
    if dist.get_rank() == 0 and os.environ.get("BENCH_VERBOSE"):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(fn: Callable[[], Any], profile: bool = False) -> dict[str, float]:
    """Run ``fn`` on every rank from a barrier. Returns the slowest rank's seconds (``s``) and
    ``blocked``/``snapshot`` seconds (``fn``'s own, max over ranks), peak RSS (MiB, max over
    ranks), CPU seconds (``cpu``: user + system of every thread and waited child, summed over
    ranks), and bytes: ``rchar`` read by syscalls, ``read``/``needed`` (``fn``'s, summed)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (Linux >= 4.0)
    except OSError:
        pass
    rchar0 = _rchar()
    dist.barrier()
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        extra = prof.runcall(fn) or {}
        with open(
            os.path.join(tempfile.gettempdir(), f"bench-profile-rank{dist.get_rank()}.txt"), "w"
        ) as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
    else:
        extra = fn() or {}
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0
    maxed = torch.tensor(
        [seconds, _hwm_kib() / 1024, extra.get("blocked", 0.0), extra.get("snapshot", 0.0)],
        dtype=torch.float64,
    )
    summed = torch.tensor(
        [_rchar() - rchar0, extra.get("read", 0), extra.get("needed", 0), cpu], dtype=torch.float64
    )
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    dist.all_reduce(summed)
    return {
        "s": float(maxed[0]),
        "rss_mib": float(maxed[1]),
        "blocked": float(maxed[2]),
        "snapshot": float(maxed[3]),
        "rchar": float(summed[0]),
        "read": float(summed[1]),
        "needed": float(summed[2]),
        "cpu": float(summed[3]),
    }


def fsync_own(path: str, rank: int) -> None:
    """fsync the files under ``path`` that ``rank`` wrote (its shard file; rank 0: the rest)."""
    mine = f"rank-{rank:05d}"
    for dirpath, _, names in os.walk(path):
        for name in names:
            if (mine in name) if "rank-" in name else rank == 0:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


# ---- one worker ------------------------------------------------------------------------------


class Bench:
    """Everything one rank needs; methods are collective."""

    def __init__(self, args: argparse.Namespace, base: str, opts: dict[str, Any]) -> None:
        self.args, self.base, self.opts = args, base, opts
        self.local_disk = not base.startswith("s3://")
        self.cfg = model_for_size(args.gb)
        self.dims = parse_layout(args.save_layout)
        self.rank = dist.get_rank()
        self.dcp_state, self.local, _, _ = build_state(self.cfg, self.dims, fill=True)
        log("source state built")
        self.targets = {
            name: build_state(self.cfg, parse_layout(name), fill=False)
            for name in args.load_layouts.split(",")
        }
        self.ckpt = AsyncCheckpointer(Store(base, opts), self.cfg, self.dims)
        self.dcp_group = dist.new_group(backend="gloo")
        plan = plan_local_writes(0, self.local, self.cfg, self.dims, self.rank)
        self.raw_parts = [
            t.contiguous().reshape(-1).view(torch.uint8).numpy() for _, t, _ in plan.entries
        ]
        self.raw_buf = torch.zeros(sum(p.nbytes for p in self.raw_parts), dtype=torch.uint8)
        self.crc_ok = True

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    # -- shardsmith
    def ours_save(self, name: str) -> None:
        save_checkpoint(
            Store(self.url(name), self.opts),
            1,
            self.local,
            model_cfg=self.cfg,
            dims=self.dims,
            config={},
            state={"step": 1},
        )
        if self.args.fsync and self.local_disk:
            fsync_own(self.url(name), self.rank)

    def ours_async(self, name: str, overlap: bool) -> dict[str, float]:
        """``overlap``: snapshot in the background, as with ``overlap_with(optimizer)`` in the
        trainer (the bench has no optimizer: it waits for the snapshot itself, as the
        optimizer's next step would); else the snapshot is copied inside ``save``."""
        self.ckpt.root = Store(self.url(name), self.opts)
        self.ckpt.overlap_snapshot = overlap
        t0 = time.perf_counter()
        self.ckpt.save(1, self.local, config={}, state={"step": 1})
        blocked = time.perf_counter() - t0
        self.ckpt.wait_snapshot()
        snapshot = time.perf_counter() - t0
        self.ckpt.wait()
        return {"blocked": blocked, "snapshot": snapshot}

    def ours_load(self, name: str, target: str) -> dict[str, float]:
        _, local, boxes, (replicas, siblings) = self.targets[target]
        step_store = Store(self.url(name), self.opts).child(step_dir(1))
        manifest = open_manifest(step_store).manifest(
            boxes
        )  # as the trainer: this rank's records only
        specs = checkpoint_specs(self.cfg, parse_layout(target))
        shapes = {f: s.shape for f, s in specs.items()}
        reader = share_reader(step_store, siblings)  # as the trainer: TP siblings read a union
        if shares_reads(step_store, replicas):  # once, each replica reads 1/R
            stats = load_into_replicas(
                step_store, manifest, local, boxes, shapes, replicas, reader=reader
            )
        else:
            stats = reader(step_store, manifest, local, boxes, shapes)
        return {"read": stats.nbytes_read, "needed": stats.nbytes_needed}

    # -- DCP
    def _writer(self, name: str) -> Any:
        if self.local_disk:
            return dcp.FileSystemWriter(self.url(name), sync_files=self.args.fsync)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.url(name), sync_files=False, **self.opts)

    def _reader(self, name: str) -> Any:
        if self.local_disk:
            return dcp.FileSystemReader(self.url(name))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.url(name), **self.opts)

    def dcp_save(self, name: str) -> None:
        dcp.save(self.dcp_state, storage_writer=self._writer(name))

    def dcp_async(self, name: str, staged: bool) -> dict[str, float]:
        """DCP's default ``async_save`` (staging copy inside the call), or with its
        background staging (``DefaultStager(use_async_staging=True)``)."""
        stager = None
        if staged:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=False,
                )
            )
        t0 = time.perf_counter()
        out = dcp.async_save(
            self.dcp_state,
            storage_writer=self._writer(name),
            process_group=self.dcp_group,
            async_stager=stager,
        )
        blocked = time.perf_counter() - t0
        if staged:
            out.staging_completion.result()
        snapshot = time.perf_counter() - t0
        (out.upload_completion if staged else out).result()
        if stager is not None:
            stager.close()
        return {"blocked": blocked, "snapshot": snapshot}

    def dcp_load(self, name: str, target: str) -> None:
        dcp.load(self.targets[target][0], storage_reader=self._reader(name))

    # -- raw fsspec
    def raw_write(self, name: str) -> None:
        fs, path = Store(self.url(name), self.opts).fs, Store(self.url(name), self.opts).root
        fs.makedirs(path, exist_ok=True)
        with fs.open(f"{path}/rank-{self.rank}.bin", "wb") as f:
            for part in self.raw_parts:
                f.write(memoryview(part))
            if self.args.fsync and self.local_disk:
                f.flush()
                os.fsync(f.fileno())

    def raw_read(self, name: str, fresh: bool = False) -> dict[str, float]:
        """Read back this rank's raw file: into ``raw_buf`` (memory this rank already holds, as
        a load fills tensors that exist), or with ``fresh`` into a new ``bytes`` (``f.read()``:
        that also faults in and zeroes fresh pages, which a load does not)."""
        store = Store(self.url(name), self.opts)
        with store.fs.open(f"{store.root}/rank-{self.rank}.bin", "rb") as f:
            if fresh:
                got = len(f.read())
            else:
                view, got = memoryview(self.raw_buf.numpy()), 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
        return {"read": got, "needed": got}

    def zero_target(self, target: str) -> None:
        for t in self.targets[target][1].values():
            t.zero_()

    def check_same(self, a: list[int], b: list[int]) -> None:
        flag = torch.tensor([int(a != b)])
        dist.all_reduce(flag)
        if int(flag):
            self.crc_ok = False

    def cleanup(self) -> None:
        dist.barrier()
        if self.rank == 0:
            if self.local_disk:
                shutil.rmtree(self.base, ignore_errors=True)
                os.makedirs(self.base, exist_ok=True)
            else:
                Store(self.base, self.opts).delete("", recursive=True)
        dist.barrier()

    def round(self, rep: int, results: dict[str, list[dict]]) -> None:
        """One repeat: every measurement once. Each group of rivals (sync save: shardsmith, DCP,
        raw write; each load: shardsmith, DCP, raw read) runs back to back, in an order that
        rotates every repeat, so each takes each position equally often (the cost of fresh page
        cache on a shared VM depends on what ran just before)."""
        import robust

        def rotated(names: list[str], shift: int = 0) -> list[str]:
            return robust.rotated(names, rep + shift)

        def run(key: str, fn: Callable[[], Any]) -> None:
            settle(self.base, self.local_disk)
            results.setdefault(key, []).append(measure(fn, profile=key == self.args.profile))
            log(
                f"round {rep} {key}: "
                + ", ".join(f"{k}={v:.4g}" for k, v in results[key][-1].items())
            )

        for who in rotated(["ours", "dcp", "raw"]):
            if who == "raw":
                run("raw.write", lambda: self.raw_write("raw"))
            else:
                run(f"{who}.save", lambda: getattr(self, f"{who}_save")(f"{who}-sync"))
        for mode in ("bg", "fg"):
            for who in rotated(["ours", "dcp"]):
                run(
                    f"{who}.async_{mode}",
                    lambda: getattr(self, f"{who}_async")(f"{who}-async", mode == "bg"),
                )
        run("raw.read_fresh", lambda: self.raw_read("raw", fresh=True))
        for i, target in enumerate(self.targets):
            crcs = {}
            for who in rotated(["ours", "dcp", "raw"], shift=i):
                if who == "raw":
                    self.raw_buf.zero_()  # touched just before, as zero_target
                    run(f"raw.read.{target}", lambda: self.raw_read("raw"))
                    continue
                self.zero_target(target)
                run(
                    f"{who}.load.{target}",
                    lambda: getattr(self, f"{who}_load")(f"{who}-sync", target),
                )
                crcs[who] = state_crcs(self.targets[target][1])
            self.check_same(crcs["ours"], crcs["dcp"])
        self.cleanup()


def start_peers(
    args: argparse.Namespace, cfg: ModelConfig, tmp: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """Rank 0: start each requested peer in its own interpreter (bench/lockstep.py); returns
    (name -> PeerProcess, name -> why it is not run)."""
    from peers import bcp_peer, megatron_peer

    peers, why = {}, {}
    for name, on, start in (
        ("megatron", args.megatron, megatron_peer.start_peer),
        ("bytecheckpoint", args.bytecheckpoint, bcp_peer.start_peer),
    ):
        if not on:
            why[name] = f"not requested (--{name})"
        elif args.s3:
            why[name] = "not run on --s3 (the peer writes to a local path)"
        else:
            peers[name], reason = start(cfg, args, tmp)
            if peers[name] is None:
                del peers[name]
                why[name] = reason
    return peers, why


def peer_round(r: int, procs: dict[str, Any], peers: dict[str, Any]) -> None:
    """Rank 0, right after our round ``r``: the same round of each running peer (the other ranks
    wait in a barrier), so ours and each peer alternate. Appends its figures, or None, to ``peers``."""
    for name, proc in list(procs.items()):
        figures = proc.round(r) if proc.ready() else None
        peers[name].append(figures)
        if figures is None:
            peers["why"][name] = f"{name} peer failed: {proc.why()}"
            proc.close()
            del procs[name]
        log(f"{name} round {r}: {'ok' if figures else peers['why'][name]}")


def worker(rank: int, args: argparse.Namespace, port: int, base: str, opts: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc
    )
    try:
        log("process group up")
        bench = Bench(args, base, opts)
        log("state built")
        results: dict[str, list[dict]] = {}
        peers: dict[str, Any] = {"megatron": [], "bytecheckpoint": [], "why": {}}
        procs: dict[str, Any] = {}
        if rank == 0:  # they start (untimed) during our warm-up
            procs, peers["why"] = start_peers(args, bench.cfg, os.path.dirname(out))
        try:
            for rep in range(args.warmup + args.repeats):
                round_results: dict[str, list[dict]] = {}
                bench.round(rep, round_results)
                if rep >= args.warmup:
                    for k, v in round_results.items():
                        results.setdefault(k, []).extend(v)
                    if rank == 0:  # the peers' round right after ours (A B A B ...)
                        peer_round(rep - args.warmup, procs, peers)
                    dist.barrier()
        finally:
            for proc in procs.values():
                proc.close()
        nbytes = torch.tensor([sum(p.nbytes for p in bench.raw_parts)], dtype=torch.float64)
        dist.all_reduce(nbytes)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(
                    {
                        "results": results,
                        "peers": peers,
                        "nbytes": float(nbytes),
                        "crc_ok": bench.crc_ok,
                        "model": bench.cfg.to_json(),
                    },
                    f,
                )
        bench.ckpt.wait()
    finally:
        dist.destroy_process_group()


# ---- report ------------------------------------------------------------------------------------


def median(results: dict, key: str, field: str = "s") -> float:
    return statistics.median(r[field] for r in results[key])


def per_round(results: dict, num: str, den: str, field: str = "s") -> list[float]:
    """``num / den`` in each round (the two were measured minutes apart at most)."""
    return [round(a[field] / b[field], 3) for a, b in zip(results[num], results[den])]


def report(args: argparse.Namespace, data: dict) -> dict[str, Any]:
    """Print the table of medians; return the summary JSON."""
    res, gib = data["results"], data["nbytes"] / 2**30

    def m(key: str, field: str = "s") -> float:
        return median(res, key, field)

    rows: list[tuple[str, float, float, float | None]] = [
        ("sync save (s)", m("ours.save"), m("dcp.save"), m("raw.write")),
        (
            "  CPU, all ranks (s)",
            m("ours.save", "cpu"),
            m("dcp.save", "cpu"),
            m("raw.write", "cpu"),
        ),
        (
            "async save, DCP default: blocked (s)",
            m("ours.async_bg", "blocked"),
            m("dcp.async_fg", "blocked"),
            None,
        ),
        (
            "  ours with the snapshot inside save() (s)",
            m("ours.async_fg", "blocked"),
            m("dcp.async_fg", "blocked"),
            None,
        ),
        (
            "async, both staging in background: blocked (s)",
            m("ours.async_bg", "blocked"),
            m("dcp.async_bg", "blocked"),
            None,
        ),
        (
            "  snapshot copied after (s)",
            m("ours.async_bg", "snapshot"),
            m("dcp.async_bg", "snapshot"),
            None,
        ),
        ("async save until committed (s)", m("ours.async_bg"), m("dcp.async_fg"), None),
        ("  CPU, all ranks (s)", m("ours.async_bg", "cpu"), m("dcp.async_fg", "cpu"), None),
        (
            "peak RSS, sync save (MiB/rank)",
            m("ours.save", "rss_mib"),
            m("dcp.save", "rss_mib"),
            m("raw.write", "rss_mib"),
        ),
        (
            "peak RSS, async save (MiB/rank)",
            m("ours.async_bg", "rss_mib"),
            m("dcp.async_fg", "rss_mib"),
            None,
        ),
    ]
    loads, amps, load_cpu, load_cpu_fresh = {}, {}, {}, {}
    for target in args.load_layouts.split(","):
        ours, theirs, raw = f"ours.load.{target}", f"dcp.load.{target}", f"raw.read.{target}"
        rows += [
            (f"load -> {target} (s)", m(ours), m(theirs), m(raw)),
            ("  CPU, all ranks (s)", m(ours, "cpu"), m(theirs, "cpu"), m(raw, "cpu")),
            (
                "  syscall bytes read (GiB)",
                m(ours, "rchar") / 2**30,
                m(theirs, "rchar") / 2**30,
                m(raw, "rchar") / 2**30,
            ),
            ("  peak RSS (MiB/rank)", m(ours, "rss_mib"), m(theirs, "rss_mib"), m(raw, "rss_mib")),
        ]
        loads[target] = m(theirs) / m(ours)
        amps[target] = m(ours, "read") / m(ours, "needed")
        load_cpu[target] = m(ours, "cpu") / m(raw, "cpu")
        load_cpu_fresh[target] = m(ours, "cpu") / m("raw.read_fresh", "cpu")
    raw_read_s = statistics.median(
        r["s"] for k, v in res.items() if k.startswith("raw.read.") for r in v
    )
    print(
        f"\nstate: {gib:.2f} GiB on {args.nproc} ranks, saved as {args.save_layout}; storage "
        f"{'s3 (moto)' if args.s3 else 'local disk'}; fsync {'on' if args.fsync else 'off'}; "
        f"medians of {args.repeats} (after {args.warmup} warm-up)"
    )
    print(f"{'':48s}{'shardsmith':>11s}{'DCP':>9s}{'raw fsspec':>11s}{'DCP/ours':>9s}")
    for name, ours_v, theirs_v, raw in rows:
        raw_s = f"{raw:11.3f}" if raw is not None else f"{'':11s}"
        ratio = theirs_v / ours_v if ours_v else float("nan")
        print(f"{name:48s}{ours_v:11.3f}{theirs_v:9.3f}{raw_s}{ratio:9.2f}")
    print(
        f"write bandwidth: shardsmith {gib / m('ours.save'):.2f} GiB/s, DCP {gib / m('dcp.save'):.2f} GiB/s, "
        f"raw {gib / m('raw.write'):.2f} GiB/s; raw read {gib / raw_read_s:.2f} GiB/s"
    )
    print(
        f"raw read into new memory (f.read()): {m('raw.read_fresh'):.3f} s, {m('raw.read_fresh', 'cpu'):.3f} "
        f"CPU-s (the raw column reads into memory each rank already holds, as a load does)"
    )
    for target, amp in amps.items():
        print(f"shardsmith read amplification -> {target}: {amp:.4f} (bytes read / bytes needed)")
    print(
        f"loaded tensors identical (shardsmith vs DCP): {data['crc_ok']}; load average "
        f"{os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs"
    )
    return {
        "stall_vs_dcp": m("ours.async_bg", "blocked") / m("dcp.async_fg", "blocked"),
        "save_speedup_vs_dcp": m("dcp.save") / m("ours.save"),
        "load_speedup_vs_dcp": min(loads.values()),
        "read_amplification": max(amps.values()),
        "write_fraction_of_raw": m("raw.write") / m("ours.save"),
        "save_cpu_vs_raw": m("ours.save", "cpu") / m("raw.write", "cpu"),
        "load_cpu_vs_raw": max(load_cpu.values()),
        "save_cpu_vs_dcp": m("ours.save", "cpu") / m("dcp.save", "cpu"),
        "load_cpu_vs_raw_by_layout": load_cpu,
        "load_cpu_vs_raw_fresh": max(load_cpu_fresh.values()),
        "cpu_seconds": {k: round(m(k, "cpu"), 4) for k in sorted(res)},
        "load_average_1m": round(os.getloadavg()[0], 1),
        "stall_snapshot_in_save_vs_dcp": m("ours.async_fg", "blocked")
        / m("dcp.async_fg", "blocked"),
        "stall_vs_dcp_async_staging": m("ours.async_bg", "blocked") / m("dcp.async_bg", "blocked"),
        "snapshot_vs_dcp_blocked": m("ours.async_bg", "snapshot") / m("dcp.async_fg", "blocked"),
        "load_speedup_by_layout": loads,
        "read_amplification_by_layout": amps,
        "per_round": {
            "save_speedup_vs_dcp": per_round(res, "dcp.save", "ours.save"),
            "write_fraction_of_raw": per_round(res, "raw.write", "ours.save"),
            "save_cpu_vs_raw": per_round(res, "ours.save", "raw.write", "cpu"),
            "stall_vs_dcp": per_round(res, "ours.async_bg", "dcp.async_fg", "blocked"),
            **{
                f"load_speedup_vs_dcp.{t}": per_round(res, f"dcp.load.{t}", f"ours.load.{t}")
                for t in loads
            },
            **{
                f"load_cpu_vs_raw.{t}": per_round(res, f"ours.load.{t}", f"raw.read.{t}", "cpu")
                for t in loads
            },
        },
        "seconds": {k: round(m(k), 4) for k in sorted(res)},
        "gib": round(gib, 3),
        "nproc": args.nproc,
        "storage": "s3" if args.s3 else "local",
        "fsync": args.fsync,
        "loads_identical": data["crc_ok"],
    }


def megatron_side(args: argparse.Namespace, data: dict, summary: dict[str, Any]) -> dict[str, Any]:
    """With ``--megatron`` (local disk only), Megatron-Core's figures on the same state, run
    after ours (bench/peers/megatron_peer.py); the keys are None, with the reason printed, otherwise."""
    from peers import megatron_peer

    res = data["results"]
    meg, why = None, "not requested (--megatron)"
    if args.megatron and args.s3:
        why = "not run on --s3 (Megatron's torch_dist writes to a local path)"
    elif args.megatron:
        meg, why = merge_rounds(data["peers"]["megatron"]), data["peers"]["why"].get("megatron", "")
        meg = meg and {k: [x for x in v if x] if isinstance(v, list) else v for k, v in meg.items()}
    keys = megatron_peer.summarize(
        median(res, "ours.save"),
        {t: median(res, f"ours.load.{t}") for t in args.load_layouts.split(",")},
        median(res, "ours.save", "cpu"),
        meg,
    )
    if meg is None:
        print(f"Megatron-Core: skipped, {why}")
        return keys
    print(
        f"Megatron-Core (after ours; load average {os.getloadavg()[0]:.1f}): medians of {args.repeats}, "
        f"loads identical to the saved values: {keys['megatron_loads_identical']}"
    )
    for k, v in keys["megatron_seconds"].items():
        print(f"  {k:24s}{v:9.3f} s{keys['megatron_cpu_seconds'][k]:9.3f} CPU-s")
    if keys["megatron_fp_load_skipped"]:
        print(f"  fully parallel load not run: {keys['megatron_fp_load_skipped']}")
    print(
        f"  async blocked {keys['megatron_async_blocked']:.3f} s; best save {keys['megatron_best_save_variant']}"
        f" ({keys['save_speedup_vs_megatron']:.2f}x ours), loads {keys['megatron_best_load_variant']}"
        f" ({keys['load_speedup_vs_megatron']:.2f}x ours, worst layout)"
    )
    return keys


def merge_rounds(rounds: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """A peer's per-round figures (key -> [measurement]) as one dict of per-round lists (None for
    a failed round); ``loads_identical`` is the AND of the rounds; other fields the first round's."""
    done = [r for r in rounds if r]
    if not done:
        return None
    merged: dict[str, Any] = dict(done[0])
    for key in done[0]:
        if isinstance(done[0][key], list):
            merged[key] = [r[key][0] if r and key in r else None for r in rounds]
    merged["loads_identical"] = all(r.get("loads_identical", True) for r in done)
    return merged


def paired_ratios(args: argparse.Namespace, data: dict) -> dict[str, Any]:
    """The headline ratios as medians of per-round ratios (ours and each rival alternate inside a
    round), with their spread and verdicts (bench/robust.py); prints the table. Keys: the
    ``*_vs_dcp``/``*_vs_megatron``/``*_vs_bytecheckpoint`` ratios (ByteCheckpoint: the worse of
    as shipped and patched; ``*_bytecheckpoint_shipped``/``_patched`` each), ``spread`` and
    ``within_noise``."""
    import robust

    res, targets = data["results"], args.load_layouts.split(",")

    def col(key: str, field: str = "s") -> list[float]:
        return [r[field] for r in res[key]]

    stats: dict[str, Any] = {
        "save_speedup_vs_dcp": robust.paired(col("dcp.save"), col("ours.save")),
        "load_speedup_vs_dcp": worst(
            [robust.paired(col(f"dcp.load.{t}"), col(f"ours.load.{t}")) for t in targets]
        ),
        "stall_vs_dcp": robust.paired(
            col("ours.async_bg", "blocked"), col("dcp.async_fg", "blocked")
        ),
    }
    meg = merge_rounds(data["peers"]["megatron"])
    if meg:
        best = [
            min(a["s"], b["s"]) if a and b else None for a, b in zip(meg["save"], meg["save_fp"])
        ]
        stats["save_speedup_vs_megatron"] = robust.paired(best, col("ours.save"))
        stats["load_speedup_vs_megatron"] = worst(
            [
                robust.paired(
                    [
                        min(x["s"] for x in v if x) if any(v) else None
                        for v in zip(
                            meg[f"load.{t}"],
                            meg.get(f"load_fp.{t}", [None] * len(meg[f"load.{t}"])),
                        )
                    ],
                    col(f"ours.load.{t}"),
                )
                for t in targets
            ]
        )
        stats["stall_vs_megatron"] = robust.paired(
            col("ours.async_bg", "blocked"), [x["blocked"] if x else None for x in meg["async"]]
        )
    stats.update(bcp_stats(data, col, targets))
    bcp_rss = stats.pop("bytecheckpoint_peak_rss_mib", None)
    goals = {
        k: (v, "<=" if k.startswith("stall") else ">=", 0.1 if k.startswith("stall") else 1.3)
        for k, v in stats.items()
    }
    lines, noise = robust.judge(goals)
    print(
        "\npaired rounds (median of per-round ratios; >1 faster for speedups, <1 better for stalls):"
    )
    print("\n".join(lines))
    if data["peers"]["why"]:
        print(
            "peers not measured: " + "; ".join(f"{k}: {v}" for k, v in data["peers"]["why"].items())
        )
    out = {k: (v["median"] if v else None) for k, v in stats.items()}
    out.update(
        spread={k: v for k, v in stats.items() if v},
        within_noise=noise,
        load_average=robust.load_average(),
        bytecheckpoint_peak_rss_mib=bcp_rss,
    )
    return out


def worst(stats: list[dict[str, Any] | None], low: bool = True) -> dict[str, Any] | None:
    """The stat with the lowest (``low``) or highest median; None if any is None (not measured)."""
    if not stats or any(s is None for s in stats):
        return None
    return (min if low else max)(stats, key=lambda s: s["median"])


def bcp_stats(data: dict, col: Callable[..., list[float]], targets: list[str]) -> dict[str, Any]:
    """ByteCheckpoint's paired stats per mode (``shipped``, ``patched``) and the headline keys
    (the worse mode). A load that failed in every round (as shipped: into pipeline stages) is
    left out of that mode's worst layout and listed in ``bytecheckpoint_failures``."""
    import robust

    bcp = merge_rounds(data["peers"]["bytecheckpoint"])
    if not bcp:
        return {}
    out: dict[str, Any] = {}
    for mode in ("shipped", "patched"):

        def peer(key: str, field: str = "s") -> list[float | None]:
            return [x[field] if x else None for x in bcp.get(f"{mode}.{key}", [])]

        def safe(num: list, den: list) -> dict[str, Any] | None:
            try:
                return robust.paired(num, den)
            except ValueError:
                return None

        out[f"save_speedup_vs_bytecheckpoint_{mode}"] = safe(peer("save"), col("ours.save"))
        loads = [safe(peer(f"load.{t}"), col(f"ours.load.{t}")) for t in targets]
        out[f"load_speedup_vs_bytecheckpoint_{mode}"] = (
            worst([x for x in loads if x]) if any(loads) else None
        )
        out[f"stall_vs_bytecheckpoint_{mode}"] = safe(
            col("ours.async_bg", "blocked"), peer("async", "blocked")
        )
    for kind, low in (("save_speedup", True), ("load_speedup", True), ("stall", False)):
        both = [out[f"{kind}_vs_bytecheckpoint_{m}"] for m in ("shipped", "patched")]
        out[f"{kind}_vs_bytecheckpoint"] = worst([x for x in both if x], low) if any(both) else None
    errors = {
        k: v for r in data["peers"]["bytecheckpoint"] if r for k, v in r.get("errors", {}).items()
    }
    if errors:
        print(
            "ByteCheckpoint failures (first of each): "
            + "; ".join(f"{k}: {v[:120]}" for k, v in errors.items())
        )
    identical = {
        k: v
        for r in data["peers"]["bytecheckpoint"]
        if r
        for k, v in r.get("loads_identical", {}).items()
    }
    rss = [r["peak_rss_mib"] for r in data["peers"]["bytecheckpoint"] if r and "peak_rss_mib" in r]
    out["bytecheckpoint_peak_rss_mib"] = max(rss) if rss else None
    print(
        f"ByteCheckpoint 0.0.2 (outside its declared torch <= 2.5; fsyncs its files): loads identical to the "
        f"saved values: {identical}; peak RSS {out['bytecheckpoint_peak_rss_mib']} MiB/rank"
    )
    return out


def start_s3() -> tuple[Any, dict[str, Any], str]:
    """moto's ThreadedMotoServer on a loopback port, with a bucket; (server, options, url)."""
    import logging

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
    }
    fsspec.filesystem("s3", skip_instance_cache=True, **opts).call_s3(
        "create_bucket", Bucket="bench"
    )
    return server, opts, f"s3://bench/{uuid.uuid4().hex[:8]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--gb", type=float, default=1.0, help="state size in GiB (params + AdamW moments)"
    )
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--save-layout", default="1.1.2.2", help="pp.dp_replicate.dp_shard.tp")
    p.add_argument(
        "--load-layouts", default="1.1.4.1,2.1.1.2", help="comma-separated target layouts"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--s3", action="store_true", help="use a loopback moto S3 server instead of local disk"
    )
    p.add_argument(
        "--fsync", action="store_true", help="durable writes (DCP sync_files=True; fsync ours/raw)"
    )
    p.add_argument("--verbose", action="store_true", help="print every measurement to stderr")
    p.add_argument(
        "--profile", default="", help="cProfile this measurement on rank 0, e.g. ours.save"
    )
    p.add_argument(
        "--megatron",
        action="store_true",
        help="also run Megatron-Core dist_checkpointing on the same state (bench/peers/megatron_peer.py; "
        "interpreter from SHARDSMITH_MCORE_PYTHON, default .venv-mcore/bin/python)",
    )
    p.add_argument(
        "--bytecheckpoint",
        action="store_true",
        help="also run ByteCheckpoint on the same state, as shipped and patched (bench/peers/bcp_peer.py; "
        "interpreter from SHARDSMITH_BCP_PYTHON, default .venv-bcp/bin/python)",
    )
    p.add_argument(
        "--dir", default="", help="local directory for the checkpoints (default: a temp dir)"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.verbose:
        os.environ["BENCH_VERBOSE"] = "1"
    server = None
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or None)
    try:
        if args.s3:
            server, opts, base = start_s3()
        else:
            opts, base = {}, os.path.join(tmp, "run")
            os.makedirs(base)
        out = os.path.join(tmp, "results.json")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            worker, args=(args, port, base, opts, out), nprocs=args.nproc, start_method="spawn"
        )
        with open(out) as f:
            data = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.stop()
    summary = report(args, data)
    summary.update(megatron_side(args, data, summary))
    summary.update(paired_ratios(args, data))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
