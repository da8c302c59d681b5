"""Causal attention over a context-parallel group: all-gather of K/V per layer.

Each rank of the ``cp`` group holds ``T / cp`` tokens of every sequence (two load-balanced
chunks, :mod:`.sequence`). Queries stay local; before attention every layer all-gathers
the (rotated) keys and values of the whole sequence over the group, and each local query
chunk attends to the keys up to its own position (a bottom-right causal mask). The
backward of the all-gather is a reduce-scatter of the K/V gradients (each rank's K/V
feeds every later query, wherever it lives). This is Megatron-Core's ``--cp-comm-type
all_gather``; torchtitan's and Megatron's default ``p2p`` is ring attention.

Cost at 128K tokens, Llama 3.1 405B (8 kv heads of 128, bf16) at TP 8 · CP 16, per layer
and rank (formulas; ``shardsmith train --model llama3.1-405b --dry-run`` prints them):

* **All-gather (this module).** The whole K and V of the rank's kv head are
  ``2 * 131072 * 1 * 128 * 2 B = 64 MiB``; the rank receives ``15/16`` of it (60 MiB) in
  the forward and sends as much in the backward's reduce-scatter. Over 400 Gb/s
  InfiniBand (CP groups span nodes when TP fills one) that is about 1.3 ms each way,
  *exposed* (attention waits for it), against about 11 ms of causal attention compute
  (``4 * T^2 * Dh * H / 2 / cp`` = 4.4 TFLOP at 16 local query heads, ~400 TFLOP/s): ~12 %.
  Peak memory holds the full K/V of one layer (64 MiB, plus the GQA expansion).
* **Ring (p2p).** The same 60 MiB crosses each link, but in ``cp - 1`` steps of 4 MiB,
  each overlapped with the attention of the block already received: communication hides
  behind compute whenever a block's attention (~0.7 ms) outlasts its transfer (~0.08 ms),
  and memory holds two blocks (8 MiB), not 64 MiB. The backward sends dK/dV around the
  ring as well (twice the bytes of the forward).

All-gather is chosen here: it is exact by construction (one softmax over all keys, no
online-softmax merge of partial results), works on gloo (the CPU test platform: no
``batch_isend_irecv`` ordering to get right), and costs the ~12 % above at 128K. The share
grows as the context shrinks at a fixed cp (bytes go like ``T``, compute like ``T^2``: at
32K and CP 16 it is ~50 %), so use a smaller cp at shorter context. Ring attention is the
follow-up for jobs where the exposed share counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from shardsmith.trainer.context_parallel.sequence import (
    chunk_ids,
    local_positions,
    shard_sequence,
    unshard_sequence,
)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 1) in natural token order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: "ContextParallel") -> torch.Tensor:  # type: ignore[override]
        ctx.cp = cp
        if x.is_meta:  # pipeline shape inference: no communication
            return x.new_empty((x.shape[0], x.shape[1] * cp.size, *x.shape[2:]))
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        return unshard_sequence(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        cp: ContextParallel = ctx.cp
        if grad.is_meta:
            return grad.new_empty((grad.shape[0], grad.shape[1] // cp.size, *grad.shape[2:])), None
        if grad.is_cuda:  # NCCL: reduce-scatter the rank-ordered shards
            by_rank = torch.cat([shard_sequence(grad, cp.size, r) for r in range(cp.size)], dim=0)
            out = grad.new_empty((grad.shape[0], grad.shape[1] // cp.size, *grad.shape[2:]))
            dist.reduce_scatter_tensor(out, by_rank.contiguous(), group=cp.group)
            return out, None
        grad = grad.contiguous()  # gloo has no reduce-scatter: all-reduce, keep ours
        dist.all_reduce(grad, group=cp.group)
        return shard_sequence(grad, cp.size, cp.rank), None


@dataclass(eq=False)
class ContextParallel:
    """This rank's context-parallel group.

    Attributes:
        group: the ``cp`` process group (every member calls the collectives in the same order).
        size: the group's size ``cp``.
        rank: this rank's index in it.
    """

    group: Any
    size: int
    rank: int
    _positions: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def positions(self, seq_length: int, device: torch.device) -> torch.Tensor:
        """Global positions (int64, ``(T / cp,)``) of this rank's tokens of a ``seq_length``
        sequence (RoPE angles are taken at these)."""
        key = (seq_length, str(device))
        if key not in self._positions:
            self._positions[key] = local_positions(seq_length, self.size, self.rank, device)
        return self._positions[key]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (e.g. a batch (B, T) -> (B, T / cp)); same samples on every rank."""
        return shard_sequence(x, self.size, self.rank, dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values (B, T / cp, K, Dh) of this rank -> (B, T, K, Dh) of the whole sequence
        in natural order (collective over the group; differentiable)."""
        return _GatherSequence.apply(x, self)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence.

        Args:
            q: (B, H, T / cp, Dh), this rank's two chunks in local order.
            k, v: (B, H, T, Dh), the whole sequence in natural order (:meth:`gather`).
        Returns:
            (B, H, T / cp, Dh). Each chunk attends to keys up to its own last position only
            (no work on keys it may not see). The causal mask is aligned to the lower right
            (``causal_lower_right``), which the flash and memory-efficient kernels take without
            materializing a (T / 2cp) x T mask.
        """
        c = q.shape[2] // 2
        outs = []
        for i, chunk in enumerate(chunk_ids(self.size, self.rank)):
            end = (chunk + 1) * c
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, i * c : (i + 1) * c],
                    k[:, :, :end],
                    v[:, :, :end],
                    attn_mask=causal_lower_right(c, end),
                )
            )
        return torch.cat(outs, dim=2)
