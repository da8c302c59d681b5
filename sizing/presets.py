"""Named model shapes (``--model NAME``) and the defaults a partial shape takes.

Published shapes, checked against the models' ``config.json`` on the Hugging Face Hub and
Table 3 of "The Llama 3 Herd of Models" (Meta, 2024) / Table 1 of "Llama 2" (Touvron et al.
2023). Pure: no torch, no I/O.

Resolution (:func:`resolve_model`): the preset (``tiny`` when none is named) with every
explicitly given field replacing the preset's. Without a preset, a given ``hidden_size``
also sets ``ffn_hidden_size`` by the Llama rule (:func:`llama_ffn_hidden_size`) and a given
``num_attention_heads`` sets ``num_kv_heads`` to the same count (no GQA, Megatron's
default), unless those are given too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig

#: Round the SwiGLU width up to a multiple of this (Meta's Llama reference ``multiple_of``).
FFN_MULTIPLE_OF = 256


def llama_ffn_hidden_size(
    hidden_size: int, multiple_of: int = FFN_MULTIPLE_OF, ffn_dim_multiplier: float | None = None
) -> int:
    """SwiGLU inner width for model width D, as Meta's Llama ``FeedForward`` computes it:
    ``int(2 * 4 * D / 3)`` (times ``ffn_dim_multiplier`` when given), rounded up to a
    multiple of ``multiple_of``. D = 4096 gives 11008 (Llama 2 7B); Llama 3 8B's 14336 is
    D = 4096 with multiplier 1.3 and multiple_of 1024.
    """
    width = int(2 * 4 * hidden_size / 3)
    if ffn_dim_multiplier is not None:
        width = int(ffn_dim_multiplier * width)
    return multiple_of * -(-width // multiple_of)


def _llama(
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    ffn: int,
    vocab: int,
    theta: float,
    seq: int,
    rope_scaling_factor: float = 0.0,
) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=seq,
        tie_embeddings=False,
        rope_theta=theta,
        norm_eps=1e-5,
        rope_scaling_factor=rope_scaling_factor,
    )


#: ``--model`` name -> shape. seq_length is the pre-training context (8192 / 4096); Llama 3.1's
#: is its 128K long-context length, with RoPE scaled as its ``config.json`` says
#: (``rope_type "llama3"``, factor 8, low/high frequency factors 1 and 4, original 8192).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "debug": ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=192,
        vocab_size=256,
        seq_length=64,
    ),
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 10000.0, 4096),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 10000.0, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 500000.0, 8192),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 500000.0, 8192),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256, 500000.0, 8192),
    "llama3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, 500000.0, 131072, 8.0),
    "llama3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, 500000.0, 131072, 8.0),
    "llama3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, 500000.0, 131072, 8.0),
}

#: The model when no ``--model`` and no shape flag is given.
DEFAULT_PRESET = "tiny"


def resolve_model(preset: str | None, given: dict[str, Any]) -> ModelConfig:
    """The model of ``--model preset`` plus the explicitly ``given`` fields (see module doc).

    Args:
        preset: a :data:`PRESETS` name, or None (``tiny`` with the Llama defaults above).
        given: ModelConfig field -> value, only for flags the user set.

    Raises:
        ConfigError: unknown preset or field, or a shape ModelConfig refuses.
    """
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"--model {preset!r}: unknown preset; choose one of {', '.join(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"unknown model fields {unknown}; known: {sorted(known)}")
    fields = dict(given)
    if preset is None:
        if "hidden_size" in given and "ffn_hidden_size" not in given:
            fields["ffn_hidden_size"] = llama_ffn_hidden_size(given["hidden_size"])
        if "num_attention_heads" in given and "num_kv_heads" not in given:
            fields["num_kv_heads"] = given["num_attention_heads"]
    return dataclasses.replace(PRESETS[preset or DEFAULT_PRESET], **fields)


def preset_of(model: ModelConfig) -> str | None:
    """The preset name whose shape equals ``model`` (sequence length aside), or None."""
    for name, shape in PRESETS.items():
        if dataclasses.replace(shape, seq_length=model.seq_length) == model:
            return name
    return None
