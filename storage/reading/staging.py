"""Reads into accelerator memory: through a bounded host staging buffer.

Storage reads land in host memory (``preadv`` into the destination's bytes, ranged GETs,
checksums on the CPU). A destination on a GPU (the trainer's model and optimizer shards after
``to_empty(device="cuda")``) is therefore filled in batches: each batch of boxes is read,
verified, into one reused host buffer (page-locked when the destination is CUDA, so the copy
is a DMA), then copied to the device; the device copy finishes before the buffer is reused.
A box larger than the buffer is read in runs of whole dim-0 rows. Host memory held:
at most :data:`STAGING_NBYTES` (or one row, when a single row is larger), whatever the model
size, the same bound as the rest of the load path.
"""

from __future__ import annotations

from math import prod
from typing import Callable, Sequence

import torch

from shardsmith.layout.box import Box

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
    (at least one row each); one run when it fits or is 0-d."""
    nbytes = box.numel * dest.element_size()
    if not box.lengths or nbytes <= budget:
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


class _Staging:
    """One host buffer, grown to the largest batch (at most the budget or one row)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buf = torch.empty(0, dtype=torch.uint8)

    def views(self, batch: list[Request]) -> list[torch.Tensor]:
        need = sum(_padded(box.numel * d.element_size()) for _, box, d in batch)
        if self.buf.numel() < need:
            self.buf = torch.empty(0, dtype=torch.uint8)          # drop the old one first
            self.buf = torch.empty(need, dtype=torch.uint8, pin_memory=self.pinned)
        out, off = [], 0
        for _, box, d in batch:
            n = box.numel * d.element_size()
            out.append(self.buf[off:off + n].view(d.dtype).view(box.lengths))
            off += _padded(n)
        return out


def read_staged(read: HostRead, requests: Sequence[Request], budget: int = STAGING_NBYTES) -> None:
    """Fill destinations that are not in CPU memory (e.g. CUDA tensors) through host staging.

    Args:
        read: reads and verifies a list of ``(fqn, box, host destination)`` requests (the
            storage read path, e.g. :func:`shardsmith.storage.formats.read_boxes` bound to a
            store and manifest); called once per batch.
        requests: ``(fqn, global box, destination)`` with each destination of shape
            ``box.lengths`` (checked by ``read`` per run) on any device; overwritten.
        budget: most host bytes staged at once (a single row larger than it is staged alone).

    Raises:
        Whatever ``read`` raises (``IntegrityError``, ``ValueError``, ``KeyError``); the
        destinations of batches before the failing one are already filled.
    """
    runs = [run for fqn, box, dest in requests for run in _row_runs(fqn, box, dest.detach(), budget)]
    pinned = torch.cuda.is_available() and any(d.device.type == "cuda" for _, _, d in runs)
    staging = _Staging(pinned)
    batch: list[Request] = []
    held = 0
    for run in runs:
        nbytes = _padded(run[1].numel * run[2].element_size())
        if batch and held + nbytes > budget:
            _flush(read, staging, batch)
            batch, held = [], 0
        batch.append(run)
        held += nbytes
    if batch:
        _flush(read, staging, batch)

def _flush(read: HostRead, staging: _Staging, batch: list[Request]) -> None:
    """Read one batch into the staging buffer, copy it to the destinations, wait for the copies."""
    hosts = staging.views(batch)
    read([(fqn, box, host) for (fqn, box, _), host in zip(batch, hosts)])
    for (_, _, dest), host in zip(batch, hosts):
        dest.copy_(host, non_blocking=staging.pinned)
    if staging.pinned:
        torch.cuda.synchronize()                              # the buffer is reused next batch
