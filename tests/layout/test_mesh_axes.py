"""The one table of mesh axes (layout/dims.py: MESH_AXIS_TABLE) drives every axis list."""

from dataclasses import fields

import pytest

from shardsmith.errors import ConfigError
from shardsmith.layout.dims import MESH_AXES, MESH_AXIS_TABLE, REQUIRED_AXES, ParallelDims


def test_every_table_axis_is_a_parallel_dims_field_in_order():
    names = [f.name for f in fields(ParallelDims)]
    assert [n for n in names if n in MESH_AXES] == list(MESH_AXES)
    assert len({a.short for a in MESH_AXIS_TABLE}) == len(MESH_AXIS_TABLE)


def test_names_round_trip_and_world_size_is_the_product():
    dims = ParallelDims(pp=2, dp_replicate=3, dp_shard=5, tp=7)
    assert dims.world_size == 210 and dims.shape == tuple(getattr(dims, a) for a in MESH_AXES)
    assert ParallelDims.parse(dims.describe()) == dims
    assert ParallelDims.parse(".".join(str(getattr(dims, a)) for a in REQUIRED_AXES)) == dims
    assert ParallelDims.from_json(dims.to_json()) == dims
    for rank in (0, 1, 77, 209):
        assert dims.rank_of(dims.coords(rank)) == rank
    with pytest.raises(ConfigError, match="layout name"):
        ParallelDims.parse("tp2·pp2")
    with pytest.raises(ConfigError, match="unknown mesh axes"):
        ParallelDims.for_world_size(4, zz=2)
