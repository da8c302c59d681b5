# The face of shardsmith.storage.manifest: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .checks import load_json as load_json
from .file_checks import check_file_once as check_file_once
from .model_record import check_model_record as check_model_record
from .parse import parse_manifest as parse_manifest
from .read import ManifestReader as ManifestReader
from .records import FileRecord as FileRecord, MANIFEST_NAME as MANIFEST_NAME, Manifest as Manifest, ManifestBuilder as ManifestBuilder, SIDECAR_SUFFIX as SIDECAR_SUFFIX, ShardRecord as ShardRecord, TENSOR_FORMATS as TENSOR_FORMATS, sidecar_name as sidecar_name
from .sidecar import load_chunk_crcs as load_chunk_crcs, write_sidecar as write_sidecar
from .v2 import dumps_manifest as dumps_manifest
