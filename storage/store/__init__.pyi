# The face of shardsmith.storage.store: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .backends import Backend as Backend
from .backends import register_backend as register_backend
from .capabilities import Capabilities as Capabilities
from .capabilities import StorageKind as StorageKind
from .capabilities import usable_cores as usable_cores
from .fs import Store as Store
from .options import parse_storage_options as parse_storage_options
from .posix import map_range as map_range
from .posix import preallocate as preallocate
from .posix import pwrite_all as pwrite_all
from .posix import sweep_stale_tmp as sweep_stale_tmp
from .uploads import abort_stale_uploads as abort_stale_uploads
from .uploads import has_uploads as has_uploads
from .uploads import list_uploads as list_uploads
