# The face of shardsmith.storage: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .checksum import ChunkedCrc as ChunkedCrc, DEFAULT_CHUNK_NBYTES as DEFAULT_CHUNK_NBYTES, chunk_crc32c as chunk_crc32c, crc32c as crc32c, crc32c_update as crc32c_update, grid_crcs as grid_crcs, require_full_read as require_full_read, verify_chunks as verify_chunks, verify_chunks_split as verify_chunks_split
from .commit import ensure_not_committed as ensure_not_committed, find_latest_committed as find_latest_committed, no_checkpoint_message as no_checkpoint_message, open_manifest as open_manifest, read_manifest as read_manifest, resolve_checkpoint as resolve_checkpoint, resolve_target as resolve_target, split_step_url as split_step_url
from .crashpoints import crash_point as crash_point
from .cycle_gc import cycle_gc_paused as cycle_gc_paused
from .gc import describe_steps as describe_steps, gc_after_commit as gc_after_commit
from .lineage import CORRUPT_NAME as CORRUPT_NAME, UNNAMED as UNNAMED, check_new_run_root as check_new_run_root, committed_runs as committed_runs, corrupt_mark as corrupt_mark, loadable_steps as loadable_steps, mark_corrupt as mark_corrupt, remove_runs_except as remove_runs_except, rewritten_state as rewritten_state, run_id_of as run_id_of, run_record as run_record
from .steps import list_steps as list_steps, parse_step_dir as parse_step_dir, read_latest_hint as read_latest_hint, step_dir as step_dir
from .verify import verify_checkpoint as verify_checkpoint
