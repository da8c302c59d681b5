# The face of shardsmith.trainer.runtime: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .preflight import prepare as prepare
from .supervisor import launch_in_process as launch_in_process
from .worker import exit_process as exit_process
from .worker import setup_process as setup_process
