# The face of shardsmith.reshard.foreign: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .common import ModelHints as ModelHints
from .dcp import export_dcp as export_dcp
from .dcp import import_dcp as import_dcp
from .hf_io import export_hf as export_hf
from .hf_io import import_hf as import_hf
from .hf_io import read_model_config as read_model_config
from .hf_tokenizer import find_hf_tokenizer as find_hf_tokenizer
from .megatron import import_megatron as import_megatron
from .megatron_export import export_megatron as export_megatron
