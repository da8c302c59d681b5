"""Attribution of non-finite values: on a step whose global loss or gradient norm is not
finite, which rank and which parameter it came from.

The skip decision (:class:`~shardsmith.trainer.fault.bad_steps.BadStepPolicy`) uses the
all-reduced loss and norm, the same on every rank; only then does each rank look at its own
values: its local loss, then its local gradients in model order (embedding first, output
last), and one JSON all-gather brings every rank's first finding to every rank. The event
names the *first rank* where it appeared: the lowest rank whose local loss is not finite
(the loss is computed before any gradient), else the lowest rank with a non-finite
gradient, with that rank's first such parameter. A gradient made non-finite before the
data-parallel reduction reaches every replica of that shard with it, so the event also
lists every rank that saw one (``ranks``) and what each saw (``where``).

Cost at 1,024 ranks: nothing on a good step; on a bad step one pass over the local
gradients (``isfinite``) and one all-gather of a short JSON message per rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardsmith.trainer.comm import gather_json


def first_nonfinite(model: torch.nn.Module, local_loss: float) -> str | None:
    """``"loss"`` when this rank's loss is not finite, else the FQN of its first parameter
    (model order) whose local gradient has a NaN or an infinity, else None."""
    if not math.isfinite(local_loss):
        return "loss"
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if isinstance(g, DTensor) else g
        if not bool(torch.isfinite(g).all()):
            return name
    return None


def attribution(step: int, found: list[str | None]) -> dict[str, Any]:
    """The ``nonfinite`` event from every rank's :func:`first_nonfinite` (pure; index = rank)."""
    where = {rank: what for rank, what in enumerate(found) if what is not None}
    by_loss = [rank for rank, what in where.items() if what == "loss"]
    first = by_loss[0] if by_loss else (min(where) if where else None)
    return {
        "event": "nonfinite",
        "step": step,
        "rank": first,
        "tensor": where.get(first) if first is not None else None,
        "ranks": sorted(where),
        "where": {str(r): w for r, w in where.items()},
    }


def attribute_nonfinite(step: int, model: torch.nn.Module, local_loss: float) -> dict[str, Any]:
    """Every rank's finding, gathered (collective: every rank calls it on the same bad step);
    returns the ``nonfinite`` event (the same on every rank)."""
    return attribution(step, gather_json(first_nonfinite(model, local_loss)))
