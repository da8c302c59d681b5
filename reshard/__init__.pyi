# The face of shardsmith.reshard: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .api import prepare as prepare
from .api import processes_on_node as processes_on_node
from .api import reshard as reshard
from .api import run as run
from .diff import diff_checkpoints as diff_checkpoints
from .planner import ReshardOptions as ReshardOptions
from .scaleout import Share as Share
