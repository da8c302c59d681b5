"""Tensor formats: how one step's logical tensors become files, and are read back.

Public surface: :func:`~shardsmith.storage.formats.registry.tensor_format` and
:data:`~shardsmith.storage.formats.registry.FORMATS` (a format by the name a manifest records),
:func:`~shardsmith.storage.formats.registry.read_boxes` / ``read_box`` (boxes of a committed step,
whatever its format), the safetensors header reader/writer
(:mod:`~shardsmith.storage.formats.safetensors`) and the torch <-> bytes adapters
(:mod:`~shardsmith.storage.formats.tensor_files`). Outside this package code asks a manifest's
``traits``, never its format's name.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
