"""Pure tests of the layout math: boxes, mesh coordinates, the sharding plan, write assignment."""

from __future__ import annotations

import random
import re
from math import prod

import pytest
import torch
from plan_cases import GQA_MODEL, MODEL, ODD_MODEL, PLAN_CASES

from shardsmith.errors import LayoutError
from shardsmith.layout import MESH_AXES, ModelConfig, ParallelDims, stage_layers, validate_layout
from shardsmith.layout.assignment import box_holders, write_assignment
from shardsmith.layout.box import Box, chunk_range, row_major_span
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout.sharding import checkpoint_specs, param_specs, rank_boxes, shard_file_name


def _ids(cases):
    names = {id(MODEL): "tiny", id(ODD_MODEL): "odd", id(GQA_MODEL): "gqa"}
    return [
        f"{names[id(m)]}-{d.describe()}{'-split' if d.pipeline_split else ''}" for m, d in cases
    ]


# ---- boxes -----------------------------------------------------------------------------------


def test_chunk_range_six_over_four() -> None:
    assert [chunk_range(6, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 0)]


@pytest.mark.parametrize("length", [0, 1, 5, 6, 7, 16, 250])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 7])
def test_chunk_range_matches_torch_chunk(length: int, num_chunks: int) -> None:
    pieces = list(torch.arange(length).chunk(num_chunks)) if length else []
    pieces += [torch.arange(0)] * (num_chunks - len(pieces))  # torch.chunk drops empty tails
    for i, piece in enumerate(pieces):
        start, n = chunk_range(length, num_chunks, i)
        assert n == piece.numel()
        if n:
            assert start == int(piece[0])


def test_box_intersect() -> None:
    a = Box((0, 4), (4, 8))  # rows 0..3, cols 4..11
    assert a.intersect(Box((2, 0), (4, 6))) == Box((2, 4), (2, 2))
    assert Box((2, 0), (4, 6)).intersect(a) == Box((2, 4), (2, 2))
    assert a.intersect(a) == a
    assert a.intersect(Box((4, 4), (2, 2))) is None  # touching is disjoint
    assert a.intersect(Box((0, 12), (4, 1))) is None
    assert a.intersect(Box((1, 5), (0, 3))) is None  # empty box
    assert Box((), ()).intersect(Box((), ())) == Box((), ())  # 0-d tensors
    assert Box((), ()).numel == 1 and not Box((), ()).is_empty


def test_row_major_span_examples() -> None:
    outer = Box((10, 0), (4, 6))  # (4, 6) block at row 10
    assert row_major_span(outer, Box((11, 2), (2, 3))) == (8, 17)  # gaps included
    assert row_major_span(outer, Box((11, 0), (2, 6))) == (6, 18)  # whole rows: exact
    assert row_major_span(outer, outer) == (0, 24)
    assert row_major_span(outer, Box((12, 3), (0, 2))) == (0, 0)


def test_row_major_span_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        ndim = rng.randint(1, 3)
        lengths = tuple(rng.randint(1, 5) for _ in range(ndim))
        offsets = tuple(rng.randint(0, 3) for _ in range(ndim))
        outer = Box(offsets, lengths)
        inner_len = tuple(rng.randint(1, n) for n in lengths)
        inner_off = tuple(o + rng.randint(0, n - m) for o, n, m in zip(offsets, lengths, inner_len))
        inner = Box(inner_off, inner_len)
        flat = torch.arange(prod(lengths)).reshape(lengths)[inner.relative_to(outer)]
        assert row_major_span(outer, inner) == (int(flat.min()), int(flat.max()) + 1)


# ---- mesh coordinates ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(),
        ParallelDims(tp=2),
        ParallelDims(pp=2, tp=2),
        ParallelDims(pp=3, dp_replicate=2, dp_shard=2, tp=2),
    ],
    ids=lambda d: d.describe(),
)
def test_coords_rank_of_round_trip(dims: ParallelDims) -> None:
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert list(c) == list(MESH_AXES)
        assert all(0 <= c[a] < getattr(dims, a) for a in MESH_AXES)
        assert dims.rank_of(c) == rank
        seen.add(tuple(c.values()))
    assert len(seen) == dims.world_size
    with pytest.raises(ValueError, match="outside world size"):
        dims.coords(dims.world_size)


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(),
        ParallelDims(pp=2, tp=2),
        ParallelDims(pp=3, dp_replicate=2, dp_shard=4, tp=8),
    ],
    ids=lambda d: d.describe(),
)
def test_layout_name_round_trips(dims: ParallelDims) -> None:
    name = dims.describe()
    assert name == f"pp{dims.pp}·dpr{dims.dp_replicate}·dps{dims.dp_shard}·tp{dims.tp}"
    assert ParallelDims.parse(name) == dims
    assert ParallelDims.parse(".".join(map(str, dims.shape))) == dims  # short form pp.dpr.dps.tp


@pytest.mark.parametrize("name", ["", "1.1.2", "pp2·dps1·dpr1·tp2", "pp2·dpr1·dps1·tpx", "a.b.c.d"])
def test_layout_name_parse_refuses_other_spellings(name: str) -> None:
    with pytest.raises(ValueError, match="expected e.g. 'pp2·dpr1·dps1·tp2'"):
        ParallelDims.parse(name)


def test_for_world_size_is_the_one_dp_shard_rule() -> None:
    assert ParallelDims.for_world_size(8, tp=2) == ParallelDims(tp=2, dp_shard=4)
    assert ParallelDims.for_world_size(12, tp=2, pp=3, dp_replicate=2) == ParallelDims(
        tp=2, pp=3, dp_replicate=2, dp_shard=1
    )
    assert ParallelDims.for_world_size(4, tp=2, dp_shard=2) == ParallelDims(tp=2, dp_shard=2)
    with pytest.raises(
        LayoutError, match="world size 6 is not a multiple of pp\\*dp_replicate\\*tp=4"
    ):
        ParallelDims.for_world_size(6, tp=2, pp=2)
    with pytest.raises(LayoutError, match="needs 4 processes but the job has 8"):
        ParallelDims.for_world_size(8, tp=2, dp_shard=2)
    ParallelDims(tp=2).check_world_size(2)
    with pytest.raises(LayoutError, match="--dp-shard -1"):
        ParallelDims(tp=2).check_world_size(4)


def test_tp_is_innermost() -> None:
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert [dims.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]  # TP groups: neighbours
    assert dims.coords(2) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}
    assert dims.coords(4) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 0}
    assert dims.coords(8) == {
        "pp": 1,
        "dp_replicate": 0,
        "dp_shard": 0,
        "cp": 0,
        "tp": 0,
    }  # pp outermost


# ---- the sharding plan -----------------------------------------------------------------------


def test_stage_layers_uneven_and_split() -> None:
    assert stage_layers(MODEL, ParallelDims(pp=3)) == [(0, 1), (2,), (3,)]
    assert stage_layers(MODEL, ParallelDims(pp=2, pipeline_split=(1, 3))) == [(0,), (1, 2, 3)]
    with pytest.raises(LayoutError, match="summing to num_layers=4"):
        stage_layers(MODEL, ParallelDims(pp=2, pipeline_split=(1, 2)))


def _holding_stages(spec) -> tuple[int, ...]:
    return tuple(getattr(spec, "stages", (spec.stage,)))


def _num_parts(spec, dims: ParallelDims, axis: str) -> int:
    """Distinct pieces ``axis`` cuts a tensor into (TP ranks sharing a replicated kv head
    count as one piece)."""
    return getattr(dims, axis) // (getattr(spec, "tp_replicas", 1) if axis == "tp" else 1)


@pytest.mark.parametrize("model, dims", PLAN_CASES, ids=_ids(PLAN_CASES))
def test_boxes_tile_every_tensor_once_per_stage(model: ModelConfig, dims: ParallelDims) -> None:
    specs = checkpoint_specs(model, dims)
    whole = {fqn: Box((0,) * len(s.shape), s.shape) for fqn, s in specs.items()}
    held = {r: rank_boxes(specs, dims, r) for r in range(dims.world_size)}
    for fqn, spec in specs.items():
        stages = _holding_stages(spec)
        for r in range(dims.world_size):  # exactly the holding stages hold it
            assert (fqn in held[r]) == (dims.coords(r)["pp"] in stages), (fqn, r)
        parts = prod(_num_parts(spec, dims, a) for axes in spec.dim_axes for a in axes)
        for stage in stages:
            ranks = [r for r in range(dims.world_size) if dims.coords(r)["pp"] == stage]
            count = torch.zeros(spec.shape, dtype=torch.int64)
            distinct = set()
            for r in ranks:
                box = held[r][fqn]
                assert box.within(spec.shape), (fqn, box)
                count[box.relative_to(whole[fqn])] += 1
                if not box.is_empty:
                    distinct.add(box)
            replicas = len(ranks) // parts
            assert bool((count == replicas).all()), f"{fqn} stage {stage}: not covered {replicas}x"
            assert sum(b.numel for b in distinct) == prod(spec.shape), (
                f"{fqn}: distinct boxes overlap"
            )
    # layers follow stage_layers; the embedding is on the first stage, norm and head on the last
    for s, layers in enumerate(stage_layers(model, dims)):
        for i in layers:
            assert _holding_stages(specs[f"layers.{i}.attention.wq.weight"]) == (s,)
    assert _holding_stages(specs["tok_embeddings.weight"])[0] == 0
    assert _holding_stages(specs["norm.weight"]) == (dims.pp - 1,)
    if model.tie_embeddings:
        assert "output.weight" not in specs
        assert _holding_stages(specs["tok_embeddings.weight"]) == tuple(sorted({0, dims.pp - 1}))
    else:
        assert _holding_stages(specs["output.weight"]) == (dims.pp - 1,)


def test_box_is_tp_chunk_then_fsdp_chunk() -> None:
    """wq.weight dim 0 by (tp, dp_shard): torch.chunk over tp, then over dp_shard (FSDP2 on
    the TP-local tensor); wo.weight: dim 1 by tp, dim 0 by dp_shard."""
    dims = ParallelDims(dp_shard=3, tp=2)
    specs = param_specs(MODEL, dims)
    rows = torch.arange(MODEL.hidden_size)
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        want = list(rows.chunk(2)[c["tp"]].chunk(3)) + [torch.arange(0)] * 3
        piece = want[c["dp_shard"]]
        box = specs["layers.0.attention.wq.weight"].box(dims, c)
        assert box.lengths == (piece.numel(), MODEL.hidden_size)
        if piece.numel():
            assert box.offsets == (int(piece[0]), 0)
        wo = specs["layers.0.attention.wo.weight"].box(dims, c)
        d0 = list(rows.chunk(3))[c["dp_shard"]]
        assert wo == Box((int(d0[0]), c["tp"] * 16), (d0.numel(), 16))


def test_optimizer_specs_follow_parameters() -> None:
    dims = ParallelDims(pp=2, dp_shard=2, tp=2)
    specs = checkpoint_specs(MODEL, dims)
    params = param_specs(MODEL, dims)
    assert len(specs) == 4 * len(params)
    for fqn, p in params.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            s = specs[f"optim.{kind}.{fqn}"]
            assert (s.shape, s.dim_axes, s.stage, s.dtype) == (
                p.shape,
                p.dim_axes,
                p.stage,
                p.dtype,
            )
        step = specs[f"optim.step.{fqn}"]
        assert (step.shape, step.dim_axes, step.stage, step.dtype) == ((), (), p.stage, "F32")


# ---- write assignment ------------------------------------------------------------------------


@pytest.mark.parametrize("model, dims", PLAN_CASES, ids=_ids(PLAN_CASES))
def test_write_assignment_writes_each_box_once(model: ModelConfig, dims: ParallelDims) -> None:
    specs = checkpoint_specs(model, dims)
    assignment = write_assignment(specs, dims)
    assert sorted(assignment) == list(range(dims.world_size))
    held = {r: rank_boxes(specs, dims, r) for r in range(dims.world_size)}
    distinct = {
        (fqn, box) for boxes in held.values() for fqn, box in boxes.items() if not box.is_empty
    }
    written = [item for items in assignment.values() for item in items]
    assert len(written) == len(set(written)) == len(distinct)
    assert set(written) == distinct
    for rank, items in assignment.items():
        assert [fqn for fqn, _ in items] == sorted(fqn for fqn, _ in items)
        for fqn, box in items:
            assert held[rank][fqn] == box  # a rank writes what it holds
    assert write_assignment(specs, dims) == assignment  # deterministic


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(dp_replicate=4),
        ParallelDims(dp_replicate=2, tp=2),
        ParallelDims(dp_replicate=3, dp_shard=2),
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2),
    ],
    ids=lambda d: d.describe(),
)
def test_write_assignment_balances_bytes_over_replicas(dims: ParallelDims) -> None:
    specs = checkpoint_specs(MODEL, dims)
    assignment = write_assignment(specs, dims)
    nbytes = [
        sum(box.numel * DTYPE_NBYTES[specs[fqn].dtype] for fqn, box in assignment[r])
        for r in range(dims.world_size)
    ]
    assert min(nbytes) > 0
    assert max(nbytes) / min(nbytes) < 1.05, nbytes
    total = sum(s.nbytes for s in specs.values())
    assert sum(nbytes) == total  # replicas written once


def test_tiny_boxes_with_the_same_holders_share_one_file() -> None:
    """Norms, their AdamW moments and the step counters (kilobytes beside megabytes of
    matrices) go to one writer per group of ranks holding them: a rank loading a stage in
    another layout then opens one file for the stage's step counters and one per dp_shard
    index for its norms, not every file of the stage, and the bytes stay balanced."""
    model = ModelConfig(
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=2816,
        vocab_size=32000,
        seq_length=16,
    )
    dims = ParallelDims(pp=2, dp_shard=4, tp=4)
    specs = checkpoint_specs(model, dims)
    assignment = write_assignment(specs, dims)
    writer = {(fqn, box): r for r, items in assignment.items() for fqn, box in items}
    for spec_fqn, spec in specs.items():
        for box, holders in box_holders(spec, dims):
            assert writer[(spec_fqn, box)] in holders
    step_files = {specs[f].stages: set() for f in specs}
    norm_files: dict[tuple, set[int]] = {}
    for (fqn, box), rank in writer.items():
        if fqn.startswith("optim.step."):
            step_files[specs[fqn].stages].add(rank)
        elif "norm" in fqn:
            norm_files.setdefault((specs[fqn].stages[0], box.offsets), set()).add(rank)
    assert sorted(map(len, step_files.values())) == [1, 1]  # one file per stage
    assert len(norm_files) == 2 * 4 and all(len(r) == 1 for r in norm_files.values())
    assert len({r for ranks in norm_files.values() for r in ranks}) == 8
    nbytes = [
        sum(box.numel * DTYPE_NBYTES[specs[fqn].dtype] for fqn, box in assignment[r])
        for r in range(dims.world_size)
    ]
    assert max(nbytes) / min(nbytes) < 1.05, nbytes


def test_shard_file_name() -> None:
    assert shard_file_name(3) == "shards/rank-00003.safetensors"


# ---- validation ------------------------------------------------------------------------------


def _works(model: ModelConfig, dims: ParallelDims) -> bool:
    try:
        validate_layout(model, dims)
    except LayoutError:
        return False
    return True


@pytest.mark.parametrize(
    "model, dims, needles",
    [
        (MODEL, ParallelDims(tp=3), ["tp=3", "num_attention_heads=4"]),
        (
            ModelConfig(
                num_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_kv_heads=4,
                ffn_hidden_size=66,
            ),
            ParallelDims(tp=4),
            ["tp=4", "ffn_hidden_size=66"],
        ),
        (
            ModelConfig(
                num_layers=2,
                hidden_size=48,
                num_attention_heads=6,
                num_kv_heads=2,
                ffn_hidden_size=96,
            ),
            ParallelDims(tp=3),
            ["tp=3", "num_kv_heads=2"],
        ),
    ],
    ids=["heads", "ffn", "kv_heads"],
)
def test_validate_layout_names_the_dimension_and_what_works(model, dims, needles) -> None:
    with pytest.raises(LayoutError) as info:
        validate_layout(model, dims)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in message
    listed = re.findall(r"\[([\d, ]+)\]", message)
    assert listed, f"no list of working tp degrees in {message!r}"
    working = [
        d for d in range(1, 2 * model.num_attention_heads + 1) if _works(model, ParallelDims(tp=d))
    ]
    assert [int(x) for x in listed[-1].split(",")] == working
    with pytest.raises(LayoutError):
        param_specs(model, dims)  # the plan refuses it too


def test_validate_layout_pp_beyond_layers() -> None:
    with pytest.raises(LayoutError, match=r"pp=5 exceeds num_layers=4.*pp <= 4"):
        validate_layout(MODEL, ParallelDims(pp=5))


@pytest.mark.parametrize("model, dims", PLAN_CASES, ids=_ids(PLAN_CASES))
def test_valid_layouts_pass(model: ModelConfig, dims: ParallelDims) -> None:
    validate_layout(model, dims)
