"""Checkpointing inside a training job.

Public surface: :class:`~shardsmith.trainer.checkpoint.policy.CheckpointPolicy` (when to save,
what to resume from, rollbacks; the trainer's one entry), its configuration
(:mod:`~shardsmith.trainer.checkpoint.config`), and for the launcher
:mod:`~shardsmith.trainer.checkpoint.resume` (which step a job resumes from, what a resume
changes) and :mod:`~shardsmith.trainer.checkpoint.run_checks` (does a step fit the job). Save and
load mechanics (``save_load``, ``async_save``), the node-local tier, peer copies, shared reads
and recovery are the policy's.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
