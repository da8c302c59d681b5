"""Estimated step time of a training job on a GPU kind: the planner's cost model.

Pure (no torch). One optimizer step of a 1F1B pipeline (Narayanan et al. 2021, sec. 2.2) is
``M`` microbatch slots of the slowest stage, stretched by the bubble ``(P - 1) / (V * M)``,
plus the data-parallel gradient all-reduce between HSDP replicas. One microbatch slot of a
stage is the sum of:

* compute: model FLOPs of the stage's share of the microbatch (``flops_per_token * b * s /
  (tp * pp)``, scaled by the slowest stage's share of the work), x 4/3 with activation
  checkpointing (the forward runs twice), at ``peak * efficiency``. Efficiency depends on the
  matmul size: ``MAX_MATMUL_EFFICIENCY * d / (d + MATMUL_HALF_SIZE)``, ``d`` the smallest
  per-rank matmul dimension (``h/tp``, ``ffn/tp``, tokens ``b*s``): large GEMMs reach ~75 %
  of the dense bf16 peak on A100/H100 (cuBLAS, NVIDIA's "Matrix Multiplication Background"
  guide), narrow ones much less;
* tensor parallelism: Megatron's 2 all-reduces (or all-gather + reduce-scatter with sequence
  parallelism, the same bytes) of ``b*s*h`` values per layer in the forward and 2 in the
  backward (3 + 3 with recomputation), ring cost ``2 (t-1)/t * bytes`` over NVLink; not
  overlapped (Korthikanti et al. 2022, sec. 3);
* pipeline: one send of the stage's output and one of its input gradient, ``b*s*h`` values
  (``/t`` per rank with sequence parallelism), over the network;
* FSDP: the stage's parameters all-gathered twice (forward, backward) in the compute dtype and
  the gradients reduce-scattered in fp32, per microbatch (the trainer reduce-scatters each
  block's gradient every microbatch: ``ShardedGradPipelineStage``), ``(d-1)/d`` of the bytes,
  over NVLink when the data-parallel group fits in a node, else the network; overlapped with
  compute (FSDP2 prefetch), only the excess counts.

MFU = model FLOPs of the step (no recomputation) / (GPUs x peak x step time) (Chowdhery et al.
2022, appendix B). Constants are stated, not fitted to any published run.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from shardsmith.layout import ModelConfig, ParallelDims, stage_layers
from shardsmith.sizing.gpus import Gpu
from shardsmith.sizing.verdict import Job

#: Best fraction of the dense bf16 peak a large bf16 GEMM reaches (cuBLAS on A100/H100).
MAX_MATMUL_EFFICIENCY = 0.75
#: Smallest matmul dimension at which the efficiency is half of the best.
MATMUL_HALF_SIZE = 512
#: Fraction of the nominal link bandwidth a ring collective or a send achieves (NCCL bus
#: bandwidth is ~80-90 % of NVLink's and of 400 Gb/s InfiniBand's in nccl-tests).
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class StepCost:
    """Seconds of one optimizer step and its parts (per step, the slowest stage)."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    fsdp_exposed_s: float
    dp_allreduce_s: float
    bubble_s: float
    step_s: float
    mfu: float
    tokens_per_s: float


def matmul_efficiency(model: ModelConfig, tp: int, micro_batch_size: int) -> float:
    """``MAX_MATMUL_EFFICIENCY * d / (d + MATMUL_HALF_SIZE)``, ``d`` the smallest per-rank
    matmul dimension (module doc)."""
    d = min(model.hidden_size / tp, model.ffn_hidden_size / tp, micro_batch_size * model.seq_length)
    return MAX_MATMUL_EFFICIENCY * d / (d + MATMUL_HALF_SIZE)


def model_counts(model: ModelConfig) -> tuple[int, int, float]:
    """(largest layer's parameters, parameters outside the layers, FLOPs per token)."""
    from shardsmith.layout import flops_per_token
    from shardsmith.sizing.estimate import _specs

    layers: dict[str, int] = {}
    rest = 0
    for fqn, spec in _specs(model, ParallelDims()).items():
        if fqn.startswith("layers."):
            key = fqn.split(".")[1]
            layers[key] = layers.get(key, 0) + prod(spec.shape)
        else:
            rest += prod(spec.shape)
    return max(layers.values()), rest, flops_per_token(model)


def step_cost(
    job: Job, gpu: Gpu, gpus_per_node: int, counts: tuple[int, int, float] | None = None
) -> StepCost:
    """The step time of ``job`` on ``gpu`` (module doc). ``gpus_per_node`` decides which
    groups stay on NVLink: tp always (the planner keeps it in a node), data parallelism when
    ``tp * dp_shard <= gpus_per_node``. ``counts``: :func:`model_counts` of the job's model."""
    m, d = job.model, job.dims
    layer_params, root_params, per_token = counts or model_counts(m)
    c = 2 if job.mixed_precision == "bf16" else 4
    mb = job.micro_batch_size
    num_mb = job.global_batch_size // (mb * d.dp)
    tokens_mb = mb * m.seq_length
    work = [float(len(ls)) for ls in stage_layers(m, d)]
    per_layer_flops = (per_token / 3 - 2 * m.hidden_size * m.vocab_size) / m.num_layers
    work[-1] += 2 * m.hidden_size * m.vocab_size / per_layer_flops
    slowest = max(work) / (sum(work) / len(work))
    flops_mb = per_token * tokens_mb / (d.tp * d.pp) * slowest
    recompute = 4 / 3 if job.activation_checkpointing else 1.0
    compute = flops_mb * recompute / (gpu.peak_bf16_flops * matmul_efficiency(m, d.tp, mb))
    nvlink, net = (
        gpu.nvlink_bytes_per_s * LINK_EFFICIENCY,
        gpu.network_bytes_per_s * LINK_EFFICIENCY,
    )
    act_bytes = tokens_mb * m.hidden_size * c
    tp_comm = 0.0
    if d.tp > 1:
        tp_comm = (
            max(work)
            * (6 if job.activation_checkpointing else 4)
            * 2
            * (d.tp - 1)
            / d.tp
            * act_bytes
            / nvlink
        )
    pp_comm = 2 * act_bytes / (d.tp if job.sequence_parallel else 1) / net if d.pp > 1 else 0.0
    stage_params = (max(len(ls) for ls in stage_layers(m, d)) * layer_params + root_params) / d.tp
    fsdp = 0.0
    if d.dp_shard > 1:
        bw = nvlink if d.tp * d.dp_shard <= gpus_per_node else net
        fsdp = (d.dp_shard - 1) / d.dp_shard * stage_params * (2 * c + 4) / bw
    slot = compute + tp_comm + pp_comm + max(0.0, fsdp - compute)
    busy = num_mb * slot
    bubble = busy * (d.pp - 1) / (d.virtual_stages * num_mb)
    dp_ar = 0.0
    if d.dp_replicate > 1:
        dp_ar = 2 * (d.dp_replicate - 1) / d.dp_replicate * stage_params / d.dp_shard * 4 / net
    step = busy + bubble + dp_ar
    tokens = job.global_batch_size * m.seq_length
    return StepCost(
        compute_s=num_mb * compute,
        tp_comm_s=num_mb * tp_comm,
        pp_comm_s=num_mb * pp_comm,
        fsdp_exposed_s=num_mb * max(0.0, fsdp - compute),
        dp_allreduce_s=dp_ar,
        bubble_s=bubble,
        step_s=step,
        mfu=per_token * tokens / (d.world_size * gpu.peak_bf16_flops * step),
        tokens_per_s=tokens / step,
    )
