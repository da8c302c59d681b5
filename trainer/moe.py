"""Mixtral-style mixture-of-experts FFN (Jiang et al. 2024, "Mixtral of Experts").

A linear router scores the E experts per token; each token goes to its top-K experts,
weighted by the softmax over those K logits; each expert is a SwiGLU. The expert weights
are one tensor per matrix with a leading expert dim (``experts.w1`` ``[E, F, D]``,
``experts.w2`` ``[E, D, F]``, ``experts.w3`` ``[E, F, D]``), the checkpoint's logical
form, so a split over experts is a box along dim 0.

The Switch load-balancing loss (Fedus et al. 2021, eq. 4) ``E * sum_e f_e * P_e`` (``f_e``
fraction of routed token slots given to expert e, ``P_e`` mean router probability of e) is
kept in :attr:`MoEFeedForward.aux_loss` after each forward; the step adds it times
``moe_aux_loss_coeff``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.layout import ModelConfig


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as ``[E, ...]`` tensors; :meth:`expert` runs one on its tokens."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])                                    # (N, D)
        logits = self.router(h)                                         # (N, E)
        top, idx = logits.topk(self.topk, dim=-1)                       # (N, K)
        weights = F.softmax(top.float(), dim=-1).type_as(h)
        out = torch.zeros_like(h)
        for e in range(self.num_experts):
            token, slot = (idx == e).nonzero(as_tuple=True)
            if token.numel():
                y = self.experts.expert(e, h[token]) * weights[token, slot, None]
                out = out.index_add(0, token, y)
        self.aux_loss = load_balancing_loss(logits, idx, self.num_experts)
        return out.view(shape)


def load_balancing_loss(logits: torch.Tensor, idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch loss ``E * sum_e f_e * P_e`` of router logits (N, E) and top-K choices (N, K)."""
    probs = F.softmax(logits.float(), dim=-1).mean(0)                   # P_e
    counts = torch.bincount(idx.flatten(), minlength=num_experts).float()
    return num_experts * (counts / idx.numel() * probs).sum()


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the last forward's load-balancing losses of ``model``'s MoE layers (None if none)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
