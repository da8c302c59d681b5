"""Small collectives on CPU tensors: JSON all-gather, text broadcast, any-rank flag; and the
in-place broadcast of a tensor on any device (:func:`broadcast_into`).

Every helper takes the ``group`` it runs on (``None`` = the default group) and every rank
of that group must call it, in the same order. Payloads travel as UTF-8 bytes or ints in
``uint8``/``int`` tensors: no pickle (unlike ``all_gather_object``), so a peer can never
make this rank run code. On GPU jobs these run on the gloo half of
``cpu:gloo,cuda:nccl``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from shardsmith.storage import cycle_gc_paused


def gather_json(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """All-gather a JSON-serializable object from every rank (UTF-8 bytes over the
    process group; no pickle). Every rank of ``group`` must call it.

    Returns:
        One decoded object per rank of ``group``, in group-rank order.
    """
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(t[: int(s.item())].tolist())) for t, s in zip(out, sizes)]


def gather_json_to_root(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's JSON-serializable ``obj`` on group rank 0 (``None`` on the others): UTF-8
    bytes over the process group, no pickle. Rank 0 receives world x the longest message;
    the others only send theirs (no all-gather of everything to everyone). Every rank of
    ``group`` must call it.

    Returns:
        On group rank 0, one decoded object per rank in group-rank order; elsewhere ``None``.
    """
    data = json.dumps(obj).encode()
    longest = torch.tensor([len(data)], dtype=torch.int64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    buf = torch.zeros(8 + int(longest.item()), dtype=torch.uint8)
    buf[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if data:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank(group) != 0:
        dist.gather(buf, None, dst=root, group=group)
        return None
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.gather(buf, out, dst=root, group=group)
    raw = [bytes(t.numpy()) for t in out]
    with cycle_gc_paused():  # one object tree per rank (their shard records)
        return [json.loads(r[8 : 8 + int.from_bytes(r[:8], "little")]) for r in raw]


def broadcast_text(text: str, group: dist.ProcessGroup | None = None) -> str:
    """Group rank 0's ``text`` on every rank of ``group`` (UTF-8 over the process group; one
    small collective when it is empty, the common case). Every rank of ``group`` must call it."""
    data = text.encode() if dist.get_rank(group) == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(size, src=src, group=group)
    if int(size.item()) == 0:
        return ""
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.tolist()).decode()


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (one MAX all-reduce of a CPU
    int). Every rank of ``group`` must call it."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def broadcast_into(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Broadcast ``tensor`` in place from global rank ``src`` over ``group`` (any device: with
    ``cpu:gloo,cuda:nccl`` a GPU tensor travels by NCCL); a non-contiguous one through a
    contiguous copy. Every rank of ``group`` must call it."""
    flat = tensor.detach()
    if flat.is_contiguous():
        dist.broadcast(flat, src=src, group=group)
        return
    tmp = flat.contiguous()
    dist.broadcast(tmp, src=src, group=group)
    flat.copy_(tmp)
