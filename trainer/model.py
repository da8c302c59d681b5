"""A Llama-style decoder, small enough to read top to bottom.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021),
SwiGLU MLP (Shazeer 2020), grouped-query attention (Ainslie et al. 2023), optional
tied input/output embeddings. Parameter names are the checkpoint's global FQNs:
``layers`` is a ModuleDict keyed by the *global* layer index, so a pipeline stage
that holds layers 8..15 still names them ``layers.8.…``.

Shapes: B batch, T sequence, D hidden, H query heads, K kv heads, Dh head dim, V vocab.
Under tensor parallelism the head counts seen here are the TP-local ones: every
view below infers them from the (local) projection width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from shardsmith.layout import ModelConfig
from shardsmith.trainer.moe import MoEFeedForward


def rope_tables(
    head_dim: int, seq_length: int, theta: float, cfg: ModelConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (T, Dh/2) for rotary embeddings (RoFormer eq. 34), the
    frequencies scaled as Llama 3.1 does when ``cfg.rope_scaling_factor`` is set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if cfg is not None and cfg.rope_scaling_factor:
        inv_freq = llama3_scaled_frequencies(inv_freq, cfg)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def llama3_scaled_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies (``rope_type "llama3"``; Meta's ``apply_scaling``,
    transformers' ``_compute_llama3_parameters``): wavelengths above ``original / low`` are
    divided by ``factor``, those below ``original / high`` kept, the band between smoothly
    interpolated. ``inv_freq`` (Dh/2,) in radians per token."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_seq_length
    wavelen = 2 * torch.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, T, heads, Dh) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim D."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    ``kv_copies`` > 1 stores each kv head that many times (consecutive copies), so that
    tensor parallelism with tp > num_kv_heads gives every TP rank its own copy.
    ``cp`` (set by :func:`shardsmith.trainer.context_parallel.attach`): x holds this rank's
    T / cp tokens; K/V of the whole sequence are all-gathered over the group.
    """

    cp: Any = None

    def __init__(self, cfg: ModelConfig, kv_copies: int = 1) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * kv_copies * hd, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * kv_copies * hd, bias=False)
        self.wo = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape  # x: (B, T, D)
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H, Dh)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, K, Dh)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cp is not None:  # (B, T, K, Dh): the whole sequence
            k, v = self.cp.gather(k), self.cp.gather(v)
        repeats = q.shape[2] // k.shape[2]  # query heads per kv head
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        if self.cp is not None:
            out = self.cp.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )  # (B, H, T, Dh)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


#: Ops whose outputs per-op selective activation checkpointing keeps (torchtitan's
#: ``_save_list``, plus the CPU attention kernel): matmuls, attention, the sequence-parallel
#: reduce-scatter and max; everything else is recomputed in backward.
SAC_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def op_sac_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint`` contexts of per-op selective activation checkpointing, one
    pair per block call (torchtitan's ``apply_ac`` with ``selective_ac_option="op"``): keep
    the outputs of :data:`SAC_SAVE_OPS` except every second matmul (counted from the block's
    first; in shardsmith's dense block wq, wv, w1 and w2 are kept, wk, wo and w3 recomputed),
    recompute the rest. The count restarts at every call, so forward and recomputation
    agree and every microbatch keeps the same tensors."""
    mm_count = {False: 0, True: 0}  # is_recompute -> matmuls seen in this call

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func == torch.ops.aten.mm.default:
            mm_count[ctx.is_recompute] += 1
            if mm_count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in SAC_SAVE_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x)); the FFN is a mixture of
    experts (:mod:`shardsmith.trainer.moe`) when ``moe``.

    ``activation_checkpointing``: recompute the block in backward (``torch.utils.checkpoint``,
    non-reentrant), keeping what ``checkpoint_contexts`` says (default: only its inputs;
    :func:`op_sac_contexts` for per-op selective checkpointing)."""

    def __init__(self, cfg: ModelConfig, kv_copies: int = 1, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, kv_copies)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg) if moe else FeedForward(cfg)
        self.activation_checkpointing = False
        self.checkpoint_contexts: Any = noop_context_fn

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(
                self._forward, x, cos, sin, use_reentrant=False, context_fn=self.checkpoint_contexts
            )
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    """The decoder, or one pipeline stage of it.

    A stage holds a subset of ``layers`` (global indices kept), the embedding only on
    the first stage and the final norm and output projection only on the last.

    forward: tokens (B, T) int64 on the first stage, hidden states (B, T, D) on later
    stages; returns logits (B, T, Vp) on the last stage, hidden states otherwise.

    Built on the ``meta`` device by :func:`shardsmith.trainer.parallel.build_stage_model`
    (parameters are initialized by :mod:`shardsmith.trainer.weight_init`).

    ``padded_vocab`` (Vp >= V) rows are allocated for the embedding and output (vocab
    padded to a multiple of tp); logits of the padding rows are masked to the dtype's
    minimum, so they never take probability mass. ``kv_copies``: see :class:`Attention`.
    """

    rope_cos: torch.Tensor  # (T, Dh/2), buffers registered in __init__
    rope_sin: torch.Tensor
    cp: Any = None  # context parallelism: inputs hold this rank's T / cp tokens

    def __init__(
        self,
        cfg: ModelConfig,
        layer_ids: range | None = None,
        *,
        first: bool = True,
        last: bool = True,
        padded_vocab: int = 0,
        kv_copies: int = 1,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.padded_vocab = padded_vocab or cfg.vocab_size
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = (
            nn.Embedding(self.padded_vocab, cfg.hidden_size)
            if first or (last and cfg.tie_embeddings)
            else None
        )
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(cfg, kv_copies, cfg.is_moe_layer(i)) for i in layer_ids}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if last else None
        self.output = (
            nn.Linear(cfg.hidden_size, self.padded_vocab, bias=False)
            if (last and not cfg.tie_embeddings)
            else None
        )
        self.first, self.last = first, last
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_length, cfg.rope_theta, cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the rope tables (T, Dh/2) in place, e.g. after ``to_empty`` off ``meta``."""
        cos, sin = rope_tables(
            self.cfg.head_dim, self.cfg.seq_length, self.cfg.rope_theta, self.cfg
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            assert self.tok_embeddings is not None
            h = self.tok_embeddings(x)  # (B, T, D)
        else:
            h = x
        cos, sin = self.rope_cos, self.rope_sin
        if self.cp is not None:  # angles at this rank's positions
            seq = x.shape[1] * self.cp.size if self.first else self.cfg.seq_length
            pos = self.cp.positions(seq, cos.device)
            cos, sin = cos[pos], sin[pos]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if not self.last:
            return h
        assert self.norm is not None
        h = self.norm(h)
        if self.output is not None:
            logits = self.output(h)  # (B, T, Vp)
        else:
            assert self.tok_embeddings is not None
            logits = tied_logits(h, self.tok_embeddings.weight)
        if self.padded_vocab != self.cfg.vocab_size:
            logits = mask_vocab_padding(logits, self.cfg.vocab_size)
        return logits


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of vocabulary ids >= ``vocab_size`` to the dtype's minimum.

    ``logits`` (B, T, Vp) is a plain tensor or a DTensor sharded over the vocab (last dim)
    on a 1-D TP mesh, in which case each rank masks the columns it holds.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        local = logits.to_local()
        start = logits.device_mesh.get_local_rank() * local.shape[-1]
        ids = torch.arange(start, start + local.shape[-1], device=local.device)
        masked = local.masked_fill(ids >= vocab_size, torch.finfo(local.dtype).min)
        return DTensor.from_local(
            masked,
            logits.device_mesh,
            logits.placements,
            shape=logits.shape,
            stride=logits.stride(),
        )
    ids = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min)


def tied_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits h @ E^T with the embedding matrix E (V, D); vocab-sharded when E is a DTensor."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor) and not isinstance(h, DTensor):
        h = DTensor.from_local(h, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim)
    elif isinstance(h, DTensor):  # sequence-sharded under SP
        h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
    return F.linear(h, weight)
