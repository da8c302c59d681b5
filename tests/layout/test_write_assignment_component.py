"""A saving rank's write list from its component alone equals the whole world's (layout/sharding.py)."""

from __future__ import annotations

import dataclasses

import pytest
from plan_cases import GQA_MODEL, MODEL, ODD_MODEL, PLAN_CASES

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.assignment import _component_boxes, box_holders, write_assignment
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout.sharding import checkpoint_specs

MOE = dataclasses.replace(MODEL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
CASES = PLAN_CASES + [
    (MODEL, ParallelDims(dp_shard=2, cp=2, tp=2)),
    (MODEL, ParallelDims(pp=2, virtual_stages=2, dp_replicate=2, tp=2)),
    (MOE, ParallelDims(dp_shard=2, expert_parallel=2, tp=2)),
    (GQA_MODEL, ParallelDims(dp_replicate=3, tp=4)),  # kv copies over tp, replicas over dp
    (ODD_MODEL, ParallelDims(pp=2, dp_replicate=2, dp_shard=3, tp=2)),
]
IDS = [f"{i}-{d.describe()}" for i, (_, d) in enumerate(CASES)]


@pytest.mark.parametrize("model, dims", CASES, ids=IDS)
def test_one_ranks_list_equals_the_whole_worlds(model: ModelConfig, dims: ParallelDims) -> None:
    specs = checkpoint_specs(model, dims)
    world = write_assignment(specs, dims)
    for rank in range(dims.world_size):
        assert write_assignment(specs, dims, rank=rank) == {rank: world[rank]}, rank
    tiny = sum(s.nbytes for s in specs.values()) / 1024 / dims.world_size
    for fqn, spec in specs.items():  # tiny boxes: their lowest holder
        for box, holders in box_holders(spec, dims):
            if box.numel * DTYPE_NBYTES[spec.dtype] <= tiny:
                assert (fqn, box) in world[holders[0]]


def test_a_saving_rank_looks_at_its_tp_group_not_the_world() -> None:
    """tp8 x dp_shard128: 1,024 ranks, ~900 boxes per tensor; rank 700's non-tiny boxes are its
    own (nothing is replicated), its tiny ones (norms over tp, step counters over everyone)
    are the ones it holds, listed with their lowest holder alone: a few hundred boxes, not the
    world's ~80,000."""
    model = ModelConfig(
        num_layers=2,
        hidden_size=1024,
        num_attention_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=2816,
        vocab_size=32000,
        seq_length=16,
    )
    dims = ParallelDims(dp_shard=128, tp=8)
    specs = checkpoint_specs(model, dims)
    found = _component_boxes(
        specs, dims, 700, sum(s.nbytes for s in specs.values()) / 1024 / dims.world_size
    )
    boxes = [(box, holders) for _, listed in found for box, holders in listed]
    assert len(boxes) <= len(specs)
    assert all(700 in holders or (len(holders) == 1 and holders[0] <= 700) for _, holders in boxes)
    assert any(holders == [0] for _, holders in boxes)  # step counters: rank 0 writes them
    mine = write_assignment(specs, dims, rank=700)[700]
    assert mine and all(fqn in specs for fqn, _ in mine)
