"""Tensor parallelism moves what the cost model charges: on real gloo processes (tp2), one
training step's bus bytes on the TP group equal ``sizing/traffic.py``'s ``tp`` term, with and
without sequence parallelism.

The term counts Megatron's four collectives per layer and microbatch (fused QKV and gate/up)
plus the embedding's and the output projection's. A plan that handed each column-parallel
linear its own input DTensor would all-reduce the input gradient once per linear: seven per
layer, 1.67x these bytes on this model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_MODEL, run_torchrun, tiny_train_config

from shardsmith.layout import ParallelDims
from shardsmith.sizing import step_traffic

TP2 = ParallelDims(tp=2)


@pytest.mark.distributed
def test_tp_bus_bytes_equal_the_cost_model(tmp_path: Path, data_path: str) -> None:
    cfg = tiny_train_config(TP2, data_path)
    cases = {"plain": False, "sequence-parallel": True}
    tasks = [
        {
            "kind": "bus_bytes",
            "out": str(tmp_path / f"{name}.json"),
            "set": {"sequence_parallel": sp},
        }
        for name, sp in cases.items()
    ]
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 2, tmp_path, "tp-bytes").check()
    microbatches = cfg.global_batch_size // cfg.micro_batch_size
    for name, sp in cases.items():
        got = json.loads((tmp_path / f"{name}.json").read_text())["tp"]
        want = step_traffic(
            TINY_MODEL,
            TP2,
            pp_rank=0,
            micro_batch_size=cfg.micro_batch_size,
            num_microbatches=microbatches,
            sequence_parallel=sp,
        )["tp"]
        # the world is the tp group here: the gradient norm's scalar all-reduces count too
        assert got == pytest.approx(want, rel=0.01), (name, got, want)
