"""Where bytes live: the Store and its backends.

Public surface (what other packages use): :class:`~shardsmith.storage.store.fs.Store` (every
read and write, under one retry policy and error mapping), its
:attr:`~shardsmith.storage.store.fs.Store.capabilities`
(:class:`~shardsmith.storage.store.capabilities.Capabilities`, :class:`~shardsmith.storage.store.capabilities.StorageKind`),
:func:`~shardsmith.storage.store.options.parse_storage_options`, and the POSIX helpers of
:mod:`~shardsmith.storage.store.posix` for the resharder's local copies. The backends
(:mod:`~shardsmith.storage.store.backends`) are reached only through the Store.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
