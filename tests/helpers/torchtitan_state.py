"""A training state shaped as torchtitan hands it to ``dcp.save``, for the foreign-format tests."""

from __future__ import annotations

import torch
from conftest import TINY_MODEL
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from shardsmith.trainer.model import Transformer
from shardsmith.trainer.weight_init import init_weights


def torchtitan_state(seed: int = 1) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state dict as torchtitan hands it to dcp.save, full tensors by DCP key): one AdamW step."""
    model = Transformer(TINY_MODEL)
    init_weights(model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(
        torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ).square().mean().backward()
    opt.step()
    optim = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state = {
        **model.state_dict(),
        "optimizer": optim,
        "train_state": {"step": 5, "ntokens_seen": 640},
        "lr_scheduler": {"last_epoch": 5},
        "dataloader": {"dp_rank_0": b"opaque"},
    }
    full = {
        **model.state_dict(),
        **{f"optimizer.{k}": v for k, v in optim.items() if isinstance(v, torch.Tensor)},
    }
    return state, {k: v.detach().clone() for k, v in full.items()}
