"""The job's processes: launch, workers, supervisor, preflight, in-process restart.

Public surface: :func:`~shardsmith.trainer.runtime.launch.launch` (the CLI's ``train``),
:func:`~shardsmith.trainer.runtime.preflight.prepare` (every check a manifest allows, before
torch is imported), :mod:`~shardsmith.trainer.runtime.worker` (a torchrun worker's set-up and
exit) and :mod:`~shardsmith.trainer.runtime.supervisor` (``--restart in-process``).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
