"""What a run reports: metrics (``metrics.jsonl``, wandb), console lines, plots, profiles.

Public surface: :mod:`~shardsmith.trainer.observe.metrics`, :mod:`~shardsmith.trainer.observe.console`
(``short_url`` and the step/resume lines), :mod:`~shardsmith.trainer.observe.plot` and
:mod:`~shardsmith.trainer.observe.profiling`.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
