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
* communication: the bytes of :func:`shardsmith.sizing.traffic.step_traffic` (what the
  trainer moves, per rank and step, by group; ``bench/comm_volume.py`` checks it on the real
  step), at ``LINK_EFFICIENCY`` of the link: TP over NVLink, not overlapped (Korthikanti et al.
  2022, sec. 3); the pipeline's sends over the network (each chunk boundary of the rank);
  FSDP over NVLink when the data-parallel group fits in a node, else the network; CP's K/V
  all-gather and its backward's reduce-scatter not overlapped (attention waits for them:
  ``trainer/context_parallel/attention.py``), over NVLink when ``tp * cp`` fits in a node,
  else the network. A CP rank computes ``s / cp`` tokens of each microbatch (its attention
  share too: the load-balanced chunks give every rank the same causal work);
* FSDP, exchanged per microbatch (``--fsdp-reshard-after-forward always``): overlapped with
  the microbatch's compute (FSDP2 prefetch), only the excess counts; exchanged once per step
  (``never``, the default under pipelining): the all-gather overlaps the first microbatch's
  forward (a third of its compute) and the reduce-scatter after the last backward is exposed.

The HSDP all-reduce (once per step) is exposed. The bubble is ``(P - 1) / (V * M)`` of the
busy time for every schedule when ``M >= P`` (``(P - 1) / M`` below: virtual stages then do
not fill the pipeline) (the interleaved and zero-bubble schedules are charged as
interleaved 1F1B: no further gain is claimed).

MFU = model FLOPs of the step (no recomputation) / (GPUs x peak x step time) (Chowdhery et al.
2022, appendix B). Constants are stated, not fitted to any published run.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from shardsmith.layout import ModelConfig, ParallelDims, reshards_after_forward, stage_layers
from shardsmith.sizing.gpus import Gpu
from shardsmith.sizing.traffic import rank_traffic
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
    cp_comm_s: float
    fsdp_exposed_s: float
    dp_allreduce_s: float
    bubble_s: float
    step_s: float
    mfu: float
    tokens_per_s: float

    #: The parts of the step, in the order ``plan`` and the dry run print them.
    PARTS = (
        "compute_s",
        "tp_comm_s",
        "pp_comm_s",
        "cp_comm_s",
        "fsdp_exposed_s",
        "bubble_s",
        "dp_allreduce_s",
    )

    def parts(self) -> dict[str, float]:
        """Seconds of each part of the step (:attr:`PARTS`), by field name."""
        return {k: getattr(self, k) for k in self.PARTS}


def matmul_efficiency(model: ModelConfig, tp: int, micro_batch_size: int, cp: int = 1) -> float:
    """``MAX_MATMUL_EFFICIENCY * d / (d + MATMUL_HALF_SIZE)``, ``d`` the smallest per-rank
    matmul dimension (module doc): a CP rank's matmuls see ``s / cp`` tokens."""
    tokens = micro_batch_size * model.seq_length / cp
    d = min(model.hidden_size / tp, model.ffn_hidden_size / tp, tokens)
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


def _traffic(job: Job) -> tuple[float, float, float, float, float, float]:
    """Per step, the largest over pipeline ranks: (TP bytes of the rank with the most layers,
    PP bytes, FSDP all-gather bytes, FSDP reduce-scatter bytes, HSDP all-reduce bytes, CP
    bytes)."""

    d = job.dims
    reshard = reshards_after_forward(job.fsdp_reshard_after_forward, d.pp)
    per_rank = rank_traffic(
        job.model,
        d,
        micro_batch_size=job.micro_batch_size,
        num_microbatches=job.global_batch_size // (job.micro_batch_size * d.dp),
        mixed_precision=job.mixed_precision,
        reshard_after_forward=reshard,
        sequence_parallel=job.sequence_parallel,
        activation_checkpointing=job.activation_checkpointing,
    )
    c = 2 if job.mixed_precision == "bf16" else 4
    gathers = 2 * c if reshard else c  # dp_shard bytes split into all-gather and reduce-scatter
    fsdp = max(t["dp_shard"] for t in per_rank)
    return (
        max(t["tp"] for t in per_rank),
        max(t["pp"] for t in per_rank),
        fsdp * gathers / (gathers + 4),
        fsdp * 4 / (gathers + 4),
        max(t["dp_replicate"] for t in per_rank),
        max(t["cp"] for t in per_rank),
    )


def step_cost(
    job: Job, gpu: Gpu, gpus_per_node: int, counts: tuple[int, int, float] | None = None
) -> StepCost:
    """The step time of ``job`` on ``gpu`` (module doc). ``gpus_per_node`` decides which
    groups stay on NVLink: tp always (the planner keeps it in a node), data parallelism when
    ``tp * dp_shard * cp <= gpus_per_node``, cp when ``tp * cp <= gpus_per_node``.
    ``counts``: :func:`model_counts` of the job's model."""
    m, d = job.model, job.dims
    per_token = (counts or model_counts(m))[2]
    mb = job.micro_batch_size
    num_mb = job.global_batch_size // (mb * d.dp)
    tokens_mb = mb * m.seq_length / d.cp  # a CP rank's share of the microbatch
    work = [float(len(ls)) for ls in stage_layers(m, d)]
    per_layer_flops = (per_token / 3 - 2 * m.hidden_size * m.vocab_size) / m.num_layers
    work[-1] += 2 * m.hidden_size * m.vocab_size / per_layer_flops
    slowest = max(work) / (sum(work) / len(work))
    flops_mb = per_token * tokens_mb / (d.tp * d.pp) * slowest
    recompute = 4 / 3 if job.activation_checkpointing else 1.0
    compute = flops_mb * recompute / (gpu.peak_bf16_flops * matmul_efficiency(m, d.tp, mb, d.cp))
    nvlink, net = (
        gpu.nvlink_bytes_per_s * LINK_EFFICIENCY,
        gpu.network_bytes_per_s * LINK_EFFICIENCY,
    )
    tp_bytes, pp_bytes, gather_bytes, reduce_bytes, replica_bytes, cp_bytes = _traffic(job)
    tp_comm, pp_comm = tp_bytes / num_mb / nvlink, pp_bytes / num_mb / net
    cp_comm = cp_bytes / num_mb / (nvlink if d.tp * d.cp <= gpus_per_node else net)
    bw = nvlink if d.tp * d.fsdp <= gpus_per_node else net
    if reshards_after_forward(job.fsdp_reshard_after_forward, d.pp):
        fsdp_exposed = num_mb * max(0.0, (gather_bytes + reduce_bytes) / bw / num_mb - compute)
    else:
        fsdp_exposed = max(0.0, gather_bytes / bw - compute / 3) + reduce_bytes / bw
    busy = num_mb * (compute + tp_comm + pp_comm + cp_comm)
    # fewer microbatches than stages: a chunk's round leaves the rank idle, whatever V
    bubble = busy * (d.pp - 1) / ((d.virtual_stages if num_mb >= d.pp else 1) * num_mb)
    dp_ar = replica_bytes / net
    step = busy + bubble + fsdp_exposed + dp_ar
    tokens = job.global_batch_size * m.seq_length
    return StepCost(
        compute_s=num_mb * compute,
        tp_comm_s=num_mb * tp_comm,
        pp_comm_s=num_mb * pp_comm,
        cp_comm_s=num_mb * cp_comm,
        fsdp_exposed_s=fsdp_exposed,
        dp_allreduce_s=dp_ar,
        bubble_s=bubble,
        step_s=step,
        mfu=per_token * tokens / (d.world_size * gpu.peak_bf16_flops * step),
        tokens_per_s=tokens / step,
    )
