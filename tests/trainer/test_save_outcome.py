"""A background save reports what happened: a rank that fails after rank 0 committed the step
(its confirmation never came: a dead peer, a broken group) says the step is committed, not
that the save failed; a failure before the commit is still reported as one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from shardsmith.errors import SaveError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.sharding import checkpoint_specs
from shardsmith.storage.commit import find_latest_committed
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint import save_load
from shardsmith.trainer.checkpoint.async_save import AsyncCheckpointer

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=16,
    num_attention_heads=2,
    num_kv_heads=1,
    ffn_hidden_size=32,
    vocab_size=32,
    seq_length=8,
)
DIMS = ParallelDims()


def test_a_failure_after_the_commit_says_the_step_is_committed(
    gloo_group, tmp_path: Path, monkeypatch, caplog
) -> None:
    root = Store(str(tmp_path / "ckpt"))
    tensors = {fqn: torch.zeros(spec.shape) for fqn, spec in checkpoint_specs(MODEL, DIMS).items()}
    ckpt = AsyncCheckpointer(root, MODEL, DIMS)
    real_broadcast = save_load.broadcast_text

    def lost_confirmation(text: str, group=None) -> str:
        if text == "":  # the broadcast before the writes: rank 0 had no old step to clear
            return real_broadcast(text, group)
        # as a rank sees it when rank 0 died after committing
        raise RuntimeError("connection closed by peer")

    monkeypatch.setattr(save_load, "broadcast_text", lost_confirmation)
    with caplog.at_level(logging.WARNING, logger="shardsmith"):
        ckpt.save(4, tensors, config={}, state={"step": 4})
        with pytest.raises(SaveError, match="step 4 is committed .*connection closed by peer"):
            ckpt.wait()
    assert find_latest_committed(root) == 4
    lines = [r.getMessage() for r in caplog.records]
    assert not any("failed:" in line and "save of step 4" in line for line in lines), lines
    assert any("step 4 is committed" in line for line in lines), lines

    def failed_commit(*args, **kwargs) -> None:
        raise OSError("disk full")

    caplog.clear()
    monkeypatch.setattr(save_load, "broadcast_text", real_broadcast)
    monkeypatch.setattr(save_load, "commit", failed_commit)
    with caplog.at_level(logging.WARNING, logger="shardsmith"):
        ckpt.save(5, tensors, config={}, state={"step": 5})
        with pytest.raises(SaveError, match="not committed"):
            ckpt.wait()
    assert any("background save of step 5 failed" in r.getMessage() for r in caplog.records)
