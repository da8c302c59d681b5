"""The optimizer and its learning-rate schedule (see :class:`~shardsmith.trainer.config.OptimConfig`)."""

from __future__ import annotations

import math

import torch

from shardsmith.trainer.config import OptimConfig


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of ``cfg.lr`` at a step: linear warmup then cosine to ``min_lr_ratio``
    (see :class:`~shardsmith.trainer.config.OptimConfig`)."""

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        decay = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / decay)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms). ``foreach=False`` because
    parameters live on different meshes (TP-sharded and replicated)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
