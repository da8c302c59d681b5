"""Megatron-Core ``dist_checkpointing`` on the state of bench/checkpoint_vs_dcp.py (its peer run).

Two halves, in two interpreters:

* :func:`start_peer` (shardsmith's Python, called by checkpoint_vs_dcp.py ``--megatron``) writes
  the state's description (every rank's FQN, global shape, box, replica id and fill seed, for
  the save layout and each load layout) to JSON and starts this file under megatron-core's
  Python (env ``SHARDSMITH_MCORE_PYTHON``, default ``<repo>/.venv-mcore/bin/python``, built by
  bench/peers/setup.sh). It returns the running peer, or ``None`` and a reason when that
  interpreter is absent or fails.
* ``python bench/peers/megatron_peer.py SPEC DIR CTRL`` (megatron-core's Python; no shardsmith import)
  spawns ``nproc`` gloo ranks that build the same tensors (same values: the same generator
  seeds) as ``ShardedTensor`` s, warm up once, then run one round each time the bench asks
  (bench/lockstep.py: its rounds alternate with ours), measuring, from a barrier after a
  page-cache flush + evict, like the bench: ``save`` (default torch_dist strategy), ``save_fp``
  (``FullyParallelSaveStrategyWrapper``), ``async`` (``async_sharded_save`` + a
  non-persistent ``AsyncCallsQueue``: ``blocked`` = seconds in ``save``, ``s`` = until
  finalized), and per load layout ``load.<L>`` / ``load_fp.<L>``
  (``FullyParallelLoadStrategyWrapper``, ``exchange_algo="gather_object"``); loaded values are
  checked against the seeds once per layout.

On CPU, ``torch.cuda.current_device`` / ``torch.cuda.synchronize`` are replaced by no-ops in
the Megatron ranks (shared/notes/megatron-core-on-cpu.md). Megatron always fsyncs its shard
files; without ``--fsync`` the peer turns that off (``use_fsync=False``) to match the bench.
AdamW ``step`` scalars go into Megatron's common state (rank 0's ``common.pt``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/peers/
from peer_state import _loaded_ok, _measure, describe_state  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- shardsmith side ---------------------------------------------------------------------------


def mcore_python() -> str:
    return os.environ.get(
        "SHARDSMITH_MCORE_PYTHON", os.path.join(REPO, ".venv-mcore", "bin", "python")
    )


def start_peer(cfg: Any, args: Any, tmp: str) -> tuple[Any, str]:
    """Start the Megatron ranks on ``args``' state (``nproc``, ``save_layout``, ``load_layouts``,
    ``fsync``) under megatron-core's Python, in lockstep with the bench (bench/lockstep.py), in
    the scratch directory ``tmp``. Returns (the started PeerProcess: wait with ``ready()``, "") or (None, why not)."""
    from lockstep import PeerProcess

    py = mcore_python()
    if not os.path.exists(py):
        return (
            None,
            f"no megatron-core interpreter at {py} (bash bench/peers/setup.sh mcore, or set SHARDSMITH_MCORE_PYTHON)",
        )
    try:
        spec = describe_state(cfg, args.save_layout, args.load_layouts.split(","), args.nproc)
    except ValueError as e:
        return None, f"megatron peer not run: {e}"
    spec.update(nproc=args.nproc, fsync=args.fsync)
    with open(os.path.join(tmp, "mcore-spec.json"), "w") as f:
        json.dump(spec, f)
    peer = PeerProcess(
        [
            py,
            os.path.abspath(__file__),
            os.path.join(tmp, "mcore-spec.json"),
            os.path.join(tmp, "mcore-run"),
            os.path.join(tmp, "mcore-ctrl"),
        ],
        os.path.join(tmp, "mcore-ctrl"),
        {**os.environ, "OMP_NUM_THREADS": "1"},
        os.path.join(tmp, "mcore.log"),
    )
    return peer, ""


def summarize(
    ours_save: float, ours_loads: dict[str, float], ours_save_cpu: float, meg: dict[str, Any] | None
) -> dict[str, Any]:
    """Final-JSON keys: ``save_speedup_vs_megatron`` (Megatron's best sync save variant's median
    seconds / ours), ``load_speedup_vs_megatron`` (min over load layouts of Megatron's best
    load variant / ours), the variants, and ``megatron_seconds``/``megatron_cpu_seconds``/
    ``megatron_async_blocked`` medians. All None without figures."""
    ok = bool(meg and meg.get("loads_identical"))
    if not meg:
        return {
            "megatron_loads_identical": None,
            "megatron_fp_load_skipped": None,
            "save_speedup_vs_megatron": None,
            "load_speedup_vs_megatron": None,
            "megatron_best_save_variant": None,
            "megatron_best_load_variant": None,
            "megatron_seconds": None,
            "megatron_cpu_seconds": None,
            "megatron_async_blocked": None,
        }

    skipped = meg.get("load_fp_skipped", "")
    meg = {k: v for k, v in meg.items() if k not in ("loads_identical", "load_fp_skipped")}

    def med(key: str, field: str = "s") -> float:
        return statistics.median(r[field] for r in meg[key])

    save_var = min(("save", "save_fp"), key=med)
    load_speed, load_var = {}, {}
    for target, ours in ours_loads.items():
        load_var[target] = min(
            (k for k in (f"load.{target}", f"load_fp.{target}") if k in meg), key=med
        )
        load_speed[target] = med(load_var[target]) / ours
    return {
        "save_speedup_vs_megatron": med(save_var) / ours_save,
        "load_speedup_vs_megatron": min(load_speed.values()),
        "load_speedup_vs_megatron_by_layout": load_speed,
        "save_cpu_vs_megatron": ours_save_cpu / med(save_var, "cpu"),
        "megatron_best_save_variant": save_var,
        "megatron_best_load_variant": load_var,
        "megatron_seconds": {k: round(med(k), 4) for k in sorted(meg)},
        "megatron_cpu_seconds": {k: round(med(k, "cpu"), 4) for k in sorted(meg)},
        "megatron_async_blocked": round(med("async", "blocked"), 4),
        "megatron_loads_identical": ok,
        "megatron_fp_load_skipped": skipped or None,
    }


# ---- megatron-core side ------------------------------------------------------------------------


def _sharded(rows: list[list[Any]], steps: list[str], fill: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor

    sd: dict[str, Any] = {}
    for fqn, shape, offsets, lengths, replica, seed in rows:
        t = torch.zeros(lengths)
        if fill:
            t.uniform_(-1, 1, generator=torch.Generator().manual_seed(seed))
        sd[fqn] = ShardedTensor(
            key=fqn,
            data=t,
            dtype=t.dtype,
            local_shape=tuple(lengths),
            global_shape=tuple(shape),
            global_offset=tuple(offsets),
            axis_fragmentations=tuple(g // n for g, n in zip(shape, lengths)),
            replica_id=replica,
        )
    sd["step"] = {fqn: torch.tensor(7.0) for fqn in steps}
    return sd


def _no_fsync() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data

    def no_fsync(*a: Any, **k: Any) -> Any:
        k["use_fsync"] = False
        return write(*a, **k)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(no_fsync)  # type: ignore[method-assign]


class _Ops:
    """One rank's Megatron save/load variants on the bench's state."""

    def __init__(self, spec: dict[str, Any], base: str) -> None:
        from megatron.core import dist_checkpointing as dc
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.strategies import fully_parallel as fp
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.dc, self.ser, self.fp, self.queue_cls, self.base = (
            dc,
            serialization,
            fp,
            AsyncCallsQueue,
            base,
        )
        rank = dist.get_rank()
        self.src = _sharded(spec["layouts"][spec["save"]][rank], spec["steps"], True)
        self.dst = {
            t: _sharded(spec["layouts"][t][rank], spec["steps"], False) for t in spec["loads"]
        }
        self.loaded: dict[str, dict[str, Any]] = {}

    def _dir(self, name: str) -> str:
        path = os.path.join(self.base, name)
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        dist.barrier()
        return path

    def save(self, name: str, fully_parallel: bool) -> None:
        strategy = self.ser.get_default_save_sharded_strategy()
        if fully_parallel:
            strategy = self.fp.FullyParallelSaveStrategyWrapper(strategy)
        self.dc.save(self.src, self._dir(name), strategy)

    def async_save(self, name: str) -> float:
        path = self._dir(name)
        queue = self.queue_cls()
        t0 = time.perf_counter()
        request = self.dc.save(self.src, path, async_sharded_save=True, async_strategy="mcore")
        queue.schedule_async_request(request)
        blocked = time.perf_counter() - t0
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        return blocked

    def load(self, name: str, target: str, fully_parallel: bool) -> None:
        strategy = None
        if fully_parallel:
            strategy = self.fp.FullyParallelLoadStrategyWrapper(
                self.ser.get_default_load_sharded_strategy(os.path.join(self.base, name)),
                exchange_algo="gather_object",
            )
        for t in self.dst[target].values():
            if isinstance(t, torch.Tensor):
                t.zero_()
            elif hasattr(t, "data"):
                t.data.zero_()
        self.loaded[target] = self.dc.load(
            self.dst[target], os.path.join(self.base, name), strategy
        )


def _fp_load_too_big(spec: dict[str, Any]) -> str:
    """Why the fully parallel load is not run ("" if it is): with ``gather_object`` every rank
    receives every shard it needs as pickles, several copies of the state per rank (a 1.11 GiB
    state drove one rank past 6 GiB and the kernel OOM-killed it); run it only if ``nproc`` x
    3 x the state fits in half of MemAvailable."""
    nbytes = 4 * sum(
        math.prod(row[3]) for rows in spec["layouts"][spec["save"]] for row in rows if row[4] == 0
    )
    with open("/proc/meminfo") as f:
        avail = int(next(line.split()[1] for line in f if line.startswith("MemAvailable"))) * 1024
    need = spec["nproc"] * 3 * nbytes
    return (
        ""
        if need < avail / 2
        else f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
    )


def _worker(rank: int, spec: dict[str, Any], base: str, ctrl: str, port: int) -> None:
    import lockstep

    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec["nproc"]
    )
    try:
        if not spec["fsync"]:
            _no_fsync()
        ops = _Ops(spec, base)
        ops.save("warmup", False)  # the first save in a process takes seconds
        skipped, checked = _fp_load_too_big(spec), set()
        lockstep.serve_rounds(ctrl, lambda r: _round(ops, spec, base, skipped, checked))
    finally:
        dist.destroy_process_group()


def _round(
    ops: Any, spec: dict[str, Any], base: str, skipped: str, checked: set[str]
) -> dict[str, Any]:
    """One round: plain, fully parallel and async saves, then a plain (and, when it fits, a fully
    parallel) load into each layout; loaded values are checked once per layout."""
    results: dict[str, Any] = {"loads_identical": True, "load_fp_skipped": skipped}

    def run(key: str, fn: Callable[[], Any]) -> None:
        results[key] = [_measure(base, fn)]
        if key.startswith("load") and key not in checked:
            checked.add(key)
            target = key.split(".", 1)[1]
            results["loads_identical"] &= _loaded_ok(spec, target, ops.loaded[target])

    run("save", lambda: ops.save("plain", False))
    run("save_fp", lambda: ops.save("fp", True))
    run("async", lambda: ops.async_save("async"))
    for target in spec["loads"]:
        run(f"load.{target}", lambda: ops.load("plain", target, False))
        if not skipped:
            run(f"load_fp.{target}", lambda: ops.load("plain", target, True))
    return results


def main(argv: list[str]) -> int:
    from lockstep import peer_main

    return peer_main(argv, _worker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
