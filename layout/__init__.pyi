# The face of shardsmith.layout: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .assignment import lpt_assign as lpt_assign
from .assignment import write_assignment as write_assignment
from .box import Box as Box
from .box import bounding_box as bounding_box
from .box import chunk_range as chunk_range
from .box import row_major_span as row_major_span
from .box import row_major_strides as row_major_strides
from .compat import SHAPE_FIELDS as SHAPE_FIELDS
from .compat import check_has_optimizer_state as check_has_optimizer_state
from .compat import check_model_compatible as check_model_compatible
from .compat import check_tensor_names as check_tensor_names
from .dims import FSDP_AXES as FSDP_AXES
from .dims import FSDP_MESH_DIM as FSDP_MESH_DIM
from .dims import MESH_AXES as MESH_AXES
from .dims import MESH_AXIS_TABLE as MESH_AXIS_TABLE
from .dims import REQUIRED_AXES as REQUIRED_AXES
from .dims import MeshAxisName as MeshAxisName
from .dims import ParallelDims as ParallelDims
from .dtypes import DTYPE_CHOICES as DTYPE_CHOICES
from .dtypes import DTYPE_NBYTES as DTYPE_NBYTES
from .dtypes import DTYPES as DTYPES
from .dtypes import FLOAT_DTYPES as FLOAT_DTYPES
from .dtypes import SAFETENSORS_DTYPE_ORDER as SAFETENSORS_DTYPE_ORDER
from .dtypes import ZARR_DTYPES as ZARR_DTYPES
from .flops import flops_per_token as flops_per_token
from .fsdp_policy import FSDP_RESHARD_POLICIES as FSDP_RESHARD_POLICIES
from .fsdp_policy import reshards_after_forward as reshards_after_forward
from .model_config import ModelConfig as ModelConfig
from .model_config import check_sequence_split as check_sequence_split
from .model_config import chunk_layers as chunk_layers
from .model_config import stage_layers as stage_layers
from .model_config import validate_layout as validate_layout
from .sharding import COLWISE as COLWISE
from .sharding import (
    OPTIM_NAMESPACE as OPTIM_NAMESPACE,
)
from .sharding import ROWWISE as ROWWISE
from .sharding import VOCAB_PARALLEL as VOCAB_PARALLEL
from .sharding import TensorSpec as TensorSpec
from .sharding import checkpoint_specs as checkpoint_specs
from .sharding import grad_sum_groups as grad_sum_groups
from .sharding import (
    has_optim_state as has_optim_state,
)
from .sharding import (
    is_optim_fqn as is_optim_fqn,
)
from .sharding import kv_replicas as kv_replicas
from .sharding import (
    optim_fqn as optim_fqn,
)
from .sharding import (
    optim_state_of as optim_state_of,
)
from .sharding import padded_vocab_size as padded_vocab_size
from .sharding import param_specs as param_specs
from .sharding import rank_boxes as rank_boxes
from .sharding import shard_file_name as shard_file_name
from .sharding import tp_module_key as tp_module_key
from .shrink import SHRINK_RULE as SHRINK_RULE
from .shrink import shrink_layout as shrink_layout
from .sizes import SIZE_HELP as SIZE_HELP
from .sizes import format_nbytes as format_nbytes
from .sizes import parse_nbytes as parse_nbytes
from .sizes import short_nbytes as short_nbytes
