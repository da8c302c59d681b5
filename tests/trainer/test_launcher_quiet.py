"""What a Ctrl-C shows: shardsmith's own line, no torchelastic log line and no traceback of a
worker interrupted while it imports torch (both seen in a fresh-clone run of README's main
job, interrupted a few seconds after the launch)."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
from conftest import tiny_train_config

from shardsmith.layout import ParallelDims
from shardsmith.trainer.runtime import launch as launcher
from shardsmith.trainer.runtime import worker


def test_the_agents_own_loggers_are_quieted_too(monkeypatch) -> None:
    monkeypatch.delenv("SHARDSMITH_DEBUG", raising=False)
    names = [
        "torch.distributed.elastic",
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.errors",
    ]
    before = {n: logging.getLogger(n).level for n in names}
    try:
        launcher._quiet_elastic_logs()
        for name in names:
            assert not logging.getLogger(name).isEnabledFor(logging.WARNING), name
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


class _InterruptedImport(types.ModuleType):
    """A ``shardsmith.trainer.train`` whose import is cut short by Ctrl-C."""

    def __getattr__(self, name: str):
        if name == "run_training":  # other lookups (inspect, pytest) stay harmless
            raise KeyboardInterrupt
        raise AttributeError(name)


def test_a_ctrl_c_while_the_worker_imports_torch_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(tiny_train_config(ParallelDims(), "unused").to_json()))
    monkeypatch.setattr(worker, "setup_process", lambda: None)  # no global logging changes
    monkeypatch.setitem(
        sys.modules, "shardsmith.trainer.train", _InterruptedImport("shardsmith.trainer.train")
    )
    monkeypatch.setenv("RANK", "0")
    try:
        code = worker.main([str(cfg_path)])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped main(): each worker printed a KeyboardInterrupt traceback")
    assert code == 130
    assert capsys.readouterr().err == "interrupted before the first step: nothing saved\n"
