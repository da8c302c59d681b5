"""The V pipeline style (ZB-V, DualPipeV) in the pure layout code, the config and the
schedule lowering (no processes): torch's stage map, the plan's stage ownership, names,
the config rules, and one gather per chunk when chunks stay unsharded."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _ComputationType

from shardsmith.errors import ConfigError, LayoutError
from shardsmith.layout import ModelConfig, ParallelDims, stage_layers
from shardsmith.layout.sharding import param_specs, rank_boxes
from shardsmith.trainer.config import TrainConfig

MODEL = ModelConfig(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=64,
)


@pytest.mark.parametrize("style", ["loop", "v"])
def test_chunk_map_is_torchs(style: str) -> None:
    for pp in (2, 3, 4):
        for v in (2, 3, 4):
            dims = ParallelDims(pp=pp, virtual_stages=v, pipeline_style=style)
            torch_map = generate_stage_to_rank_mapping(pp, pp * v, style=style)
            assert [dims.chunk_rank(c) for c in range(pp * v)] == [
                torch_map[c] for c in range(pp * v)
            ]
            for r in range(pp):
                assert dims.chunk_ids(r) == tuple(c for c in range(pp * v) if torch_map[c] == r)


def test_v_style_puts_first_and_last_chunk_on_rank_0_and_keeps_boxes() -> None:
    dims = ParallelDims(pp=2, virtual_stages=2, pipeline_style="v")
    assert dims.chunk_ids(0) == (0, 3) and dims.chunk_ids(1) == (1, 2)
    assert stage_layers(MODEL, dims) == [(0, 1, 6, 7), (2, 3, 4, 5)]
    specs = param_specs(MODEL, dims)
    assert specs["layers.6.attention.wq.weight"].stages == (0,)
    assert specs["layers.4.feed_forward.w1.weight"].stages == (1,)
    assert specs["tok_embeddings.weight"].stages == (0,) and specs["output.weight"].stages == (0,)
    assert specs["norm.weight"].stages == (0,)
    loop = ParallelDims(pp=2, virtual_stages=2)
    held = {}
    for d in (dims, loop):  # same FQNs, same boxes; only the holding pp rank differs
        boxes = {}
        for rank in range(d.world_size):
            boxes.update(rank_boxes(param_specs(MODEL, d), d, rank))
        held[d.pipeline_style] = boxes
    assert held["v"] == held["loop"]


def test_v_style_names_json_and_errors() -> None:
    dims = ParallelDims(pp=2, virtual_stages=2, pipeline_style="v")
    assert dims.describe() == "pp2·dpr1·dps1·tp1·v2·vshape"
    assert ParallelDims.parse(dims.describe()) == dims
    assert ParallelDims.from_json(dims.to_json()) == dims
    assert "pipeline_style" not in ParallelDims(pp=2, virtual_stages=2).to_json()
    with pytest.raises(ConfigError, match="virtual_stages >= 2"):
        ParallelDims(pp=2, pipeline_style="v")
    with pytest.raises(ConfigError, match="pipeline_style='w'"):
        ParallelDims(pp=2, virtual_stages=2, pipeline_style="w")
    tied = ModelConfig(**{**MODEL.__dict__, "tie_embeddings": True})
    with pytest.raises(LayoutError, match="tied embeddings"):
        param_specs(tied, dims)


def test_the_schedule_decides_the_pipeline_style() -> None:
    v2 = ParallelDims(pp=2, virtual_stages=2)
    cfg = TrainConfig(model=MODEL, parallel=v2, pipeline_schedule="zbv", global_batch_size=8)
    assert cfg.parallel.pipeline_style == "v" and v2.pipeline_style == "loop"
    back = TrainConfig.from_json(cfg.to_json())
    assert back.parallel == cfg.parallel and back.pipeline_schedule == "zbv"
    styled = TrainConfig(model=MODEL, parallel=cfg.parallel, global_batch_size=8)
    assert styled.pipeline_schedule == "zbv"  # no schedule named: the style's
    loop = TrainConfig(
        model=MODEL,
        parallel=cfg.parallel,
        pipeline_schedule="interleaved-1f1b",
        global_batch_size=8,
    )
    assert loop.parallel.pipeline_style == "loop"
    with pytest.raises(ConfigError, match="--virtual-stages 2"):
        TrainConfig(model=MODEL, parallel=ParallelDims(pp=2), pipeline_schedule="dualpipev")
    with pytest.raises(ConfigError, match="at least 2 x pp = 4"):
        TrainConfig(
            model=MODEL,
            parallel=v2,
            pipeline_schedule="dualpipev",
            global_batch_size=4,
            micro_batch_size=2,
        )


def _mock_stage(index: int, num_stages: int, pp: int) -> SimpleNamespace:
    return SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_size=pp,
        group_rank=index % pp,
        is_first=index == 0,
        is_last=index == num_stages - 1,
        submod=torch.nn.Linear(1, 1),
    )


def test_relowering_gathers_each_chunk_once() -> None:
    """torch 2.13 lowers with at most 3 chunks gathered: with 4 chunks per rank a chunk is
    all-gathered again and again; lowered with 4 it is gathered once per step."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from shardsmith.trainer.pipeline import lower_unshard_reshard

    pp, v, m = 2, 4, 8
    stages = [_mock_stage(k * pp, pp * v, pp) for k in range(v)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m)

    def unshards() -> Counter:
        actions = schedule.pipeline_order_with_comms[0]
        return Counter(
            a.stage_index for a in actions if a.computation_type == _ComputationType.UNSHARD
        )

    assert sum(unshards().values()) > v
    lower_unshard_reshard(schedule, max_active_stages=v)
    assert unshards() == Counter({0: 1, 2: 1, 4: 1, 6: 1})
    kinds = Counter(a.computation_type for a in schedule.pipeline_order_with_comms[0])
    assert kinds[_ComputationType.FORWARD] == v * m and kinds[_ComputationType.REDUCE_GRAD] == v
