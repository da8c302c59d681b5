"""``shardsmith plan``: search the layouts of a model on N GPUs, keep those that fit, rank by
the estimated step time of :mod:`shardsmith.sizing.cost`.

Pure (no torch). The search space: tp in 1, 2, 4, 8 within a node (a divisor of
``gpus_per_node``), pp a divisor of the GPUs up to the layer count, virtual stages 1 to
:data:`MAX_VIRTUAL_STAGES` (up to one layer per chunk; when the chunks do not divide the layers,
an uneven ``--pipeline-split`` with the first and last chunks one layer shorter:
:func:`balanced_split`, as Llama 3 405B's 126 layers on 16 stages), both FSDP exchange
policies (``--fsdp-reshard-after-forward``: the default, and the other one: ``always`` under
pipelining, ``never`` without), dp_shard the whole data-parallel degree or HSDP with dp_shard = 8,
16, 32, 64 replicated over the rest, context parallelism (cp) over powers of two that leave
each CP rank :data:`MIN_TOKENS_PER_CP_RANK` tokens or more (long sequences only; the split
checked by :func:`shardsmith.layout.check_sequence_split`), micro-batch size 1, 2, 4,
activation checkpointing off
and on, sequence parallelism whenever tp > 1 (same communication, less memory), bf16, and
expert parallelism over dp_shard for a MoE model. Every candidate is first ranked by the cost
model (no memory needed); the memory check (:func:`shardsmith.sizing.estimate.estimate`, fast
path: the rank with tp = dp_shard = 0 of each stage, which holds the largest shares under
``torch.chunk``'s split, so its peak is the stage's) runs in that order until ``top`` fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims, check_sequence_split, validate_layout
from shardsmith.sizing.cost import StepCost, model_counts, step_cost
from shardsmith.sizing.gpus import Gpu
from shardsmith.sizing.verdict import Job, max_peak, warnings

MAX_MEMORY_CHECKS = 3000
#: The largest number of virtual stages (model chunks per pipeline rank) searched.
MAX_VIRTUAL_STAGES = 8
#: Context parallelism is searched only while every CP rank keeps at least this many tokens of
#: each sequence: Llama 3 405B's long-context stage ran CP 16 at 131,072 tokens, 8,192 per rank
#: (Llama 3 paper, sec. 3.3.2 and Table 4), and trained at 8,192 tokens without CP. Shorter
#: shares only shrink every matmul while the K/V all-gather's bytes stay.
MIN_TOKENS_PER_CP_RANK = 8192


def balanced_split(num_layers: int, num_chunks: int) -> tuple[int, ...]:
    """Layers per chunk, as even as they go, the shorter chunks first and last alternately
    (the first stage also embeds, the last also projects and takes the loss); ``()`` when the
    chunks divide the layers (the even split needs no flag)."""
    base, extra = divmod(num_layers, num_chunks)
    if not extra:
        return ()
    counts = [base + 1] * num_chunks
    for i in range(num_chunks - extra):
        counts[i // 2 if i % 2 == 0 else num_chunks - 1 - i // 2] -= 1
    return tuple(counts)


@dataclass(frozen=True)
class Candidate:
    """A job that fits, its peak memory per GPU and its estimated step."""

    job: Job
    peak_nbytes: int
    cost: StepCost

    def to_json(self, device_nbytes: int, model_flags: list[str]) -> dict[str, Any]:
        """``fits``, ``layout``, ``flags``, ``command``, memory, step time, MFU, tokens/s."""
        flags = model_flags + self.job.flags()
        return {
            "fits": self.peak_nbytes <= device_nbytes,
            "layout": self.job.dims.describe(),
            "flags": flags,
            "command": "shardsmith train " + " ".join(flags),
            "peak_bytes": self.peak_nbytes,
            "headroom_bytes": device_nbytes - self.peak_nbytes,
            "step_s": self.cost.step_s,
            "mfu": self.cost.mfu,
            "tokens_per_s": self.cost.tokens_per_s,
            "bubble_fraction": self.cost.bubble_s / self.cost.step_s if self.cost.step_s else 0.0,
            "cost_s": self.cost.parts(),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_degrees(model: ModelConfig, ranks: int) -> list[int]:
    """Context-parallel degrees searched on ``ranks`` ranks: 1, and the powers of two dividing
    ``ranks`` that leave every CP rank :data:`MIN_TOKENS_PER_CP_RANK` tokens or more (the
    sequence's split itself is :func:`shardsmith.layout.check_sequence_split`'s to judge)."""
    out, cp = [1], 2
    while ranks % cp == 0 and model.seq_length // cp >= MIN_TOKENS_PER_CP_RANK:
        out.append(cp)
        cp *= 2
    return out


def layouts(model: ModelConfig, gpus: int, gpus_per_node: int) -> Iterator[ParallelDims]:
    """Every valid layout of the search space (module doc) on ``gpus`` GPUs."""
    for tp in (1, 2, 4, 8):
        if tp > gpus_per_node or gpus_per_node % tp or gpus % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > min(model.num_layers, 64):
                continue
            for cp in cp_degrees(model, gpus // (tp * pp)):
                yield from _layouts_at(model, gpus // (tp * pp * cp), tp, pp, cp)


def _layouts_at(model: ModelConfig, dp: int, tp: int, pp: int, cp: int) -> Iterator[ParallelDims]:
    """The layouts of :func:`layouts` with ``tp``, ``pp`` and ``cp`` fixed, ``dp`` GPUs left
    for data parallelism (the FSDP shapes of one (tp, pp) stay in ``traffic``'s cache)."""
    shards = {dp} | {s for s in (8, 16, 32, 64) if s < dp and dp % s == 0}
    for dp_shard in sorted(shards):
        for v in range(1, MAX_VIRTUAL_STAGES + 1) if pp > 1 else (1,):
            if pp * v > model.num_layers:
                continue
            split = balanced_split(model.num_layers, pp * v) if pp > 1 else ()
            experts = model.num_experts and cp == 1 and dp_shard > 1
            eps = (1, dp_shard) if experts and model.num_experts % dp_shard == 0 else (1,)
            for ep in eps:
                dims = ParallelDims(
                    tp=tp,
                    cp=cp,
                    pp=pp,
                    dp_shard=dp_shard,
                    dp_replicate=dp // dp_shard,
                    virtual_stages=v,
                    expert_parallel=ep,
                    pipeline_split=split,
                )
                try:
                    validate_layout(model, dims)
                    check_sequence_split(model.seq_length, dims, sequence_parallel=tp > 1)
                except (ValueError, ArithmeticError):
                    continue
                yield dims


def jobs(
    model: ModelConfig, gpus: int, gpus_per_node: int, global_batch_size: int
) -> Iterator[Job]:
    """Every job of the search space whose batch divides (module doc)."""
    for dims in layouts(model, gpus, gpus_per_node):
        for mb in (1, 2, 4):
            if global_batch_size % (mb * dims.dp):
                continue
            m = global_batch_size // (mb * dims.dp)  # the default schedules' rules, as
            rounds = max(1, m // dims.pp)  # trainer.config.check_pipeline_microbatches
            if dims.pp > 1 and (m < dims.pp if dims.virtual_stages == 1 else m % rounds):
                continue
            other = "always" if dims.pp > 1 else "never"
            for ac, policy in ((a, p) for a in (False, True) for p in ("default", other)):
                yield Job(
                    model,
                    dims,
                    micro_batch_size=mb,
                    global_batch_size=global_batch_size,
                    activation_checkpointing=ac,
                    mixed_precision="bf16",
                    sequence_parallel=dims.tp > 1,
                    fsdp_reshard_after_forward=policy,
                )


def plan(
    model: ModelConfig,
    gpus: int,
    gpus_per_node: int,
    gpu: Gpu,
    global_batch_size: int,
    device_nbytes: int | None = None,
    top: int = 5,
) -> list[Candidate]:
    """The ``top`` fastest jobs that fit ``device_nbytes`` (default: the GPU's memory) per GPU,
    fastest first (module doc).

    Raises:
        ConfigError: no layout of the search space divides the GPUs and the batch, or none fits.
    """
    device = device_nbytes or gpu.memory_nbytes
    counts = model_counts(model)
    ranked = [
        (step_cost(job, gpu, gpus_per_node, counts), job)
        for job in jobs(model, gpus, gpus_per_node, global_batch_size)
    ]
    if not ranked:
        raise ConfigError(
            f"no layout of {gpus} GPUs ({gpus_per_node} per node) divides the global batch "
            f"{global_batch_size} and the model; try a multiple of {gpus} for --global-batch-size"
        )
    ranked.sort(key=lambda x: (round(x[0].step_s, 3), x[1].micro_batch_size))
    found: list[Candidate] = []
    seen: set[str] = set()
    for cost, job in ranked[:MAX_MEMORY_CHECKS]:
        if repr(job.dims) in seen:  # one (the fastest, then smallest) job per layout
            continue
        peak = max_peak(job.estimate(first_rank_only=True))
        if peak <= device:
            found.append(Candidate(job, peak, cost))
            seen.add(repr(job.dims))
        if len(found) == top:
            break
    if not found:
        raise ConfigError(
            f"no layout of {model.num_layers} layers on {gpus} GPUs fits {device / 2**30:.1f} GiB "
            "per GPU among the fastest candidates; use more GPUs or a GPU with more memory"
        )
    return found


def plan_warnings(candidate: Candidate) -> list[str]:
    """The dry run's warning lines (bubble, imbalance) of a candidate."""
    return warnings(candidate.job.estimate())
