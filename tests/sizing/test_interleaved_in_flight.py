"""Microbatches in flight with virtual stages: the estimator's pure copy of torch 2.13's
interleaved 1F1B order is torch's own, and the activation term counts each chunk's
microbatches from it (hand-computed values)."""

from __future__ import annotations

import types

import pytest
from plan_cases import MODEL
from torch.distributed.pipelining import schedules

from shardsmith.layout import ParallelDims
from shardsmith.sizing import activations as act
from shardsmith.sizing.estimate import estimate
from shardsmith.sizing.peak import fsdp_buffer_nbytes


def _torch_events(pp: int, v: int, m: int, rank: int) -> list[tuple[int, int]]:
    """torch's ScheduleInterleaved1F1B order on ``rank``, built on stand-in stages."""
    ids = [rank + k * pp for k in range(v)]
    stages = [
        types.SimpleNamespace(
            num_stages=pp * v, group_size=pp, group_rank=rank, stage_index=i, submod=None
        )
        for i in ids
    ]
    order = schedules.ScheduleInterleaved1F1B(stages, n_microbatches=m).pipeline_order[rank]
    kinds = {schedules.FORWARD: 1, schedules.FULL_BACKWARD: -1}
    return [(ids.index(a.stage_index), kinds[a.computation_type]) for a in order if a is not None]


@pytest.mark.parametrize(
    "pp,v,m", [(2, 2, 4), (2, 3, 2), (4, 2, 8), (4, 3, 6), (4, 2, 3), (3, 4, 9), (16, 7, 16)]
)
def test_interleaved_order_is_torchs(pp: int, v: int, m: int) -> None:
    for rank in range(pp):
        assert act.interleaved_1f1b_events(pp, v, m, rank) == _torch_events(pp, v, m, rank)


def test_every_rank_holds_most_of_its_chunks_microbatches() -> None:
    # the 405B plan's pp16 v7 with M = 16: warm-up min(6*16 + 2*(15 - r), 112) forwards, then +1
    dims = ParallelDims(pp=16, virtual_stages=7, dp_shard=128, tp=8)
    assert act.microbatches_in_flight(dims, 0, 16, [1.0] * 7) == (16,) * 7
    assert act.microbatches_in_flight(dims, 8, 16, [1.0] * 7) == (16,) * 6 + (15,)
    assert act.microbatches_in_flight(dims, 15, 16, [1.0] * 7) == (16,) * 6 + (1,)
    # the peak is weighted by the chunks' bytes: a heavy last chunk moves it later
    events = [(0, 1), (0, 1), (1, 1), (0, -1), (1, 1), (1, -1)]
    assert act.peak_in_flight(events, [1.0, 1.0]) == (2, 1)
    assert act.peak_in_flight(events, [1.0, 10.0]) == (1, 2)
    # without virtual stages, 1F1B: min(P - p, M); the V shape: min(P, M) of every chunk
    assert act.microbatches_in_flight(ParallelDims(pp=4), 1, 8, [1.0]) == (3,)
    v_shape = ParallelDims(pp=4, virtual_stages=2, pipeline_style="v")
    assert act.microbatches_in_flight(v_shape, 3, 8, [1.0, 1.0]) == (4, 4)


def test_estimate_counts_each_chunks_microbatches() -> None:
    # pp2 v2, M = 4, fp32, no recompute: chunks of 1 layer; rank 0 holds chunks 0 and 2,
    # rank 1 chunks 1 and 3. torch's order, just before a backward: rank 0 holds at most
    # (3, 2) (before chunk 2's), rank 1 (3, 0) or (2, 1), as many bytes (chunks of one size).
    dims = ParallelDims(pp=2, virtual_stages=2)
    est = estimate(MODEL, dims, micro_batch_size=1, global_batch_size=4)
    plain = act.layer_nbytes_per_token(MODEL, 1, 4) * 16  # a layer, a microbatch of 16 tokens
    received = act.checkpointed_layer_nbytes_per_token(MODEL, 1, 4) * 16  # a chunk's input copy
    by_rank = {r.stage: r for r in est.roles}
    assert by_rank[0].activation_nbytes == int(3 * plain + 2 * (plain + received))
    assert by_rank[1].activation_nbytes == int(3 * (plain + received))
    assert (by_rank[0].microbatches_in_flight, by_rank[1].microbatches_in_flight) == (3, 3)


def test_a_prefetching_chunk_binds_with_what_torch_holds_at_its_backward() -> None:
    # the 405B plan's rank 1: chunks of one layer but local chunk 3 (two layers: FSDP prefetches
    # a block in its backward). All 112 forwards run first, then backwards from chunk 6 down,
    # so chunk 3's backwards meet chunks 0-3 only.
    dims = ParallelDims(pp=16, virtual_stages=7, dp_shard=128, tp=8)
    ones = [1.0] * 7
    assert act.binding_phase(dims, 1, 16, ones, [0.0] * 7) == ((16,) * 7, 6)
    held, k = act.binding_phase(dims, 1, 16, ones, [0, 0, 0, 50.0, 0, 0, 0])
    assert (held, k) == ((16, 16, 16, 16, 0, 0, 0), 3)  # 64 + 50 > 112
    assert act.binding_phase(dims, 1, 16, ones, [0, 0, 0, 40.0, 0, 0, 0])[1] == 6  # 104 < 112
    # the prefetched block is the one buffer a one-layer chunk lacks: 2c + 4 bytes per element
    # (bf16: gathered parameters and gradient, fp32 reduce-scatter input) instead of 3c + 4
    assert fsdp_buffer_nbytes(100, 10, dims, True, prefetch=False) == 10 * 2 + 100 * 8
    assert fsdp_buffer_nbytes(100, 10, dims, True) == 10 * 2 + 100 * 10
