"""Context parallelism on real gloo process groups, one 4-rank launch for every case:

* cp4, cp2·tp2, cp2·pp2 and cp2·dp_shard2: fresh-init logits and first-step gradients equal
  one process (1e-5);
* losses over 4 steps of cp2·dp_shard2 and cp4 equal dp_shard4 (cp1) within 1e-4;
* cp2·tp2 saved at step 2 and resumed at cp4 continues with the cp1 run's losses (the data
  state is exact across a cp change);
* checkpoints move between cp1, cp2 and cp4: loaded and saved again, and resharded offline,
  with bitwise the same tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import (
    assert_tensors_bitwise_equal,
    read_full_tensors,
    run_torchrun,
    tiny_train_config,
)
from dist_reference import assert_close as _assert_close
from dist_reference import fixed_batch as _batch
from dist_reference import load_rank_files as _load_all
from dist_reference import single_process_reference as _single_process_reference

from shardsmith.cli.main import cli
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import step_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {
    "cp4": ParallelDims(cp=4),
    "cp2tp2": ParallelDims(cp=2, tp=2),
    "cp2pp2": ParallelDims(cp=2, pp=2),
    "cp2dps2": ParallelDims(cp=2, dp_shard=2),
}


def _losses(path: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in json.loads(path.read_text())}


def test_context_parallel_equals_one_process_and_moves_between_cp_sizes(
    tmp_path: Path, data_path: str
) -> None:
    cfg = tiny_train_config(ParallelDims(dp_shard=4), data_path)
    tokens, targets = _batch()
    two, four = step_dir(2), step_dir(4)
    tasks = []
    for name, dims in LAYOUTS.items():
        at = {"parallel": dims.to_json()}
        tasks += [
            {
                "kind": "logits",
                "tokens": tokens,
                "out": str(tmp_path / f"logits-{name}"),
                "set": at,
            },
            {
                "kind": "grads",
                "tokens": tokens,
                "targets": targets,
                "out": str(tmp_path / f"grads-{name}"),
                "set": at,
            },
        ]
    cp4, cp2tp2 = {"parallel": LAYOUTS["cp4"].to_json()}, {"parallel": LAYOUTS["cp2tp2"].to_json()}
    tasks += [
        {"kind": "train", "steps": 4, "out": str(tmp_path / "cp1.json")},
        {
            "kind": "train",
            "steps": 4,
            "out": str(tmp_path / "cp2dps2.json"),
            "set": {"parallel": LAYOUTS["cp2dps2"].to_json()},
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(tmp_path / "a"),
            "save_interval": 2,
            "out": str(tmp_path / "part.json"),
            "set": cp2tp2,
        },
        {
            "kind": "train",
            "steps": 4,
            "ckpt": str(tmp_path / "b"),
            "resume": str(tmp_path / "a" / two),
            "out": str(tmp_path / "cp4.json"),
            "set": cp4,
        },
        {"kind": "reload", "src": str(tmp_path / "b" / four), "dst": str(tmp_path / "as-cp1")},
        {
            "kind": "reload",
            "src": str(tmp_path / "as-cp1" / four),
            "dst": str(tmp_path / "as-cp2"),
            "set": cp2tp2,
        },
        {
            "kind": "reshard",
            "src": str(tmp_path / "b" / four),
            "dst": str(tmp_path / "off-cp2" / four),
            "parallel": ParallelDims(cp=2, tp=2).to_json(),
        },
        {
            "kind": "reshard",
            "src": str(tmp_path / "off-cp2" / four),
            "dst": str(tmp_path / "off-cp1" / four),
            "parallel": ParallelDims().to_json(),
        },
    ]
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 4, tmp_path, "cp").check()

    for name, dims in LAYOUTS.items():
        logits, grads = _single_process_reference(
            tokens, targets, tiny_train_config(dims, data_path).num_microbatches()
        )
        _assert_close(
            _load_all(tmp_path / f"logits-{name}", "logits"), {"logits": logits}, f"{name} logits"
        )
        _assert_close(
            _load_all(tmp_path / f"grads-{name}", "grads"), grads, f"{name} first-step grads"
        )

    ref = _losses(tmp_path / "cp1.json")
    for run, steps in (("cp2dps2", (1, 2, 3, 4)), ("part", (1, 2)), ("cp4", (3, 4))):
        got = _losses(tmp_path / f"{run}.json")
        assert sorted(got) == list(steps)
        for s in steps:
            assert abs(got[s] - ref[s]) <= 1e-4 * abs(ref[s]), (
                f"{run} step {s}: {got[s]} vs cp1 {ref[s]}"
            )

    for command in (["ls", str(tmp_path / "a")], ["inspect", str(tmp_path / "a" / two)]):
        result = CliRunner().invoke(cli, command)  # the CP size is named
        assert result.exit_code == 0 and "dps1·cp2·tp2" in result.output, result.output

    saved = read_full_tensors(str(tmp_path / "b" / four))
    for name in ("as-cp1", "as-cp2", "off-cp2", "off-cp1"):
        assert_tensors_bitwise_equal(
            read_full_tensors(str(tmp_path / name / four)), saved, f"cp4 -> {name}"
        )
