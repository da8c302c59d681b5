"""``shardsmith train --dry-run``: the report of a job without starting it: memory per rank
group (:mod:`shardsmith.sizing.estimate`), the verdict on a GPU and the fixes
(:mod:`shardsmith.sizing.verdict`), and with ``--gpu`` the cost model's step time in ``plan``'s
words (:mod:`shardsmith.sizing.cost`).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

import click

from shardsmith.cli.options import plural
from shardsmith.layout import format_nbytes


def device_nbytes(flags: dict[str, Any]) -> int | None:
    """Bytes per GPU from ``--gpu-memory SIZE`` or ``--gpu NAME`` (the former wins); None without."""
    from shardsmith.layout import parse_nbytes
    from shardsmith.sizing import gpu

    if flags.get("gpu_memory"):
        return parse_nbytes(flags["gpu_memory"])
    return gpu(flags["gpu_name"]).memory_nbytes if flags.get("gpu_name") else None


def gpu_of(flags: dict[str, Any]) -> Any:
    """The :class:`~shardsmith.sizing.gpus.Gpu` of ``--gpu NAME``; None without."""
    from shardsmith.sizing import gpu

    return gpu(flags["gpu_name"]) if flags.get("gpu_name") else None


def step_cost_json(job: Any, accel: Any) -> dict[str, Any]:
    """The cost model's step on ``accel`` (``plan``'s figures for this job): ``gpu``,
    ``gpus_per_node``, ``step_s``, ``mfu``, ``tokens_per_s``, ``bubble_fraction`` and
    ``cost_s`` (seconds by part); {} without a GPU."""
    from shardsmith.sizing import GPUS_PER_NODE, step_cost

    if accel is None:
        return {}
    cost = step_cost(job, accel, GPUS_PER_NODE)
    return {
        "gpu": accel.name,
        "gpus_per_node": GPUS_PER_NODE,
        "step_s": cost.step_s,
        "mfu": cost.mfu,
        "tokens_per_s": cost.tokens_per_s,
        "bubble_fraction": cost.bubble_s / cost.step_s if cost.step_s else 0.0,
        "cost_s": cost.parts(),
    }


def print_step_cost(step: dict[str, Any]) -> None:
    """The dry run's step-time lines (:func:`step_cost_json`), in ``plan``'s words."""
    from shardsmith.cli.plan_commands import step_breakdown

    if not step:
        return
    click.echo(
        f"  step time on {step['gpu']} ({step['gpus_per_node']} per node; the cost model of "
        f"`shardsmith plan`): {step['step_s']:.2f} s, MFU {step['mfu']:.1%}, "
        f"{step['tokens_per_s']:,.0f} tokens/s"
    )
    click.echo(f"    step: {step_breakdown(step['cost_s'])}")


def job_of(cfg: Any) -> Any:
    """The :class:`~shardsmith.sizing.verdict.Job` of a TrainConfig."""
    from shardsmith.sizing import Job

    names = [f.name for f in dataclasses.fields(Job)][2:]  # the step's settings: TrainConfig's too
    settings = {name: getattr(cfg, name) for name in names}
    settings["activation_checkpointing"] = cfg.ac_policy  # full (True) or selective ("op", "N")
    return Job(cfg.model, cfg.parallel, **settings)


def verdict_json(job: Any, est: Any, device: int | None) -> dict[str, Any]:
    """``fits``, ``headroom_bytes``, ``peak_bytes`` per rank group, the warnings and the fixes."""
    from shardsmith.sizing import fixes, judge, warnings

    out: dict[str, Any] = {"warnings": warnings(est)}
    if device is None:
        return out
    groups = judge(est, device)
    out.update(
        {
            "device_bytes": device,
            "fits": all(g["fits"] for g in groups),
            "headroom_bytes": min(g["headroom_bytes"] for g in groups),
            "peak_bytes": max(g["peak_bytes"] for g in groups),
            "rank_groups": groups,
            "fixes": [] if all(g["fits"] for g in groups) else fixes(job, device),
        }
    )
    return out


def print_verdict(verdict: dict[str, Any]) -> None:
    """The verdict lines of the text report (see :func:`verdict_json`)."""
    for line in verdict["warnings"]:
        click.echo(f"  warning: {line}")
    if "fits" not in verdict:
        return
    gib = 2**30
    for g in verdict["rank_groups"]:
        how = (
            f"fits with {g['headroom_bytes'] / gib:.1f} GiB headroom"
            if g["fits"]
            else f"does not fit by {-g['headroom_bytes'] / gib:.1f} GiB"
        )
        click.echo(
            f"  stage {g['stage']} ({plural(g['num_ranks'], 'rank')}, e.g. rank {g['example_rank']}): needs "
            f"{g['peak_bytes'] / gib:.1f} GiB of {verdict['device_bytes'] / gib:.1f} GiB: {how}"
        )
    for fix in verdict["fixes"]:
        click.echo(
            f"  to fit: {' '.join(fix['changes'])} -> {fix['peak_bytes'] / gib:.1f} GiB "
            f"({fix['headroom_bytes'] / gib:.1f} GiB headroom)"
        )
    if not verdict["fits"] and not verdict["fixes"]:
        click.echo(
            "  to fit: no single change does; try `shardsmith plan` for this model and GPU count"
        )


def print_estimate(
    cfg: Any,
    preset: str | None,
    as_json: bool,
    device: int | None = None,
    note: str = "",
    accel: Any = None,
) -> None:
    """The ``--dry-run`` report of ``cfg`` (a TrainConfig), as text or JSON; with ``device``
    (bytes per GPU) a verdict per rank group and the changes that would make it fit; with
    ``accel`` (``--gpu``) the cost model's step time and its parts, as ``plan`` prints them;
    ``note`` (text only) follows the layout line."""
    from shardsmith.sizing import FORMULAS, preset_of

    job = job_of(cfg)
    est = job.estimate()
    verdict = verdict_json(job, est, device)
    step = step_cost_json(job, accel)
    name = preset or preset_of(cfg.model)
    if as_json:
        extra = {"step_cost": step} if step else {}
        click.echo(json.dumps({"preset": name, **est.to_json(), **verdict, **extra}, indent=1))
        return
    m, dims = cfg.model, cfg.parallel
    click.echo(f"dry run: {name or 'custom model'}: {describe_model(m)}")
    click.echo(
        f"  {est.total_params:,} parameters ({est.total_params / 1e9:.2f}B); checkpoint "
        f"{format_nbytes(est.checkpoint_nbytes)} (fp32 weights + AdamW state)"
    )
    click.echo(
        f"  layout {dims.describe()} = {dims.world_size:,} ranks; batch {est.global_batch_size} = "
        f"{est.micro_batch_size} per microbatch x {est.num_microbatches} microbatches x dp {dims.dp}; "
        f"{est.tokens_per_step:,} tokens/step"
    )
    if note:
        click.echo(f"  {note}")
    click.echo(
        f"  pipeline bubble (P-1)/(V*M) = {dims.pp - 1}/({dims.virtual_stages}*{est.num_microbatches}) = "
        f"{est.pipeline_bubble_fraction:.1%} of the step"
    )
    click.echo(
        f"  FLOPs/step {est.flops_per_step:.3e} ({est.flops_per_step / dims.world_size:.3e} per rank)"
    )
    print_step_cost(step)
    print_model_parts(est, m)
    print_roles(est)
    for what in ("memory", "activation", "loss", "peak", "bubble", "flops") + (
        ("moe",) if est.moe else ()
    ):
        click.echo(
            textwrap.fill(
                f"{what}: {FORMULAS[what]}", 100, initial_indent="  ", subsequent_indent="    "
            )
        )
    print_verdict(verdict)


def print_model_parts(est: Any, m: Any) -> None:
    """The dry run's lines for what the model or layout has beyond the dense basics: MoE,
    context parallelism, RoPE scaling."""
    if est.moe:
        click.echo(
            f"  MoE: {est.moe['num_moe_layers']} layers x {m.num_experts} experts (top-{m.moe_router_topk}); "
            f"{est.moe['experts_per_rank']} experts x {est.moe['expert_ffn_per_rank']} hidden per rank; "
            f"all-to-all {format_nbytes(est.moe['dispatch_nbytes_per_layer_microbatch'])} sent per rank, "
            "layer and microbatch"
        )
    if est.context_parallel:
        c = est.context_parallel
        click.echo(
            f"  context parallel: cp {c['cp']}, {c['tokens_per_rank']:,} tokens per rank; K/V all-gather "
            f"{format_nbytes(c['kv_gather_nbytes_per_layer_microbatch'])} received per rank, layer and "
            "microbatch (as much sent by the backward's reduce-scatter)"
        )
    if m.rope_scaling:
        click.echo(
            f"  RoPE scaling llama3: factor {m.rope_scaling_factor:g}, low/high frequency factors "
            f"{m.rope_low_freq_factor:g}/{m.rope_high_freq_factor:g}, original context "
            f"{m.rope_original_seq_length:,}"
        )


def print_roles(est: Any) -> None:
    """The dry run's table: per rank group, parameters and bytes of each kind."""
    click.echo(
        f"  {'stage':>5} {'layers':>7} {'ranks':>6} {'e.g.':>6} {'params':>15} {'weights':>10} "
        f"{'grads':>10} {'optim':>10} {'activ.':>10} {'total':>10} {'ckpt':>10}"
    )
    for r in est.roles:
        click.echo(
            f"  {r.stage:>5} {f'{r.layers[0]}-{r.layers[1]}':>7} {r.num_ranks:>6,} {r.example_rank:>6} "
            f"{r.num_params:>15,} "
            + " ".join(
                f"{_short(n):>10}"
                for n in (
                    r.param_nbytes,
                    r.grad_nbytes,
                    r.optim_nbytes,
                    r.activation_nbytes,
                    r.total_nbytes,
                    r.checkpoint_nbytes,
                )
            )
        )


def _short(nbytes: int) -> str:
    return format_nbytes(nbytes).replace(" ", "")


def describe_model(m: Any) -> str:
    """One line: layers, width, heads, FFN, vocab, sequence, RoPE base (and Llama 3.1 scaling), tying."""
    scaled = (
        f" (llama3 scaling x{m.rope_scaling_factor:g} from {m.rope_original_seq_length:,})"
        if getattr(m, "rope_scaling_factor", 0)
        else ""
    )
    return (
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.num_kv_heads} kv), ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}, "
        f"rope_theta {m.rope_theta:g}{scaled}, {'tied' if m.tie_embeddings else 'untied'} embeddings"
    )
