"""Selective activation checkpointing (``--activation-checkpointing selective``), in one
process: loss and gradients as without it (1e-5), the matmuls recomputed in backward
(per op: only the ones the policy drops), and the flags that set it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import TINY_MODEL
from torch.utils._python_dispatch import TorchDispatchMode

from shardsmith.errors import ConfigError
from shardsmith.trainer.config import TrainConfig, ac_fields
from shardsmith.trainer.model import Transformer
from shardsmith.trainer.parallel import apply_ac


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def _run(policy: bool | str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and the matmuls backward ran, for ``policy`` (see ``apply_ac``)."""
    torch.manual_seed(0)
    model = Transformer(TINY_MODEL)
    apply_ac(model, policy)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, TINY_MODEL.seq_length))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    with _CountMatmuls() as counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, counter.calls[torch.ops.aten.mm.default]


def test_selective_checkpointing_leaves_loss_and_gradients_unchanged() -> None:
    loss, grads, mm_plain = _run(False)
    layers = TINY_MODEL.num_layers
    recomputed = {}
    for policy in (True, "op", "2"):
        got_loss, got_grads, mm = _run(policy)
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5, msg=name)
        recomputed[policy] = mm - mm_plain
    # a dense block runs 7 matmuls (wq wk wv wo w1 w3 w2); recomputation stops after the
    # last tensor backward needs (w2's input), so full recomputes 6 per layer, every 2nd
    # layer half the layers' 6, per op the 3 the policy drops (wk, wo, w3)
    assert recomputed == {True: 6 * layers, "2": 6 * layers // 2, "op": 3 * layers}


def test_selective_flags_and_config() -> None:
    assert ac_fields(None) == {"activation_checkpointing": False, "selective_ac_option": ""}
    assert ac_fields("full") == {"activation_checkpointing": True, "selective_ac_option": ""}
    assert ac_fields("selective")["selective_ac_option"] == "op"
    assert ac_fields(None, "2") == {"activation_checkpointing": False, "selective_ac_option": "2"}
    cfg = TrainConfig(model=TINY_MODEL, selective_ac_option="op")
    assert cfg.ac_policy == "op" and TrainConfig.from_json(cfg.to_json()) == cfg
    assert "selective_ac_option" not in TrainConfig(model=TINY_MODEL).to_json()
    with pytest.raises(ConfigError, match="'op' \\(per op\\) or a layer frequency"):
        TrainConfig(model=TINY_MODEL, selective_ac_option="attention")
    with pytest.raises(ConfigError, match="full or selective, not both"):
        TrainConfig(model=TINY_MODEL, activation_checkpointing=True, selective_ac_option="op")
