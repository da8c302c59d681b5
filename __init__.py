"""shardsmith: a checkpoint-centric, fault-tolerant 3D-parallel trainer with resharding tools.

Subpackages (dependencies point one way: ``cli -> trainer, reshard -> storage``):

- :mod:`shardsmith.storage`: where bytes live (fsspec), the manifest format, the commit protocol.
- :mod:`shardsmith.reshard`: pure layout math (the sharding plan) and offline resharding.
- :mod:`shardsmith.trainer`: model, parallelism, data, train loop, checkpoint policy.
- :mod:`shardsmith.cli`: click commands.
"""

__version__ = "0.1.0"
