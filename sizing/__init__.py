"""Sizing: will a job fit, and how fast will it step (``cli -> sizing -> layout``).

The capacity model behind ``shardsmith train --dry-run`` and ``shardsmith plan``: ``presets``
(``--model``), ``estimate`` (memory per rank, per stage), ``activations`` and ``peak`` (what a
block keeps for backward, the transient peak), ``gpus`` (the accelerator table, CUDA/NCCL context
and allocator margin), ``verdict`` (fits or not per rank group, and the re-estimated fixes),
``cost`` (the step-time model) and ``search`` (the layout search).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
