# The face of shardsmith.storage.formats: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .registry import SafetensorsFormat as SafetensorsFormat, ZarrFormat as ZarrFormat, layout_arrays as layout_arrays, read_box as read_box, read_boxes as read_boxes, tensor_format as tensor_format
from .safetensors import encode_header as encode_header, file_order as file_order, shard_records as shard_records, write_stream as write_stream
from .tensor_files import DTYPE_NAMES as DTYPE_NAMES, TORCH_DTYPES as TORCH_DTYPES, byte_view as byte_view, write_shard_file as write_shard_file
from .zarr_format import parse_codec as parse_codec, write_chunks as write_chunks, write_metadata as write_metadata
