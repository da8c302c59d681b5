"""ByteCheckpoint (``bytecheckpoint`` 0.0.2) on the state of bench/checkpoint_vs_dcp.py (its peer).

Two halves, in two interpreters, as bench/peers/megatron_peer.py:

* :func:`start_peer` (shardsmith's Python, called by checkpoint_vs_dcp.py ``--bytecheckpoint``)
  writes the state's description (megatron_peer.describe_state plus the model config) to JSON
  and starts this file under ByteCheckpoint's Python (env ``SHARDSMITH_BCP_PYTHON``, default
  ``<repo>/.venv-bcp/bin/python``, built by bench/peers/setup.sh). Returns the running peer, or
  None and a reason when that interpreter is absent or fails.
* ``python bench/peers/bcp_peer.py SPEC DIR OUT`` (ByteCheckpoint's Python) spawns ``nproc`` gloo
  ranks that build the same FSDP2 + TP model as the bench (the trainer's ``Transformer`` and
  ``parallelize``, with the same values: the same generator seeds), an AdamW whose state holds
  the same ``exp_avg``/``exp_avg_sq``/``step``, warm up once (its first save starts a gRPC
  coordinator process), then run one round each time the bench asks (bench/lockstep.py: its
  rounds alternate with ours), measuring, from a barrier after a page-cache flush + evict, twice:
  ``shipped.*`` (the package as released) and ``patched.*`` (with the two fixes below):
  ``save`` (``fast_saving=False``), ``async`` (``fast_saving=True``: ``blocked`` = seconds in
  ``save``, ``s`` = until rank 0 has written its tracker file, its commit) and ``load.<L>``
  (``fast_loading=True``) into each layout, values checked against the seeds.

ByteCheckpoint declares torch <= 2.5; it runs here on torch 2.13 outside that range (its
version assert compares strings, so it passes). The two patches (shared/notes/peers-on-cpu.md),
applied in the peer's own process only for the ``patched.*`` figures:

1. ``fast_saving`` is never asynchronous as shipped: ``save_state_dict`` looks up its plan cache
   before the planner has the state dict, so every save misses and takes the synchronous
   first-save path. The patch sets the planner up first and passes the path as ``pathlib.Path``
   (the cache-hit branch joins it with ``/``).
2. Loading into pipeline stages fails as shipped (the saved ``param_groups`` list every FQN of
   the saving layout); the patch restores the local ``params`` lists after its optimizer load.

ByteCheckpoint fsyncs its files; the bench without ``--fsync`` does not turn that off (no
option), which is noted next to its figures.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import threading
import time
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path[:0] = [
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- shardsmith side ---------------------------------------------------------------------------


def bcp_python() -> str:
    return os.environ.get("SHARDSMITH_BCP_PYTHON", os.path.join(REPO, ".venv-bcp", "bin", "python"))


def start_peer(cfg: Any, args: Any, tmp: str) -> tuple[Any, str]:
    """Start the ByteCheckpoint ranks on ``args``' state (``nproc``, ``save_layout``,
    ``load_layouts``) under its own Python, in lockstep with the bench (bench/lockstep.py), in
    the scratch directory ``tmp``. Returns (the started PeerProcess: wait with ``ready()``, "") or (None, why not)."""
    from lockstep import PeerProcess
    from peer_state import describe_state

    py = bcp_python()
    if not os.path.exists(py):
        return (
            None,
            f"no bytecheckpoint interpreter at {py} (bash bench/peers/setup.sh bcp, or set SHARDSMITH_BCP_PYTHON)",
        )
    try:
        spec = describe_state(cfg, args.save_layout, args.load_layouts.split(","), args.nproc)
    except ValueError as e:
        return None, f"bytecheckpoint peer not run: {e}"
    spec.update(nproc=args.nproc, model=cfg.to_json())
    with open(os.path.join(tmp, "bcp-spec.json"), "w") as f:
        json.dump(spec, f)
    peer = PeerProcess(
        [
            py,
            os.path.abspath(__file__),
            os.path.join(tmp, "bcp-spec.json"),
            os.path.join(tmp, "bcp-run"),
            os.path.join(tmp, "bcp-ctrl"),
        ],
        os.path.join(tmp, "bcp-ctrl"),
        {**os.environ, "OMP_NUM_THREADS": "1"},
        os.path.join(tmp, "bcp.log"),
    )
    return peer, ""


# ---- ByteCheckpoint side -----------------------------------------------------------------------


class _Patches:
    """The two fixes, installed and removed around the ``patched.*`` figures."""

    def __init__(self) -> None:
        import pathlib

        from bytecheckpoint.checkpointer import base_checkpointer as base
        from bytecheckpoint.checkpointer.fsdp2_checkpointer import FSDP2Checkpointer

        self.base, self.cls = base, FSDP2Checkpointer
        self.orig_save, self.own = (
            base.save_state_dict,
            FSDP2Checkpointer.__dict__.get("_load_optimizer"),
        )
        orig_save, orig_load = self.orig_save, FSDP2Checkpointer._load_optimizer.__func__

        def save_state_dict(**kw: Any) -> Any:  # fix 1: the plan cache can hit
            kw["planner"].set_up_planner(
                kw["state_dict"], dist.get_rank() == kw.get("coordinator_rank", 0)
            )
            kw["state_path"] = pathlib.Path(kw["state_path"])
            return orig_save(**kw)

        def load_optimizer(
            cls: Any, *a: Any, **kw: Any
        ) -> Any:  # fix 2: keep the local params lists
            state = kw.get("optimizer_state", a[1] if len(a) > 1 else None)
            local = [list(g["params"]) for g in state["param_groups"]]
            out = orig_load(cls, *a, **kw)
            for group, params in zip(out["param_groups"], local):
                group["params"] = params
            return out

        self.save_fn, self.load_fn = save_state_dict, classmethod(load_optimizer)

    def apply(self, on: bool) -> None:
        self.base.save_state_dict = self.save_fn if on else self.orig_save
        if on:
            self.cls._load_optimizer = self.load_fn
        elif self.own is not None:
            self.cls._load_optimizer = self.own
        elif "_load_optimizer" in self.cls.__dict__:
            del self.cls._load_optimizer


class _Ops:
    """One rank's ByteCheckpoint save/load on the bench's state."""

    def __init__(self, spec: dict[str, Any], base: str) -> None:
        import bytecheckpoint

        from shardsmith.layout import ModelConfig

        self.bcp, self.base, self.step = bytecheckpoint, base, 0
        self.cfg = ModelConfig.from_json(spec["model"])
        self.src = _build(self.cfg, spec["save"], fill=True)
        self.dst: dict[str, dict[str, Any]] = {}

    def target(self, layout: str) -> dict[str, Any]:
        """The load target under ``layout``, built afresh (untimed) with the previous one dropped:
        one target alive at a time, so a rank holds two copies of its share of the state (the
        source and one target), not one per layout (one per layout drove the peer past the
        memory of a shared 24 GiB VM at 1 GiB of state)."""
        self.dst.clear()
        gc.collect()
        self.dst[layout] = _build(self.cfg, layout, fill=False)
        return self.dst[layout]

    def save(self, name: str, fast: bool) -> float:
        """Returns the seconds the caller was blocked; returns after the save is committed."""
        self.step += 1
        done = threading.Event()
        t0 = time.perf_counter()
        self.bcp.save(
            os.path.join(self.base, name),
            self.src["state"],
            framework="fsdp2",
            fast_saving=fast,
            global_steps=self.step,
            callback=done.set,
        )
        blocked = time.perf_counter() - t0
        if dist.get_rank() == 0 and not done.wait(600):
            raise RuntimeError("bytecheckpoint save not committed after 600 s")
        dist.barrier()
        return blocked

    def load(self, name: str, target: str) -> None:
        dst = self.dst[target]
        self.bcp.load(
            os.path.join(self.base, name, f"global_step_{self.step_of[name]}"),
            dst["state"],
            framework="fsdp2",
            fast_loading=True,
        )

    step_of: dict[str, int] = {}


def _build(cfg: Any, layout: str, fill: bool) -> dict[str, Any]:
    """The bench's model under ``layout`` with an AdamW holding its moments (no ``extra_state``:
    its load unpickles with ``weights_only`` and fails on torch >= 2.6); ``locals()`` maps the
    bench's FQNs (``w``, ``optim.exp_avg.w``, ...) to this rank's local tensors, read afresh (an
    optimizer load replaces its state tensors)."""
    from ckpt_state import build_model, parse_layout

    from shardsmith.layout.sharding import checkpoint_specs, rank_boxes

    dims = parse_layout(layout)
    _, model = build_model(cfg, dims)
    boxes = rank_boxes(checkpoint_specs(cfg, dims), dims, dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = dict(model.named_parameters())
    for fqn, p in params.items():
        opt.state[p] = {
            "step": torch.tensor(7.0),
            "exp_avg": torch.zeros_like(p.detach()),
            "exp_avg_sq": torch.zeros_like(p.detach()),
        }

    def local_tensors() -> dict[str, torch.Tensor]:
        out = {}
        for fqn, p in params.items():
            for key, t in (
                (fqn, p.detach()),
                (f"optim.exp_avg.{fqn}", opt.state[p]["exp_avg"]),
                (f"optim.exp_avg_sq.{fqn}", opt.state[p]["exp_avg_sq"]),
            ):
                out[key] = t.to_local() if hasattr(t, "to_local") else t
        return out

    if fill:
        with torch.no_grad():
            for key, t in local_tensors().items():
                gen = torch.Generator().manual_seed(zlib.crc32(f"{key}{boxes[key]}".encode()))
                t.uniform_(-1, 1, generator=gen)
    return {"state": {"model": model, "optimizer": opt}, "locals": local_tensors}


def _worker(rank: int, spec: dict[str, Any], base: str, ctrl: str, port: int) -> None:
    import lockstep

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec["nproc"]
    )
    try:
        ops, patches = _Ops(spec, base), _Patches()
        ops.save("warmup", False)  # starts its gRPC coordinator
        checked: set[str] = set()
        lockstep.serve_rounds(ctrl, lambda r: _round(ops, patches, spec, base, checked))
    finally:
        dist.destroy_process_group()


def _round(
    ops: _Ops, patches: _Patches, spec: dict[str, Any], base: str, checked: set[str]
) -> dict[str, Any]:
    """One round: as shipped, then patched: sync save, async save, a load into each layout (a
    failure is recorded in ``errors``; loaded values are checked once per mode and layout)."""
    from peer_state import _loaded_ok, _measure

    results: dict[str, Any] = {"errors": {}, "loads_identical": {}}

    def run(key: str, fn: Callable[[], Any]) -> None:
        try:
            results[key] = [_measure(base, fn)]
        except Exception as e:  # a peer's failure is a result: record it, go on
            results["errors"][key] = f"{type(e).__name__}: {str(e)[:200]}"
            dist.barrier()

    for mode in ("shipped", "patched"):
        patches.apply(mode == "patched")
        if mode == "patched":
            ops.save(f"{mode}-async", True)  # the patched cache hits from the second save on
        run(f"{mode}.save", lambda: ops.save(f"{mode}-sync", False))
        ops.step_of[f"{mode}-sync"] = ops.step
        run(f"{mode}.async", lambda: ops.save(f"{mode}-async", True))
        for target in spec["loads"]:
            key = f"{mode}.load.{target}"
            ops.target(target)
            run(key, lambda: ops.load(f"{mode}-sync", target))
            if key in results and key not in checked:
                checked.add(key)
                results["loads_identical"][f"{mode}.{target}"] = _loaded_ok(
                    spec, target, ops.dst[target]["locals"]()
                )
    with open("/proc/self/status") as f:  # peak RSS since the rank started (its HWM)
        hwm = torch.tensor([int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024])
    dist.all_reduce(hwm, op=dist.ReduceOp.MAX)
    results["peak_rss_mib"] = float(hwm[0])
    return results


def main(argv: list[str]) -> int:
    from lockstep import peer_main

    return peer_main(argv, _worker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
