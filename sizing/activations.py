"""Activation bytes of shardsmith's Llama block, counted from what its autograd graph keeps.

Pure (no torch). Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", eq. 2) count a GPT block with dropout and materialized attention scores
(``sbh(34 + 5as/h)``). shardsmith's block (:mod:`shardsmith.trainer.model`) has neither: no
dropout, and ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU, the
fused CPU kernel here) keeps only its output and a log-sum-exp per row, never the s x s
scores. Counted per token of one microbatch, at ``c`` bytes per compute value (2 under bf16
autocast with FSDP's bf16 parameters, 4 in fp32), hidden ``h``, FFN width ``f``, query width
``q = heads * head_dim``, tensor parallel degree ``t``:

* each RMSNorm keeps its fp32 input (``x.float()``; in fp32 that is the block input itself)
  ``4h``, its normalized value before the weight ``c*h`` and, as the input the next linears
  save, its output ``c*h``: ``4h + 2ch``; under sequence parallelism the norm runs on
  ``s/t`` tokens and the linears save the all-gathered output: ``(4h + ch)/t + ch``;
* attention keeps q and the GQA-expanded k and v after RoPE, the fused kernel's output and
  its (B, T, q) copy that ``wo`` saves: ``5*c*q/t``;
* the SwiGLU FFN keeps ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product: ``4*c*f/t``;
* with activation checkpointing (``torch.utils.checkpoint``, non-reentrant) a layer keeps
  only its input, ``c*h`` (``/t`` under sequence parallelism), and the layer being
  recomputed in backward holds its full set once;
* with per-op selective checkpointing (``--activation-checkpointing selective``, option
  ``op``: :func:`shardsmith.trainer.model.op_sac_contexts`) a layer keeps its input
  ``c*h`` (``/t`` under sequence parallelism) and the outputs of the matmuls and the
  attention kernel the policy saves: ``wq`` ``c*q/t``, ``wv`` ``c*k`` (``k`` its TP-local
  width, at least one head), the attention output ``c*q/t`` and its fp32 log-sum-exp
  ``4*heads/t``, ``w1`` ``c*f/t``, ``w2``'s partial sums ``c*h`` and, under sequence
  parallelism, the two reduce-scatter outputs ``2*c*h/t``; ``wk``, ``wo``, ``w3`` and every
  elementwise op are recomputed (a MoE layer is counted as a dense one of width
  ``topk * expert_ffn``); the layer being recomputed in backward holds its full set once;
* the last stage's loss: logits ``(b, s, V/t)`` in ``c`` bytes, their fp32 copy
  (``loss_fn``'s ``.float()``; none in fp32), the log-softmax of the vocab-parallel cross
  entropy and its gradient, 4 bytes each.

``bench/fake_scale.py`` checks these counts against PyTorch's memory tracker on the real code.
"""

from __future__ import annotations

from shardsmith.layout import ModelConfig


def compute_nbytes(mixed_precision: str) -> int:
    """Bytes per activation value: 2 under ``bf16``, 4 under ``fp32``."""
    return 2 if mixed_precision == "bf16" else 4


def layer_nbytes_per_token(
    model: ModelConfig, tp: int, c: int, *, sequence_parallel: bool = False
) -> float:
    """Bytes one transformer layer keeps for backward, per token of a microbatch (module doc)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q = model.num_attention_heads * model.head_dim
    if model.num_experts:
        f = model.expert_ffn_size * model.moe_router_topk
    sp = sequence_parallel and tp > 1
    norm = (4 * h + c * h) / tp + c * h if sp else 4 * h + 2 * c * h
    return 2 * norm + 5 * c * q / tp + 4 * c * f / tp


def checkpointed_layer_nbytes_per_token(
    model: ModelConfig, tp: int, c: int, *, sequence_parallel: bool = False
) -> float:
    """Bytes a layer under activation checkpointing keeps, per token: its input (module doc)."""
    return c * model.hidden_size / (tp if sequence_parallel and tp > 1 else 1)


def selective_layer_nbytes_per_token(
    model: ModelConfig, tp: int, c: int, *, sequence_parallel: bool = False
) -> float:
    """Bytes a layer under per-op selective activation checkpointing keeps, per token
    (module doc)."""
    h, heads = model.hidden_size, model.num_attention_heads
    q = heads * model.head_dim
    f = (
        model.expert_ffn_size * model.moe_router_topk
        if model.num_experts
        else model.ffn_hidden_size
    )
    kv = max(model.num_kv_heads // tp, 1) * model.head_dim
    sp = sequence_parallel and tp > 1
    kept = c * h / (tp if sp else 1) + 2 * c * q / tp + c * kv + 4 * heads / tp + c * f / tp + c * h
    return kept + (2 * c * h / tp if sp else 0)


def loss_nbytes_per_token(vocab_per_rank: int, c: int) -> float:
    """Bytes of the last stage's logits and loss per token (module doc): logits, their fp32
    copy under bf16, the log-softmax and its gradient."""
    return vocab_per_rank * (c + (4 if c == 2 else 0) + 4 + 4)
