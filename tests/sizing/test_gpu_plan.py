"""The dry run's GPU verdict, its estimator terms (hand-computed values) and ``shardsmith plan``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.layout import ModelConfig, ParallelDims, validate_layout
from shardsmith.sizing import activations as act
from shardsmith.sizing.cost import MAX_MATMUL_EFFICIENCY, matmul_efficiency
from shardsmith.sizing.estimate import root_grad_numels, unsharded_numels
from shardsmith.sizing.gpus import (
    ALLOCATOR_MARGIN,
    CUDA_CONTEXT_NBYTES,
    NCCL_COMM_NBYTES,
    gpu,
    process_groups,
    process_overhead_nbytes,
)
from shardsmith.sizing.peak import fsdp_buffer_nbytes, loss_nbytes
from shardsmith.sizing.presets import resolve_model
from shardsmith.sizing.search import plan
from shardsmith.sizing.verdict import Job, fixes, judge, max_peak, merge_flags, warnings

TINY = ModelConfig(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=64,
)
GiB = 2**30


def test_activation_terms_by_hand() -> None:
    # h = q = 64, f = 128, t = 2, bf16 (c = 2): norms 2(4*64 + 2*2*64) = 1024, attention
    # 5*2*64/2 = 320, SwiGLU 4*2*128/2 = 512
    assert act.layer_nbytes_per_token(TINY, 2, 2) == 1856
    # sequence parallel: norms 2((4*64 + 2*64)/2 + 2*64) = 640
    assert act.layer_nbytes_per_token(TINY, 2, 2, sequence_parallel=True) == 1472
    # fp32: norms 2(4*64 + 2*4*64) = 1536, attention 5*4*64/2 = 640, SwiGLU 4*4*128/2 = 1024
    assert act.layer_nbytes_per_token(TINY, 2, 4) == 3200
    assert act.checkpointed_layer_nbytes_per_token(TINY, 2, 2, sequence_parallel=True) == 64
    assert act.checkpointed_layer_nbytes_per_token(TINY, 2, 2) == 128
    # vocab 128 per rank: bf16 logits 2 + fp32 copy 4 + log-softmax 4 + its gradient 4
    assert act.loss_nbytes_per_token(128, 2) == 128 * 14
    assert act.loss_nbytes_per_token(128, 4) == 128 * 12
    assert loss_nbytes(TINY, ParallelDims(tp=2), 2, 2) == 64 * 2 * 128 * 14


def test_fsdp_buffer_and_process_terms_by_hand() -> None:
    dims = ParallelDims(tp=2, dp_shard=2)
    # block per TP rank: wq 64*64/2 + wk, wv 32*64/2 each + wo 64*64/2 + w1, w2, w3 128*64/2 each
    # + two norms of 64 = 2048 + 2*1024 + 2048 + 3*4096 + 128 = 18,560; root: embedding and output
    # 256*64/2 each + the final norm 64
    blocks, roots = unsharded_numels(TINY, dims)
    assert blocks == [18560] and roots == [16448]
    # the embedding's gradient is Replicate over tp: the whole 256*64 instead of its half
    assert root_grad_numels(TINY, dims) == [16448 + 256 * 64 // 2]
    # bf16: root 2 bytes, block (current + prefetched + gradient) 2 each + fp32 reduce-scatter input 4
    assert fsdp_buffer_nbytes(1000, 500, dims, True) == 500 * 2 + 1000 * 10
    assert fsdp_buffer_nbytes(1000, 500, dims, False) == 500 * 4 + 1000 * 12
    assert fsdp_buffer_nbytes(1000, 500, ParallelDims(tp=2), True) == 0
    assert process_groups(ParallelDims(tp=8, pp=4, dp_shard=8)) == 3
    assert process_groups(ParallelDims(tp=8, dp_shard=8, dp_replicate=2)) == 4
    # context parallelism: its own group and the dp_shard x cp group FSDP shards over
    assert process_groups(ParallelDims(tp=8, pp=16, cp=16, dp_shard=1)) == 4
    assert process_groups(ParallelDims(tp=8, cp=2, dp_shard=4, dp_replicate=2)) == 6
    assert process_overhead_nbytes(3) == CUDA_CONTEXT_NBYTES + 3 * NCCL_COMM_NBYTES
    est = Job(TINY, dims, micro_batch_size=1, global_batch_size=8).estimate()
    role = est.roles[0]
    assert role.peak_nbytes == int(
        role.total_nbytes * (1 + ALLOCATOR_MARGIN)
    ) + process_overhead_nbytes(2)
    assert (
        role.total_nbytes == 16 * role.num_params + role.activation_nbytes + role.transient_nbytes
    )


def test_gpu_table_and_matmul_efficiency() -> None:
    assert gpu("H100-SXM") is gpu("h100") and gpu("h200").memory_nbytes > gpu("h100").memory_nbytes
    with pytest.raises(ValueError, match="known: a100-80gb"):
        gpu("tpu")
    m = resolve_model("llama3-70b", {})
    # d = min(8192/8, 28672/8, 8192 tokens) = 1024: 0.75 * 1024 / (1024 + 512) = 0.5
    assert matmul_efficiency(m, 8, 1) == pytest.approx(MAX_MATMUL_EFFICIENCY * 1024 / 1536)


def test_verdict_and_fixes_are_computed() -> None:
    m = resolve_model("llama3-70b", {})
    device = 80 * 10**9
    toy = Job(
        m, ParallelDims(tp=8, pp=4, dp_shard=8), micro_batch_size=2, global_batch_size=16
    )  # train defaults
    est = toy.estimate()
    assert not any(v["fits"] for v in judge(est, device))
    found = fixes(toy, device)
    assert found
    for fix in found:  # each fix re-estimated: it fits by the estimator
        assert fix["peak_bytes"] <= device and fix["headroom_bytes"] == device - fix["peak_bytes"]
    assert any("bubble" in w for w in warnings(est))
    good = Job(
        m,
        ParallelDims(tp=8, pp=4, dp_shard=8),
        micro_batch_size=1,
        global_batch_size=512,
        activation_checkpointing=True,
        mixed_precision="bf16",
        sequence_parallel=True,
    )
    verdicts = judge(good.estimate(), device)
    assert all(v["fits"] and v["headroom_bytes"] > 0 for v in verdicts)
    assert not any("bubble" in w for w in warnings(good.estimate()))


def test_dry_run_json_carries_the_verdict() -> None:
    args = [
        "train",
        "--model",
        "llama3-70b",
        "--tp",
        "8",
        "--pp",
        "4",
        "--dp-shard",
        "8",
        "--global-batch-size",  # 4 microbatches: 1F1B over 4 stages takes no fewer
        "64",
        "--dry-run",
        "--json",
        "--gpu-memory",
        "80GB",
    ]
    no = json.loads(CliRunner().invoke(cli, args).output)
    assert no["fits"] is False and no["fixes"] and all(not g["fits"] for g in no["rank_groups"])
    yes = CliRunner().invoke(
        cli,
        args
        + [
            "--mixed-precision",
            "bf16",
            "--activation-checkpointing",
            "--sequence-parallel",
            "--global-batch-size",
            "512",
            "--gpu",
            "h100",
        ],
    )
    d = json.loads(yes.output)
    assert (
        d["fits"] is True
        and d["fixes"] == []
        and d["peak_bytes"] == max(r["peak_bytes"] for r in d["roles"])
    )
    text = CliRunner().invoke(cli, [a for a in args if a != "--json"]).output
    assert "does not fit by" in text and "to fit: " in text and "warning: pipeline bubble" in text


def test_plan_recommends_valid_fitting_layouts() -> None:
    m = resolve_model("llama3-70b", {})
    h100 = gpu("h100")
    found = plan(m, 256, 8, h100, 512)
    assert found and [c.cost.step_s for c in found] == sorted(c.cost.step_s for c in found)
    for c in found:
        validate_layout(m, c.job.dims)
        assert c.job.dims.world_size == 256 and c.job.dims.tp <= 8
        assert max_peak(c.job.estimate()) <= h100.memory_nbytes  # every rank group, full estimate
        assert 0 < c.cost.mfu < MAX_MATMUL_EFFICIENCY
    out = CliRunner().invoke(
        cli,
        [
            "plan",
            "--model",
            "llama3-405b",
            "--gpus",
            "16384",
            "--gpu",
            "h100",
            "--global-batch-size",
            "2048",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    cands = json.loads(out.output)["candidates"]
    assert cands and all(
        c["fits"] and c["command"].startswith("shardsmith train --model llama3-405b") for c in cands
    )


@pytest.mark.distributed
def test_planner_flags_start_a_real_run(tmp_path: Path, data_path: str) -> None:
    model = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--ffn-hidden-size",
        "64",
        "--vocab-size",
        "256",
        "--seq-length",
        "32",
    ]
    out = CliRunner().invoke(
        cli,
        [
            "plan",
            *model,
            "--gpus",
            "2",
            "--gpus-per-node",
            "2",
            "--gpu",
            "h100",
            "--global-batch-size",
            "4",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    flags = json.loads(out.output)["candidates"][0]["flags"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            *flags,
            "--nproc-per-node",
            "2",
            "--steps",
            "2",
            "--data",
            data_path,
            "--ckpt",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step" in run.stdout + run.stderr


def test_a_series_of_fixes_names_each_flag_once() -> None:
    """The cumulative fix of a config no single change fits (70B tp1·pp2·dps8 on 80 GB) names
    every flag once, with its last value: ``--tp 8 --dp-shard 1``, not ``--tp 2 ... --tp 4 ... --tp 8``."""
    assert merge_flags(
        [
            "--micro-batch-size 1",
            "--tp 2 --dp-shard 4",
            "--sequence-parallel",
            "--tp 4 --dp-shard 2",
        ]
    ) == ["--micro-batch-size 1", "--tp 4", "--dp-shard 2", "--sequence-parallel"]
    m = resolve_model("llama3-70b", {})
    job = Job(m, ParallelDims(pp=2, dp_shard=8), micro_batch_size=2, global_batch_size=16)
    for fix in fixes(job, 80 * 10**9):
        names = [c.split()[0] for c in fix["changes"]]
        assert len(names) == len(set(names)), fix["changes"]
