"""``shardsmith plan`` searches context parallelism for long sequences (and only for them), the
cost model charges CP's K/V traffic, and ``train --dry-run --gpu`` prints ``plan``'s step."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.layout import ParallelDims, check_sequence_split
from shardsmith.sizing import gpu, search, step_traffic
from shardsmith.sizing.cost import LINK_EFFICIENCY
from shardsmith.sizing.presets import resolve_model
from shardsmith.sizing.verdict import max_peak

H100 = gpu("h100")


def test_cp_traffic_by_hand() -> None:
    m = resolve_model("llama3.1-405b", {})  # 131,072 tokens, 8 kv heads of 128
    dims = ParallelDims(tp=8, cp=16, dp_shard=16)
    kv = 2 * 131072 * 1 * 128 * 2  # K and V of one kv head (8 kv heads / tp 8), bf16: 64 MiB

    def cp_bytes(ac: bool) -> float:
        return step_traffic(
            m,
            dims,
            pp_rank=0,
            micro_batch_size=1,
            num_microbatches=2,
            mixed_precision="bf16",
            activation_checkpointing=ac,
        )["cp"]

    # per layer and microbatch: the all-gather and the backward's reduce-scatter, 15/16 each;
    # full recomputation gathers once more
    assert cp_bytes(False) == 2 * 126 * 2 * kv * 15 / 16
    assert cp_bytes(True) == 2 * 126 * 3 * kv * 15 / 16


def test_plan_finds_a_context_parallel_layout_at_128k(monkeypatch: pytest.MonkeyPatch) -> None:
    m = resolve_model("llama3.1-405b", {})
    assert search.cp_degrees(m, 256) == [1, 2, 4, 8, 16]  # 8,192 tokens per rank at cp 16
    best = search.plan(m, 2048, 8, H100, 16, top=1)[0]
    d = best.job.dims
    assert d.cp > 1 and d.world_size == 2048
    check_sequence_split(m.seq_length, d, best.job.sequence_parallel)
    assert max_peak(best.job.estimate()) <= H100.memory_nbytes  # every rank group
    # the cost model charges the K/V exchange: over the network once tp * cp leaves a node
    cp_bytes = step_traffic(
        m,
        d,
        pp_rank=0,
        micro_batch_size=best.job.micro_batch_size,
        num_microbatches=16 // (best.job.micro_batch_size * d.dp),
        mixed_precision="bf16",
        activation_checkpointing=best.job.activation_checkpointing,
    )["cp"]
    link = H100.nvlink_bytes_per_s if d.tp * d.cp <= 8 else H100.network_bytes_per_s
    assert cp_bytes > 0 and best.cost.cp_comm_s == pytest.approx(
        cp_bytes / (link * LINK_EFFICIENCY)
    )
    # without CP the fastest layout that fits is a 1-microbatch pipeline: over 10x slower
    monkeypatch.setattr(search, "MIN_TOKENS_PER_CP_RANK", 10**9)
    no_cp = search.plan(m, 2048, 8, H100, 16, top=1)[0]
    assert no_cp.job.dims.cp == 1 and no_cp.cost.step_s > 10 * best.cost.step_s


def test_short_sequences_never_use_cp() -> None:
    m = resolve_model("llama3-8b", {"seq_length": 8192})
    assert search.cp_degrees(m, 1024) == [1]
    assert all(c.job.dims.cp == 1 for c in search.plan(m, 64, 8, H100, 256))
    # 32K: cp up to 4 where the ranks allow it, never past what divides them
    long = resolve_model("llama3-8b", {"seq_length": 32768})
    assert search.cp_degrees(long, 64) == [1, 2, 4] and search.cp_degrees(long, 6) == [1, 2]


def test_dry_run_prints_the_plans_step() -> None:
    args = ["plan", "--model", "llama3.1-8b", "--gpus", "64", "--gpu", "h100"]
    out = CliRunner().invoke(cli, [*args, "--global-batch-size", "32", "--top", "1", "--json"])
    assert out.exit_code == 0, out.output
    cand = json.loads(out.output)["candidates"][0]
    assert "--cp" in cand["flags"]  # 131,072 tokens: the planner splits the sequence
    dry = ["train", *cand["flags"], "--dry-run", "--gpu", "h100"]
    report = json.loads(CliRunner().invoke(cli, [*dry, "--json"]).output)
    assert report["step_cost"]["cost_s"] == cand["cost_s"]
    assert report["step_cost"]["mfu"] == cand["mfu"] and report["fits"] is True
    text = CliRunner().invoke(cli, dry).output
    assert "step: compute " in text and ", CP " in text and "exposed FSDP" in text, text
    no_gpu = json.loads(CliRunner().invoke(cli, [*dry[:-2], "--json"]).output)
    assert "step_cost" not in no_gpu  # no accelerator named, no step time


def test_a_split_of_virtual_stages_is_accepted_as_plan_prints_it() -> None:
    # plan prints --virtual-stages with a --pipeline-split of pp * v counts (balanced_split)
    split = ",".join(map(str, search.balanced_split(6, 4)))
    args = ["train", "--num-layers", "6", "--pp", "2", "--virtual-stages", "2", "--dp-shard", "1"]
    out = CliRunner().invoke(cli, [*args, "--pipeline-split", split, "--dry-run", "--json"])
    assert out.exit_code == 0, out.output
    parallel = json.loads(out.output)["parallel"]
    assert parallel["pipeline_split"] == [1, 2, 2, 1] and parallel["virtual_stages"] == 2
