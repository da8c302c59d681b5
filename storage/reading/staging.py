"""Reads into accelerator memory: through a bounded host staging buffer.

Storage reads land in host memory (``preadv`` into the destination's bytes, ranged GETs,
checksums on the CPU). A destination on a GPU (the trainer's model and optimizer shards after
``to_empty(device="cuda")``) is therefore filled in batches: each batch of boxes is read,
verified, into one reused host buffer (page-locked when the destination is CUDA, so the copy
is a DMA), then copied to the device; the device copy finishes before the buffer is reused.
A box larger than the buffer is read in runs of whole dim-0 rows. Host memory held: one
buffer of at most :data:`STAGING_NBYTES` (or one row, when a single row is larger), whatever
the model size, the same bound as the rest of the load path; zarr checkpoints are staged box
by box (a compressed chunk is read and decoded whole by every call that touches it, so boxes
are not cut there: a box larger than the budget is staged whole). Page-locked memory goes back
to torch's pinned-memory cache after the load, which keeps it for the process's next one.
"""

from __future__ import annotations

from math import prod
from typing import Callable, Sequence

import torch

from shardsmith.layout import Box

#: Host bytes staged at once for destinations off the CPU (one buffer, reused batch after batch).
STAGING_NBYTES = 256 * 2**20
#: Byte alignment of each box inside the staging buffer (covers every dtype's element size).
_ALIGN = 64

Request = tuple[str, Box, torch.Tensor]
HostRead = Callable[[Sequence[tuple[str, Box, "torch.Tensor | None"]]], object]


def on_host(t: torch.Tensor | None) -> bool:
    """True when ``t`` is absent (a new CPU tensor is made) or lives in CPU memory."""
    return t is None or t.device.type == "cpu"


def _row_runs(fqn: str, box: Box, dest: torch.Tensor, budget: int) -> list[Request]:
    """``(fqn, box, dest)`` cut along dim 0 into runs of whole rows of at most ``budget`` bytes
    (at least one row each); one run when it fits, is 0-d, or ``budget`` is negative (no cuts)."""
    nbytes = box.numel * dest.element_size()
    if not box.lengths or nbytes <= budget or budget < 0:
        return [(fqn, box, dest)]
    row = prod(box.lengths[1:]) * dest.element_size()
    step = max(1, budget // max(row, 1))
    runs = []
    for r0 in range(0, box.lengths[0], step):
        r = min(step, box.lengths[0] - r0)
        sub = Box((box.offsets[0] + r0, *box.offsets[1:]), (r, *box.lengths[1:]))
        runs.append((fqn, sub, dest.narrow(0, r0, r)))
    return runs


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _views(buf: torch.Tensor, batch: list[Request]) -> list[torch.Tensor]:
    """One host tensor per request of ``batch``, carved from ``buf`` at 64-byte-aligned offsets."""
    out, off = [], 0
    for _, box, d in batch:
        n = box.numel * d.element_size()
        out.append(buf[off : off + n].view(d.dtype).view(box.lengths))
        off += _padded(n)
    return out


def read_staged(
    read: HostRead,
    requests: Sequence[Request],
    budget: int = STAGING_NBYTES,
    split_rows: bool = True,
) -> None:
    """Fill destinations that are not in CPU memory (e.g. CUDA tensors) through host staging.

    Args:
        read: reads and verifies a list of ``(fqn, box, host destination)`` requests (the
            storage read path, e.g. :func:`shardsmith.storage.formats.registry.read_boxes` bound to a
            store and manifest); called once per batch.
        requests: ``(fqn, global box, destination)`` with each destination of shape
            ``box.lengths`` (checked by ``read`` per run) on any device; overwritten.
        budget: most host bytes staged at once (a single row larger than it is staged alone).
        split_rows: cut boxes larger than ``budget`` into runs of rows (False: stage each box
            whole, for formats whose reads cannot be cut cheaply, e.g. compressed zarr chunks).

    Raises:
        Whatever ``read`` raises (``IntegrityError``, ``ValueError``, ``KeyError``); the
        destinations of batches before the failing one are already filled.
    """
    runs = [
        run
        for fqn, box, dest in requests
        for run in (_row_runs(fqn, box, dest.detach(), budget if split_rows else -1))
    ]
    batches: list[list[Request]] = []
    held = largest = 0
    for run in runs:
        nbytes = _padded(run[1].numel * run[2].element_size())
        if not batches or held + nbytes > budget:
            batches.append([])
            held = 0
        batches[-1].append(run)
        held += nbytes
        largest = max(largest, held)
    pinned = torch.cuda.is_available() and any(d.device.type == "cuda" for _, _, d in runs)
    buf = torch.empty(largest, dtype=torch.uint8, pin_memory=pinned)  # allocated once
    for batch in batches:
        _flush(read, buf, batch, pinned)


def _flush(read: HostRead, buf: torch.Tensor, batch: list[Request], pinned: bool) -> None:
    """Read one batch into ``buf``, copy it to the destinations, wait for the copies."""
    hosts = _views(buf, batch)
    read([(fqn, box, host) for (fqn, box, _), host in zip(batch, hosts)])
    for (_, _, dest), host in zip(batch, hosts):
        dest.copy_(host, non_blocking=pinned)
    for device in {dest.device for _, _, dest in batch if dest.device.type == "cuda"}:
        torch.cuda.synchronize(device)  # the buffer is reused next batch
