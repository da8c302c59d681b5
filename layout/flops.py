"""Model FLOPs per training token: what MFU is measured against."""

from __future__ import annotations

from math import prod

from shardsmith.layout.dims import ParallelDims
from shardsmith.layout.model_config import ModelConfig
from shardsmith.layout.sharding import TensorSpec, param_specs

_SPECS: dict[str, dict[str, TensorSpec]] = {}


def _param_specs_once(model: ModelConfig) -> dict[str, TensorSpec]:
    """The unsharded parameter specs of ``model``, remembered by its repr (the planner asks
    for the same model thousands of times); at most 16 kept."""
    key = repr(model)
    if key not in _SPECS:
        if len(_SPECS) >= 16:
            _SPECS.pop(next(iter(_SPECS)))
        _SPECS[key] = param_specs(model, ParallelDims())
    return _SPECS[key]


def flops_per_token(model: ModelConfig) -> float:
    """Model FLOPs of one training token (forward + backward), without recomputation.

    ``6 * N + 12 * L * H * Q * T`` (Chowdhery et al. 2022, "PaLM", appendix B): N is the
    number of parameters that take part in matrix multiplies (all but the input embedding
    table, which is a lookup; with tied embeddings the output projection still counts; of a MoE
    layer's experts only the K of E each token is routed to),
    L layers, H query heads, Q = head dim, T = sequence length; the second term is the
    attention score and value matmuls (counted for the full T x T matrix, as PaLM does).
    The same convention as nanoGPT's ``estimate_mfu`` and torchtitan's
    ``get_num_flop_per_token``.

    Returns:
        FLOPs per token (float, unitless count).
    """
    specs = _param_specs_once(model)
    num_params = sum(
        prod(s.shape)
        for fqn, s in specs.items()
        if fqn != "tok_embeddings.weight" and ".experts." not in fqn
    )
    num_params += sum(
        prod(s.shape) * model.moe_router_topk // model.num_experts  # active experts only
        for fqn, s in specs.items()
        if ".experts." in fqn
    )
    if model.tie_embeddings:
        num_params += model.vocab_size * model.hidden_size  # the output matmul
    head_dim = model.hidden_size // model.num_attention_heads
    return (
        6.0 * num_params
        + 12.0 * model.num_layers * model.num_attention_heads * head_dim * model.seq_length
    )
