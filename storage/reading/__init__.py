"""Load-time reads: which byte ranges a rank reads, and reading them.

``ranges`` and ``spans`` (pure: boxes -> coalesced chunk-aligned byte ranges), ``execute`` (threads
as the store's capabilities say, verified ranged reads, scatter into tensors), ``staging``
(destinations off the CPU through one bounded, reused, page-locked host buffer).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
