"""Context parallelism, the pure parts: which tokens a rank holds, the layout name, the plan's
boxes (a cp change is an ordinary reshard), the estimator's figures, and the attention of one
rank's chunks against plain causal attention (no process group: the gathered K/V are given)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.sizing.estimate import estimate
from shardsmith.trainer.context_parallel import (
    ContextParallel,
    local_positions,
    shard_sequence,
    unshard_sequence,
)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    x = torch.arange(2 * 24).reshape(2, 24)
    parts = [shard_sequence(x, 3, r) for r in range(3)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(24))
    assert torch.equal(unshard_sequence(parts), x)
    with pytest.raises(ConfigError, match="divisible by 8"):
        local_positions(20, 4, 0)


def test_layout_name_and_json_carry_cp_only_when_used() -> None:
    dims = ParallelDims(tp=2, cp=2, dp_shard=2)
    assert dims.describe() == "pp1·dpr1·dps2·cp2·tp2" and dims.world_size == 8
    assert ParallelDims.parse(dims.describe()) == dims == ParallelDims.from_json(dims.to_json())
    assert ParallelDims.parse("1.1.2.2.2") == dims
    assert (
        "cp" not in ParallelDims(tp=2).to_json()
        and ParallelDims(tp=2).describe() == "pp1·dpr1·dps1·tp2"
    )
    assert [dims.coords(r)["cp"] for r in range(4)] == [0, 0, 1, 1]  # tp innermost, cp next


def test_fsdp_over_dp_shard_x_cp_gives_the_boxes_of_dp_shard_alone() -> None:
    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        vocab_size=250,
        seq_length=32,
    )
    with_cp, without = ParallelDims(tp=2, dp_shard=2, cp=3), ParallelDims(tp=2, dp_shard=6)
    specs_cp, specs = checkpoint_specs(model, with_cp), checkpoint_specs(model, without)
    boxes_cp = sorted(str(sorted(rank_boxes(specs_cp, with_cp, r).items())) for r in range(12))
    boxes = sorted(str(sorted(rank_boxes(specs, without, r).items())) for r in range(12))
    assert boxes_cp == boxes


def test_estimate_divides_activations_and_names_the_gather() -> None:
    model = ModelConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=512,
        vocab_size=256,
        seq_length=4096,
        rope_scaling_factor=8.0,
    )
    one = estimate(model, ParallelDims(tp=2), micro_batch_size=1, global_batch_size=1)
    four = estimate(model, ParallelDims(tp=2, cp=4), micro_batch_size=1, global_batch_size=1)
    kv = 2 * 4096 * 1 * (4 // 2) * 32 * 4  # the whole sequence's K/V, this rank's 2 kv heads, fp32
    assert four.roles[0].activation_nbytes - 4 * kv == pytest.approx(
        one.roles[0].activation_nbytes / 4, abs=16
    )
    assert four.roles[0].num_ranks == 8 and four.roles[0].num_params * 4 == one.roles[0].num_params
    cp = four.to_json()["context_parallel"]
    assert cp["tokens_per_rank"] == 1024 and cp["rope_scaling"]["rope_type"] == "llama3"
    assert cp["kv_gather_nbytes_per_layer_microbatch"] == 2 * 4096 * 2 * 32 * 4 * 3 // 4


def test_chunked_attention_equals_causal_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, 8, generator=gen) for _ in range(3))  # (B, H, T, Dh)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for cp in (1, 2, 3):
        outs = [
            ContextParallel(None, cp, r).attention(shard_sequence(q, cp, r, 2), k, v)
            for r in range(cp)
        ]
        torch.testing.assert_close(unshard_sequence(outs, dim=2), want, atol=1e-6, rtol=1e-6)
