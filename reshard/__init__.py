"""Offline conversion of checkpoints between layouts and formats.

``api`` (:func:`reshard`, :func:`prepare`, :class:`ReshardOptions`: the one entry the CLI calls),
``planner`` + ``slabs`` (pure: source manifest x target layout -> where every byte goes), ``engine``
+ ``stream`` (the streaming executor in a memory budget, resumable through ``progress``),
``posix_copy`` (the ways a slab reaches a POSIX target file), ``scaleout`` (several processes),
``zarr_convert``, ``diff``, and ``foreign/`` (Hugging Face, PyTorch DCP, Megatron-Core).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
