"""The optimizer, its learning-rate schedule and their config (:class:`OptimConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from shardsmith.errors import ConfigError

if TYPE_CHECKING:  # the config is read before torch is imported (the launcher)
    import torch


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW (Loshchilov & Hutter 2019) with linear warmup and cosine decay.

    lr(step) = lr * (step+1)/warmup_steps during warmup, then
    min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 (SGDR, Loshchilov & Hutter 2017),
    where min_lr = lr * min_lr_ratio and progress runs 0 -> 1 from warmup_steps to
    decay_steps (0 = the run's ``steps``; set it explicitly when a run will be extended on
    resume, as Megatron's ``--lr-decay-iters``), constant at min_lr afterwards.
    """

    lr: float = 3e-3
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr}: must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.decay_steps < 0:
            raise ConfigError(f"optim.decay_steps={self.decay_steps}: must be >= 0 (0 = steps)")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps}: must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip}: must be >= 0 (0 disables)")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay}: must be >= 0")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps={self.eps}: must be > 0")


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` at a step: linear warmup then cosine to ``min_lr_ratio``
    (see :class:`OptimConfig`)."""

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
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
    )
