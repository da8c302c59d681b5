"""GPU-only branches that a CPU machine can still check: device choice per node."""

from __future__ import annotations

import logging

import pytest
import torch

from shardsmith.trainer import parallel


@pytest.mark.parametrize(
    "available, count, local, want",
    [
        (False, 0, "4", "cpu"),
        (True, 8, "8", "cuda"),
        (True, 8, "4", "cuda"),
        (True, 1, "4", "cpu"),  # shardsmith demo's 4 processes on a 1-GPU machine
    ],
)
def test_device_type_needs_a_gpu_per_local_process(
    monkeypatch, caplog, available, count, local, want
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    parallel._warn_too_few_gpus.cache_clear()
    with caplog.at_level(logging.WARNING, logger="shardsmith.trainer.parallel"):
        assert parallel.device_type() == want
        assert parallel.device_type() == want
    warned = [r.getMessage() for r in caplog.records if "GPU(s) visible" in r.getMessage()]
    assert len(warned) == (1 if available and want == "cpu" else 0), warned  # once, not per call
    if warned:
        assert f"{local} processes on this node but {count} GPU(s)" in warned[0]
