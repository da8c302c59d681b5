"""The layout vocabulary every package shares: pure, no torch, no I/O.

``dims`` (ParallelDims, mesh axes), ``model_config`` (ModelConfig, stages, layout
check), ``box`` (Box, chunk math), ``plan`` (the sharding plan), ``dtypes`` (the one
dtype table).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
