# The face of shardsmith.trainer.checkpoint: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .config import CheckpointConfig as CheckpointConfig
from .resume import COMMAND_ENV as COMMAND_ENV
