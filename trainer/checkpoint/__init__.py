"""Checkpointing inside a training job: policy, save/load, tiers, recovery."""
