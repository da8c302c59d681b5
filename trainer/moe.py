"""Mixtral-style mixture-of-experts FFN (Jiang et al. 2024, "Mixtral of Experts").

A linear router scores the E experts per token; each token goes to its top-K experts,
weighted by the softmax over those K logits; each expert is a SwiGLU. The expert weights
are one tensor per matrix with a leading expert dim (``experts.w1`` ``[E, F, D]``,
``experts.w2`` ``[E, D, F]``, ``experts.w3`` ``[E, F, D]``), the checkpoint's logical
form, so a split over experts is a box along dim 0 and a TP split one along F.

Dispatch (:meth:`MoEFeedForward.forward`): the N*K (token, choice) slots are sorted by
expert, each expert runs once on its rows, and the weighted outputs are summed back per
token (``index_add``). Without expert parallelism that is all.

Expert parallelism (:func:`shard_experts`, Megatron's ``alltoall`` token dispatcher): each
rank of the EP group keeps ``E / ep`` whole experts as plain tensors (FSDP leaves them
alone). The per-expert row counts are exchanged first (one ``all_to_all_single`` of E
integers), then each rank sends every slot's row only to the rank owning its expert and
gets the outputs back by a second all-to-all: each rank moves ``N * K * D`` elements per
direction whatever ``ep`` is. (The all-gather dispatcher this replaced moved
``ep * N * D`` in and all-reduced ``ep * N * D`` out, growing linearly with ep: 64x the
activations per layer at EP 64.) Expert gradients sum over the group's batches and are
divided by ``ep`` in :func:`shardsmith.trainer.parallel.finalize_grads` (FSDP averages).

Expert tensor parallelism (tp > 1; Megatron's default ``--expert-tensor-parallel-size``
= ``--tensor-model-parallel-size``): inside each expert, ``w1``/``w3`` are column-parallel
and ``w2`` row-parallel over the TP group (F split); the experts' input is copied into the
TP region (identity forward, all-reduce backward) and their output reduced from it
(all-reduce forward, identity backward), as Megatron's ``mappings.py`` does.

The Switch load-balancing loss (Fedus et al. 2021, eq. 4) ``E * sum_e f_e * P_e`` (``f_e``
fraction of routed token slots given to expert e, ``P_e`` mean router probability of e) is
kept in :attr:`MoEFeedForward.aux_loss` after each forward. In training it enters the
backward where it is computed (Megatron's ``MoEAuxLossAutoScaler``): its gradient, times
:attr:`MoEFeedForward.aux_loss_scale`, is injected when the layer's output gradient
arrives, so it is correct under pipeline parallelism, where the schedule's loss sees only
the last stage. :func:`router_stats` reports the tokens per expert and the aux loss.

Why ``demo --moe`` shows ``experts max/mean 2.00`` (every token's top-2 holds the same
expert) in its last layers early on: the statistic is right and the load-balancing loss
reaches every router (``tests/trainer/test_moe_pipeline_metrics.py`` compares a pipelined
step's router gradients with one process's, with and without it). The router's inputs
collapse: while the model first learns the unigram distribution, the FFN inputs of the last
layers become nearly the same vector for every token (the per-token deviation from the mean
input shrinks to a small fraction of the mean within the first steps), so every token gets
nearly the same logits and the same top-K. The aux
loss can only change which expert that is, not split tokens a linear router cannot tell
apart; it evens out once the representations differ again (or with a far larger
``moe_aux_loss_coeff``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from shardsmith.layout import ModelConfig, chunk_range

#: Expert weight -> the dim tensor parallelism splits (w1/w3 column-, w2 row-parallel over F).
EXPERT_TP_DIMS: dict[str, int] = {"w1": 1, "w2": 2, "w3": 1}


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as ``[E, ...]`` tensors (or this rank's ``E / ep`` of them,
    each with ``F / tp`` hidden units under expert TP)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.ep_size = 1  # > 1: these are E / ep experts
        self.tp_size = 1  # > 1: F split over tp
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows x (M, D) sorted by local expert, ``counts[e]`` of them for expert e -> (M, D).

        Every expert runs, also on zero rows, so each expert weight gets a gradient (zeros
        when unused), as the whole ``[E, ...]`` tensor of one process does."""
        outs = [
            F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
            for e, rows in enumerate(x.split(counts))
        ]
        return torch.cat(outs)


class MoEFeedForward(nn.Module):
    """Router + top-K dispatch over :class:`GroupedExperts`; x (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size)
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_scale = 0.0  # training: d(step loss) / d(aux loss), see module doc
        self.ep_group: dist.ProcessGroup | None = None
        self.tp_group: dist.ProcessGroup | None = None
        self.load: torch.Tensor | None = None  # (E,) routed slots per expert since reset_stats
        self.aux_sum: torch.Tensor | float = 0.0  # sum of the aux losses since reset_stats
        self.num_forwards = 0
        self.counting = True  # False inside :func:`uncounted`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, D)
        logits = self.router(h)  # (N, E)
        top, idx = logits.topk(self.topk, dim=-1)  # (N, K)
        weights = F.softmax(top.float(), dim=-1).type_as(h)  # (N, K)
        self.aux_loss = load_balancing_loss(logits, idx, self.num_experts)
        flat = idx.flatten()  # (N*K,) expert of each slot
        order = flat.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        self._record(counts)
        token = order // self.topk  # (N*K,) token of each sorted slot
        y = self._dispatch(h[token], counts) * weights.flatten()[order, None]
        out = torch.zeros_like(h).index_add(0, token, y)
        if self.aux_loss_scale and torch.is_grad_enabled():
            out = _AuxLossScaler.apply(out, self.aux_loss, self.aux_loss_scale)
        return out.view(shape)

    def _dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs (M, D) of rows (M, D) sorted by expert, ``counts`` (E,) per expert,
        wherever the experts live (all-to-all over the EP group; see the module docstring)."""
        if self.ep_group is None:
            return self._experts(rows, counts.tolist())
        g = self.ep_group
        ep = dist.get_world_size(g)
        per = self.num_experts // ep
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=g)  # recv[s*per + e]: from rank s, expert e
        send_splits = counts.view(ep, per).sum(1).tolist()
        recv_splits = recv.view(ep, per).sum(1).tolist()
        x = all_to_all_single_autograd(rows, recv_splits, send_splits, g)  # grouped by source rank
        expert_of_row = torch.arange(per, device=counts.device).repeat(ep).repeat_interleave(recv)
        perm = expert_of_row.argsort(stable=True)  # source-major -> expert-major
        y = self._experts(x[perm], recv.view(ep, per).sum(0).tolist())
        y = y[perm.argsort()]
        return all_to_all_single_autograd(y, send_splits, recv_splits, g)

    def _experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on rows sorted by local expert; TP-reduced under expert TP."""
        if self.tp_group is None:
            return self.experts(rows, counts)
        rows = _CopyToGroup.apply(rows, self.tp_group)
        return _ReduceFromGroup.apply(self.experts(rows, counts), self.tp_group)

    def _record(self, counts: torch.Tensor) -> None:
        """Accumulate router statistics (activation-checkpoint recomputes count twice, which
        leaves max/mean and the mean aux loss unchanged); nothing inside :func:`uncounted`."""
        if not self.counting:
            return
        c = counts.detach().float()
        self.load = c if self.load is None else self.load + c
        assert self.aux_loss is not None
        self.aux_sum = self.aux_loss.detach() + self.aux_sum
        self.num_forwards += 1

    def reset_stats(self) -> None:
        """Forget the router statistics (start of a step)."""
        self.load, self.aux_sum, self.num_forwards = None, 0.0, 0


class _AuxLossScaler(torch.autograd.Function):
    """Identity on ``out``; backward also sends gradient ``scale`` into ``aux`` (a scalar
    loss), so ``scale * aux`` is minimized with the loss wherever the layer runs."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank holds a part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward over ``group``; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """Every group rank's ``x`` concatenated along ``dim``, in group-rank order (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def shard_experts(
    moe: MoEFeedForward, ep_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None
) -> list[nn.Parameter]:
    """Keep only this rank's experts (``E / ep`` of them, each with its ``F / tp`` slice under
    expert TP), on ``meta`` before materialization, and route through the groups. Returns the
    expert parameters when they are expert-parallel (FSDP must ignore them), else []."""
    experts = moe.experts
    ep, ep_rank = (dist.get_world_size(ep_group), dist.get_rank(ep_group)) if ep_group else (1, 0)
    tp, tp_rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group else (1, 0)
    moe.ep_group, moe.tp_group = ep_group, tp_group
    experts.ep_size, experts.tp_size = ep, tp
    for name, tp_dim in EXPERT_TP_DIMS.items():
        full = getattr(experts, name)
        shape = list(full.shape)
        shape[0] = chunk_range(shape[0], ep, ep_rank)[1]
        shape[tp_dim] = chunk_range(shape[tp_dim], tp, tp_rank)[1]
        setattr(experts, name, nn.Parameter(torch.empty(shape, device=full.device)))
    return [experts.w1, experts.w2, experts.w3] if ep > 1 else []


def expert_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, GroupedExperts, str]]:
    """FQN -> (parameter, its experts module, weight name) of every expert tensor of ``model``."""
    ids = {id(p): fqn for fqn, p in model.named_parameters()}
    return {
        ids[id(getattr(m, n))]: (getattr(m, n), m, n)
        for m in model.modules()
        if isinstance(m, GroupedExperts)
        for n in EXPERT_TP_DIMS
    }


def expert_parallel_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, int]]:
    """FQN -> (parameter, ep) of every expert-parallel expert tensor of ``model``."""
    return {fqn: (p, m.ep_size) for fqn, (p, m, _) in expert_params(model).items() if m.ep_size > 1}


def load_balancing_loss(logits: torch.Tensor, idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch loss ``E * sum_e f_e * P_e`` of router logits (N, E) and top-K choices (N, K)."""
    probs = F.softmax(logits.float(), dim=-1).mean(0)  # P_e
    counts = torch.bincount(idx.flatten(), minlength=num_experts).float()
    return num_experts * (counts / idx.numel() * probs).sum()


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the last forward's load-balancing losses of ``model``'s MoE layers (None if none)."""
    losses = [
        m.aux_loss
        for m in model.modules()
        if isinstance(m, MoEFeedForward) and m.aux_loss is not None
    ]
    return torch.stack(losses).sum() if losses else None


def moe_layers(model: nn.Module) -> dict[int, MoEFeedForward]:
    """Global layer index -> MoE FFN of every MoE layer ``model`` (a stage or its chunks) holds."""
    out = {}
    for name, m in model.named_modules():
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
        if isinstance(m, MoEFeedForward) and found:
            out[int(found.group(1))] = m
    return out


@contextlib.contextmanager
def uncounted(model: nn.Module) -> Iterator[None]:
    """Forwards of ``model``'s MoE layers inside this block leave the router statistics alone.

    For passes that are not training: torch's pipeline stage infers its activation shapes
    with one extra forward on the first step of every schedule, stage 0 on the first
    microbatch again and later stages on uninitialized tensors (NaN or garbage router
    loads). Any rank may call it; it is local.
    """
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    for m in layers:
        m.counting = False
    try:
        yield
    finally:
        for m in layers:
            m.counting = True


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set every MoE layer's :attr:`MoEFeedForward.aux_loss_scale` and reset its statistics."""
    for m in moe_layers(model).values():
        m.aux_loss_scale = scale
        m.reset_stats()


def router_stats(model: nn.Module, cfg: ModelConfig) -> dict[str, object]:
    """The router's load since the last :func:`set_aux_loss_scale`, over the whole job.

    Returns ``{"moe_load_imbalance": [max/mean routed slots per expert, one per MoE layer],
    "moe_aux_loss": sum over MoE layers of the mean load-balancing loss}`` ({} for a dense
    model). Collective over the default group: every rank calls it (ranks without MoE
    layers contribute zeros); TP replicas count the same tokens, scaling max and mean alike.
    """
    if not cfg.num_experts:
        return {}
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    table = torch.zeros(
        len(layers), cfg.num_experts + 2, dtype=torch.float64
    )  # load..., aux sum, forwards
    mine = moe_layers(model)
    for row, i in enumerate(layers):
        m = mine.get(i)
        if m is not None and m.load is not None:
            table[row, :-2] = m.load.double().cpu()
            table[row, -2], table[row, -1] = float(m.aux_sum), m.num_forwards
    dist.all_reduce(table)
    load, aux, forwards = table[:, :-2], table[:, -2], table[:, -1].clamp(min=1)
    imbalance = (load.max(1).values / load.mean(1).clamp(min=1e-9)).tolist()
    return {
        "moe_load_imbalance": [round(x, 4) for x in imbalance],
        "moe_aux_loss": round(float((aux / forwards).sum()), 6),
    }
