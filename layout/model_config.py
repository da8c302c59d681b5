"""The model's shape, the layers of each pipeline stage, and the layout check.

Pure (no torch, no I/O): with :class:`~shardsmith.layout.dims.ParallelDims` this is
everything the sharding plan needs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shardsmith.errors import ConfigError, LayoutError
from shardsmith.layout.dims import ParallelDims


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

    Attributes:
        num_layers: transformer blocks.
        hidden_size: model width D.
        num_attention_heads: query heads H; ``hidden_size % H == 0``.
        num_kv_heads: key/value heads (GQA groups); ``H % num_kv_heads == 0``.
        ffn_hidden_size: SwiGLU inner width F.
        vocab_size: tokens V (unpadded; 256 for byte-level text).
        seq_length: tokens per sample T.
        tie_embeddings: output projection shares the input embedding matrix.
        rope_theta: RoPE base (Su et al. 2021, "RoFormer", eq. 15).
        norm_eps: RMSNorm epsilon (Zhang & Sennrich 2019).
        num_experts: experts E of a Mixtral-style mixture-of-experts FFN (Jiang et al. 2024);
            0 = dense SwiGLU everywhere. Expert weights are one logical tensor per layer and
            matrix with a leading expert dim ``[E, ...]``.
        moe_router_topk: experts K each token is routed to (softmax over its top-K logits).
        moe_ffn_hidden_size: each expert's SwiGLU width (0 = ``ffn_hidden_size``).
        moe_aux_loss_coeff: weight of the Switch load-balancing loss ``E * sum_e f_e * P_e``
            (Fedus et al. 2021), added to the loss of a step.
        moe_layer_freq: every this-many-th layer is MoE (layer ``i`` with ``i % freq == 0``).
        rope_scaling_factor: Llama 3.1 RoPE scaling (``rope_type "llama3"``, Meta's
            ``apply_scaling`` in llama-models; transformers' ``_compute_llama3_parameters``):
            wavelengths longer than ``rope_original_seq_length / rope_low_freq_factor`` are
            stretched by this factor, those shorter than ``rope_original_seq_length /
            rope_high_freq_factor`` kept, the band between interpolated. 0 = plain RoPE.
        rope_low_freq_factor, rope_high_freq_factor: the band's edges (Llama 3.1: 1 and 4).
        rope_original_seq_length: the pre-training context the scaling extends (Llama 3.1: 8192).
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 352
    vocab_size: int = 256
    seq_length: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_aux_loss_coeff: float = 0.0
    moe_layer_freq: int = 1
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_length: int = 8192

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
            "seq_length",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name}={value!r}: must be an integer >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ConfigError(
                f"model head dim {self.hidden_size // self.num_attention_heads} must be even for RoPE"
            )

        if self.num_experts and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(
                f"model.moe_router_topk={self.moe_router_topk}: must be in 1..num_experts="
                f"{self.num_experts}"
            )
        if self.rope_scaling_factor and not (
            self.rope_scaling_factor >= 1
            and self.rope_original_seq_length >= 1
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ConfigError(
                f"model RoPE scaling factor={self.rope_scaling_factor}, low_freq_factor="
                f"{self.rope_low_freq_factor}, high_freq_factor={self.rope_high_freq_factor}, "
                f"original_seq_length={self.rope_original_seq_length}: need factor >= 1 (or 0 "
                "for none), 0 < low < high and original_seq_length >= 1 (Llama 3.1: 8, 1, 4, 8192)"
            )
        if self.num_experts < 0 or self.moe_layer_freq < 1 or self.moe_ffn_hidden_size < 0:
            raise ConfigError(
                "model.num_experts, moe_ffn_hidden_size must be >= 0 and moe_layer_freq >= 1"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has the mixture-of-experts FFN."""
        return self.num_experts > 0 and layer % self.moe_layer_freq == 0

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's SwiGLU width."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        """Per-head width ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict of every field (the MoE fields only for a MoE model, the RoPE
        scaling ones only when scaled, so other models write the bytes they always wrote)."""
        out = dataclasses.asdict(self)
        if not self.num_experts:
            for name in _MOE_FIELDS:
                del out[name]
        if not self.rope_scaling_factor:
            for name in ROPE_SCALING_FIELDS:
                del out[name]
        return out

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The RoPE scaling as Hugging Face's ``rope_scaling`` names it, or None when plain."""
        if not self.rope_scaling_factor:
            return None
        return {
            "rope_type": "llama3",
            "factor": self.rope_scaling_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position_embeddings": self.rope_original_seq_length,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_json`; unknown keys raise :class:`ConfigError`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(
                f"unknown model config keys {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**data)


_MOE_FIELDS = (
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_aux_loss_coeff",
    "moe_layer_freq",
)
#: The Llama 3.1 RoPE scaling fields (written only when ``rope_scaling_factor`` is set).
ROPE_SCALING_FIELDS = (
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_seq_length",
)


def chunk_layers(model: ModelConfig, dims: ParallelDims) -> list[range]:
    """Global layer indices of each pipeline model chunk (``pp * virtual_stages`` of them,
    in pipeline order; chunk ``c`` lives on pipeline rank ``c % pp``).

    Returns:
        contiguous ranges covering ``0..num_layers-1``.

    Raises:
        LayoutError: a chunk would hold no layer, or ``pipeline_split`` does not sum to
            ``num_layers``.
    """
    chunks = dims.num_chunks
    if dims.pipeline_split:
        counts = list(dims.pipeline_split)
        if sum(counts) != model.num_layers or min(counts) < 1:
            raise LayoutError(
                f"pipeline_split={','.join(map(str, counts))} must be {chunks} positive counts "
                f"summing to num_layers={model.num_layers}"
            )
    else:
        if chunks > model.num_layers:
            what, fix = (
                (f"pp={dims.pp}", f"pp <= {model.num_layers}")
                if dims.virtual_stages == 1
                else (
                    f"pp={dims.pp} x virtual_stages={dims.virtual_stages}",
                    f"pp x virtual_stages <= {model.num_layers}",
                )
            )
            raise LayoutError(
                f"{what} exceeds num_layers={model.num_layers}: every pipeline stage needs "
                f"at least one layer; use {fix}"
            )
        base, extra = divmod(model.num_layers, chunks)
        counts = [base + (1 if s < extra else 0) for s in range(chunks)]
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_layers(model: ModelConfig, dims: ParallelDims) -> list[tuple[int, ...]]:
    """Global layer indices held by each pipeline rank (its chunks' layers, ascending; one
    contiguous run without virtual stages). Raises as :func:`chunk_layers`."""
    chunks = chunk_layers(model, dims)
    return [tuple(i for c in dims.chunk_ids(r) for i in chunks[c]) for r in range(dims.pp)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_layout(model: ModelConfig, dims: ParallelDims) -> None:
    """Check that ``dims`` can shard ``model``; raise naming the dimension otherwise.

    Raises:
        LayoutError: tp does not divide the attention heads or the FFN width, tp and the
            kv heads do not divide one another, or pp does not fit the layers. (The
            vocabulary needs no divisibility: it is padded to a multiple of tp.)
    """
    if model.num_attention_heads % dims.tp or model.ffn_hidden_size % dims.tp:
        ok = [d for d in _divisors(model.num_attention_heads) if model.ffn_hidden_size % d == 0]
        name, value = (
            ("num_attention_heads", model.num_attention_heads)
            if model.num_attention_heads % dims.tp
            else ("ffn_hidden_size", model.ffn_hidden_size)
        )
        raise LayoutError(
            f"tp={dims.tp} does not divide {name}={value}; tensor-parallel degrees that divide "
            f"this model: {ok}"
        )
    kv = model.num_kv_heads
    if (dims.tp <= kv and kv % dims.tp) or (dims.tp > kv and dims.tp % kv):
        ok = [
            d
            for d in _divisors(model.num_attention_heads)
            if model.ffn_hidden_size % d == 0 and (kv % d == 0 or d % kv == 0)
        ]
        raise LayoutError(
            f"tp={dims.tp} and num_kv_heads={kv}: one must divide the other (kv heads are split "
            f"over tp, or replicated when tp > num_kv_heads); tensor-parallel degrees that work: {ok}"
        )
    if dims.expert_parallel > 1 and (
        not model.num_experts or model.num_experts % dims.expert_parallel
    ):
        raise LayoutError(
            f"expert_parallel={dims.expert_parallel} needs a MoE model whose num_experts="
            f"{model.num_experts} it divides (--num-experts)"
        )
    if model.tie_embeddings and dims.pipeline_style == "v":
        raise LayoutError(
            "tied embeddings with the V pipeline style (zbv, dualpipev) would put both copies "
            "on pipeline rank 0 as two modules; untie them or use a loop schedule"
        )
    stage_layers(model, dims)


def check_sequence_split(seq_length: int, dims: ParallelDims, sequence_parallel: bool) -> None:
    """Check that every rank's share of a sequence is a whole number of tokens.

    Context parallelism cuts each sequence into ``2 * cp`` equal chunks and gives every cp
    rank two of them (the load balance of Megatron-LM's ``get_batch_on_this_cp_rank``), so
    ``2 * cp`` must divide ``seq_length``; sequence parallelism then splits each rank's
    ``seq_length / cp`` tokens over the TP group, so ``tp`` must divide that count.

    Raises:
        ConfigError: naming the sequence length, the degrees and a length that works.
    """
    cp, tp = dims.cp, dims.tp
    if cp > 1 and seq_length % (2 * cp):
        ok = 2 * cp * max(1, seq_length // (2 * cp))
        raise ConfigError(
            f"seq_length={seq_length} with cp={cp}: context parallelism cuts each sequence into "
            f"2*cp={2 * cp} equal chunks; use a seq_length divisible by {2 * cp} (e.g. {ok})"
        )
    per_rank = seq_length // cp
    if sequence_parallel and tp > 1 and per_rank % tp:
        unit = cp * math.lcm(2, tp) if cp > 1 else tp  # the shortest length that splits
        where = f"each cp rank's {per_rank} tokens" if cp > 1 else f"seq_length={seq_length}"
        raise ConfigError(
            f"--sequence-parallel with tp={tp} and cp={cp}: sequence parallelism splits {where} "
            f"over the TP group, and {per_rank} tokens are not divisible by tp={tp}; use a "
            f"seq_length divisible by {unit} (e.g. {unit * max(1, seq_length // unit)})"
        )
