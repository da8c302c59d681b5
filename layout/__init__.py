"""The layout vocabulary every package shares: pure, no torch, no I/O.

``dims`` (ParallelDims, mesh axes), ``model_config`` (ModelConfig, stages, layout
check), ``box`` (Box, chunk math), ``plan`` (the sharding plan), ``dtypes`` (the one
dtype table).
"""

from shardsmith.layout.dims import MESH_AXES, MESH_AXIS_TABLE, ParallelDims
from shardsmith.layout.model_config import ModelConfig, chunk_layers, stage_layers, validate_layout

__all__ = ["MESH_AXES", "MESH_AXIS_TABLE", "ModelConfig", "ParallelDims", "chunk_layers", "stage_layers", "validate_layout"]
