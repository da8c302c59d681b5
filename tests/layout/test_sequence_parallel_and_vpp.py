"""Sequence parallelism and virtual pipeline stages in the pure layout code and the CLI
(no processes): chunk assignment, plan stage ownership, dry-run figures, flags."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims, chunk_layers, stage_layers
from shardsmith.layout.assignment import write_assignment
from shardsmith.layout.sharding import param_specs, rank_boxes
from shardsmith.sizing.estimate import activation_nbytes_per_layer, estimate

MODEL = ModelConfig(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=64,
)


def test_virtual_chunks_are_interleaved_as_megatron_assigns_them() -> None:
    dims = ParallelDims(pp=2, virtual_stages=2)
    assert dims.num_chunks == 4 and dims.chunk_ids(0) == (0, 2) and dims.chunk_ids(1) == (1, 3)
    assert chunk_layers(MODEL, dims) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(MODEL, dims) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    specs = param_specs(MODEL, dims)
    assert specs["layers.4.attention.wq.weight"].stages == (0,)
    assert specs["layers.2.feed_forward.w1.weight"].stages == (1,)
    assert specs["tok_embeddings.weight"].stages == (0,) and specs["output.weight"].stages == (1,)


def test_virtual_stages_change_no_box_or_name() -> None:
    """The checkpoint is layout-independent: pp2 and pp2·v2 hold the same boxes of the same
    FQNs (only which pp rank holds a layer differs)."""
    plain, virtual = ParallelDims(pp=2, tp=2), ParallelDims(pp=2, tp=2, virtual_stages=2)
    a, b = param_specs(MODEL, plain), param_specs(MODEL, virtual)
    assert sorted(a) == sorted(b)
    for fqn in a:
        assert (a[fqn].shape, a[fqn].dim_axes) == (b[fqn].shape, b[fqn].dim_axes)
    written = {k for items in write_assignment(b, virtual).values() for k in items}
    assert written == {k for items in write_assignment(a, plain).values() for k in items}
    assert "layers.4.attention.wq.weight" in rank_boxes(b, virtual, 0)  # chunk 2 on pp rank 0
    assert "layers.4.attention.wq.weight" not in rank_boxes(a, plain, 0)


def test_virtual_stage_layout_errors() -> None:
    with pytest.raises(ConfigError, match="needs pp >= 2"):
        ParallelDims(virtual_stages=2)
    with pytest.raises(ConfigError, match="needs 4"):
        ParallelDims(pp=2, virtual_stages=2, pipeline_split=(4, 4))
    assert (
        ParallelDims.from_json(ParallelDims(pp=2, virtual_stages=3).to_json()).virtual_stages == 3
    )
    assert (
        ParallelDims.from_json({"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}).virtual_stages
        == 1
    )


def test_bubble_fraction_shrinks_by_the_virtual_stages() -> None:
    kw = {"micro_batch_size": 1, "global_batch_size": 8}
    assert estimate(MODEL, ParallelDims(pp=4), **kw).pipeline_bubble_fraction == 3 / 8
    assert (
        estimate(MODEL, ParallelDims(pp=4, virtual_stages=2), **kw).pipeline_bubble_fraction
        == 3 / 16
    )


def test_sequence_parallel_activation_formula() -> None:
    """sizing/activations.py at 16 bit: per token 2(4h + 4h) + 10q/t + 8f/t without SP, the norms
    over t and the gathered linear input whole with SP: 2((4h + 2h)/t + 2h) + 10q/t + 8f/t;
    2sbh vs 2sbh/t under full recomputation."""
    s, b, h, t = 64, 2, 64, 2
    f = MODEL.ffn_hidden_size
    assert activation_nbytes_per_layer(MODEL, b, t) == int(
        s * b * (16 * h + 10 * h / t + 8 * f / t)
    )
    assert activation_nbytes_per_layer(MODEL, b, t, sequence_parallel=True) == int(
        s * b * (2 * (6 * h / t + 2 * h) + 10 * h / t + 8 * f / t)
    )
    assert (
        activation_nbytes_per_layer(MODEL, b, t, recompute=True, sequence_parallel=True)
        == s * b * h
    )
    assert activation_nbytes_per_layer(
        MODEL, b, 1, sequence_parallel=True
    ) == activation_nbytes_per_layer(MODEL, b, 1)


FLAGS = [
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--ffn-hidden-size",
    "128",
    "--vocab-size",
    "256",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--dry-run",
    "--json",
]


def _dry_run(*extra: str) -> dict:
    import json

    result = CliRunner().invoke(cli, ["train", *FLAGS, *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_dry_run_flags() -> None:
    tp = _dry_run("--tp", "2", "--nproc-per-node", "2")
    sp = _dry_run("--tp", "2", "--nproc-per-node", "2", "--sequence-parallel")
    assert sp["roles"][0]["activation_nbytes"] < tp["roles"][0]["activation_nbytes"]
    vp = _dry_run(
        "--pp", "2", "--nproc-per-node", "2", "--num-layers-per-virtual-pipeline-stage", "2"
    )
    assert vp["parallel"]["virtual_stages"] == 2 and vp["pipeline_bubble_fraction"] == 1 / 16
    assert (
        _dry_run("--pp", "2", "--nproc-per-node", "2", "--virtual-stages", "4")["parallel"][
            "virtual_stages"
        ]
        == 4
    )
    bad = CliRunner().invoke(
        cli,
        [
            "train",
            *FLAGS,
            "--pp",
            "2",
            "--nproc-per-node",
            "2",
            "--virtual-stages",
            "2",
            "--pipeline-schedule",
            "1f1b",
        ],
    )
    assert bad.exit_code != 0 and "runs one stage per rank" in bad.output
    bad = CliRunner().invoke(
        cli,
        [
            "train",
            *FLAGS,
            "--pp",
            "2",
            "--nproc-per-node",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "3",
        ],
    )
    assert bad.exit_code != 0 and "multiple of pp=2 x 3" in bad.output


def test_schedule_names_match_the_torch_table() -> None:
    from shardsmith.trainer.config import PIPELINE_SCHEDULES
    from shardsmith.trainer.pipeline import SCHEDULES

    assert tuple(SCHEDULES) == PIPELINE_SCHEDULES


def test_compiled_blocks_keep_checkpoint_names_and_values() -> None:
    """``--compile`` compiles each block in place: the FQNs the checkpoint code reads
    (``named_parameters``) and the state_dict keys carry no ``_orig_mod.``, and the compiled
    model computes what the uncompiled one does. (Dynamo with the ``eager`` backend: inductor's
    C++ codegen takes minutes per block on this CPU box; the FQN mapping does not depend on it.)"""
    import torch

    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.parallel import apply_compile
    from shardsmith.trainer.weight_init import init_weights

    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        vocab_size=256,
        seq_length=16,
    )
    plain, compiled = Transformer(cfg), Transformer(cfg)
    init_weights(plain, 7)
    init_weights(compiled, 7)
    apply_compile(compiled, backend="eager")
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in compiled.named_parameters()] == names
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert not any("_orig_mod" in n for n in compiled.state_dict())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(x), plain(x), rtol=1e-6, atol=1e-6)
    compiled.load_state_dict(plain.state_dict())  # each loads the other's names
    plain.load_state_dict(compiled.state_dict())


def test_moe_plan_stores_experts_with_a_leading_expert_dim() -> None:
    import dataclasses

    moe = dataclasses.replace(
        MODEL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_layer_freq=2
    )
    specs = param_specs(moe, ParallelDims(dp_shard=2, tp=2))
    assert specs["layers.0.feed_forward.experts.w1"].shape == (4, 96, 64)
    assert specs["layers.0.feed_forward.experts.w2"].shape == (4, 64, 96)
    assert specs["layers.0.feed_forward.router.weight"].shape == (4, 64)
    assert "layers.0.feed_forward.w1.weight" not in specs
    assert specs["layers.1.feed_forward.w1.weight"].shape == (128, 64)  # freq 2: layer 1 dense
    box = specs["layers.2.feed_forward.experts.w3"].box(
        ParallelDims(dp_shard=2, tp=2), {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "tp": 0}
    )
    assert box.offsets == (2, 0, 0) and box.lengths == (2, 48, 64)  # experts 2, 3; F split by tp
    assert specs["layers.2.feed_forward.experts.w2"].dim_axes == (
        ("dp_shard", "cp"),
        (),
        ("tp",),
    )  # row-parallel
    assert specs["layers.2.feed_forward.experts.w1"].dim_axes == (
        ("dp_shard", "cp"),
        ("tp",),
        (),
    )  # column-parallel
    assert "num_experts" not in MODEL.to_json() and moe.to_json()["num_experts"] == 4
    assert ModelConfig.from_json(moe.to_json()) == moe
    with pytest.raises(ConfigError, match="moe_router_topk"):
        dataclasses.replace(MODEL, num_experts=2, moe_router_topk=3)


def test_moe_flags_reach_the_model() -> None:
    out = _dry_run(
        "--num-experts",
        "4",
        "--moe-router-topk",
        "1",
        "--moe-ffn-hidden-size",
        "32",
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-layer-freq",
        "2",
    )
    assert {
        k: out["model"][k]
        for k in (
            "num_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "moe_aux_loss_coeff",
            "moe_layer_freq",
        )
    } == {
        "num_experts": 4,
        "moe_router_topk": 1,
        "moe_ffn_hidden_size": 32,
        "moe_aux_loss_coeff": 0.01,
        "moe_layer_freq": 2,
    }
    moe = ("--num-experts", "4", "--nproc-per-node", "2", "--tp", "2")
    assert _dry_run(*moe, "--expert-tensor-parallel-size", "2")["moe"]["expert_ffn_per_rank"] == 64
    bad = CliRunner().invoke(cli, ["train", *FLAGS, *moe, "--expert-tensor-parallel-size", "1"])
    assert (
        bad.exit_code != 0
        and "--expert-tensor-parallel-size 1" in bad.output
        and "use 2" in bad.output
    )


def test_expert_parallel_layout_rules() -> None:
    import dataclasses

    from shardsmith.errors import LayoutError
    from shardsmith.layout import validate_layout

    moe = dataclasses.replace(MODEL, num_experts=4)
    dims = ParallelDims(dp_shard=2, expert_parallel=2)
    validate_layout(moe, dims)
    assert param_specs(moe, dims) == param_specs(
        moe, ParallelDims(dp_shard=2)
    )  # same boxes: same files
    with pytest.raises(LayoutError, match="needs a MoE model"):
        validate_layout(MODEL, dims)
    with pytest.raises(LayoutError, match="num_experts=3"):
        validate_layout(dataclasses.replace(MODEL, num_experts=3, moe_router_topk=1), dims)
    with pytest.raises(ConfigError, match="use 1 or dp_shard=4"):
        ParallelDims(dp_shard=4, expert_parallel=2)
    assert (
        ParallelDims.from_json(dims.to_json()) == dims
        and "expert_parallel" not in ParallelDims().to_json()
    )


def test_moe_flops_count_only_the_routed_experts() -> None:
    import dataclasses

    from shardsmith.layout.flops import flops_per_token

    dense = flops_per_token(MODEL)
    moe = dataclasses.replace(
        MODEL, num_experts=4, moe_router_topk=1
    )  # 1 of 4 experts = the dense FFN
    assert (
        flops_per_token(moe) == dense + 6 * MODEL.num_layers * 4 * MODEL.hidden_size
    )  # + the routers


def test_dry_run_covers_moe_and_interleaving() -> None:
    moe = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96")
    dense_ep = _dry_run(*moe, "--nproc-per-node", "2")["moe"]
    ep = _dry_run(*moe, "--nproc-per-node", "4", "--tp", "2", "--ep", "2")
    assert (
        dense_ep["experts_per_rank"] == 4 and dense_ep["dispatch_nbytes_per_layer_microbatch"] == 0
    )
    assert ep["moe"]["experts_per_rank"] == 2 and ep["moe"]["expert_ffn_per_rank"] == 48
    s, b, k, h = 64, 1, 2, 64  # 4 s b K h (ep-1)/ep values, fp32
    assert ep["moe"]["dispatch_nbytes_per_layer_microbatch"] == 4 * s * b * k * h // 2 * 4
    assert ep["moe"]["expert_params"] == 8 * 3 * 4 * 96 * 64 and "moe" not in _dry_run()
    pp = _dry_run("--pp", "2", "--nproc-per-node", "2")["roles"][0]["activation_nbytes"]
    vp = _dry_run("--pp", "2", "--nproc-per-node", "2", "--virtual-stages", "2")["roles"][0][
        "activation_nbytes"
    ]
    assert vp > pp  # interleaving keeps more in flight
