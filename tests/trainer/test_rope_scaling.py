"""Llama 3.1 RoPE scaling (rope_type "llama3"): the frequencies, the presets, and a
rope-scaled model made by transformers giving the same logits after import-hf, and its
rope_scaling carried back out by export-hf."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.layout import ModelConfig
from shardsmith.layout.box import Box
from shardsmith.reshard.foreign.hf import hf_config, model_config_from_hf
from shardsmith.sizing.presets import PRESETS
from shardsmith.storage.commit import read_manifest, resolve_checkpoint
from shardsmith.storage.formats.registry import read_box
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.model import Transformer, rope_tables

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SEQ = 128


def test_presets_and_config_round_trip() -> None:
    for size, (layers, width) in {
        "8b": (32, 4096),
        "70b": (80, 8192),
        "405b": (126, 16384),
    }.items():
        m = PRESETS[f"llama3.1-{size}"]
        assert (m.num_layers, m.hidden_size, m.num_kv_heads, m.seq_length) == (
            layers,
            width,
            8,
            131072,
        )
        assert m.rope_scaling == {**SCALING, "original_max_position_embeddings": 8192}
    model = ModelConfig(seq_length=SEQ, rope_scaling_factor=8.0, rope_original_seq_length=16)
    assert model_config_from_hf(hf_config(model, "float32")) == model
    assert ModelConfig.from_json(model.to_json()) == model
    assert "rope_scaling_factor" not in ModelConfig().to_json()  # plain models: bytes unchanged


def test_scaled_frequencies_match_transformers() -> None:
    rope = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    model = ModelConfig(
        num_attention_heads=4,
        hidden_size=32,
        seq_length=SEQ,
        rope_scaling_factor=8.0,
        rope_original_seq_length=16,
    )
    hf = transformers.LlamaConfig(
        **{
            k: v
            for k, v in hf_config(model, "float32").items()
            if k not in ("architectures", "dtype", "torch_dtype")
        }
    )
    inv_freq, _ = rope.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cos, _ = rope_tables(model.head_dim, SEQ, model.rope_theta, model)
    plain, _ = rope_tables(model.head_dim, SEQ, model.rope_theta)
    want = torch.outer(torch.arange(SEQ, dtype=torch.float32), inv_freq.float()).cos()
    torch.testing.assert_close(cos, want, atol=1e-5, rtol=0)
    assert not torch.allclose(cos, plain, atol=1e-3)  # the scaling changed something


def test_transformers_rope_scaled_model_gives_our_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(SCALING),
    )
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.save_pretrained(str(src))
    result = CliRunner().invoke(cli, ["import-hf", str(src), str(ckpt)])
    assert result.exit_code == 0, result.output
    _, store, _ = resolve_checkpoint(str(ckpt))
    manifest = read_manifest(store)
    model = TrainConfig.from_json(manifest.config).model
    assert model.rope_scaling == SCALING
    net = Transformer(model)
    net.load_state_dict(
        {
            f: read_box(store, manifest, f, Box((0,) * len(r.shape), tuple(r.shape)))
            for f, r in manifest.tensors.items()
        },
        strict=True,
    )
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = net(tokens), hf(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert CliRunner().invoke(cli, ["export-hf", str(ckpt), str(out)]).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == SCALING and config["rope_parameters"]["rope_type"] == "llama3"
    back = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tokens).logits, theirs, atol=1e-5, rtol=1e-5)
