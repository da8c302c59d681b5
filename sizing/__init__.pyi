# The face of shardsmith.sizing: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .cost import step_cost as step_cost
from .estimate import FORMULAS as FORMULAS
from .gpus import GPUS_PER_NODE as GPUS_PER_NODE
from .gpus import gpu as gpu
from .presets import DEFAULT_PRESET as DEFAULT_PRESET
from .presets import PRESETS as PRESETS
from .presets import preset_of as preset_of
from .presets import resolve_model as resolve_model
from .search import plan as plan
from .search import plan_warnings as plan_warnings
from .traffic import GROUP_KINDS as GROUP_KINDS
from .traffic import step_traffic as step_traffic
from .verdict import Job as Job
from .verdict import fixes as fixes
from .verdict import judge as judge
from .verdict import warnings as warnings
