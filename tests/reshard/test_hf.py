"""Hugging Face export/import: names, RoPE permutation, configs, and logits against transformers.

The integration tests run ``transformers`` offline (HF_HUB_OFFLINE=1) on tiny models:
a checkpoint trained TP2·PP2 by shardsmith (one 4-process launch) exported and loaded by
``LlamaForCausalLM.from_pretrained``, and a model made and saved by ``transformers``
imported into TP2·PP2; both must give the same logits as shardsmith's own forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_models import save_hf_llama
from safetensors import safe_open

from shardsmith.cli.main import cli
from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import param_specs, rank_boxes
from shardsmith.layout.sizes import parse_nbytes
from shardsmith.reshard.foreign.hf import (
    from_hf_name,
    hf_config,
    model_config_from_hf,
    permute_from_hf,
    permute_to_hf,
    to_hf_name,
)
from shardsmith.reshard.foreign.hf_io import WeightEntry, plan_weight_files
from shardsmith.storage.commit import read_manifest, resolve_checkpoint
from shardsmith.storage.formats.registry import read_box
from shardsmith.trainer.checkpoint.save_load import load_into
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.model import Transformer, apply_rope, rope_tables

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)
TOL = dict(atol=1e-4, rtol=1e-4)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


# ---- pure -------------------------------------------------------------------------------------


def test_names_map_both_ways_and_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    for tied in (False, True):
        model = ModelConfig(**TINY, tie_embeddings=tied)
        ours = list(param_specs(model, ParallelDims()))
        assert [from_hf_name(to_hf_name(f)) for f in ours] == ours
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig.from_dict(hf_config(model, "float32"))
        )
        hf_names = {n for n, _ in hf.named_parameters()}  # tied lm_head is not listed twice
        assert {to_hf_name(f) for f in ours} == hf_names
    assert to_hf_name("layers.1.feed_forward.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert (
        to_hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    with pytest.raises(KeyError, match="q_proj.bias"):
        from_hf_name("model.layers.0.self_attn.q_proj.bias")


def test_permutation_is_convert_llama_weights_permute_and_inverts() -> None:
    heads, hd, d = 3, 8, 5
    w = torch.arange(heads * hd * d, dtype=torch.float32).reshape(heads * hd, d)
    hf = permute_to_hf(w, heads)
    # HF row h*Dh + j is our row h*Dh + 2j (first half) or h*Dh + 2(j - Dh/2) + 1 (second half)
    for h in range(heads):
        for j in range(hd):
            src = h * hd + (2 * j if j < hd // 2 else 2 * (j - hd // 2) + 1)
            assert torch.equal(hf[h * hd + j], w[src])
    assert torch.equal(permute_from_hf(hf, heads), w)


def test_rope_scores_agree_with_transformers_rotate_half() -> None:
    """q·k after our interleaved RoPE on W equals q·k after HF's rotate_half RoPE on permute(W)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    heads, hd, d, t = 2, 8, 16, 6
    gen = torch.Generator().manual_seed(0)
    wq, wk, x = (
        torch.randn(heads * hd, d, generator=gen),
        torch.randn(heads * hd, d, generator=gen),
        torch.randn(1, t, d, generator=gen),
    )
    cos, sin = rope_tables(hd, t, 10000.0)
    q = apply_rope((x @ wq.T).view(1, t, heads, hd), cos, sin)
    k = apply_rope((x @ wk.T).view(1, t, heads, hd), cos, sin)
    ours = torch.einsum("bqhd,bkhd->bhqk", q, k)
    hcos, hsin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # (1, T, Dh)
    hq = (x @ permute_to_hf(wq, heads).T).view(1, t, heads, hd).transpose(1, 2)
    hk = (x @ permute_to_hf(wk, heads).T).view(1, t, heads, hd).transpose(1, 2)
    hq, hk = llama.apply_rotary_pos_emb(hq, hk, hcos, hsin)
    torch.testing.assert_close(hq @ hk.transpose(-1, -2), ours, atol=1e-5, rtol=1e-5)


def test_config_round_trip() -> None:
    model = ModelConfig(**TINY, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6)
    assert model_config_from_hf(hf_config(model, "bfloat16")) == model


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("attention_bias", True, "attention_bias"),
        ("mlp_bias", True, "mlp_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("head_dim", 16, "head_dim"),
        ("model_type", "mistral", "model_type"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling"),
        (
            "rope_parameters",
            {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5},
            "rope_parameters",
        ),
    ],
)
def test_unrepresentable_config_names_the_field(field: str, value: object, named: str) -> None:
    cfg = hf_config(ModelConfig(**TINY), "float32")
    cfg[field] = value
    with pytest.raises(ConfigError, match=named):
        model_config_from_hf(cfg)


def test_sizes_and_file_split() -> None:
    assert parse_nbytes("5GB") == 5 * 10**9 and parse_nbytes("2MiB") == 2 * 2**20
    assert parse_nbytes(1000) == 1000
    with pytest.raises(ValueError, match="size"):
        parse_nbytes("5 parsecs")
    entries = [WeightEntry(f"t{i}", f"t{i}", (n,)) for i, n in enumerate([10, 10, 30, 5, 5])]
    split = plan_weight_files(entries, 4, 80)
    assert [[e.hf_name for e in f] for f in split] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


# ---- integration with transformers ------------------------------------------------------------


def _full_params(ckpt: str) -> dict[str, torch.Tensor]:
    _, step_store, _ = resolve_checkpoint(ckpt)
    m = read_manifest(step_store)
    return {
        f: read_box(step_store, m, f, Box((0,) * len(r.shape), tuple(r.shape)))
        for f, r in m.tensors.items()
        if not f.startswith("optim.")
    }


def _shardsmith_logits(model: ModelConfig, params: dict[str, torch.Tensor]) -> torch.Tensor:
    net = Transformer(model)
    net.load_state_dict(params, strict=True)
    with torch.no_grad():
        return net(_tokens())


def _hf_logits(hf_dir: Path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        return hf(input_ids=_tokens()).logits


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.fixture(scope="module")
def trained_tp2_pp2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint trained 3 steps with TP2·PP2 on 4 processes (one torchrun launch)."""
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            "--nproc-per-node",
            "4",
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp-shard",
            "1",
            *flags,
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
            "--steps",
            "3",
            "--ckpt",
            str(root),
        ],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
    )
    return str(root)


@pytest.mark.distributed
def test_trained_tp2_pp2_export_loads_in_transformers(trained_tp2_pp2: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    result = CliRunner().invoke(
        cli, ["export-hf", trained_tp2_pp2, str(out), "--max-shard-size", "20KB"]
    )
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert not (out / "model.safetensors").exists()
    params = _full_params(trained_tp2_pp2)
    model = ModelConfig(**TINY)
    hf = _hf_tensors(out)
    assert set(hf) == {to_hf_name(f) for f in params} and "lm_head.weight" in hf
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf.values())
    torch.testing.assert_close(_hf_logits(out), _shardsmith_logits(model, params), **TOL)

    again = CliRunner().invoke(cli, ["export-hf", trained_tp2_pp2, str(out), "--dtype", "bf16"])
    assert again.exit_code == 1 and "--overwrite" in again.output
    again = CliRunner().invoke(
        cli, ["export-hf", trained_tp2_pp2, str(out), "--dtype", "bf16", "--overwrite"]
    )
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 16
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        emb = st.get_tensor("model.embed_tokens.weight")
    assert torch.equal(emb, params["tok_embeddings.weight"].to(torch.bfloat16))


def test_transformers_model_imported_tp2_pp2_gives_same_logits(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    save_hf_llama(src, tied=False)
    ckpt = tmp_path / "ckpt"
    result = CliRunner().invoke(
        cli, ["import-hf", str(src), str(ckpt), "--tp", "2", "--pp", "2", "--dp-shard", "1"]
    )
    assert result.exit_code == 0, result.output
    assert (
        f"imported {src} as step 0 in pp2·dpr1·dps1·tp2 (model weights only): 4 files"
        in result.output
    )
    _, step_store, step = resolve_checkpoint(str(ckpt))
    manifest = read_manifest(step_store)
    assert step == 0 and manifest.state["step"] == 0
    assert not any(f.startswith("optim.") for f in manifest.tensors)
    assert len(manifest.files) == 4 and manifest.layout["tp"] == 2 and manifest.layout["pp"] == 2
    cfg = TrainConfig.from_json(manifest.config)
    model = cfg.model
    assert model == ModelConfig(**TINY, rope_theta=500000.0, norm_eps=1e-5)
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)

    # every rank of TP2·PP2 loads its boxes (params only) with the trainer's load_into
    dims = ParallelDims(tp=2, pp=2)
    specs = param_specs(model, dims)
    full = {f: torch.full(s.shape, float("nan")) for f, s in specs.items()}
    for rank in range(dims.world_size):
        boxes = rank_boxes(specs, dims, rank)
        local = {f: torch.empty(b.lengths) for f, b in boxes.items()}
        load_into(step_store, manifest, local, boxes, {f: s.shape for f, s in specs.items()})
        for f, b in boxes.items():
            full[f][b.relative_to(Box((0,) * len(b.offsets), specs[f].shape))] = local[f]
    assert not any(t.isnan().any() for t in full.values())
    torch.testing.assert_close(_shardsmith_logits(model, full), _hf_logits(src), **TOL)

    # boxes that cut heads (dp_shard=3 over 16-row TP halves of 8-row heads) read the same values
    other = tmp_path / "dps3"
    result = CliRunner().invoke(
        cli, ["import-hf", str(src), str(other), "--tp", "2", "--dp-shard", "3"]
    )
    assert result.exit_code == 0, result.output
    cut = _full_params(str(other))
    assert set(cut) == set(full) and all(torch.equal(cut[f], full[f]) for f in full)

    # and back out again: bitwise the tensors transformers saved
    out = tmp_path / "back"
    assert CliRunner().invoke(cli, ["export-hf", str(ckpt), str(out)]).exit_code == 0
    original, back = _hf_tensors(src), _hf_tensors(out)
    assert set(original) == set(back)
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    save_hf_llama(src, tied=True)
    ckpt = tmp_path / "ckpt" / "step-000000007"
    result = CliRunner().invoke(cli, ["import-hf", str(src), str(ckpt), "--tp", "2"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(resolve_checkpoint(str(ckpt))[1])
    assert manifest.step == 7 and "output.weight" not in manifest.tensors
    out = tmp_path / "back"
    assert CliRunner().invoke(cli, ["export-hf", str(ckpt), str(out)]).exit_code == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    back = _hf_tensors(out)
    assert "lm_head.weight" not in back
    original = _hf_tensors(src)
    assert all(torch.equal(original[k], back[k]) for k in back)
    torch.testing.assert_close(_hf_logits(out), _hf_logits(src), atol=0, rtol=0)
    model = ModelConfig(**TINY, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5)
    torch.testing.assert_close(
        _shardsmith_logits(model, _full_params(str(ckpt))), _hf_logits(src), **TOL
    )


def test_import_refuses_what_shardsmith_cannot_represent(tmp_path: Path) -> None:
    biased = tmp_path / "biased"
    save_hf_llama(biased, tied=False, attention_bias=True)
    result = CliRunner().invoke(cli, ["import-hf", str(biased), str(tmp_path / "c1")])
    assert result.exit_code == 1 and "attention_bias" in result.output

    scaled = tmp_path / "scaled"
    save_hf_llama(scaled, tied=False)
    config = json.loads((scaled / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["import-hf", str(scaled), str(tmp_path / "c2")])
    assert result.exit_code == 1 and "rope_scaling" in result.output

    # weights with a bias the config does not declare: the tensor is named
    config["rope_scaling"] = None
    (scaled / "config.json").write_text(json.dumps(config))
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text(json.dumps(config))
    tensors = _hf_tensors(scaled)
    tensors["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(32)
    from safetensors.torch import save_file

    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    result = CliRunner().invoke(cli, ["import-hf", str(extra), str(tmp_path / "c3")])
    assert result.exit_code == 1 and "model.layers.1.self_attn.q_proj.bias" in result.output
    assert not (tmp_path / "c1").exists() and not (tmp_path / "c3").exists()
