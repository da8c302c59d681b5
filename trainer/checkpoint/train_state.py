"""What a checkpoint holds for one rank: the objects that own its tensors, and the counters
and positions saved as the manifest's JSON ``state`` (:class:`TrainState`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardsmith.trainer.data import GlobalBatchSampler
from shardsmith.trainer.fault.bad_steps import BadStepPolicy


@dataclass
class TrainState:
    """What a checkpoint holds for one rank: the objects that own tensors and the counters.

    Attributes:
        step: optimizer steps taken (skipped bad steps count).
        tokens_seen: tokens of the steps whose update was applied.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: GlobalBatchSampler
    bad_steps: BadStepPolicy
    step: int = 0
    tokens_seen: int = 0

    def state_json(self) -> dict[str, Any]:
        """Non-tensor state saved in the manifest (without ``rng``: the save adds it)."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.sampler.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "fault": self.bad_steps.state_json(),
        }

    def load_state_json(self, state: dict[str, Any], *, rollback: bool) -> None:
        """Restore :meth:`state_json` (after a rollback the bad-step counters in memory win)."""
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.sampler.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # The LR at the resumed step comes from *this* run's schedule (same formula as
        # LambdaLR.get_lr, so an unchanged schedule resumes bitwise); the saved _last_lr would
        # belong to the old schedule when --steps/--lr-decay-steps changed.
        sched = self.scheduler
        sched._last_lr = [
            base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)
        ]
        for group, lr in zip(self.optimizer.param_groups, sched._last_lr):
            group["lr"] = lr
        self.bad_steps.load_state_json(state.get("fault", {}), keep_counters=rollback)
