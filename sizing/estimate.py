"""What a layout costs, per rank, before anything runs (``shardsmith train --dry-run``).

Pure (no torch, no I/O). Parameter counts come from the sharding plan
(:func:`shardsmith.layout.sharding.param_specs` and its boxes), so they are the elements each
rank really holds. The rest are standard estimates, each with its source:

* bytes per parameter element: fp32 master weight 4 + fp32 gradient 4 + AdamW
  ``exp_avg``/``exp_avg_sq`` 8 (mixed precision keeps fp32 master weights);
* activations per layer and microbatch counted from what shardsmith's own block keeps
  (:mod:`shardsmith.sizing.activations`: ``2*(4h + 2ch) + 5cq/t + 4cf/t`` bytes per token at
  ``c`` bytes per value; fused attention, no dropout, so not Korthikanti et al. 2022's
  ``sbh(34 + 5as/h)``); with full activation recomputation (``--activation-checkpointing``,
  their section 4.1) ``c*h`` per token and layer (``/t`` with sequence parallelism) plus one
  layer's full set. 1F1B stage ``p`` of ``P`` holds ``min(P - p, M)`` microbatches (their
  sec. 4.2.3); with V chunks, what torch's interleaved 1F1B holds (``activations.binding_phase``);
* the last stage's logits and loss per microbatch, ``s*b*V/t*(c + 4 + 4 + 4)`` bytes under bf16
  (``s*b*V/t*(4 + 4 + 4)`` in fp32): logits, their fp32 copy, the log-softmax and its
  gradient (:func:`shardsmith.sizing.activations.loss_nbytes_per_token`);
* the peak (:func:`shardsmith.sizing.peak.transient_nbytes`): the sharded state and the kept activations are held
  all step; on top of them, the largest of three phases that never overlap: a block's
  backward (FSDP's unsharded block buffers, plus the output layer's gradient the last stage
  made first), the end of backward (every root gradient, the embedding's last), the loss;
* pipeline bubble ``(P - 1) / (V * M)`` of the step (Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters", section 2.2: 1F1B at V = 1, the
  interleaved schedule with V virtual stages per rank, sec. 2.2.2);
* MoE (:func:`moe_estimate`): experts and expert hidden units per rank from the plan's
  split (E/ep whole experts, F/tp of each), and the all-to-all traffic of the token
  dispatcher, ``4 * s*b*K*h * (ep-1)/ep`` values sent per rank, MoE layer and microbatch
  (dispatch and combine, forward and backward; Megatron's ``alltoall`` dispatcher);
* context parallelism (:func:`context_parallel_estimate`): each rank keeps the activations of
  its ``s/cp`` tokens; its attention runs the flash / memory-efficient kernel (a lower-right
  causal bias), so no ``s x s`` scores are kept (the ``5as/h`` term drops) but the all-gathered
  K and V of the whole sequence are, ``2*s*b*k*d/t`` values per layer (k kv heads of d); the
  all-gather receives ``(cp-1)/cp`` of them per layer and microbatch, and the backward's
  reduce-scatter sends as much (trainer/context_parallel/attention.py);
* FLOPs per token ``6*N + 12*L*H*Q*T`` (Chowdhery et al. 2022, "PaLM", appendix B; see
  :func:`flops_per_token`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from math import prod
from typing import Any

from shardsmith.layout import (
    MESH_AXES,
    ModelConfig,
    ParallelDims,
    TensorSpec,
    chunk_layers,
    flops_per_token,
    padded_vocab_size,
    param_specs,
    reshards_after_forward,
    stage_layers,
)
from shardsmith.sizing import activations as act
from shardsmith.sizing.gpus import process_groups, process_overhead_nbytes
from shardsmith.sizing.peak import stage_transient
from shardsmith.sizing.traffic import fsdp_numel

#: Bytes per parameter element: fp32 weight, fp32 gradient, AdamW's two fp32 moments.
PARAM_NBYTES, GRAD_NBYTES, OPTIM_NBYTES = 4, 4, 8

FORMULAS = {
    "activation": "per token, layer and microbatch 2*(4h + 2ch) + 5cq/t + 4cf/t bytes at c bytes per value "
    "(2 under bf16, 4 in fp32; q = heads*head_dim, f = ffn), the norms (4h + ch)/t + ch each with "
    "sequence parallelism (counted from shardsmith's block: fused attention keeps no s x s scores, "
    "no dropout; Korthikanti et al. 2022 eq. 2 counts sbh(34 + 5as/h) for GPT with both); with "
    "activation checkpointing c*h per layer (/t with SP) + one full layer (their sec. 4.1); off "
    "stage 0 the stage input; min(P - stage, M) microbatches in flight under 1F1B (sec. 4.2.3), "
    "per chunk as torch 2.13's interleaved 1F1B orders them with V virtual stages",
    "loss": "last stage, per microbatch: s*b*V/t*(c + 4 + 4 + 4) bytes at c = 2 (bf16), s*b*V/t*(4 + 4 + 4) in "
    "fp32: logits, their fp32 copy (bf16 only), log-softmax, its gradient",
    "peak": "weights + gradients + AdamW state + kept activations + gathered root parameters + the largest of: "
    "a block's FSDP buffers (+ the last stage's output gradient), all root gradients (end of "
    "backward), the loss",
    "bubble": "(P - 1) / (V * M), V virtual stages per rank (Narayanan et al. 2021, sec. 2.2: 1F1B at "
    "V = 1, interleaved 1F1B sec. 2.2.2)",
    "flops": "(6*N + 12*L*H*Q*T) * tokens, N = matmul parameters (all but the input embedding) "
    "(Chowdhery et al. 2022, PaLM, appendix B)",
    "memory": "per parameter element: fp32 weight 4 + fp32 gradient 4 + AdamW moments 8 bytes",
    "context_parallel": "tokens per rank s/cp; activations of s/cp tokens without the 5as/h scores "
    "(flash / memory-efficient attention) plus the gathered K,V 2*s*b*k*d/t values per "
    "layer; K/V all-gather per layer and microbatch 2*s*b*k*d/t*(cp-1)/cp values "
    "received (forward), as many sent by the backward's reduce-scatter",
    "moe": "experts per rank E/ep, expert hidden units per rank F/tp; all-to-all bytes sent per rank, "
    "MoE layer and microbatch 4*s*b*K*h*(ep-1)/ep values (dispatch + combine, forward + backward)",
}


_SPECS: dict[tuple[str, str], dict[str, TensorSpec]] = {}


def _specs(model: ModelConfig, dims: ParallelDims) -> dict[str, TensorSpec]:
    """:func:`param_specs`, remembered by the configs' reprs (the planner asks for the same
    layouts again); at most 64 kept."""
    key = (repr(model), repr(dims))
    if key not in _SPECS:
        if len(_SPECS) >= 64:
            _SPECS.pop(next(iter(_SPECS)))
        _SPECS[key] = param_specs(model, dims)
    return _SPECS[key]


def activation_nbytes_per_layer(
    model: ModelConfig,
    micro_batch_size: int,
    tp: int,
    *,
    bytes_per_value: int = 2,
    recompute: bool | str = False,
    sequence_parallel: bool = False,
    cp: int = 1,
) -> int:
    """Activation bytes one transformer layer keeps for one microbatch: ``s/cp * b`` times the
    per-token counts of :mod:`shardsmith.sizing.activations` (``recompute``: only the layer
    input, ``c*h``, over t with sequence parallelism; ``"op"``: what per-op selective
    checkpointing keeps); ``cp`` > 1 adds the K/V of the whole
    sequence that the layer's all-gather brought in and backward keeps."""
    tokens = model.seq_length // cp * micro_batch_size
    if recompute == "op":
        per_token = act.selective_layer_nbytes_per_token
        return int(
            tokens * per_token(model, tp, bytes_per_value, sequence_parallel=sequence_parallel)
        )
    if recompute:
        return int(
            tokens
            * act.checkpointed_layer_nbytes_per_token(
                model, tp, bytes_per_value, sequence_parallel=sequence_parallel
            )
        )
    kv = (
        0
        if cp == 1
        else (
            2
            * model.seq_length
            * micro_batch_size
            * max(1, model.num_kv_heads // tp)
            * model.head_dim
            * bytes_per_value
        )
    )
    return (
        int(
            tokens
            * act.layer_nbytes_per_token(
                model, tp, bytes_per_value, sequence_parallel=sequence_parallel
            )
        )
        + kv
    )


def context_parallel_estimate(
    model: ModelConfig, dims: ParallelDims, micro_batch_size: int, bytes_per_value: int
) -> dict[str, Any]:
    """The dry run's context-parallel figures (module doc); {} without cp.

    Returns ``cp``, ``tokens_per_rank`` (s/cp), ``kv_gather_nbytes_per_layer_microbatch``
    (bytes each rank receives by the K/V all-gather of one layer and microbatch in the forward;
    the backward's reduce-scatter sends as many) and ``rope_scaling`` (the model's, or None).
    """
    if dims.cp == 1:
        return {}
    kv_local = max(1, model.num_kv_heads // dims.tp)
    whole = 2 * model.seq_length * micro_batch_size * kv_local * model.head_dim * bytes_per_value
    return {
        "cp": dims.cp,
        "tokens_per_rank": model.seq_length // dims.cp,
        "kv_gather_nbytes_per_layer_microbatch": whole * (dims.cp - 1) // dims.cp,
        "rope_scaling": model.rope_scaling,
    }


@dataclass(frozen=True)
class RankRole:
    """Ranks that hold the same amounts: one pipeline stage, equal shard sizes.

    Byte counts are per rank. ``checkpoint_nbytes`` is what the rank holds of a checkpoint
    (weights + optimizer state: its async-save snapshot), replicas included.
    """

    stage: int
    layers: tuple[int, int]
    num_ranks: int
    example_rank: int
    num_params: int
    param_nbytes: int
    grad_nbytes: int
    optim_nbytes: int
    checkpoint_nbytes: int
    activation_nbytes: int
    microbatches_in_flight: int
    fsdp_buffer_nbytes: int = 0
    loss_nbytes: int = 0
    process_nbytes: int = 0
    root_grad_nbytes: int = 0
    transient_nbytes: int = 0

    @property
    def total_nbytes(self) -> int:
        """What PyTorch's allocator holds at the step's peak: weights + gradients + optimizer
        state + activations + the largest transient phase (:func:`transient_nbytes`: FSDP
        buffers, root gradients or the last stage's loss, which never coexist)."""
        return (
            self.param_nbytes
            + self.grad_nbytes
            + self.optim_nbytes
            + self.activation_nbytes
            + self.transient_nbytes
        )

    @property
    def tracked_peak_nbytes(self) -> int:
        """= :attr:`total_nbytes` (what a memory tracker of tensors sees)."""
        return self.total_nbytes

    @property
    def peak_nbytes(self) -> int:
        """Device memory the rank needs: the tracked peak plus the allocator margin, the CUDA
        context and NCCL buffers (:mod:`shardsmith.sizing.gpus`)."""
        from shardsmith.sizing.gpus import ALLOCATOR_MARGIN

        return int(self.total_nbytes * (1 + ALLOCATOR_MARGIN)) + self.process_nbytes

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict, with ``total_nbytes`` and ``peak_nbytes``."""
        return {
            **asdict(self),
            "layers": list(self.layers),
            "total_nbytes": self.total_nbytes,
            "peak_bytes": self.peak_nbytes,
        }


@dataclass(frozen=True)
class Estimate:
    """The whole dry-run report (see :func:`estimate`)."""

    model: ModelConfig
    dims: ParallelDims
    total_params: int
    checkpoint_nbytes: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    tokens_per_step: int
    pipeline_bubble_fraction: float
    flops_per_token: float
    flops_per_step: float
    roles: list[RankRole] = field(default_factory=list)
    moe: dict[str, Any] = field(default_factory=dict)
    context_parallel: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict: model config, layout, totals, formulas and one record per role."""
        out = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("model", "dims", "roles", "moe", "context_parallel")
        }
        if self.moe:
            out["moe"] = self.moe
        if self.context_parallel:
            out["context_parallel"] = self.context_parallel
        return {
            "model": self.model.to_json(),
            "parallel": {
                **self.dims.to_json(),
                "world_size": self.dims.world_size,
                "layout": self.dims.describe(),
            },
            **out,
            "flops_per_rank_per_step": self.flops_per_step / self.dims.world_size,
            "formulas": FORMULAS,
            "roles": [r.to_json() for r in self.roles],
        }


def _class_key(spec: TensorSpec) -> tuple[Any, ...]:
    return (spec.shape, spec.dim_axes, spec.pad_dim0_to, spec.tp_replicas)


def _local_numels(
    spec: TensorSpec, dims: ParallelDims, first_only: bool = False
) -> list[list[int]]:
    """``[tp index][FSDP index over dp_shard x cp]`` -> elements the rank holds (the plan's
    boxes); only ``[0][0]`` with ``first_only``."""
    coords = dict.fromkeys(MESH_AXES, 0)
    out = []
    for t in range(1 if first_only else dims.tp):
        row = []
        for i in range(1 if first_only else dims.fsdp):
            coords["tp"], (coords["dp_shard"], coords["cp"]) = t, divmod(i, dims.cp)
            row.append(spec.box(dims, coords).numel)
        out.append(row)
    return out


def _stage_numels(
    specs: dict[str, TensorSpec], dims: ParallelDims, first_only: bool = False
) -> list[dict[tuple[int, int], int]]:
    """Per stage: (tp index, dp_shard index) -> parameter elements held (only (0, 0) with
    ``first_only``). Tensors of equal shape and placement are counted once and multiplied
    (the layers repeat)."""
    per_class: dict[tuple[Any, ...], list[list[int]]] = {}
    counts: list[Counter] = [Counter() for _ in range(dims.pp)]
    for spec in specs.values():
        key = _class_key(spec)
        if key not in per_class:
            per_class[key] = _local_numels(spec, dims, first_only)
        for stage in spec.stages:
            counts[stage][key] += 1
    out = []
    for stage_counts in counts:
        cell: dict[tuple[int, int], int] = {}
        for t in range(1 if first_only else dims.tp):
            for i in range(1 if first_only else dims.fsdp):
                cell[(t, i)] = sum(n * per_class[k][t][i] for k, n in stage_counts.items())
        out.append(cell)
    return out


def _activation_nbytes(
    model: ModelConfig,
    dims: ParallelDims,
    stage: int,
    micro_batch_size: int,
    num_microbatches: int,
    bytes_per_value: int,
    recompute: bool | str,
    sequence_parallel: bool = False,
    block_nbytes: int = 0,
) -> tuple[int, int, bool]:
    """(activation bytes, most microbatches of a chunk in flight, whether the binding backward's
    chunk prefetches a block: :func:`act.binding_phase`) of a rank of ``stage`` (module doc)."""
    layers = stage_layers(model, dims)[stage]
    kw = {"bytes_per_value": bytes_per_value, "sequence_parallel": sequence_parallel, "cp": dims.cp}
    every = int(recompute) if isinstance(recompute, str) and recompute.isdigit() else 0
    redone = [bool(recompute) and (not every or (i + 1) % every == 0) for i in layers]
    per_layer = partial(activation_nbytes_per_layer, model, micro_batch_size, dims.tp, **kw)
    kept, plain = per_layer(recompute=every > 0 or recompute), per_layer()
    redo, chunks = dict(zip(layers, redone)), chunk_layers(model, dims)
    nbytes = [  # per chunk: its layers, and off chunk 0 the received input (a copy) unless redone
        sum(kept if redo[i] else plain for i in chunks[k])
        + (per_layer(recompute=True) if k and not redo[chunks[k][0]] else 0)
        for k in dims.chunk_ids(stage)
    ]
    prefetch = [len(chunks[k]) > 1 for k in dims.chunk_ids(stage)]
    extra = [block_nbytes * p for p in prefetch]  # a chunk of 2+ layers: FSDP's prefetched block
    counts, k = act.binding_phase(dims, stage, num_microbatches, nbytes, extra)
    total = int(sum(n * b for n, b in zip(counts, nbytes))) + (plain if any(redone) else 0)
    return total, max(counts), prefetch[k]


def unsharded_numels(model: ModelConfig, dims: ParallelDims) -> tuple[list[int], list[int]]:
    """Per stage: (largest transformer block's, root's) parameter elements one rank holds
    while FSDP has them all-gathered (its TP share; expert-parallel experts, never gathered,
    left out). The root is what is not in a block: embedding, final norm, output."""
    one = replace(dims, dp_replicate=1, dp_shard=1, cp=1, expert_parallel=1)
    coords = dict.fromkeys(MESH_AXES, 0)
    blocks: list[Counter] = [Counter() for _ in range(dims.pp)]
    roots = [0] * dims.pp
    numels: dict[tuple[Any, ...], int] = {}
    for fqn, spec in _specs(model, one).items():
        if dims.expert_parallel > 1 and ".experts." in fqn:
            continue
        key = _class_key(spec)
        if key not in numels:
            numels[key] = spec.box(one, coords).numel
        for stage in spec.stages:
            if fqn.startswith("layers."):
                blocks[stage][fqn.split(".")[1]] += numels[key]
            else:
                roots[stage] += numels[key]
    return [max(b.values(), default=0) for b in blocks], roots


def root_grad_numels(model: ModelConfig, dims: ParallelDims) -> list[int]:
    """Per stage: gradient elements one rank holds for the parameters outside the blocks while
    backward produces them: their TP share, but the vocab-parallel embedding's gradient comes
    back ``Replicate`` over tp (``RowwiseParallel`` on ``nn.Embedding``; redistributed by
    ``parallel.finalize_grads`` after backward): each TP rank holds the whole ``V x h``."""
    _, roots = unsharded_numels(model, dims)
    out = list(roots)
    if dims.tp > 1:
        vh = padded_vocab_size(model.vocab_size, dims.tp) * model.hidden_size
        for stage in range(dims.pp):
            if stage == 0 or (model.tie_embeddings and stage == dims.pp - 1):
                out[stage] += vh - vh // dims.tp
    return out


def _stage_roles(
    model: ModelConfig,
    dims: ParallelDims,
    specs: dict[str, TensorSpec],
    stage: int,
    cells: dict[tuple[int, int], int],
    extra: dict[str, int],
) -> list[RankRole]:
    """The roles of one stage: its ranks grouped by the parameter elements they hold."""
    layers = stage_layers(model, dims)[stage]
    num_tensors = sum(1 for s in specs.values() if stage in s.stages)
    groups: dict[int, list[tuple[int, int]]] = {}
    for cell, numel in cells.items():
        groups.setdefault(numel, []).append(cell)
    roles = []
    for numel, members in sorted(groups.items(), reverse=True):
        t, i = members[0]
        rank = dims.rank_of(
            {"pp": stage, "dp_replicate": 0, "dp_shard": i // dims.cp, "cp": i % dims.cp, "tp": t}
        )
        roles.append(
            RankRole(
                stage=stage,
                layers=(layers[0], layers[-1]),
                num_ranks=len(members) * dims.dp_replicate,
                example_rank=rank,
                num_params=numel,
                param_nbytes=PARAM_NBYTES * numel,
                grad_nbytes=GRAD_NBYTES * numel,
                optim_nbytes=OPTIM_NBYTES * numel,
                checkpoint_nbytes=(PARAM_NBYTES + OPTIM_NBYTES) * numel + 4 * num_tensors,
                **extra,
            )
        )
    return roles


def estimate(
    model: ModelConfig,
    dims: ParallelDims,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    activation_checkpointing: bool | str = False,
    mixed_precision: str = "fp32",
    sequence_parallel: bool = False,
    first_rank_only: bool = False,
    fsdp_reshard_after_forward: str = "default",
) -> Estimate:
    """Per-role memory, FLOPs and bubble of training ``model`` under ``dims`` (module doc).

    ``fsdp_reshard_after_forward``: the FSDP policy (:mod:`shardsmith.layout.fsdp_policy`);
    when parameters stay gathered for the step, each stage holds them and their fp32
    gradients unsharded (:func:`shardsmith.sizing.peak.stage_transient`).

    ``first_rank_only``: one role per stage, the rank with tp = dp_shard = 0, which holds the
    largest shares (``torch.chunk`` gives the remainder to the first chunks); its
    ``num_ranks`` is 1. The planner's fast filter; the full report groups every rank.

    Runs in well under a second for 405B parameters on 16,384 ranks: work grows with
    ``tp * dp_shard`` and the number of distinct tensor shapes, not with layers or ranks.

    Raises:
        LayoutError: the layout does not fit the model.
        ConfigError: the global batch is not a multiple of micro batch x dp.
    """
    from shardsmith.errors import ConfigError

    if (
        global_batch_size % (micro_batch_size * dims.dp)
        or global_batch_size < micro_batch_size * dims.dp
    ):
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
            f"{micro_batch_size} x dp={dims.dp}"
        )
    num_microbatches = global_batch_size // (micro_batch_size * dims.dp)
    specs = _specs(model, dims)
    c = 2 if mixed_precision == "bf16" else 4
    blocks, roots = unsharded_numels(model, dims)
    root_grads = root_grad_numels(model, dims)
    groups = process_groups(dims)
    keep_gathered = not reshards_after_forward(fsdp_reshard_after_forward, dims.pp)
    roles = []
    for stage, cells in enumerate(_stage_numels(specs, dims, first_rank_only)):
        act_nbytes, in_flight, prefetch = _activation_nbytes(
            model,
            dims,
            stage,
            micro_batch_size,
            num_microbatches,
            c,
            activation_checkpointing,
            sequence_parallel,
            0 if keep_gathered else c * blocks[stage],
        )
        gathered = fsdp_numel(model, dims, stage) if keep_gathered else 0
        numels = (blocks[stage], roots[stage], root_grads[stage])
        extra = {
            "activation_nbytes": act_nbytes,
            "microbatches_in_flight": in_flight,
            **stage_transient(model, dims, stage, *numels, c, micro_batch_size, gathered, prefetch),
            "process_nbytes": process_overhead_nbytes(groups),
        }
        roles.extend(_stage_roles(model, dims, specs, stage, cells, extra))
    total = sum(prod(s.shape) for s in specs.values())
    tokens = global_batch_size * model.seq_length
    per_token = flops_per_token(model)
    return Estimate(
        model=model,
        dims=dims,
        total_params=total,
        checkpoint_nbytes=(PARAM_NBYTES + OPTIM_NBYTES) * total + 4 * len(specs),
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        num_microbatches=num_microbatches,
        tokens_per_step=tokens,
        pipeline_bubble_fraction=(dims.pp - 1) / (dims.virtual_stages * num_microbatches),
        flops_per_token=per_token,
        flops_per_step=per_token * tokens,
        roles=roles,
        moe=moe_estimate(model, dims, micro_batch_size, c),
        context_parallel=context_parallel_estimate(model, dims, micro_batch_size, c),
    )


def moe_estimate(
    model: ModelConfig, dims: ParallelDims, micro_batch_size: int, bytes_per_value: int
) -> dict[str, Any]:
    """The dry run's MoE figures (module doc); {} for a dense model.

    Returns ``num_moe_layers``, ``experts_per_rank`` (E/ep), ``expert_ffn_per_rank`` (F/tp,
    rounded up), ``expert_params`` (all layers, all experts), ``active_expert_params_per_token``
    (K of E) and ``dispatch_nbytes_per_layer_microbatch`` (bytes each rank sends by all-to-all
    per MoE layer and microbatch, forward and backward; 0 without expert parallelism).
    """
    if not model.num_experts:
        return {}
    e, f, h, k = model.num_experts, model.expert_ffn_size, model.hidden_size, model.moe_router_topk
    layers = sum(1 for i in range(model.num_layers) if model.is_moe_layer(i))
    ep = dims.expert_parallel
    values = 4 * model.seq_length * micro_batch_size * k * h * (ep - 1) // ep
    return {
        "num_moe_layers": layers,
        "experts_per_rank": e // ep,
        "expert_ffn_per_rank": -(-f // dims.tp),
        "expert_params": layers * 3 * e * f * h,
        "active_expert_params_per_token": layers * 3 * k * f * h,
        "dispatch_nbytes_per_layer_microbatch": values * bytes_per_value,
    }
