"""Does a training job fit its GPUs, and if not, which changes would make it fit.

Pure (no torch). A :class:`Job` is a model, a layout and the step's settings; its estimate is
:func:`shardsmith.sizing.estimate.estimate`; :func:`judge` compares each rank group's
``peak_nbytes`` (tracked peak + allocator margin + CUDA/NCCL context) with the device's memory;
:func:`fixes` re-runs the estimator on changed jobs (never a guess) and returns those that fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.sizing.estimate import Estimate, estimate

#: A pipeline bubble above this fraction of the step is worth a warning (Narayanan et al. 2021
#: aim for under ~20-25 % by choosing M >= 4P).
BUBBLE_WARNING = 0.25
#: Stages whose work (layers, plus the output layer's matmul in layer-equivalents) differs by
#: more than this ratio are worth a warning: the slowest stage sets the pace.
IMBALANCE_WARNING = 1.25


@dataclass(frozen=True)
class Job:
    """A model, a layout and the step's settings (the ``train`` flags the estimate reads)."""

    model: ModelConfig
    dims: ParallelDims
    micro_batch_size: int
    global_batch_size: int
    activation_checkpointing: bool | str = False  # True (full), "op" or "N" (selective)
    mixed_precision: str = "fp32"
    sequence_parallel: bool = False
    fsdp_reshard_after_forward: str = "default"
    pipeline_schedule: str = ""

    def estimate(self, first_rank_only: bool = False) -> Estimate:
        """:func:`shardsmith.sizing.estimate.estimate` of this job (raises as it does)."""
        return estimate(
            self.model,
            self.dims,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            activation_checkpointing=self.activation_checkpointing,
            mixed_precision=self.mixed_precision,
            sequence_parallel=self.sequence_parallel,
            first_rank_only=first_rank_only,
            fsdp_reshard_after_forward=self.fsdp_reshard_after_forward,
        )

    def flags(self) -> list[str]:
        """The ``shardsmith train`` flags of the layout and settings (not the model's)."""
        d = self.dims
        out = ["--tp", str(d.tp), "--pp", str(d.pp), "--dp-shard", str(d.dp_shard)]
        if d.dp_replicate > 1:
            out += ["--dp-replicate", str(d.dp_replicate)]
        if d.cp > 1:
            out += ["--cp", str(d.cp)]
        if d.virtual_stages > 1:
            out += ["--virtual-stages", str(d.virtual_stages)]
        if d.pipeline_split:
            out += ["--pipeline-split", ",".join(map(str, d.pipeline_split))]
        if self.pipeline_schedule:
            out += ["--pipeline-schedule", self.pipeline_schedule]
        if self.fsdp_reshard_after_forward != "default":
            out += ["--fsdp-reshard-after-forward", self.fsdp_reshard_after_forward]
        if d.expert_parallel > 1:
            out += ["--expert-parallel", str(d.expert_parallel)]
        if self.mixed_precision == "bf16":
            out += ["--mixed-precision", "bf16"]
        if isinstance(self.activation_checkpointing, str) and self.activation_checkpointing:
            out += ["--selective-ac-option", self.activation_checkpointing]
        elif self.activation_checkpointing:
            out.append("--activation-checkpointing")
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        return out + [
            "--global-batch-size",
            str(self.global_batch_size),
            "--micro-batch-size",
            str(self.micro_batch_size),
        ]


def judge(est: Estimate, device_nbytes: int) -> list[dict[str, Any]]:
    """Per rank group: ``fits``, ``headroom_bytes`` (negative: short by that much),
    ``peak_bytes`` and the group's stage and example rank."""
    return [
        {
            "stage": r.stage,
            "example_rank": r.example_rank,
            "num_ranks": r.num_ranks,
            "fits": r.peak_nbytes <= device_nbytes,
            "headroom_bytes": device_nbytes - r.peak_nbytes,
            "peak_bytes": r.peak_nbytes,
        }
        for r in est.roles
    ]


def max_peak(est: Estimate) -> int:
    """The largest ``peak_nbytes`` of any rank group."""
    return max(r.peak_nbytes for r in est.roles)


def _candidates(job: Job) -> list[tuple[str, Job]]:
    """Single changes to try, cheapest in speed first (each a new job on the same GPUs)."""
    out: list[tuple[str, Job]] = []
    d = job.dims
    if job.mixed_precision != "bf16":
        out.append(("--mixed-precision bf16", replace(job, mixed_precision="bf16")))
    if d.tp > 1 and not job.sequence_parallel:
        out.append(("--sequence-parallel", replace(job, sequence_parallel=True)))
    if job.micro_batch_size > 1:
        out.append(
            (
                f"--micro-batch-size {job.micro_batch_size // 2}",
                replace(job, micro_batch_size=job.micro_batch_size // 2),
            )
        )
    if not job.activation_checkpointing:
        sac = replace(job, activation_checkpointing="op")
        out.append(("--activation-checkpointing selective", sac))
    if job.activation_checkpointing is not True:
        out.append(("--activation-checkpointing", replace(job, activation_checkpointing=True)))
    for axis, flag in (("tp", "--tp"), ("pp", "--pp")):
        if d.dp_shard % 2 == 0:
            bigger = replace(
                d, **{axis: getattr(d, axis) * 2, "dp_shard": d.dp_shard // 2, "pipeline_split": ()}
            )
            out.append(
                (
                    f"{flag} {getattr(bigger, axis)} --dp-shard {bigger.dp_shard}",
                    replace(job, dims=bigger),
                )
            )
    return out


def _fits(job: Job, device_nbytes: int) -> tuple[bool, int]:
    try:
        peak = max_peak(job.estimate())
    except (ValueError, ArithmeticError):  # LayoutError / ConfigError: not a valid change here
        return False, 0
    return peak <= device_nbytes, peak


def merge_flags(changes: list[str]) -> list[str]:
    """A series of flag changes as one set of flags: a later value of a flag replaces an earlier
    one, in the place the flag first appeared (``["--tp 2 --dp-shard 4", "--tp 4 --dp-shard 2"]``
    -> ``["--tp 4", "--dp-shard 2"]``)."""
    flags: dict[str, str] = {}
    for change in changes:
        words = change.split()
        for i, word in enumerate(words):
            if word.startswith("--"):
                value = (
                    words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
                )
                flags[word] = value
    return [f"{flag} {value}".strip() for flag, value in flags.items()]


def fixes(job: Job, device_nbytes: int, limit: int = 4) -> list[dict[str, Any]]:
    """Changes that make ``job`` fit ``device_nbytes`` per GPU, each checked by the estimator:
    single changes that fit alone, then the shortest cumulative series of the single changes
    (in :func:`_candidates`' order, re-derived after each step) that fits.

    Returns up to ``limit`` dicts: ``changes`` (train flags), ``peak_bytes``, ``headroom_bytes``.
    """
    found: list[dict[str, Any]] = []
    for change, changed in _candidates(job):
        ok, peak = _fits(changed, device_nbytes)
        if ok:
            found.append(
                {"changes": [change], "peak_bytes": peak, "headroom_bytes": device_nbytes - peak}
            )
    steps: list[str] = []
    current = job
    for _ in range(8):
        options = _candidates(current)
        if not options:
            break
        change, current = options[0]
        steps.append(change)
        ok, peak = _fits(current, device_nbytes)
        if ok:
            if len(steps) > 1:
                found.append(
                    {
                        "changes": merge_flags(steps),
                        "peak_bytes": peak,
                        "headroom_bytes": device_nbytes - peak,
                    }
                )
            break
    return found[:limit]


def stage_work(est: Estimate) -> list[float]:
    """Per pipeline stage, its forward FLOPs in layer-equivalents: layers, plus the output
    projection's ``2*h*V`` per token over one layer's ``flops_per_token / (3 L)`` on the last."""
    from shardsmith.layout import stage_layers

    m, d = est.model, est.dims
    per_layer = (est.flops_per_token / 3 - 2 * m.hidden_size * m.vocab_size) / m.num_layers
    out = [float(len(layers)) for layers in stage_layers(m, d)]
    out[-1] += 2 * m.hidden_size * m.vocab_size / per_layer
    return out


def warnings(est: Estimate) -> list[str]:
    """Warning lines: a pipeline bubble above :data:`BUBBLE_WARNING`, stage imbalance above
    :data:`IMBALANCE_WARNING`."""
    out = []
    d = est.dims
    if est.pipeline_bubble_fraction > BUBBLE_WARNING:
        need = -(-4 * d.pp // d.virtual_stages) * est.micro_batch_size * d.dp
        out.append(
            f"pipeline bubble {est.pipeline_bubble_fraction:.0%} of the step (> {BUBBLE_WARNING:.0%}): "
            f"{est.num_microbatches} microbatches for {d.pp} stages; use --global-batch-size >= {need} "
            "(M >= 4P), --virtual-stages, or a smaller --pp"
        )
    work = stage_work(est) if d.pp > 1 else []
    if work and max(work) > IMBALANCE_WARNING * min(work):
        out.append(
            f"pipeline stages unbalanced: {max(work):.1f} vs {min(work):.1f} layer-equivalents of work "
            "(the output layer counts on the last stage); set --pipeline-split to give the last stage "
            "fewer layers"
        )
    return out
