"""What the distributed parallelism tests compare against: a fixed batch, the whole model's
logits and first-step gradients in one process, and the per-rank files a launch dumps."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import TINY_MODEL
from safetensors.torch import load_file


def fixed_batch() -> tuple[list[list[int]], list[list[int]]]:
    """A fixed (B=8, T=16) batch of inputs and targets."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_MODEL.vocab_size, (8, TINY_MODEL.seq_length + 1), generator=gen)
    return ids[:, :-1].tolist(), ids[:, 1:].tolist()


def load_rank_files(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Merge the per-rank safetensors files ``<prefix>-rank-*.safetensors`` of ``directory``."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob(f"{prefix}-rank-*.safetensors")):
        out.update(load_file(str(path)))
    return out


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    """Same keys, and every tensor equal within 1e-5 (relative and absolute)."""
    assert sorted(got) == sorted(want), f"{where}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=f"{where}: {key}")


def single_process_reference(
    tokens: list[list[int]], targets: list[list[int]], num_microbatches: int, model_cfg=TINY_MODEL
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and first-step gradients of the whole model in this process (no parallelism)."""
    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.moe import aux_loss
    from shardsmith.trainer.step import loss_fn
    from shardsmith.trainer.weight_init import init_weights

    model = Transformer(model_cfg)
    init_weights(model, 1234)
    x, y = torch.tensor(tokens), torch.tensor(targets)
    with torch.no_grad():
        logits = model(x)
    for xm, ym in zip(x.chunk(num_microbatches), y.chunk(num_microbatches)):
        loss = loss_fn(model(xm), ym)
        if model_cfg.moe_aux_loss_coeff:
            loss = loss + model_cfg.moe_aux_loss_coeff * aux_loss(model)
        (loss / num_microbatches).backward()
    return logits, {fqn: p.grad for fqn, p in model.named_parameters()}
