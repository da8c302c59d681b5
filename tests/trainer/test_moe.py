"""The MoE layer in one process: the aux loss injected in backward equals adding it to the
loss, the sort-based dispatch equals a per-token loop, and the router statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_MODEL

MOE = dataclasses.replace(TINY_MODEL, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)


def _model():
    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.weight_init import init_weights

    model = Transformer(MOE)
    init_weights(model, 1234)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    out = {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def test_aux_loss_injected_in_backward_equals_adding_it_to_the_loss() -> None:
    from shardsmith.trainer.moe import aux_loss, set_aux_loss_scale
    from shardsmith.trainer.step import loss_fn

    model = _model()
    x = torch.randint(
        0, MOE.vocab_size, (4, MOE.seq_length), generator=torch.Generator().manual_seed(0)
    )
    y = x.roll(-1, 1)
    set_aux_loss_scale(model, 0.0)
    logits = model(x)
    (loss_fn(logits, y) + 0.25 * aux_loss(model)).backward()
    added = _grads(model)
    set_aux_loss_scale(model, 0.25)
    loss_fn(model(x), y).backward()
    injected = _grads(model)
    set_aux_loss_scale(model, 0.0)
    loss_fn(model(x), y).backward()
    without = _grads(model)
    router = "layers.0.feed_forward.router.weight"
    assert not torch.allclose(added[router], without[router], atol=1e-6)  # the aux loss matters
    for fqn in added:
        torch.testing.assert_close(injected[fqn], added[fqn], rtol=1e-6, atol=1e-7, msg=fqn)


def test_sorted_dispatch_equals_a_per_token_loop() -> None:
    moe = _model().layers["1"].feed_forward
    h = torch.randn(12, MOE.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = moe(h.view(3, 4, -1)).view(12, -1)
        logits = moe.router(h)
        top, idx = logits.topk(2, dim=-1)
        weights = torch.softmax(top, dim=-1)
        want = torch.zeros_like(h)
        for n in range(12):
            for k in range(2):
                e = int(idx[n, k])
                w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
                want[n] += (
                    weights[n, k] * (torch.nn.functional.silu(h[n] @ w1.T) * (h[n] @ w3.T)) @ w2.T
                )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_router_stats_count_tokens_per_expert(gloo_group: None) -> None:
    from shardsmith.trainer.moe import moe_layers, router_stats, set_aux_loss_scale

    model = _model()
    set_aux_loss_scale(model, 0.0)
    x = torch.randint(
        0, MOE.vocab_size, (2, MOE.seq_length), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        model(x)
        model(x)
    layers = moe_layers(model)
    assert sorted(layers) == [0, 1, 2, 3]
    load = layers[2].load
    assert load is not None and load.sum() == 2 * 2 * x.numel()  # two forwards, top-2
    stats = router_stats(model, MOE)
    assert stats["moe_load_imbalance"][2] == pytest.approx(
        float(load.max() / load.mean()), abs=1e-4
    )
    aux = sum(float(m.aux_loss) for m in layers.values())
    assert stats["moe_aux_loss"] == pytest.approx(aux, abs=1e-5)
    assert router_stats(model, TINY_MODEL) == {}


def test_demo_moe_layouts_move_stages_experts_and_tp() -> None:
    from shardsmith.cli.demo import demo_layouts
    from shardsmith.layout import validate_layout
    from shardsmith.layout.sharding import param_specs

    model, first, then = demo_layouts(moe=True)
    assert model.num_experts == 4 and (first.world_size, then.world_size) == (4, 2)
    assert (first.pp, first.expert_parallel, then.tp, then.expert_parallel) == (2, 2, 2, 1)
    for dims in (first, then):
        validate_layout(model, dims)
    w1 = "layers.0.feed_forward.experts.w1"
    assert param_specs(model, first)[w1].dim_axes[0] == ("dp_shard", "cp")  # experts split over EP
    assert param_specs(model, then)[w1].dim_axes[1] == ("tp",)  # each expert over tp
    assert demo_layouts(moe=False)[0].num_experts == 0
