"""Mixtral-style mixture-of-experts FFN (Jiang et al. 2024, "Mixtral of Experts").

A linear router scores the E experts per token; each token goes to its top-K experts,
weighted by the softmax over those K logits; each expert is a SwiGLU. The expert weights
are one tensor per matrix with a leading expert dim (``experts.w1`` ``[E, F, D]``,
``experts.w2`` ``[E, D, F]``, ``experts.w3`` ``[E, F, D]``), the checkpoint's logical
form, so a split over experts is a box along dim 0.

Expert parallelism (:func:`shard_experts`): each rank of the EP group keeps ``E / ep`` whole
experts as plain tensors (FSDP leaves them alone); tokens, choices and weights are
all-gathered over the group, each rank runs its experts on every token routed to them, and
an all-reduce sums the partial outputs, of which each rank keeps its own tokens (Megatron's
``allgather`` token dispatcher). Expert gradients then sum over the group's batches and are
divided by ``ep`` in :func:`shardsmith.trainer.parallel.finalize_grads` (FSDP averages).
The same function's gather (:func:`all_gather_rows`) reassembles whole experts for tests.

The Switch load-balancing loss (Fedus et al. 2021, eq. 4) ``E * sum_e f_e * P_e`` (``f_e``
fraction of routed token slots given to expert e, ``P_e`` mean router probability of e) is
kept in :attr:`MoEFeedForward.aux_loss` after each forward; the step adds it times
``moe_aux_loss_coeff``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardsmith.layout import ModelConfig


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as ``[E, ...]`` tensors; :meth:`expert` runs one on its tokens."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.ep_size = 1                                                # > 1: these are E / ep experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on tokens x (N, D) -> (N, D)."""
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])


class MoEFeedForward(nn.Module):
    """Router + top-K dispatch over :class:`GroupedExperts`; x (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size)
        self.aux_loss: torch.Tensor | None = None
        self.ep_group: dist.ProcessGroup | None = None
        self.first_expert = 0                                           # global id of local expert 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])                                    # (N, D)
        logits = self.router(h)                                         # (N, E)
        top, idx = logits.topk(self.topk, dim=-1)                       # (N, K)
        weights = F.softmax(top.float(), dim=-1).type_as(h)
        self.aux_loss = load_balancing_loss(logits, idx, self.num_experts)
        if self.ep_group is None:
            return self._local_experts(h, idx, weights).view(shape)
        g = self.ep_group
        gathered_idx = [torch.empty_like(idx) for _ in range(dist.get_world_size(g))]
        dist.all_gather(gathered_idx, idx.contiguous(), group=g)
        out = self._local_experts(_GatherRows.apply(h, g), torch.cat(gathered_idx), _GatherRows.apply(weights, g))
        return _SumOwnRows.apply(out, g).view(shape)

    def _local_experts(self, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's experts of their weighted outputs for tokens h (N, D)."""
        out = torch.zeros_like(h)
        for e in range(self.experts.w1.shape[0]):
            token, slot = (idx == self.first_expert + e).nonzero(as_tuple=True)
            if token.numel():
                y = self.experts.expert(e, h[token]) * weights[token, slot, None]
                out = out.index_add(0, token, y)
        return out


class _GatherRows(torch.autograd.Function):
    """Concatenate every group rank's rows (rank order); backward: sum the gradients over the
    group and keep this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        return all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.rows
        return grad[start:start + ctx.rows], None


class _SumOwnRows(torch.autograd.Function):
    """Sum the group's partial outputs (all-reduce) and keep this rank's rows; backward:
    gather every rank's row gradients (each rank's partial fed every rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        rows = x.shape[0] // dist.get_world_size(group)
        start = dist.get_rank(group) * rows
        return total[start:start + rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_rows(grad, ctx.group), None


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every group rank's ``x`` concatenated along dim 0, in group-rank order (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def shard_experts(moe: MoEFeedForward, group: dist.ProcessGroup) -> list[nn.Parameter]:
    """Keep only this EP rank's ``E / ep`` experts (on ``meta``, before materialization) and
    route through ``group``; returns the new expert parameters (FSDP must ignore them)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = moe.experts
    per_rank = experts.w1.shape[0] // ep
    moe.ep_group, moe.first_expert = group, rank * per_rank
    experts.ep_size = ep
    for name in ("w1", "w2", "w3"):
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(torch.empty((per_rank, *full.shape[1:]), device=full.device)))
    return [experts.w1, experts.w2, experts.w3]


def expert_parallel_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, int]]:
    """FQN -> (parameter, ep) of every expert-parallel expert tensor of ``model``."""
    ids = {id(p): fqn for fqn, p in model.named_parameters()}
    return {ids[id(p)]: (p, m.ep_size) for m in model.modules() if isinstance(m, GroupedExperts) and m.ep_size > 1
            for p in (m.w1, m.w2, m.w3)}


def load_balancing_loss(logits: torch.Tensor, idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch loss ``E * sum_e f_e * P_e`` of router logits (N, E) and top-K choices (N, K)."""
    probs = F.softmax(logits.float(), dim=-1).mean(0)                   # P_e
    counts = torch.bincount(idx.flatten(), minlength=num_experts).float()
    return num_experts * (counts / idx.numel() * probs).sum()


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the last forward's load-balancing losses of ``model``'s MoE layers (None if none)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
