# The face of shardsmith.sizing: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .estimate import FORMULAS as FORMULAS
from .gpus import gpu as gpu
from .presets import DEFAULT_PRESET as DEFAULT_PRESET, PRESETS as PRESETS, preset_of as preset_of, resolve_model as resolve_model
from .search import plan as plan, plan_warnings as plan_warnings
from .verdict import Job as Job, fixes as fixes, judge as judge, warnings as warnings
