"""Export a shardsmith checkpoint as a Megatron-Core GPT ``torch_dist`` checkpoint.

Written with ``torch.distributed.checkpoint`` itself (one file per item) from placeholders
a planner fills when DCP writes them (see :mod:`.dcp`): peak memory is one stacked
parameter (e.g. every layer's ``linear_qkv``). Names, QKV fusion, SwiGLU order, RoPE row
order and vocabulary padding are those of :mod:`.megatron`. The directory also gets
``metadata.json``, Megatron's ``common_state`` (``{"iteration": step, "checkpoint_version":
3.0}``, as Megatron-LM's ``load_checkpoint`` reads them; a plain ``dist_checkpointing.load``
returns these two keys next to the model's) and per-layer
``_extra_state`` objects (``None``), so ``dist_checkpointing.load`` finds every key a GPT
model's ``sharded_state_dict()`` asks for; with Adam state, also what a
``DistributedOptimizer.sharded_state_dict(..., metadata={"distrib_optim_sharding_type":
"fully_reshardable"})`` asks for (:mod:`.megatron_optim`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from shardsmith.errors import CheckpointError
from shardsmith.layout import Box, ModelConfig, ParallelDims, optim_fqn, param_specs
from shardsmith.reshard.foreign.dcp import lazy_planner, save_one_process
from shardsmith.reshard.foreign.dcp_reader import METADATA_NAME
from shardsmith.reshard.foreign.megatron import (
    BACKEND_JSON,
    EXTRA_STATE_MODULES,
    FC1,
    GLOBAL_MAP,
    LAYER_MAP,
    LAYERS,
    QKV,
    fuse_qkv,
)
from shardsmith.reshard.foreign.megatron_optim import STATE, common_steps, optimizer_common
from shardsmith.storage import read_manifest, resolve_checkpoint
from shardsmith.storage.formats import read_box


@dataclass
class MegatronExportReport:
    """What :func:`export_megatron` wrote."""

    source: str
    out_dir: str
    step: int
    padded_vocab_size: int
    num_tensors: int
    with_optimizer: bool
    seconds: float = 0.0


def megatron_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM ``_vocab_size_with_padding``: up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _megatron_shapes(model: ModelConfig, padded: int) -> dict[str, tuple[int, ...]]:
    """Megatron key -> global shape of every exported tensor."""
    d, hd, layers = model.hidden_size, model.head_dim, model.num_layers
    h, k, f = model.num_attention_heads, model.num_kv_heads, model.ffn_hidden_size
    shapes = {
        GLOBAL_MAP["tok_embeddings.weight"]: (padded, d),
        GLOBAL_MAP["norm.weight"]: (d,),
        LAYERS + "self_attention.linear_qkv.layer_norm_weight": (layers, d),
        LAYERS + QKV: (layers, (h + 2 * k) * hd, d),
        LAYERS + "self_attention.linear_proj.weight": (layers, d, h * hd),
        LAYERS + "mlp.linear_fc1.layer_norm_weight": (layers, d),
        LAYERS + FC1: (layers, 2 * f, d),
        LAYERS + "mlp.linear_fc2.weight": (layers, d, f),
    }
    if not model.tie_embeddings:
        shapes[GLOBAL_MAP["output.weight"]] = (padded, d)
    return shapes


#: Megatron state kind -> our prefix (``param``: the fp32 main copy, our weights).
OUR_PREFIX = {"param": "", **{k: optim_fqn(k, "") for k in ("exp_avg", "exp_avg_sq")}}


class _Reader:
    """Builds each Megatron tensor (weights, or ``optimizer.state.<kind>.*``) from whole
    shardsmith tensors."""

    def __init__(self, step_store: Any, manifest: Any, model: ModelConfig, padded: int) -> None:
        self.store, self.manifest, self.model, self.padded = step_store, manifest, model, padded

    def ours(self, fqn: str) -> torch.Tensor:
        shape = tuple(self.manifest.tensors[fqn].shape)
        return read_box(self.store, self.manifest, fqn, Box((0,) * len(shape), shape)).to(
            torch.float32
        )

    def layer(self, name: str, i: int, prefix: str) -> torch.Tensor:
        p = f"{prefix}layers.{i}."
        if name == QKV:
            q, k, v = (self.ours(p + f"attention.{w}.weight") for w in ("wq", "wk", "wv"))
            return fuse_qkv(q, k, v, self.model)
        if name == FC1:
            return torch.cat(
                [self.ours(p + "feed_forward.w1.weight"), self.ours(p + "feed_forward.w3.weight")]
            )
        ours = next(o for o, (n, _) in LAYER_MAP.items() if n == name)
        return self.ours(p + ours)

    def __call__(self, key: str) -> torch.Tensor:
        prefix = ""
        if key.startswith(STATE):
            kind, key = key[len(STATE) :].split(".", 1)
            prefix = OUR_PREFIX[kind]
        if key.startswith(LAYERS):
            return torch.stack(
                [self.layer(key[len(LAYERS) :], i, prefix) for i in range(self.model.num_layers)]
            )
        ours = next(o for o, m in GLOBAL_MAP.items() if m == key)
        t = self.ours(prefix + ours)
        if ours != "norm.weight" and self.padded > t.shape[0]:
            t = torch.cat([t, t.new_zeros(self.padded - t.shape[0], t.shape[1])])
        return t


def _common_state(
    step_store: Any, manifest: Any, model: ModelConfig, step: int, with_optimizer: bool
) -> dict[str, Any]:
    """Megatron-LM's ``iteration`` / ``checkpoint_version``, and the optimizer's param groups."""
    common: dict[str, Any] = {"iteration": step, "checkpoint_version": 3.0}
    if with_optimizer:

        def read_step(fqn: str) -> float:
            return float(read_box(step_store, manifest, fqn, Box((), ())))

        fqns = list(param_specs(model, ParallelDims()))
        adam_step = common_steps(manifest.tensors, read_step, fqns, step_store.url)
        common.update(optimizer_common(manifest.config, adam_step))
    return common


def export_megatron(
    ckpt_url: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    divisible_by: int = 128,
    optimizer: bool = True,
    overwrite: bool = False,
    storage_options: dict | None = None,
) -> MegatronExportReport:
    """Write checkpoint ``ckpt_url`` as a Megatron-Core GPT ``torch_dist`` directory (float32)
    that ``dist_checkpointing.load`` reads into any tp/pp: the weights, and the Adam state in
    the distributed optimizer's ``fully_reshardable`` layout when the checkpoint has it (see
    :mod:`.megatron_optim`).

    Args:
        tp: Megatron TP degree the vocabulary padding is computed for.
        pp: checked to fit the layers (``torch_dist`` itself is layout-free).
        divisible_by: Megatron's ``--make-vocab-size-divisible-by``.
        optimizer: False: weights only even when the checkpoint has Adam state.

    Raises:
        CheckpointError: a model tensor is missing or misshapen.
        ConfigError: the parameters' Adam steps differ (Megatron keeps one per group).
        LayoutError: ``tp``/``pp`` do not divide the model.
        FileExistsError: ``out_dir`` already holds ``.metadata`` and ``overwrite`` is false.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    _, step_store, step = resolve_checkpoint(ckpt_url, storage_options)
    manifest = read_manifest(step_store)
    model = ModelConfig.from_json(manifest.model)
    param_specs(model, ParallelDims(tp=tp, pp=pp))  # LayoutError when tp/pp do not fit
    missing = [
        f
        for f, s in param_specs(model, ParallelDims()).items()
        if f not in manifest.tensors or tuple(manifest.tensors[f].shape) != s.shape
    ]
    if missing:
        raise CheckpointError(
            f"{step_store.url}: tensors {missing[:3]} are missing or misshapen; the "
            "checkpoint is incomplete or not a shardsmith Llama"
        )
    if os.path.exists(os.path.join(out_dir, METADATA_NAME)) and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds a checkpoint ({METADATA_NAME}); choose an empty "
            "directory or pass --overwrite"
        )
    padded = megatron_padded_vocab(model.vocab_size, tp, divisible_by)
    shapes = _megatron_shapes(model, padded)
    with_optim = optimizer and all(
        optim_fqn("exp_avg", f) in manifest.tensors for f in param_specs(model, ParallelDims())
    )
    if with_optim:
        shapes.update(
            {f"{STATE}{kind}.{k}": s for kind in OUR_PREFIX for k, s in list(shapes.items())}
        )
    sd: dict[str, Any] = {k: torch.empty(()).expand(s) for k, s in shapes.items()}
    sd["common_state/shard_0_1"] = [_common_state(step_store, manifest, model, step, with_optim)]
    for module in EXTRA_STATE_MODULES:
        for i in range(model.num_layers):
            sd[f"{LAYERS}{module}._extra_state/shard_{i}_{model.num_layers}"] = [None]
    os.makedirs(out_dir, exist_ok=True)
    writer = dcp.FileSystemWriter(
        out_dir, single_file_per_rank=False, thread_count=1, sync_files=False
    )
    planner = lazy_planner(_Reader(step_store, manifest, model, padded), set(shapes), flatten=False)
    save_one_process(sd, writer, planner)
    with open(os.path.join(out_dir, "metadata.json"), "w", encoding="utf-8") as f:
        json.dump(BACKEND_JSON, f)
    return MegatronExportReport(
        source=step_store.url,
        out_dir=os.path.abspath(out_dir),
        step=step,
        padded_vocab_size=padded,
        num_tensors=len(shapes),
        with_optimizer=with_optim,
        seconds=time.perf_counter() - t0,
    )
