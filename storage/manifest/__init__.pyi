# The face of shardsmith.storage.manifest: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .checks import load_json as load_json
from .file_checks import check_file_once as check_file_once
from .model_record import check_model_record as check_model_record
from .parse import parse_manifest as parse_manifest
from .read import ManifestReader as ManifestReader
from .records import MANIFEST_NAME as MANIFEST_NAME
from .records import SIDECAR_SUFFIX as SIDECAR_SUFFIX
from .records import TENSOR_FORMATS as TENSOR_FORMATS
from .records import FileRecord as FileRecord
from .records import Manifest as Manifest
from .records import ManifestBuilder as ManifestBuilder
from .records import ShardRecord as ShardRecord
from .records import sidecar_name as sidecar_name
from .sidecar import load_chunk_crcs as load_chunk_crcs
from .sidecar import write_sidecar as write_sidecar
from .v2 import dumps_manifest as dumps_manifest
