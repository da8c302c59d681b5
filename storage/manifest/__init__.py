"""The manifest: the record whose presence makes a checkpoint step exist, and its checks.

Public surface: the records and their builder (:mod:`~shardsmith.storage.manifest.records`:
``Manifest``, ``TensorRecord``, ``ShardRecord``, ``FileRecord``, ``ManifestBuilder``,
``FORMAT_TRAITS``), :func:`~shardsmith.storage.manifest.parse.parse_manifest` (untrusted bytes,
any version), :func:`~shardsmith.storage.manifest.v2.dumps_manifest` (the bytes written),
:class:`~shardsmith.storage.manifest.read.ManifestReader` (only what a rank loads), the sidecars
(:mod:`~shardsmith.storage.manifest.sidecar`), per-file checks
(:mod:`~shardsmith.storage.manifest.file_checks`) and
:func:`~shardsmith.storage.manifest.model_record.check_model_record`. ``v2``, ``grid`` and
``checks`` are the parser's internals.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
