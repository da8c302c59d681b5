"""The models and layouts the sharding-plan tests walk (tests/layout/)."""

from __future__ import annotations

from shardsmith.layout import ModelConfig, ParallelDims

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)
#: Sizes that do not divide evenly by 3 (vocab 250, ffn 40 -> chunks 14, 14, 12 / 9, 9, 9, 9, 4 ...).
ODD_MODEL = ModelConfig(
    num_layers=5,
    hidden_size=24,
    num_attention_heads=2,
    num_kv_heads=1,
    ffn_hidden_size=40,
    vocab_size=250,
    seq_length=8,
)
#: GQA with tp > num_kv_heads (replicated kv heads), vocab 250 padded to a multiple of tp, tied.
GQA_MODEL = ModelConfig(
    num_layers=3,
    hidden_size=24,
    num_attention_heads=4,
    num_kv_heads=1,
    ffn_hidden_size=40,
    vocab_size=250,
    seq_length=8,
    tie_embeddings=True,
)

PLAN_CASES = [
    (MODEL, ParallelDims()),
    (MODEL, ParallelDims(tp=2)),
    (MODEL, ParallelDims(pp=2)),
    (MODEL, ParallelDims(dp_shard=2)),
    (MODEL, ParallelDims(pp=2, tp=2)),
    (MODEL, ParallelDims(dp_shard=2, tp=2)),
    (MODEL, ParallelDims(pp=2, dp_shard=2, tp=2)),
    (MODEL, ParallelDims(dp_replicate=2, dp_shard=2, tp=2)),
    (MODEL, ParallelDims(pp=3, dp_shard=3)),  # uneven stages 2, 1, 1
    (MODEL, ParallelDims(pp=2, dp_shard=5, pipeline_split=(1, 3))),
    (MODEL, ParallelDims(dp_shard=6, tp=2)),  # 16 kv rows / 2 / 6 -> 2,2,2,2,0,0
    (ODD_MODEL, ParallelDims(dp_shard=3)),
    (ODD_MODEL, ParallelDims(pp=2, dp_replicate=2, dp_shard=7)),  # 5 layers -> 3, 2; d=24 over 7
    (MODEL, ParallelDims(tp=4)),  # 2 kv heads over 4 TP ranks
    (GQA_MODEL, ParallelDims(tp=4, dp_shard=3)),
    (GQA_MODEL, ParallelDims(pp=2, tp=2, dp_replicate=2)),  # tied copies on stages 0 and 1
]
