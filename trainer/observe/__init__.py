"""What a run reports: metrics (``metrics.jsonl``, wandb), console lines, plots, profiles.

Public surface: :mod:`~shardsmith.trainer.observe.metrics`, :mod:`~shardsmith.trainer.observe.console`
(``short_url`` and the step/resume lines), :mod:`~shardsmith.trainer.observe.plot` and
:mod:`~shardsmith.trainer.observe.profiling`.
"""
