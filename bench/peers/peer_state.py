"""What both checkpoint peers share (bench/peers/megatron_peer.py, bench/peers/bcp_peer.py): the
state description handed to a peer's interpreter, the timed measurement and the load check.
Only torch at the top level: the peers' own interpreters import it without shardsmith."""

from __future__ import annotations

import os
import resource
import sys
import time
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/


def describe_state(
    cfg: Any, save_layout: str, load_layouts: list[str], nproc: int
) -> dict[str, Any]:
    """The bench's state per layout and rank: ``[fqn, global_shape, offsets, lengths, replica_id,
    seed]`` rows (non-empty boxes only), plus the scalar ``step`` FQNs. Raises ValueError if a
    box is not on a regular grid (Megatron's ``ShardedTensor`` needs one)."""
    from ckpt_state import parse_layout

    from shardsmith.layout.sharding import checkpoint_specs, rank_boxes

    layouts: dict[str, list[list[list[Any]]]] = {}
    steps: list[str] = []
    for name in [save_layout, *load_layouts]:
        dims = parse_layout(name)
        specs = checkpoint_specs(cfg, dims)
        boxes = [rank_boxes(specs, dims, r) for r in range(nproc)]
        holders: dict[tuple[str, str], list[int]] = {}
        for r in range(nproc):
            for fqn, box in boxes[r].items():
                holders.setdefault((fqn, str(box)), []).append(r)
        rows: list[list[list[Any]]] = []
        for r in range(nproc):
            mine = []
            for fqn, box in sorted(boxes[r].items()):
                shape = tuple(specs[fqn].shape)
                if not shape:
                    if name == save_layout and r == 0:
                        steps.append(fqn)
                    continue
                if box.is_empty:
                    continue
                if any(g % n or o % n for g, o, n in zip(shape, box.offsets, box.lengths)):
                    raise ValueError(f"{fqn} box {box} of {shape} is not on a regular grid")
                mine.append(
                    [
                        fqn,
                        list(shape),
                        list(box.offsets),
                        list(box.lengths),
                        holders[(fqn, str(box))].index(r),
                        zlib.crc32(f"{fqn}{box}".encode()),
                    ]
                )
            rows.append(mine)
        layouts[name] = rows
    return {"save": save_layout, "loads": load_layouts, "layouts": layouts, "steps": steps}


def _cpu_seconds() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _settle(base: str) -> None:
    from pagecache import flush_and_evict

    if dist.get_rank() == 0:
        flush_and_evict(base)
    dist.barrier()


def _measure(base: str, fn: Callable[[], Any]) -> dict[str, float]:
    """Slowest rank's seconds and ``blocked``; CPU seconds (own + waited children) summed."""
    _settle(base)
    dist.barrier()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    blocked = fn() or 0.0
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    maxed = torch.tensor([seconds, blocked], dtype=torch.float64)
    summed = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    dist.all_reduce(summed)
    return {"s": float(maxed[0]), "blocked": float(maxed[1]), "cpu": float(summed[0])}


def _loaded_ok(spec: dict[str, Any], target: str, dst: dict[str, Any]) -> bool:
    """Whether every loaded tensor equals the saved values (regenerated from the source rows'
    seeds, overlap by overlap), on all ranks. Collective; untimed."""
    sources: dict[str, list[list[Any]]] = {}
    for rows in spec["layouts"][spec["save"]]:
        for row in rows:
            if row[4] == 0:
                sources.setdefault(row[0], []).append(row)
    ok = True
    for fqn, _, offsets, lengths, _, _ in spec["layouts"][target][dist.get_rank()]:
        got, covered = dst[fqn], 0
        for _, _, s_off, s_len, _, seed in sources[fqn]:
            lo = [max(a, b) for a, b in zip(offsets, s_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, lengths, s_off, s_len)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            src = torch.zeros(s_len).uniform_(-1, 1, generator=torch.Generator().manual_seed(seed))
            mine = got[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
            ok &= torch.equal(
                mine, src[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s_off))]
            )
            covered += mine.numel()
        ok &= covered == got.numel()
        if not ok and os.environ.get("MEGATRON_PEER_DEBUG"):
            print(f"rank {dist.get_rank()} {target} {fqn} differs", file=sys.stderr)
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return not int(flag)
