"""Model presets, the Llama defaults of a partial shape, and the dry-run estimate. Pure."""

from __future__ import annotations

import json
from math import prod

import pytest
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.flops import flops_per_token
from shardsmith.layout.sharding import param_specs
from shardsmith.sizing.estimate import activation_nbytes_per_layer, estimate
from shardsmith.sizing.presets import PRESETS, llama_ffn_hidden_size, preset_of, resolve_model


@pytest.mark.parametrize(
    "name, num_params",
    [
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("tiny", 803_968),
    ],
)
def test_preset_parameter_counts_match_the_published_models(name, num_params) -> None:
    """Counts as the models' safetensors index files report them (8.03B, 70.6B, 406B, 6.74B, 13.0B)."""
    specs = param_specs(PRESETS[name], ParallelDims())
    assert sum(prod(s.shape) for s in specs.values()) == num_params


def test_llama_ffn_rule_reproduces_the_published_widths() -> None:
    assert llama_ffn_hidden_size(4096) == 11008  # Llama 2 7B
    assert llama_ffn_hidden_size(5120) == 13824  # Llama 2 13B
    assert llama_ffn_hidden_size(4096, 1024, 1.3) == PRESETS["llama3-8b"].ffn_hidden_size
    assert llama_ffn_hidden_size(8192, 1024, 1.3) == PRESETS["llama3-70b"].ffn_hidden_size
    assert llama_ffn_hidden_size(16384, 4096, 1.2) == PRESETS["llama3-405b"].ffn_hidden_size


def test_resolve_model_rules() -> None:
    assert resolve_model(None, {}) == ModelConfig() == PRESETS["tiny"]
    m = resolve_model(None, {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 2})
    assert (m.ffn_hidden_size, m.num_kv_heads, m.num_layers) == (11008, 32, 2)
    m = resolve_model(
        None,
        {"hidden_size": 256, "ffn_hidden_size": 100, "num_attention_heads": 8, "num_kv_heads": 2},
    )
    assert (m.ffn_hidden_size, m.num_kv_heads) == (100, 2)  # explicit flags win
    assert resolve_model(None, {"num_layers": 2}) == ModelConfig(num_layers=2)
    m = resolve_model("llama3-8b", {"num_layers": 2, "hidden_size": 2048})
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_kv_heads) == (2, 2048, 14336, 8)
    assert preset_of(PRESETS["llama3-70b"]) == "llama3-70b" and preset_of(m) is None
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_model("gpt5", {})


def test_estimate_rank_roles_add_up_to_the_model() -> None:
    model = PRESETS["llama3-8b"]
    dims = ParallelDims(tp=8, pp=2, dp_shard=4, dp_replicate=2)
    est = estimate(model, dims, micro_batch_size=1, global_batch_size=64)
    assert sum(r.num_ranks for r in est.roles) == dims.world_size
    # every element is held by dp_replicate ranks (TP-replicated norms by tp of them as well)
    norms = sum(
        prod(s.shape) for f, s in param_specs(model, dims).items() if f.endswith("norm.weight")
    )
    held = sum(r.num_params * r.num_ranks for r in est.roles)
    assert held == dims.dp_replicate * (est.total_params + (dims.tp - 1) * norms)
    assert est.num_microbatches == 8 and est.pipeline_bubble_fraction == pytest.approx(
        1 / 8
    )  # 64/(1*dp 8)
    assert est.flops_per_step == flops_per_token(model) * 64 * model.seq_length
    first = est.roles[0]
    assert first.param_nbytes == 4 * first.num_params and first.optim_nbytes == 8 * first.num_params
    # shardsmith's block at bf16, t=1 (sizing/activations.py): 2 norms x (4h + 2*2h) + attention
    # 5*2*q + SwiGLU 4*2*f bytes per token = 16*4096 + 10*4096 + 8*14336 = 221,184; x 8,192 tokens
    s, h = model.seq_length, model.hidden_size
    assert activation_nbytes_per_layer(model, 1, 1) == 221_184 * 8192 == 1_811_939_328
    assert activation_nbytes_per_layer(model, 1, 1, recompute=True) == 2 * s * h


def test_estimate_groups_16384_ranks_into_few_roles() -> None:
    """Ranks with the same share are one role (the estimate's cost grows with the roles, not
    the ranks; ~0.2 s here on an idle core — speed is not asserted in tests)."""
    est = estimate(
        PRESETS["llama3-405b"],
        ParallelDims(tp=8, pp=16, dp_shard=128),
        micro_batch_size=1,
        global_batch_size=2048,
    )
    assert sum(r.num_ranks for r in est.roles) == 16384 and len(est.roles) < 64


def _dry_run(*flags: str) -> dict:
    result = CliRunner().invoke(cli, ["train", *flags, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_dry_run_json_for_llama3_presets() -> None:
    d = _dry_run("--model", "llama3-8b", "--tp", "8", "--pp", "2", "--dp-shard", "4")
    assert d["total_params"] == 8_030_261_248 and d["preset"] == "llama3-8b"
    assert d["parallel"]["world_size"] == 64 and d["model"]["num_kv_heads"] == 8
    assert {"activation", "bubble", "flops"} <= set(d["formulas"])
    d = _dry_run(
        "--model",
        "llama3-70b",
        "--tp",
        "8",
        "--pp",
        "4",
        "--dp-shard",
        "8",
        "--global-batch-size",
        "64",
    )  # 4 microbatches: 1F1B over 4 stages takes no fewer
    assert abs(d["total_params"] - 70.6e9) <= 0.005 * 70.6e9
    assert [r["stage"] for r in d["roles"]] == [0, 1, 2, 3] and d[
        "pipeline_bubble_fraction"
    ] == 0.75


def test_dry_run_llama_defaults_for_a_partial_shape() -> None:
    d = _dry_run("--hidden-size", "4096", "--num-attention-heads", "32", "--num-layers", "2")
    assert d["model"]["ffn_hidden_size"] == 11008 and d["model"]["num_kv_heads"] == 32


def test_dry_run_explicit_flag_overrides_preset_and_text_output() -> None:
    result = CliRunner().invoke(
        cli, ["train", "--model", "llama2-7b", "--num-layers", "4", "--pp", "2", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "4 layers, hidden 4096" in result.output
        and "pipeline bubble (P-1)/(V*M) = 1/(1*8)" in result.output
    )
    assert "Korthikanti" in result.output


def test_dry_run_refuses_a_bad_layout_in_one_line() -> None:
    result = CliRunner().invoke(cli, ["train", "--model", "llama3-8b", "--tp", "3", "--dry-run"])
    assert result.exit_code == 1 and result.output.startswith("error: tp=3")
    assert len(result.output.strip().splitlines()) == 1
