# The face of shardsmith.layout: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .assignment import lpt_assign as lpt_assign, write_assignment as write_assignment
from .box import Box as Box, bounding_box as bounding_box, chunk_range as chunk_range, row_major_span as row_major_span, row_major_strides as row_major_strides
from .compat import SHAPE_FIELDS as SHAPE_FIELDS, check_has_optimizer_state as check_has_optimizer_state, check_model_compatible as check_model_compatible, check_tensor_names as check_tensor_names
from .dims import FSDP_AXES as FSDP_AXES, FSDP_MESH_DIM as FSDP_MESH_DIM, MESH_AXES as MESH_AXES, MESH_AXIS_TABLE as MESH_AXIS_TABLE, ParallelDims as ParallelDims, REQUIRED_AXES as REQUIRED_AXES
from .dtypes import DTYPES as DTYPES, DTYPE_CHOICES as DTYPE_CHOICES, DTYPE_NBYTES as DTYPE_NBYTES, FLOAT_DTYPES as FLOAT_DTYPES, SAFETENSORS_DTYPE_ORDER as SAFETENSORS_DTYPE_ORDER, ZARR_DTYPES as ZARR_DTYPES
from .flops import flops_per_token as flops_per_token
from .model_config import ModelConfig as ModelConfig, chunk_layers as chunk_layers, stage_layers as stage_layers, validate_layout as validate_layout
from .sharding import COLWISE as COLWISE, ROWWISE as ROWWISE, TensorSpec as TensorSpec, VOCAB_PARALLEL as VOCAB_PARALLEL, checkpoint_specs as checkpoint_specs, grad_sum_groups as grad_sum_groups, kv_replicas as kv_replicas, padded_vocab_size as padded_vocab_size, param_specs as param_specs, rank_boxes as rank_boxes, shard_file_name as shard_file_name, tp_module_key as tp_module_key
from .sizes import SIZE_HELP as SIZE_HELP, format_nbytes as format_nbytes, parse_nbytes as parse_nbytes, short_nbytes as short_nbytes
