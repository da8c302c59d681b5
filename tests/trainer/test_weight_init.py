"""Layout-independent initialization: any box of a tensor, generated alone, equals
the same slice of the whole tensor, bitwise; the distribution is the documented one. (Jobs'
step-0 saves in several layouts, equal to this init: e2e/test_layout_cases, which launches them
together with its own jobs.)"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import param_specs
from shardsmith.trainer.model import Transformer
from shardsmith.trainer.weight_init import BLOCK_NUMEL, block_rows, init_box, init_std, init_weights

#: rows long enough that one tensor spans several generation blocks
WIDE = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=1,
    ffn_hidden_size=2 * BLOCK_NUMEL // 64 + 4100,
    vocab_size=257,
    seq_length=8,
)


def _whole(fqn: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int = 3) -> torch.Tensor:
    return init_box(fqn, shape, Box((0,) * len(shape), shape), seed, cfg)


@pytest.mark.parametrize(
    "fqn", ["layers.1.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"]
)
def test_any_box_equals_the_slice_of_the_whole(fqn: str) -> None:
    shape = tuple(param_specs(WIDE, ParallelDims())[fqn].shape)
    assert shape[0] > 2 * block_rows(shape)  # spans several blocks
    whole = _whole(fqn, shape, WIDE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        offsets = tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in shape)
        lengths = tuple(
            int(torch.randint(0, n - o + 1, (1,), generator=gen)) for o, n in zip(offsets, shape)
        )
        got = init_box(fqn, shape, Box(offsets, lengths), 3, WIDE)
        want = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        assert got.shape == want.shape and torch.equal(got, want), (offsets, lengths)


def test_every_layouts_boxes_tile_the_same_tensor() -> None:
    """For each tensor and layout, the plan's boxes generated separately reassemble the whole."""
    wholes: dict[tuple, torch.Tensor] = {}
    for dims in (ParallelDims(tp=2), ParallelDims(pp=2, dp_shard=2, tp=4)):
        for fqn, spec in param_specs(WIDE, dims).items():
            if fqn.startswith("layers.1."):  # the same shapes and placements as layer 0
                continue
            key = (fqn, tuple(spec.shape))
            whole = wholes[key] = (
                wholes.get(key) if key in wholes else _whole(fqn, spec.shape, WIDE)
            )
            for rank in range(dims.world_size):
                coords = dims.coords(rank)
                if coords["pp"] not in spec.stages:
                    continue
                box = spec.box(dims, coords)
                got = init_box(fqn, spec.shape, box, 3, WIDE)
                assert torch.equal(
                    got, whole[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
                )


def test_distribution_and_seed() -> None:
    w = _whole("layers.0.attention.wq.weight", (512, 512), TINY_MODEL)
    assert abs(float(w.std()) - 0.02) < 0.0005 and abs(float(w.mean())) < 0.0005
    wo = _whole("layers.0.attention.wo.weight", (512, 512), TINY_MODEL)
    assert abs(float(wo.std()) - init_std("x.wo.weight", TINY_MODEL)) < 0.0002
    assert init_std("x.wo.weight", TINY_MODEL) == 0.02 / (2 * TINY_MODEL.num_layers) ** 0.5
    assert torch.equal(_whole("norm.weight", (32,), TINY_MODEL), torch.ones(32))
    other = init_box(
        "layers.0.attention.wq.weight", (512, 512), Box((0, 0), (512, 512)), 4, TINY_MODEL
    )
    assert not torch.equal(w, other)
    assert not torch.equal(w, _whole("layers.1.attention.wq.weight", (512, 512), TINY_MODEL))


def test_init_weights_fills_the_single_process_model() -> None:
    model = Transformer(TINY_MODEL)
    init_weights(model, 1234)
    specs = param_specs(TINY_MODEL, ParallelDims())
    for fqn, p in model.named_parameters():
        assert torch.equal(p.detach(), _whole(fqn, specs[fqn].shape, TINY_MODEL, 1234)), fqn
