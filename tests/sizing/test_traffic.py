"""The one bytes-per-step formula (sizing/traffic.py) that the cost model and
bench/comm_volume.py share; the bench checks it against the real step on gloo."""

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.sizing import step_traffic
from shardsmith.sizing.traffic import fsdp_numel, pp_sends

TINY = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)
HSDP = ParallelDims(pp=2, dp_replicate=2, dp_shard=2)


def traffic(dims: ParallelDims, m: int, reshard: bool, rank: int = 0) -> dict[str, float]:
    return step_traffic(
        TINY,
        dims,
        pp_rank=rank,
        micro_batch_size=1,
        num_microbatches=m,
        reshard_after_forward=reshard,
    )


def test_fsdp_bytes_once_per_step_do_not_grow_with_microbatches() -> None:
    # stage 0: embedding 256x32 + 2 blocks of 4*32*32 + 2*32*64... as FSDP2 gathers them
    block = 32 * 32 * 2 + 2 * 16 * 32 + 3 * 32 * 64 + 2 * 32  # wq, wo, wk, wv, w1-w3, 2 norms
    assert fsdp_numel(TINY, HSDP, 0) == 256 * 32 + 2 * block
    once = [traffic(HSDP, m, reshard=False)["dp_shard"] for m in (2, 8)]
    per_mb = [traffic(HSDP, m, reshard=True)["dp_shard"] for m in (2, 8)]
    n = fsdp_numel(TINY, HSDP, 0)
    assert once == [0.5 * n * (4 + 4)] * 2  # (d-1)/d of one fp32 gather and one fp32 reduce
    assert per_mb == [0.5 * n * (2 * m * 4 + m * 4) for m in (2, 8)]
    # the replica all-reduce of the fp32 shards, once per step in both policies
    assert traffic(HSDP, 8, reshard=True)["dp_replicate"] == 2 * 0.5 * n / 2 * 4


def test_fsdp_pads_dim0_to_the_degree() -> None:
    odd = ModelConfig(**{**TINY.to_json(), "vocab_size": 255})  # 255 rows pad to 256 at dp_shard 2
    dims = ParallelDims(dp_shard=2)
    assert fsdp_numel(odd, dims, 0) == fsdp_numel(TINY, dims, 0)


def test_pipeline_sends_per_stage_map() -> None:
    assert [pp_sends(ParallelDims(pp=2), r) for r in (0, 1)] == [1, 1]
    v2 = ParallelDims(pp=2, virtual_stages=2)  # stages 0 1 2 3 on ranks 0 1 0 1
    assert [pp_sends(v2, r) for r in (0, 1)] == [3, 3]
    # a V schedule's turn (stages 1 and 2 on rank 1) sends nothing between them
    assert [pp_sends(v2, r, v_shaped=True) for r in (0, 1)] == [2, 2]
    act = 16 * 32 * 4  # b * s * h fp32 values
    assert traffic(HSDP, 4, reshard=False)["pp"] == 4 * act
