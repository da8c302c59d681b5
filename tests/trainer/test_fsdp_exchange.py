"""FSDP's parameter and gradient exchange policy (``--fsdp-reshard-after-forward``) under every
pipeline schedule, on real gloo process groups.

One launch of 8 processes trains every case for 4 fp32 steps: each pipeline schedule under HSDP
(pp2, dp_replicate 2, dp_shard 2), two under context parallelism (pp2, dp_shard 2, cp 2), one
under TP (pp2, dp_shard 2, tp2), four chunks per rank (more than torch keeps gathered), and the
unpipelined loop under HSDP (dp_replicate 2, dp_shard 4), each with the exchange once per step (``never``; ``default`` under pipelining) and once per microbatch
(``always``). Their losses and gradient norms agree within 1e-5: the policies differ in when
the gradients are reduced (their sum in fp32, in another order), never in what is computed.
``bench/comm_volume.py`` shows the bytes each moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_torchrun, tiny_train_config

from shardsmith.layout import ParallelDims
from shardsmith.trainer.config import TrainConfig

HSDP = ParallelDims(pp=2, dp_replicate=2, dp_shard=2)
HSDP_V2 = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, virtual_stages=2)
CP = ParallelDims(pp=2, dp_shard=2, cp=2)
CP_V2 = ParallelDims(pp=2, dp_shard=2, cp=2, virtual_stages=2)
TP_V2 = ParallelDims(pp=2, dp_shard=2, tp=2, virtual_stages=2)
NO_PP = ParallelDims(dp_replicate=2, dp_shard=4)
HSDP_V4 = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, virtual_stages=4)  # 8 layers

#: case name -> (layout, pipeline schedule); every case runs under both policies.
CASES: dict[str, tuple[ParallelDims, str]] = {
    "1f1b-hsdp": (HSDP, "1f1b"),
    "gpipe-hsdp": (HSDP, "gpipe"),
    "interleaved-1f1b-hsdp": (HSDP_V2, "interleaved-1f1b"),
    "looped-bfs-hsdp": (HSDP_V2, "looped-bfs"),
    "interleaved-zb-hsdp": (HSDP_V2, "interleaved-zb"),
    "1f1b-cp": (CP, "1f1b"),
    "interleaved-zb-cp": (CP_V2, "interleaved-zb"),
    "interleaved-1f1b-tp": (TP_V2, "interleaved-1f1b"),
    "no-pipeline-hsdp": (NO_PP, ""),
    "interleaved-1f1b-v4-hsdp": (HSDP_V4, "interleaved-1f1b"),  # beyond torch's 3 gathered chunks
}
POLICIES = ("never", "always")


@pytest.fixture(scope="module")
def exchange_runs(tmp_path_factory: pytest.TempPathFactory, data_path: str) -> Path:
    """One 8-process launch: every case of :data:`CASES` under both policies, 4 steps each."""
    out = tmp_path_factory.mktemp("exchange")
    cfg = tiny_train_config(HSDP, data_path)
    tasks = [
        {
            "kind": "train",
            "steps": 4,
            "out": str(out / f"{case}-{policy}.json"),
            "set": {
                "parallel": dims.to_json(),
                "pipeline_schedule": schedule,
                "fsdp_reshard_after_forward": policy,
                "global_batch_size": 16,
                "micro_batch_size": 1,
                **(
                    {"model": {**cfg.model.to_json(), "num_layers": 8}}
                    if dims.num_chunks > 4
                    else {}
                ),
            },
        }
        for case, (dims, schedule) in CASES.items()
        for policy in POLICIES
    ]
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 8, out, "exchange", timeout=900).check()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_exchange_once_per_step_matches_per_microbatch(
    exchange_runs: Path, case: str
) -> None:
    never, always = (json.loads((exchange_runs / f"{case}-{p}.json").read_text()) for p in POLICIES)
    assert [m["step"] for m in never] == [1, 2, 3, 4] == [m["step"] for m in always]
    for a, b in zip(never, always):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (case, a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-5), (case, a, b)
    assert never[-1]["loss"] < never[0]["loss"]  # it trained


def test_exchange_policy_is_left_out_of_manifests_at_its_default(data_path: str) -> None:
    """Checkpoints of runs that keep the default write the config bytes they always wrote."""
    cfg = tiny_train_config(HSDP, data_path)
    assert "fsdp_reshard_after_forward" not in cfg.to_json()
    changed = TrainConfig.from_json({**cfg.to_json(), "fsdp_reshard_after_forward": "always"})
    assert changed.to_json()["fsdp_reshard_after_forward"] == "always"
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward='sometimes'"):
        TrainConfig.from_json({**cfg.to_json(), "fsdp_reshard_after_forward": "sometimes"})
