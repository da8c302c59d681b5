"""Sequence parallelism and the interleaved (virtual) pipeline, on real gloo process groups.

One launch per layout covers every case of that layout (start-up dominates on CPU):

* tp2, sequence parallel vs not: fresh-init logits and first-step gradients (1e-5), a
  bitwise same-layout resume with SP, and checkpoints that SP and non-SP jobs load from
  each other (loaded, saved again, bitwise the same tensors); ``--profile-steps`` writes a
  Chrome trace per rank and the step record carries ``peak_mem_nbytes``.
* pp2 with 2 virtual stages: logits and first-step gradients vs one process (1e-5), a
  bitwise same-layout resume, and its checkpoint loaded by pp1, pp2 and offline-resharded.
* a MoE model under dp_shard 2 and under EP2 vs one process; EP2 -> EP1 -> one process.
"""

from __future__ import annotations

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


def _assert_bitwise_resume(tmp_path: Path) -> None:
    """Step 2 resumed from the step-1 checkpoint has the uninterrupted run's loss and grad norm, bitwise."""
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert [m["step"] for m in resumed] == [2]
    assert resumed[0]["loss"] == full[1]["loss"] and resumed[0]["grad_norm"] == full[1]["grad_norm"]


def test_sequence_parallel_matches_tp_and_shares_checkpoints(
    tmp_path: Path, data_path: str
) -> None:
    cfg = tiny_train_config(ParallelDims(tp=2), data_path)
    tokens, targets = fixed_batch()
    sp = {"sequence_parallel": True}
    one = step_dir(1)
    two = step_dir(2)
    tasks = [
        {"kind": "logits", "tokens": tokens, "out": str(tmp_path / "logits-tp")},
        {"kind": "logits", "tokens": tokens, "out": str(tmp_path / "logits-sp"), "set": sp},
        {"kind": "grads", "tokens": tokens, "targets": targets, "out": str(tmp_path / "grads-tp")},
        {
            "kind": "grads",
            "tokens": tokens,
            "targets": targets,
            "out": str(tmp_path / "grads-sp"),
            "set": sp,
        },
        {"kind": "train", "steps": 2, "out": str(tmp_path / "full.json"), "set": sp},
        {
            "kind": "train",
            "steps": 1,
            "ckpt": str(tmp_path / "sp1"),
            "out": str(tmp_path / "part.json"),
            "set": sp,
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(tmp_path / "sp2"),
            "resume": str(tmp_path / "sp1" / one),
            "out": str(tmp_path / "resumed.json"),
            "set": {**sp, "profile_steps": [2]},
        },
        {"kind": "reload", "src": str(tmp_path / "sp2" / two), "dst": str(tmp_path / "as-tp")},
        {
            "kind": "reload",
            "src": str(tmp_path / "as-tp" / two),
            "dst": str(tmp_path / "as-sp"),
            "set": sp,
        },
    ]
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 2, tmp_path, "sp").check()

    assert_close(
        load_rank_files(tmp_path / "logits-sp", "logits"),
        load_rank_files(tmp_path / "logits-tp", "logits"),
        "SP logits vs TP",
    )
    grads_tp = load_rank_files(tmp_path / "grads-tp", "grads")
    assert len(grads_tp) == 4 * 9 + 3 and all(g.abs().sum() > 0 for g in grads_tp.values())
    assert_close(
        load_rank_files(tmp_path / "grads-sp", "grads"), grads_tp, "SP first-step grads vs TP"
    )

    _assert_bitwise_resume(tmp_path)

    for rank in (0, 1):  # --profile-steps 2: a trace per rank
        trace = json.loads(
            (tmp_path / "sp2" / "profile" / "step-000000002" / f"rank-{rank:05d}.json").read_text()
        )
        assert trace["traceEvents"]
    records = [
        json.loads(line) for line in (tmp_path / "sp2" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r.get("step") == 2 and "loss" in r]
    assert steps and steps[-1]["peak_mem_nbytes"] > 10 * 2**20

    saved_sp = read_full_tensors(str(tmp_path / "sp2" / two))
    assert_tensors_bitwise_equal(
        read_full_tensors(str(tmp_path / "as-tp" / two)), saved_sp, "SP -> TP load"
    )
    assert_tensors_bitwise_equal(
        read_full_tensors(str(tmp_path / "as-sp" / two)), saved_sp, "TP -> SP load"
    )


def test_interleaved_pipeline_matches_one_process_and_reshards(
    tmp_path: Path, data_path: str
) -> None:
    """pp2 with 2 virtual stages (rank 0: layers 0 and 2, rank 1: layers 1 and 3) under
    ScheduleInterleaved1F1B: logits and first-step grads equal one process (1e-5); a
    same-layout resume is bitwise; its checkpoint loads into pp1 (dp_shard 2) and pp2 and back,
    and reshards offline to one process, with bitwise the same tensors."""
    from shardsmith.reshard.api import reshard
    from shardsmith.storage.store.fs import Store

    virtual = ParallelDims(pp=2, virtual_stages=2)
    cfg = tiny_train_config(virtual, data_path)
    tokens, targets = fixed_batch()
    two = step_dir(2)
    pp1 = {"parallel": ParallelDims(dp_shard=2).to_json()}
    pp2 = {"parallel": ParallelDims(pp=2).to_json()}
    tasks = [
        {"kind": "logits", "tokens": tokens, "out": str(tmp_path / "logits")},
        {"kind": "grads", "tokens": tokens, "targets": targets, "out": str(tmp_path / "grads")},
        {"kind": "train", "steps": 2, "out": str(tmp_path / "full.json")},
        {
            "kind": "train",
            "steps": 1,
            "ckpt": str(tmp_path / "vp1"),
            "out": str(tmp_path / "part.json"),
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(tmp_path / "vp2"),
            "resume": str(tmp_path / "vp1" / step_dir(1)),
            "out": str(tmp_path / "resumed.json"),
        },
        {
            "kind": "reload",
            "src": str(tmp_path / "vp2" / two),
            "dst": str(tmp_path / "as-pp1"),
            "set": pp1,
        },
        {
            "kind": "reload",
            "src": str(tmp_path / "vp2" / two),
            "dst": str(tmp_path / "as-pp2"),
            "set": pp2,
        },
        {"kind": "reload", "src": str(tmp_path / "as-pp1" / two), "dst": str(tmp_path / "back")},
    ]
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 2, tmp_path, "vp").check()

    logits, grads = single_process_reference(tokens, targets, cfg.num_microbatches())
    assert_close(
        load_rank_files(tmp_path / "logits", "logits"), {"logits": logits}, "pp2·v2 logits"
    )
    assert_close(load_rank_files(tmp_path / "grads", "grads"), grads, "pp2·v2 first-step grads")

    _assert_bitwise_resume(tmp_path)

    saved = read_full_tensors(str(tmp_path / "vp2" / two))
    for name in ("as-pp1", "as-pp2", "back"):
        assert_tensors_bitwise_equal(
            read_full_tensors(str(tmp_path / name / two)), saved, f"pp2·v2 -> {name}"
        )
    offline = str(tmp_path / "offline" / two)
    reshard(Store(str(tmp_path / "vp2" / two)), offline, ParallelDims())
    assert_tensors_bitwise_equal(read_full_tensors(offline), saved, "offline reshard pp2·v2 -> pp1")


def test_moe_with_expert_parallelism_matches_one_process(tmp_path: Path, data_path: str) -> None:
    """A Mixtral-style MoE (4 experts, top-2, aux loss) on 2 ranks, FSDP-only (dp_shard 2: FSDP2
    splits each ``[E, ...]`` expert tensor along the experts) and EP2 (each rank keeps experts
    {0, 1} or {2, 3} whole and all-gathers tokens): logits and first-step gradients equal one
    process (1e-5); the EP2 checkpoint (whole ``[E, ...]`` tensors) loads into EP1 and reshards
    offline to one process bitwise."""
    import dataclasses

    from shardsmith.reshard.api import reshard
    from shardsmith.storage.store.fs import Store

    moe = dataclasses.replace(TINY_MODEL, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
    cfg = dataclasses.replace(tiny_train_config(ParallelDims(dp_shard=2), data_path), model=moe)
    ep2 = {"parallel": ParallelDims(dp_shard=2, expert_parallel=2).to_json()}
    tokens, targets = fixed_batch()
    two = step_dir(2)
    tasks = [
        {"kind": "logits", "tokens": tokens, "out": str(tmp_path / "logits")},
        {"kind": "grads", "tokens": tokens, "targets": targets, "out": str(tmp_path / "grads")},
        {"kind": "logits", "tokens": tokens, "out": str(tmp_path / "logits-ep"), "set": ep2},
        {
            "kind": "grads",
            "tokens": tokens,
            "targets": targets,
            "out": str(tmp_path / "grads-ep"),
            "set": ep2,
        },
        {
            "kind": "train",
            "steps": 2,
            "ckpt": str(tmp_path / "ep"),
            "out": str(tmp_path / "full.json"),
            "set": ep2,
        },
        {"kind": "reload", "src": str(tmp_path / "ep" / two), "dst": str(tmp_path / "ep1")},
    ]
    run_torchrun({"config": cfg.to_json(), "tasks": tasks}, 2, tmp_path, "moe").check()

    logits, grads = single_process_reference(tokens, targets, cfg.num_microbatches(), moe)
    assert grads["layers.0.feed_forward.experts.w1"].shape == (
        4,
        moe.ffn_hidden_size,
        moe.hidden_size,
    )
    for suffix, what in (("", "dps2"), ("-ep", "EP2")):
        assert_close(
            load_rank_files(tmp_path / f"logits{suffix}", "logits"),
            {"logits": logits},
            f"MoE {what} logits",
        )
        assert_close(
            load_rank_files(tmp_path / f"grads{suffix}", "grads"),
            grads,
            f"MoE {what} first-step grads",
        )

    saved = read_full_tensors(str(tmp_path / "ep" / two))
    assert saved["layers.3.feed_forward.experts.w2"].shape == (
        4,
        moe.hidden_size,
        moe.ffn_hidden_size,
    )
    assert_tensors_bitwise_equal(
        read_full_tensors(str(tmp_path / "ep1" / two)), saved, "MoE EP2 -> EP1 load"
    )
    offline = str(tmp_path / "one" / two)
    reshard(Store(str(tmp_path / "ep" / two)), offline, ParallelDims())
    assert_tensors_bitwise_equal(read_full_tensors(offline), saved, "MoE EP2 -> one process")
