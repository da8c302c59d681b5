# The face of shardsmith.trainer: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .config import TrainConfig as TrainConfig
from .config import ac_fields as ac_fields
from .detect import DetectConfig as DetectConfig
from .fault import FaultConfig as FaultConfig
from .optim import OptimConfig as OptimConfig
from .train import run_training as run_training
