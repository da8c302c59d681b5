"""MoE layouts beside the other parallelisms on 4 gloo processes, in one launch, and the
reshard matrix; MoE with expert TP and sequence parallelism on 2 (the last test).

One launch (start-up dominates on CPU) trains and checks:

* MoE (4 experts, top-2, aux loss 0.01) under EP2·TP2 (dp_shard 2 = ep 2, experts' F split
  over tp 2) and PP2·EP2 (the aux loss enters each stage's backward): fresh-init logits and
  first-step gradients equal one process (1e-5), and a same-layout resume is bitwise;
* dense dp_shard 2·tp 2 with sequence parallelism and pp 2·dp_shard 2 with 2 virtual stages:
  two steps saved, for the matrix;
* two resumes elsewhere: the EP2·TP2 step-1 checkpoint resharded offline to EP4 (4 ranks of
  whole experts) and resumed there; the PP2·EP2 step-1 checkpoint loaded by an EP1·TP2 job
  (load-time reshard). Their step-2 loss equals the uninterrupted run's within 1e-4.

The reshard matrix then runs offline in this process: every MoE checkpoint to every MoE
layout of {ep2, ep4, ep1, ep2·tp2, pp2·ep2}, every dense one to the other dense layout and to
one process; ``diff`` finds no difference and every tensor, optimizer state included, is
bitwise the source's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import (
    TINY_MODEL,
    assert_tensors_bitwise_equal,
    read_full_tensors,
    run_torchrun,
    tiny_train_config,
)
from dist_reference import assert_close, fixed_batch, load_rank_files, single_process_reference

from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import step_dir

pytestmark = pytest.mark.distributed

MOE = dataclasses.replace(TINY_MODEL, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)

#: MoE layouts of the matrix, each valid for 4 experts.
MOE_LAYOUTS: dict[str, ParallelDims] = {
    "ep2": ParallelDims(dp_shard=2, expert_parallel=2),
    "ep4": ParallelDims(dp_shard=4, expert_parallel=4),
    "ep1": ParallelDims(),
    "ep2·tp2": ParallelDims(dp_shard=2, tp=2, expert_parallel=2),
    "pp2·ep2": ParallelDims(pp=2, dp_shard=2, expert_parallel=2),
}
#: Dense layouts of the matrix, trained on 4 ranks (with their training flags).
DENSE_LAYOUTS: dict[str, tuple[ParallelDims, dict]] = {
    "tp2·sp": (ParallelDims(dp_shard=2, tp=2), {"sequence_parallel": True}),
    "pp2·v2": (ParallelDims(pp=2, dp_shard=2, virtual_stages=2), {}),
}
_TRAINED = ("ep2·tp2", "pp2·ep2")


def _reference_tasks(d: Path, tokens: list, targets: list, overrides: dict) -> list[dict]:
    """Fresh-init logits and first-step gradients into ``d/logits``, ``d/grads`` (compared
    with one process by :func:`_assert_reference`)."""
    return [
        {"kind": "logits", "tokens": tokens, "out": str(d / "logits"), "set": overrides},
        {
            "kind": "grads",
            "tokens": tokens,
            "targets": targets,
            "out": str(d / "grads"),
            "set": overrides,
        },
    ]


def _resume_tasks(d: Path, overrides: dict) -> list[dict]:
    """Two steps saved every step into ``d/full``, and a resume from step 1 into ``d/resumed``
    (checked by :func:`_assert_resume_bitwise`)."""
    return [
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(d / "full"),
            "save_interval": 1,
            "out": str(d / "full.json"),
            "set": overrides,
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(d / "resumed"),
            "resume": str(d / "full" / step_dir(1)),
            "out": str(d / "resumed.json"),
            "set": overrides,
        },
    ]


def _assert_reference(d: Path, logits, grads, what: str) -> None:
    assert_close(load_rank_files(d / "logits", "logits"), {"logits": logits}, f"{what} logits")
    assert_close(load_rank_files(d / "grads", "grads"), grads, f"{what} first-step grads")


def _assert_resume_bitwise(d: Path, what: str) -> None:
    full, resumed = _metrics(d / "full.json"), _metrics(d / "resumed.json")
    assert [m["step"] for m in resumed] == [2], what
    assert (resumed[0]["loss"], resumed[0]["grad_norm"]) == (
        full[1]["loss"],
        full[1]["grad_norm"],
    ), f"{what}: same-layout resume is not bitwise"


def _moe_tasks(tmp_path: Path, tokens: list, targets: list) -> list[dict]:
    tasks: list[dict] = []
    for name in _TRAINED:
        layout = {"parallel": MOE_LAYOUTS[name].to_json(), "model": MOE.to_json()}
        tasks += _reference_tasks(tmp_path / name, tokens, targets, layout) + _resume_tasks(
            tmp_path / name, layout
        )
    ep4 = tmp_path / "ep4-resume"
    tasks += [
        {
            "kind": "reshard",
            "src": str(tmp_path / "ep2·tp2" / "full" / step_dir(1)),
            "dst": str(ep4 / "from" / step_dir(1)),
            "parallel": MOE_LAYOUTS["ep4"].to_json(),
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(ep4 / "run"),
            "resume": str(ep4 / "from" / step_dir(1)),
            "out": str(ep4 / "resumed.json"),
            "set": {"parallel": MOE_LAYOUTS["ep4"].to_json(), "model": MOE.to_json()},
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(tmp_path / "ep1tp2"),
            "resume": str(tmp_path / "pp2·ep2" / "full" / step_dir(1)),
            "out": str(tmp_path / "ep1tp2.json"),
            "set": {"parallel": ParallelDims(dp_shard=2, tp=2).to_json(), "model": MOE.to_json()},
        },
    ]
    for name, (dims, flags) in DENSE_LAYOUTS.items():
        tasks.append(
            {
                "kind": "train",
                "steps": 2,
                "ckpt": str(tmp_path / name),
                "out": str(tmp_path / f"{name}.json"),
                "set": {"parallel": dims.to_json(), **flags},
            }
        )
    return tasks


def _metrics(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def test_moe_layouts_match_one_process_resume_and_reshard_everywhere(
    tmp_path: Path, data_path: str
) -> None:
    cfg = tiny_train_config(ParallelDims(dp_shard=2, tp=2), data_path)
    tokens, targets = fixed_batch()
    run_torchrun(
        {"config": cfg.to_json(), "tasks": _moe_tasks(tmp_path, tokens, targets)},
        4,
        tmp_path,
        "moe4",
        timeout=1500,
    ).check()

    logits, grads = single_process_reference(tokens, targets, 2, MOE)  # 8 / (micro 2 * dp 2)
    for name in _TRAINED:
        _assert_reference(tmp_path / name, logits, grads, f"MoE {name}")
        _assert_resume_bitwise(tmp_path / name, f"MoE {name}")
    full = _metrics(tmp_path / "ep2·tp2" / "full.json")
    assert (
        abs(_metrics(tmp_path / "ep4-resume" / "resumed.json")[0]["loss"] - full[1]["loss"]) <= 1e-4
    )
    full = _metrics(tmp_path / "pp2·ep2" / "full.json")
    assert abs(_metrics(tmp_path / "ep1tp2.json")[0]["loss"] - full[1]["loss"]) <= 1e-4

    _reshard_matrix(tmp_path)


def _reshard_matrix(tmp_path: Path) -> None:
    """Offline: each trained checkpoint to every layout of its kind; ``diff`` and bitwise checks."""
    from shardsmith.reshard.api import reshard
    from shardsmith.reshard.diff import diff_checkpoints
    from shardsmith.storage.commit import read_manifest
    from shardsmith.storage.store.fs import Store

    two = step_dir(2)
    sources = {name: (str(tmp_path / name / "full" / two), MOE_LAYOUTS) for name in _TRAINED}
    dense_targets = {**{n: d for n, (d, _) in DENSE_LAYOUTS.items()}, "pp1": ParallelDims()}
    sources.update({name: (str(tmp_path / name / two), dense_targets) for name in DENSE_LAYOUTS})
    for src_name, (src, targets) in sources.items():
        saved = read_full_tensors(src)
        assert any(k.startswith("optim.exp_avg.") for k in saved), src_name
        for dst_name, dims in targets.items():
            dst = str(tmp_path / "matrix" / f"{src_name}-to-{dst_name}" / two)
            reshard(Store(src), dst, dims)
            report = diff_checkpoints(
                Store(src), read_manifest(Store(src)), Store(dst), read_manifest(Store(dst))
            )
            assert report.equal, f"diff {src_name} -> {dst_name}: {report}"
            assert_tensors_bitwise_equal(
                read_full_tensors(dst), saved, f"reshard {src_name} -> {dst_name}"
            )


def test_moe_with_expert_tensor_and_sequence_parallelism(tmp_path: Path, data_path: str) -> None:
    """MoE under tp 2 (EP1: FSDP-free, each expert's F split over tp), with and without
    sequence parallelism: logits and first-step gradients equal one process (1e-5); the SP
    run resumes bitwise."""
    cfg = dataclasses.replace(tiny_train_config(ParallelDims(tp=2), data_path), model=MOE)
    tokens, targets = fixed_batch()
    sp = {"sequence_parallel": True}
    tasks = (
        _reference_tasks(tmp_path / "tp", tokens, targets, {})
        + _reference_tasks(tmp_path / "sp", tokens, targets, sp)
        + _resume_tasks(tmp_path / "sp", sp)
    )
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 2, tmp_path, "moe-sp").check()

    logits, grads = single_process_reference(tokens, targets, cfg.num_microbatches(), MOE)
    for what in ("tp", "sp"):
        _assert_reference(tmp_path / what, logits, grads, f"MoE tp2 {what}")
    _assert_resume_bitwise(tmp_path / "sp", "MoE tp2 sp")
