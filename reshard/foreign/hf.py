"""Hugging Face Llama <-> shardsmith: tensor names, the q/k row permutation, config mapping.

Pure functions, no I/O (the streaming export and import are in
:mod:`shardsmith.reshard.foreign.hf_io`).

Names (ours -> ``transformers`` ``LlamaForCausalLM``)::

    tok_embeddings.weight                    model.embed_tokens.weight
    layers.{i}.attention.wq/wk/wv/wo.weight  model.layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj.weight
    layers.{i}.feed_forward.w1/w3/w2.weight  model.layers.{i}.mlp.gate_proj/up_proj/down_proj.weight
    layers.{i}.attention_norm.weight         model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight               model.layers.{i}.post_attention_layernorm.weight
    norm.weight                              model.norm.weight
    output.weight                            lm_head.weight   (absent when embeddings are tied)

A MoE model exports as ``MixtralForCausalLM`` (the classic Mixtral checkpoint layout, which
``transformers`` 4.x loads as is and 5.x converts on load), each ``[E, ...]`` expert tensor
as E per-expert matrices (:func:`expert_hf_names`)::

    layers.{i}.feed_forward.router.weight    model.layers.{i}.block_sparse_moe.gate.weight
    layers.{i}.feed_forward.experts.w1[e]    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight (w2, w3 alike)

Mixtral's router (softmax over all E logits, top-K, renormalized over the K) weighs the K
experts exactly as ours (softmax over the K logits).

RoPE convention: :func:`shardsmith.trainer.model.apply_rope` rotates interleaved pairs
``(x[2i], x[2i+1])`` of each head (Meta's original Llama and torchtitan); ``transformers``
rotates ``(x[i], x[i + Dh/2])`` (``rotate_half``), both with frequency
``theta ** (-2i / Dh)``. Attention scores are dot products within a head, so permuting the
rows of ``wq`` and ``wk`` the same way inside every head makes the two conventions compute
the same function: HF row ``h*Dh + j`` is our row ``h*Dh + 2j`` for ``j < Dh/2`` and our row
``h*Dh + 2(j - Dh/2) + 1`` otherwise. This is ``permute`` of ``transformers``'
``models/llama/convert_llama_weights_to_hf.py``:
``w.view(n_heads, Dh // 2, 2, D).transpose(1, 2).reshape(n_heads * Dh, D)``.
``wv``, ``wo`` and everything else are copied unchanged.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig

if TYPE_CHECKING:  # `export-hf --help` reads the defaults below without torch
    import torch


#: ``export-hf`` defaults (:func:`shardsmith.reshard.foreign.hf_io.export_hf`): the weights' dtype, and
#: the largest file before the export splits (``transformers``' own 5 GB default).
EXPORT_DTYPE = "fp32"
EXPORT_MAX_SHARD_NBYTES = 5 * 10**9

#: The ``architectures`` entry and ``model_type`` of exported configs.
HF_ARCHITECTURE = "LlamaForCausalLM"
HF_MODEL_TYPE = "llama"
#: The same for a MoE model.
HF_MOE_ARCHITECTURE, HF_MOE_MODEL_TYPE = "MixtralForCausalLM", "mixtral"

#: (our FQN pattern, HF name pattern), ``{i}`` standing for a layer index.
NAME_MAP: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.feed_forward.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
)

#: Expert tensors ``[E, ...]`` and the per-expert HF name pattern (``{e}``: the expert).
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_HF_EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"

#: HF tensors that carry no weights of the model and are skipped on import (old
#: checkpoints stored the RoPE frequency buffer).
HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_compile(ours), hf) for ours, hf in NAME_MAP]
_FROM_HF = [(_compile(hf), ours) for ours, hf in NAME_MAP]


def _translate(name: str, table: list[tuple[re.Pattern[str], str]], what: str) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    raise KeyError(
        f"{what} {name!r} has no counterpart; known patterns: {[p.pattern for p, _ in table]}"
    )


def to_hf_name(fqn: str) -> str:
    """HF ``LlamaForCausalLM`` name of one of our parameter FQNs.

    Raises:
        KeyError: not a parameter of our model.
    """
    return _translate(fqn, _TO_HF, "shardsmith tensor")


def from_hf_name(name: str) -> str:
    """Our parameter FQN of an HF ``LlamaForCausalLM`` tensor name.

    Raises:
        KeyError: not a tensor shardsmith's Llama has (e.g. a bias).
    """
    return _translate(name, _FROM_HF, "Hugging Face tensor")


def expert_hf_names(fqn: str, num_experts: int) -> list[str] | None:
    """The E per-expert HF names of an expert tensor ``layers.{i}.feed_forward.experts.w1``
    (expert e's matrix is row e of ours), or None for any other tensor."""
    m = _EXPERT_RE.match(fqn)
    if m is None:
        return None
    return [_HF_EXPERT.format(i=m.group(1), e=e, w=m.group(2)) for e in range(num_experts)]


def rope_heads(fqn: str, model: ModelConfig) -> int | None:
    """Number of heads whose rows must be permuted for ``fqn`` (wq: H, wk: K), else None."""
    if fqn.endswith(".attention.wq.weight"):
        return model.num_attention_heads
    if fqn.endswith(".attention.wk.weight"):
        return model.num_kv_heads
    return None


def permute_to_hf(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection from interleaved RoPE pairs to HF's halves.

    Args:
        w: ``(num_heads * Dh, D)``, our row order (whole heads).
        num_heads: heads in ``w``.

    Returns:
        ``(num_heads * Dh, D)`` in HF row order (``permute`` of ``convert_llama_weights_to_hf.py``).
    """
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_to_hf`: HF row order ``(num_heads * Dh, D)`` back to ours."""
    rows, cols = w.shape
    return w.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(model: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """``config.json`` of a ``transformers`` ``LlamaConfig`` equivalent to ``model``.

    Args:
        model: our model shape.
        torch_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (the weights' dtype).

    Returns:
        A JSON-safe dict readable by ``transformers`` 4.x (``rope_theta``, ``torch_dtype``)
        and 5.x (``rope_parameters``, ``dtype``). Token ids are null: shardsmith's byte-level
        data has no BOS/EOS/pad token.
    """
    out = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "num_hidden_layers": model.num_layers,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.seq_length,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {
            **(model.rope_scaling or {"rope_type": "default"}),
            "rope_theta": model.rope_theta,
        },
        "rope_scaling": model.rope_scaling,
        "tie_word_embeddings": model.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }
    if model.num_experts:
        if model.moe_layer_freq != 1:
            raise ConfigError(
                f"moe_layer_freq={model.moe_layer_freq}: Mixtral has experts in every layer; "
                "only models with --moe-layer-freq 1 export to Hugging Face"
            )
        out.update(
            architectures=[HF_MOE_ARCHITECTURE],
            model_type=HF_MOE_MODEL_TYPE,
            intermediate_size=model.expert_ffn_size,
            num_local_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            router_aux_loss_coef=model.moe_aux_loss_coeff,
            output_router_logits=False,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
        for key in ("mlp_bias", "attention_bias"):
            del out[key]
    return out


def _field_error(source: str, name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        f"{source}: {name}={value!r}: {why}; shardsmith's Llama cannot represent "
        "this model, so it was not imported"
    )


#: Hugging Face ``rope_scaling`` key of "llama3" RoPE -> our ModelConfig field.
_LLAMA3_ROPE = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_seq_length",
}


def _rope_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """RoPE base and Llama 3.1 scaling (ModelConfig fields) from ``rope_parameters``
    (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x)."""
    out: dict[str, Any] = {"rope_theta": float(cfg.get("rope_theta", 10000.0))}
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise _field_error(source, key, params, "expected an object or null")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise _field_error(
                source,
                f"{key}.rope_type",
                kind,
                "only plain RoPE ('default') and Llama 3.1's 'llama3' scaling are supported",
            )
        known = {"rope_type", "type", "rope_theta", *(_LLAMA3_ROPE if kind == "llama3" else ())}
        extra = sorted(set(params) - known)
        if extra and (key == "rope_parameters" or kind == "llama3"):
            raise _field_error(source, key, params, f"unsupported RoPE options {extra}")
        if kind == "llama3":
            missing = sorted(set(_LLAMA3_ROPE) - set(params))
            if missing:
                raise _field_error(source, key, params, f"llama3 RoPE scaling without {missing}")
            out.update(
                {
                    ours: type_(params[theirs])
                    for theirs, ours in _LLAMA3_ROPE.items()
                    for type_ in [int if ours == "rope_original_seq_length" else float]
                }
            )
        out["rope_theta"] = float(params.get("rope_theta", out["rope_theta"]))
    return out


def model_config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` of an HF Llama ``config.json``.

    ``max_position_embeddings`` becomes ``seq_length`` (the training sequence length; set
    another one with the trainer's flags when starting from the import).

    Raises:
        ConfigError: naming the field, when the model is not a Llama shardsmith can
            represent: another ``model_type``, attention or MLP biases, an activation other
            than SiLU, a ``head_dim`` other than ``hidden_size / num_attention_heads``,
            scaled RoPE other than Llama 3.1's ``llama3``, or a missing size field.
    """
    model_type = cfg.get("model_type")
    if model_type not in (HF_MODEL_TYPE, HF_MOE_MODEL_TYPE):
        raise _field_error(
            source, "model_type", model_type, "only 'llama' and 'mixtral' checkpoints are supported"
        )
    if model_type == HF_MOE_MODEL_TYPE and cfg.get("sliding_window") is not None:
        raise _field_error(
            source, "sliding_window", cfg["sliding_window"], "only full attention is supported"
        )
    for key, allowed in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if cfg.get(key, allowed) != allowed:
            raise _field_error(source, key, cfg[key], f"only {allowed!r} is supported")
    sizes = {}
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
    ):
        if not isinstance(cfg.get(key), int):
            raise _field_error(source, key, cfg.get(key), "missing or not an integer")
        sizes[key] = cfg[key]
    heads = sizes["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != sizes["hidden_size"]:
        raise _field_error(
            source,
            "head_dim",
            head_dim,
            f"must equal hidden_size / num_attention_heads = {sizes['hidden_size'] / heads}",
        )
    moe: dict[str, Any] = {}
    if model_type == HF_MOE_MODEL_TYPE:
        moe = {
            "num_experts": int(cfg.get("num_local_experts", 8)),
            "moe_router_topk": int(cfg.get("num_experts_per_tok", 2)),
            "moe_aux_loss_coeff": float(cfg.get("router_aux_loss_coef", 0.0)),
        }
    return ModelConfig(
        **moe,
        num_layers=sizes["num_hidden_layers"],
        hidden_size=sizes["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_hidden_size=sizes["intermediate_size"],
        vocab_size=sizes["vocab_size"],
        seq_length=sizes["max_position_embeddings"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **_rope_fields(cfg, source),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )
