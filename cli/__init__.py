"""The ``shardsmith`` command line (click): maps flags onto configs and calls the library.

``main`` is the console script's entry; one module per command group.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
