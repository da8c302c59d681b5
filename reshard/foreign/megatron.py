"""Megatron-Core GPT checkpoints in the ``torch_dist`` format <-> shardsmith.

``torch_dist`` (``megatron.core.dist_checkpointing``) is a DCP directory (``.metadata`` +
``__<rank>_<n>.distcp``) plus ``metadata.json`` (``{"sharded_backend": "torch_dist"}``);
tensors are stored by their global ShardedTensor key, so the layout (tp, pp) it was saved
with does not matter. Keys of a GPT model (checked against megatron-core 0.19.2 on CPU)::

    embedding.word_embeddings.weight                     (Vp, D)       vocab padded
    decoder.layers.self_attention.linear_qkv.layer_norm_weight (L, D)   attention_norm
    decoder.layers.self_attention.linear_qkv.weight      (L, (H+2K)*Dh, D)
    decoder.layers.self_attention.linear_proj.weight     (L, D, H*Dh)  wo
    decoder.layers.mlp.linear_fc1.layer_norm_weight      (L, D)        ffn_norm
    decoder.layers.mlp.linear_fc1.weight                 (L, 2F, D)    [gate (w1); up (w3)]
    decoder.layers.mlp.linear_fc2.weight                 (L, D, F)     w2
    decoder.final_layernorm.weight                       (D,)
    output_layer.weight                                  (Vp, D)       absent when tied

Layers are stacked along a leading dim of the global layer index (``decoder.layers.N.*``
per-layer keys and the local spec's ``input_layernorm`` / ``pre_mlp_layernorm`` names are
read too). The fused QKV rows are grouped per kv head: for each of the K groups, its H/K
query heads, then its key head, then its value head (Megatron ``SelfAttention``,
``get_query_key_value_tensors``). Megatron rotates RoPE halves (``rotary_interleaved=False``,
like Hugging Face), shardsmith interleaved pairs, so q/k rows are permuted within each head
exactly as for Hugging Face (:func:`shardsmith.reshard.foreign.hf.permute_from_hf`). The vocabulary
is padded to a multiple of ``make_vocab_size_divisible_by * tp`` with zero rows.
Adam state: :mod:`.megatron_optim` (model-space layout converted, bucket layout reported).
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any, Callable

import torch

from shardsmith.errors import ConfigError
from shardsmith.layout import Box, ModelConfig, ParallelDims, is_optim_fqn, optim_state_of
from shardsmith.reshard.foreign.common import ImportReport, ModelHints, infer_model_config
from shardsmith.reshard.foreign.dcp_reader import DCPCheckpoint
from shardsmith.reshard.foreign.hf import permute_from_hf, permute_to_hf
from shardsmith.reshard.foreign.megatron_optim import (
    BUCKET_SPACE,
    KINDS,
    STATE,
    MegatronOptim,
    optimizer_layout,
    step_tensor,
)
from shardsmith.reshard.foreign.write import write_checkpoint

LAYERS = "decoder.layers."
QKV = "self_attention.linear_qkv.weight"
FC1 = "mlp.linear_fc1.weight"
#: Our name after ``layers.{i}.`` -> (Megatron name after ``decoder.layers.``, part).
LAYER_MAP: dict[str, tuple[str, str]] = {
    "attention_norm.weight": ("self_attention.linear_qkv.layer_norm_weight", ""),
    "attention.wq.weight": (QKV, "q"),
    "attention.wk.weight": (QKV, "k"),
    "attention.wv.weight": (QKV, "v"),
    "attention.wo.weight": ("self_attention.linear_proj.weight", ""),
    "ffn_norm.weight": ("mlp.linear_fc1.layer_norm_weight", ""),
    "feed_forward.w1.weight": (FC1, "gate"),
    "feed_forward.w3.weight": (FC1, "up"),
    "feed_forward.w2.weight": ("mlp.linear_fc2.weight", ""),
}
#: Local-spec (non-Transformer-Engine) names of the two norms.
LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
GLOBAL_MAP = {
    "tok_embeddings.weight": "embedding.word_embeddings.weight",
    "norm.weight": "decoder.final_layernorm.weight",
    "output.weight": "output_layer.weight",
}
#: Modules whose ``_extra_state`` ShardedObjects Megatron saves per layer.
EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
BACKEND_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


def split_qkv(qkv: torch.Tensor, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Megatron's fused ``((H+2K)*Dh, D)`` QKV -> our ``q (H*Dh, D)``, ``k``, ``v (K*Dh, D)``,
    q/k rows in our interleaved-RoPE order."""
    h, k, hd = model.num_attention_heads, model.num_kv_heads, model.head_dim
    groups = qkv.reshape(k, h // k + 2, hd, -1)
    q = groups[:, : h // k].reshape(h * hd, -1)
    key = groups[:, h // k].reshape(k * hd, -1)
    return {
        "q": permute_from_hf(q, h),
        "k": permute_from_hf(key, k),
        "v": groups[:, -1].reshape(k * hd, -1),
    }


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    h, kv, hd = model.num_attention_heads, model.num_kv_heads, model.head_dim
    q = permute_to_hf(q, h).reshape(kv, h // kv, hd, -1)
    k = permute_to_hf(k, kv).reshape(kv, 1, hd, -1)
    return torch.cat([q, k, v.reshape(kv, 1, hd, -1)], dim=1).reshape((h + 2 * kv) * hd, -1)


class MegatronSource:
    """Whole per-layer tensors of a ``torch_dist`` checkpoint, by Megatron name.

    Args:
        prefix: before every key: ``""`` for the weights, ``"optimizer.state.exp_avg."`` ... for
            the optimizer state of the same parameters (see :mod:`.megatron_optim`).
    """

    def __init__(self, ck: DCPCheckpoint, prefix: str = "") -> None:
        self.ck, self.prefix = ck, prefix
        self.layer = lru_cache(maxsize=4)(self._layer)

    def key(self, name: str, i: int) -> tuple[str, bool] | None:
        """(DCP key, stacked) holding layer ``i``'s ``name``, trying the local-spec norm names."""
        p = self.prefix
        for n in (name, LOCAL_NORMS.get(name, name)):
            if f"{p}{LAYERS}{i}.{n}" in self.ck.chunks:
                return f"{p}{LAYERS}{i}.{n}", False
            if p + LAYERS + n in self.ck.chunks:
                return p + LAYERS + n, True
        return None

    def global_tensor(self, fqn: str, box: Box) -> torch.Tensor:
        """Box of the non-layer tensor our ``fqn`` names (vocab padding rows are never asked for)."""
        return self.ck.read(self.prefix + GLOBAL_MAP[fqn], box, torch.float32)

    def _layer(self, name: str, i: int) -> torch.Tensor:
        found = self.key(name, i)
        if found is None:
            raise ConfigError(
                f"{self.ck.dir}: no {self.prefix}{LAYERS}{name} for layer {i}; not a Megatron-Core "
                "GPT checkpoint shardsmith can import (SwiGLU, RMSNorm, no biases)"
            )
        key, stacked = found
        shape = self.ck.shape(key)
        if not stacked:
            return self.ck.read(key, Box((0,) * len(shape), shape))
        return self.ck.read(key, Box((i,) + (0,) * (len(shape) - 1), (1,) + shape[1:]))[0]

    def shapes(self, num_layers: int) -> dict[str, tuple[int, ...]]:
        """Our-FQN shapes implied by the Megatron names (the fused ones as stored)."""
        out = {}
        for i in range(num_layers):
            for ours, (name, _) in LAYER_MAP.items():
                found = self.key(name, i)
                if found is not None:
                    shape = self.ck.shape(found[0])
                    out[f"layers.{i}.{ours}"] = shape[1:] if found[1] else shape
        return out


def _num_layers(ck: DCPCheckpoint) -> int:
    stacked = LAYERS + QKV
    if stacked in ck.chunks:
        return ck.shape(stacked)[0]
    return len(
        {k.split(".")[2] for k in ck.chunks if k.startswith(LAYERS) and k.split(".")[2].isdigit()}
    )


def infer_megatron_model(
    src: MegatronSource, hints: ModelHints, vocab_size: int | None
) -> ModelConfig:
    """Our model config from the Megatron shapes (``vocab_size``: unpadded; default all rows).

    Raises:
        ConfigError: names the tensor or field that does not fit shardsmith's Llama.
    """
    ck = src.ck
    if GLOBAL_MAP["tok_embeddings.weight"] not in ck.chunks:
        raise ConfigError(
            f"{ck.dir}: no embedding.word_embeddings.weight; not a Megatron-Core GPT checkpoint"
        )
    padded, hidden = ck.shape(GLOBAL_MAP["tok_embeddings.weight"])
    vocab = vocab_size or padded
    if vocab > padded:
        raise ConfigError(f"{ck.dir}: --vocab-size {vocab} exceeds the {padded} embedding rows")
    hints = hints.completed(None, ck.dir)
    assert hints.num_attention_heads is not None
    hd = hidden // hints.num_attention_heads
    shapes = src.shapes(_num_layers(ck))
    fused: dict[str, tuple[int, ...]] = {}
    for fqn, shape in shapes.items():
        if fqn.endswith(".attention.wq.weight"):
            kv = (shape[0] // hd - hints.num_attention_heads) // 2
            fused.update(
                {
                    fqn: (hints.num_attention_heads * hd, shape[1]),
                    fqn.replace(".wq.", ".wk."): (kv * hd, shape[1]),
                    fqn.replace(".wq.", ".wv."): (kv * hd, shape[1]),
                }
            )
        elif fqn.endswith((".w1.weight", ".w3.weight")):
            fused[fqn] = (shape[0] // 2, shape[1])
        elif not fqn.endswith((".wk.weight", ".wv.weight")):
            fused[fqn] = shape
    fused["tok_embeddings.weight"] = (vocab, hidden)
    if GLOBAL_MAP["norm.weight"] in ck.chunks:
        fused["norm.weight"] = ck.shape(GLOBAL_MAP["norm.weight"])
    if GLOBAL_MAP["output.weight"] in ck.chunks:
        fused["output.weight"] = (vocab, ck.shape(GLOBAL_MAP["output.weight"])[1])
    return infer_model_config(fused, hints, ck.dir)


def _reader(
    sources: dict[str, MegatronSource], model: ModelConfig, step: int | None
) -> Callable[[str, Box], torch.Tensor]:
    """``read(fqn, box)`` over our FQNs; ``sources`` by our prefix (``""``, ``"optim.exp_avg."`` ...)."""

    def read(fqn: str, box: Box) -> torch.Tensor:
        if optim_state_of(fqn) == "step":
            assert step is not None and box.lengths == ()
            return step_tensor(step)
        ours = next(p for p in sources if p and fqn.startswith(p)) if is_optim_fqn(fqn) else ""
        src, fqn = sources[ours], fqn[len(ours) :]
        if fqn in GLOBAL_MAP:
            return src.global_tensor(fqn, box)
        _, i, rest = fqn.split(".", 2)
        name, part = LAYER_MAP[rest]
        whole = src.layer(name, int(i))
        if part in ("q", "k", "v"):
            whole = split_qkv(whole, model)[part]
        elif part in ("gate", "up"):
            whole = (
                whole[: model.ffn_hidden_size] if part == "gate" else whole[model.ffn_hidden_size :]
            )
        return whole[box.relative_to(Box((0,) * whole.dim(), tuple(whole.shape)))].to(torch.float32)

    return read


def _is_model_key(key: str) -> bool:
    """A Megatron key the import reads (global, stacked ``decoder.layers.X`` or per-layer)."""
    if key in GLOBAL_MAP.values():
        return True
    if not key.startswith(LAYERS):
        return False
    head, _, tail = key[len(LAYERS) :].partition(".")
    name = tail if head.isdigit() else key[len(LAYERS) :]
    return name in {n for n, _ in LAYER_MAP.values()} | set(LOCAL_NORMS.values())


def _common_state(ck: DCPCheckpoint) -> tuple[Any, list[str]]:
    """The decoded ``common_state`` object (None when absent) and notes: Megatron-LM's own
    objects in it (``args`` ...) are inert placeholders, listed as not carried over."""
    if "common_state/shard_0_1" not in ck.values:
        return None, []
    common = ck.read_value("common_state/shard_0_1", inert=True)
    first = common[0] if isinstance(common, list) and common and isinstance(common[0], dict) else {}
    skipped = sorted(
        k
        for k, v in first.items()
        if k not in ("iteration", "checkpoint_version", "optimizer", "content_metadata")
    )
    return common, (
        [
            f"common_state: {', '.join(map(str, skipped))} (Megatron-LM run state; the run's "
            "flags and schedule come from the train flags)"
        ]
        if skipped
        else []
    )


def _megatron_state(
    ck: DCPCheckpoint, common: Any, step: int | None, optim: MegatronOptim | None
) -> dict[str, Any]:
    """Manifest state: step from ``iteration`` (else the Adam step, else 0), LR position with it."""
    first = common[0] if isinstance(common, list) and common and isinstance(common[0], dict) else {}
    saved = first.get("iteration")
    step = (
        step
        if step is not None
        else int(saved if saved is not None else (optim.step if optim else 0))
    )
    state: dict[str, Any] = {
        "step": step,
        "tokens_seen": 0,
        "data": {"sample_index": 0},
        "source": {"format": "megatron_torch_dist", "path": ck.dir, "iteration": saved},
    }
    if optim is not None:
        state["lr_scheduler"] = {"last_epoch": step, "_step_count": step + 1, "lr_lambdas": [None]}
    return state


def _model_keys(ck: DCPCheckpoint) -> list[str]:
    return sorted(k for k in ck.chunks if _is_model_key(k))


def _sources(ck: DCPCheckpoint, optim: MegatronOptim | None) -> dict[str, MegatronSource]:
    """Our prefix -> source; weights from the fp32 main params when the model is stored narrower."""
    narrow = any(ck.dtype(k) != torch.float32 for k in _model_keys(ck))
    weights = f"{STATE}param." if optim is not None and optim.main_params and narrow else ""
    sources = {"": MegatronSource(ck, weights)}
    if optim is not None:
        sources.update(
            {ours: MegatronSource(ck, f"{STATE}{kind}.") for ours, kind in KINDS.items()}
        )
    return sources


def import_megatron(
    src_dir: str,
    ckpt_url: str,
    dims: ParallelDims,
    hints: ModelHints,
    *,
    vocab_size: int | None = None,
    step: int | None = None,
    make_config: Callable[[ModelConfig], dict] | None = None,
    storage_options: dict | None = None,
) -> ImportReport:
    """Write a Megatron-Core GPT ``torch_dist`` checkpoint as shardsmith's: the weights, and
    the Adam state (moments and step) when it is stored in model space (see
    :mod:`.megatron_optim`; what is not converted is listed in the report's ``dropped``).

    Each target box is cut from whole per-layer tensors (at most 4 cached per kind), read
    from only the DCP chunks of that layer. Float32 storage.

    Args:
        vocab_size: the unpadded vocabulary (padding rows are dropped); default: every row.
        Other arguments: as :func:`shardsmith.reshard.foreign.dcp.import_dcp`.

    Raises:
        CheckpointNotFound / IntegrityError: not a readable ``torch_dist`` directory.
        ConfigError: not a GPT shardsmith's Llama can represent (names the tensor), or partial
            Adam state.
    """
    t0 = time.perf_counter()
    ck = DCPCheckpoint(src_dir)
    try:
        model = infer_megatron_model(MegatronSource(ck), hints, vocab_size)
        common, notes = _common_state(ck)
        optim, optim_notes = optimizer_layout(set(ck.chunks), _model_keys(ck), common, ck.dir)
        state = _megatron_state(ck, common, step, optim)
        config = (
            make_config(model)
            if make_config
            else {"model": model.to_json(), "parallel": dims.to_json()}
        )
        read = _reader(_sources(ck, optim), model, optim.step if optim else None)
        written = write_checkpoint(
            ckpt_url,
            model,
            dims,
            read,
            state=state,
            config=config,
            with_optimizer=optim is not None,
            storage_options=storage_options,
        )
    finally:
        ck.close()
    used = tuple(STATE + k for k in ("exp_avg.", "exp_avg_sq.", "param.")) if optim else ()
    rest = sorted(
        k
        for k in ck.chunks
        if not _is_model_key(k) and not k.startswith(used) and not k.startswith(BUCKET_SPACE)
    )
    dropped = [f"{k} (not a parameter or Adam state shardsmith has)" for k in rest]
    extra = [k for k in ck.values if "_extra_state" in k]
    if extra:
        dropped.append(f"*._extra_state ({len(extra)} entries; Transformer Engine bookkeeping)")
    return ImportReport.of(
        written,
        source=ck.dir,
        model=model,
        with_optimizer=optim is not None,
        started=t0,
        dropped=dropped + notes + optim_notes,
    )
