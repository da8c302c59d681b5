"""Tiny Hugging Face models saved by ``transformers`` itself, for export/import tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def save_hf_llama(path: Path, *, tied: bool, **overrides: object) -> torch.nn.Module:
    """A random tiny Llama saved by transformers itself (norms randomized too, so a
    swapped norm would show)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=tied,
        **overrides,
    )
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(str(path))
    return hf
