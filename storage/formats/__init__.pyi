# The face of shardsmith.storage.formats: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .registry import SafetensorsFormat as SafetensorsFormat
from .registry import ZarrFormat as ZarrFormat
from .registry import layout_arrays as layout_arrays
from .registry import read_box as read_box
from .registry import read_boxes as read_boxes
from .registry import tensor_format as tensor_format
from .safetensors import encode_header as encode_header
from .safetensors import file_order as file_order
from .safetensors import shard_records as shard_records
from .safetensors import write_stream as write_stream
from .tensor_files import DTYPE_NAMES as DTYPE_NAMES
from .tensor_files import TORCH_DTYPES as TORCH_DTYPES
from .tensor_files import byte_view as byte_view
from .tensor_files import write_shard_file as write_shard_file
from .zarr_format import parse_codec as parse_codec
from .zarr_format import write_chunks as write_chunks
from .zarr_format import write_metadata as write_metadata
