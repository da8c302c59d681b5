# The face of shardsmith.trainer.observe: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .console import PathsFormatter as PathsFormatter
from .console import console_paths as console_paths
from .console import layout_name as layout_name
from .console import user_spelling as user_spelling
from .metrics import iter_json_lines as iter_json_lines
from .metrics import run_dir_note as run_dir_note
from .plot import plot_runs as plot_runs
