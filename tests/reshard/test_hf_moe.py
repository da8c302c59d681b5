"""Mixtral-layout Hugging Face export/import of a MoE checkpoint (no processes).

A MoE checkpoint saved EP2 exports as ``MixtralForCausalLM`` (per-expert matrices), which
``transformers`` loads with logits equal to shardsmith's forward; importing the export into
EP2·TP2 gives back every tensor bitwise."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, assert_tensors_bitwise_equal, read_full_tensors

from shardsmith.errors import ConfigError
from shardsmith.layout import ParallelDims
from shardsmith.layout.sharding import param_specs
from shardsmith.reshard.foreign.hf import expert_hf_names, hf_config, model_config_from_hf

MOE = dataclasses.replace(TINY_MODEL, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.02)


def test_mixtral_names_and_config() -> None:
    assert expert_hf_names("layers.3.feed_forward.experts.w2", 2) == [
        "model.layers.3.block_sparse_moe.experts.0.w2.weight",
        "model.layers.3.block_sparse_moe.experts.1.w2.weight",
    ]
    assert expert_hf_names("layers.3.feed_forward.router.weight", 2) is None
    cfg = hf_config(MOE, "float32")
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (
        "mixtral",
        4,
        2,
    )
    back = model_config_from_hf(cfg)
    assert (
        back.num_experts,
        back.moe_router_topk,
        back.expert_ffn_size,
        back.moe_aux_loss_coeff,
    ) == (4, 2, 64, 0.02)
    with pytest.raises(ConfigError, match="moe_layer_freq=2"):
        hf_config(dataclasses.replace(MOE, moe_layer_freq=2), "float32")
    with pytest.raises(ConfigError, match="sliding_window"):
        model_config_from_hf({**cfg, "sliding_window": 4096})


def test_moe_checkpoint_exports_as_mixtral_and_imports_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from shardsmith.reshard.foreign.hf_io import export_hf, import_hf
    from shardsmith.reshard.foreign.write import write_checkpoint
    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.weight_init import init_box

    specs = param_specs(MOE, ParallelDims())
    write_checkpoint(
        str(tmp_path / "ck"),
        MOE,
        ParallelDims(dp_shard=2, expert_parallel=2),
        lambda fqn, box: init_box(fqn, specs[fqn].shape, box, 7, MOE),
        state={"step": 3},
        config={"model": MOE.to_json()},
        with_optimizer=False,
    )
    src = str(tmp_path / "ck" / "step-000000003")
    export_hf(src, str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "MixtralForCausalLM"
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    )
    assert type(hf).__name__ == "MixtralForCausalLM"
    full = read_full_tensors(src)
    ours = Transformer(MOE)
    ours.load_state_dict(full)
    tokens = torch.randint(
        0, MOE.vocab_size, (2, MOE.seq_length), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)

    import_hf(
        str(tmp_path / "hf"),
        str(tmp_path / "back"),
        ParallelDims(dp_shard=2, tp=2, expert_parallel=2),
    )
    back = read_full_tensors(str(tmp_path / "back" / "step-000000000"))
    assert_tensors_bitwise_equal(back, full, "Mixtral export -> import EP2·TP2")
