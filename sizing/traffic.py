"""Bytes one rank moves per optimizer step, by process-group kind: the one formula behind the
cost model's communication terms (:mod:`shardsmith.sizing.cost`) and the check of the real step
(``bench/comm_volume.py``).

Pure (no torch). Bytes are *bus bytes* per rank, the convention of nccl-tests
(``doc/PERFORMANCE.md``: the bytes each rank's link carries in a ring): an all-gather or a
reduce-scatter over ``n`` ranks moves ``(n - 1) / n`` of the whole (gathered / reduced) buffer,
an all-reduce ``2 (n - 1) / n`` of it, a send its bytes (receives are not counted: every byte
is counted once, by its sender). What the trainer does, group by group:

* ``dp_shard`` (FSDP2 over ``dp_shard * cp``, ``trainer.parallel.apply_fsdp``): every FSDP unit
  of the rank (each transformer block and the rest of each model chunk, its ``root``) all-gathers
  its parameters in the compute dtype (``c`` bytes: 2 under bf16, 4 in fp32) and reduce-scatters
  its gradients in fp32. FSDP2 pads dim 0 of every tensor to a multiple of the degree ``d``, so a
  unit's gathered buffer is ``sum(ceil(rows / d) * d * cols)`` elements of its TP-local tensors.
  Per step, with ``M`` microbatches: ``M`` reduce-scatters and ``2 M`` all-gathers (forward and
  backward) when parameters are resharded after forward (``--fsdp-reshard-after-forward
  always``), one of each when they are not (``never``, and ``default`` under pipelining: the
  gradients accumulate unsharded in fp32 and are reduced once, after each chunk's last backward,
  as PyTorch's ``PipelineStage.perform_reduce_grad`` does; schedules that split the backward
  into input and weight halves, the zero-bubble ones, always do this:
  ``trainer.pipeline.splits_backward``);
* ``dp_replicate`` (HSDP): one all-reduce of the rank's fp32 gradient shards per step
  (``FSDPModule.set_requires_all_reduce`` holds it until the last microbatch);
* ``pp``: per microbatch, each of the rank's chunks sends its output forward (unless it is the
  last stage) and its input gradient backward (unless it is the first), ``b * s/cp * h`` values
  (``/ tp`` under sequence parallelism), except between two stages on the same rank;
* ``tp`` (Megatron, Korthikanti et al. 2022 sec. 3): per layer and microbatch two all-reduces of
  ``b * s/cp * h`` values forward and two backward, three and three with full recomputation
  (with sequence parallelism an all-gather and a reduce-scatter each, the same bus bytes), and one
  more on the first stage (the vocab-parallel embedding's forward) and on the last (the output
  projection's input gradient); the loss-parallel scalars are left out;
* ``cp`` (``trainer/context_parallel/attention.py``): per layer and microbatch the K/V
  all-gather, ``2 * s * b * k * d_head / t`` values times ``(cp - 1) / cp``, as many by the
  backward's reduce-scatter, and a second all-gather with full recomputation (it sits inside
  the checkpointed block);
* ``ep``: per MoE layer and microbatch ``4 * s/cp * b * K * h * (ep - 1) / ep`` values
  (Megatron's all-to-all dispatcher: dispatch and combine, forward and backward).
"""

from __future__ import annotations

from collections import Counter
from math import prod

from shardsmith.layout import MESH_AXES, ModelConfig, ParallelDims, param_specs, stage_layers

#: Process-group kinds, one per mesh axis a collective runs over (FSDP's flattened
#: ``dp_shard * cp`` group counts as ``dp_shard``).
GROUP_KINDS: tuple[str, ...] = ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep")

_SHAPES: dict[tuple[str, str, bool], tuple[tuple[tuple[int, int, int], ...], ...]] = {}


def _fsdp_shapes(
    model: ModelConfig, plain: ParallelDims, skip_experts: bool
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per pipeline rank: ``(rows, columns, count)`` of the TP-local tensors FSDP2 shards (TP
    rank 0's, the largest), counted over the rank's units; expert-parallel experts (never
    gathered) left out with ``skip_experts``. ``plain``: tp, pp, virtual stages, split only."""
    key = (repr(model), repr(plain), skip_experts)
    if key in _SHAPES:
        return _SHAPES[key]
    coords = dict.fromkeys(MESH_AXES, 0)
    per_rank: list[Counter] = [Counter() for _ in range(plain.pp)]
    for fqn, spec in param_specs(model, plain).items():
        if skip_experts and ".experts." in fqn:
            continue
        lengths = spec.local_lengths(plain, coords)
        rows = lengths[0] if lengths else 1
        for stage in spec.stages:
            per_rank[stage][(rows, prod(lengths[1:]))] += 1
    if len(_SHAPES) >= 256:
        _SHAPES.clear()
    _SHAPES[key] = tuple(tuple((r, c, n) for (r, c), n in sorted(x.items())) for x in per_rank)
    return _SHAPES[key]


def fsdp_numel(model: ModelConfig, dims: ParallelDims, pp_rank: int) -> int:
    """Elements of all FSDP units of ``pp_rank`` as FSDP2 gathers them: every TP-local tensor's
    dim 0 padded to a multiple of the FSDP degree (``dp_shard * cp``)."""
    return _fsdp_numels(model, dims)[pp_rank]


def _fsdp_numels(model: ModelConfig, dims: ParallelDims) -> list[int]:
    """:func:`fsdp_numel` of every pipeline rank."""
    plain = ParallelDims(
        tp=dims.tp,
        pp=dims.pp,
        virtual_stages=dims.virtual_stages,
        pipeline_split=dims.pipeline_split,
    )
    d = dims.fsdp
    return [
        sum(-(-r // d) * d * c * n for r, c, n in shapes)
        for shapes in _fsdp_shapes(model, plain, dims.expert_parallel > 1)
    ]


def stage_rank(stage: int, pp: int, v_shaped: bool = False) -> int:
    """The pipeline rank of pipeline stage ``stage``: ``stage % pp`` (Megatron's interleaved
    loop), or the V shape of zero-bubble V schedules (down ``0..pp-1``, then back up)."""
    if not v_shaped:
        return stage % pp
    lap, pos = divmod(stage, pp)
    return pos if lap % 2 == 0 else pp - 1 - pos


def pp_sends(dims: ParallelDims, pp_rank: int, v_shaped: bool = False) -> int:
    """Activations and gradients ``pp_rank`` sends per microbatch (module doc)."""
    if dims.pp == 1:
        return 0
    stages = dims.num_chunks
    out = 0
    for k in range(stages):
        if stage_rank(k, dims.pp, v_shaped) != pp_rank:
            continue
        if k < stages - 1 and stage_rank(k + 1, dims.pp, v_shaped) != pp_rank:
            out += 1
        if k > 0 and stage_rank(k - 1, dims.pp, v_shaped) != pp_rank:
            out += 1
    return out


def step_traffic(
    model: ModelConfig,
    dims: ParallelDims,
    *,
    pp_rank: int,
    micro_batch_size: int,
    num_microbatches: int,
    mixed_precision: str = "fp32",
    reshard_after_forward: bool = True,
    sequence_parallel: bool = False,
    activation_checkpointing: bool | str = False,
    v_shaped: bool = False,
) -> dict[str, float]:
    """Bus bytes rank ``pp_rank`` (TP rank 0, the largest shares) moves per optimizer step, by
    :data:`GROUP_KINDS` (module doc). ``reshard_after_forward``: the resolved FSDP policy
    (:func:`shardsmith.layout.reshards_after_forward`); ``v_shaped``: the stage map of a V
    schedule."""
    return rank_traffic(
        model,
        dims,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing,
        v_shaped=v_shaped,
    )[pp_rank]


def rank_traffic(
    model: ModelConfig,
    dims: ParallelDims,
    *,
    micro_batch_size: int,
    num_microbatches: int,
    mixed_precision: str = "fp32",
    reshard_after_forward: bool = True,
    sequence_parallel: bool = False,
    activation_checkpointing: bool | str = False,
    v_shaped: bool = False,
) -> list[dict[str, float]]:
    """:func:`step_traffic` of every pipeline rank, in pipeline-rank order (the layout's
    stage map and FSDP shapes worked out once: the planner asks this thousands of times)."""
    c = 2 if mixed_precision == "bf16" else 4
    m, mb = num_microbatches, micro_batch_size
    layers_of = stage_layers(model, dims)
    numels = _fsdp_numels(model, dims) if dims.dp_replicate * dims.fsdp > 1 else []
    tokens = mb * model.seq_length / dims.cp
    act = tokens * model.hidden_size * c
    recompute = bool(activation_checkpointing)  # the forward's collectives run again
    kv = 2 * model.seq_length * mb * max(1, model.num_kv_heads // dims.tp) * model.head_dim * c
    out = []
    for pp_rank, layers in enumerate(layers_of):
        row = dict.fromkeys(GROUP_KINDS, 0.0)
        if numels:
            d, r = dims.fsdp, dims.dp_replicate
            gathers, reduces = (2 * m, m) if reshard_after_forward else (1, 1)
            row["dp_shard"] = (d - 1) / d * numels[pp_rank] * (gathers * c + reduces * 4)
            row["dp_replicate"] = 2 * (r - 1) / r * numels[pp_rank] / d * 4
        sp = dims.tp if sequence_parallel and dims.tp > 1 else 1
        row["pp"] = m * pp_sends(dims, pp_rank, v_shaped) * act / sp
        if dims.tp > 1:
            ends = sum(
                stage_rank(k, dims.pp, v_shaped) == pp_rank for k in (0, dims.num_chunks - 1)
            )  # the embedding's forward, the output projection's backward
            per_mb = len(layers) * (6 if recompute else 4) + ends
            row["tp"] = m * per_mb * 2 * (dims.tp - 1) / dims.tp * act
        if dims.cp > 1:
            row["cp"] = m * len(layers) * (3 if recompute else 2) * kv * (dims.cp - 1) / dims.cp
        if model.num_experts and dims.expert_parallel > 1:
            ep = dims.expert_parallel
            moe = sum(1 for i in layers if model.is_moe_layer(i))
            k, h = model.moe_router_topk, model.hidden_size
            row["ep"] = m * moe * 4 * tokens * k * h * (ep - 1) / ep * c
        out.append(row)
    return out
