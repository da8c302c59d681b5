"""``shardsmith plan``: which layout to train a model with on N GPUs (:mod:`shardsmith.sizing.search`).

Imports no torch: it answers from the estimator and the cost model in a second or two.
"""

from __future__ import annotations

import json
from typing import Any

import click

from shardsmith.cli.options import json_option, model_from_flags, model_options


def _model_flags(flags: dict[str, Any]) -> list[str]:
    """The model part of the train command: ``--model NAME`` and the model flags given."""
    from shardsmith.cli.options import MODEL_FLAGS

    out = ["--model", flags["model_preset"]] if flags.get("model_preset") else []
    for f in MODEL_FLAGS:
        value = flags.get(f)
        if value is True:
            out.append("--" + f.replace("_", "-"))
        elif value is not None and value is not False:
            out += ["--" + f.replace("_", "-"), str(value)]
    return out


#: How the step's parts (``StepCost.PARTS``) are named in the text of ``plan`` and the dry run.
PART_NAMES = {
    "compute_s": "compute",
    "tp_comm_s": "TP",
    "pp_comm_s": "PP",
    "cp_comm_s": "CP",
    "fsdp_exposed_s": "exposed FSDP",
    "bubble_s": "bubble",
    "dp_allreduce_s": "DP",
}


def step_breakdown(cost_s: dict[str, float]) -> str:
    """``compute 6.11 s, TP 1.00 s, ...``: a step's parts in seconds (CP only when the layout
    has one), the same words in ``plan`` and ``train --dry-run``."""
    return ", ".join(
        f"{PART_NAMES[k]} {v:.2f} s" for k, v in cost_s.items() if v or k != "cp_comm_s"
    )


@click.command("plan")
@model_options
@click.option("--gpus", type=int, required=True, help="GPUs of the job (the world size).")
@click.option(
    "--gpus-per-node",
    type=int,
    default=8,
    show_default=True,
    help="GPUs per node (tp stays within one).",
)
@click.option(
    "--gpu",
    "gpu_name",
    default="h100",
    show_default=True,
    metavar="NAME",
    help="Accelerator: a100-80gb, h100, h200, b200 (memory, peak bf16 FLOPs, links).",
)
@click.option(
    "--gpu-memory", default=None, metavar="SIZE", help="Memory per GPU instead of the GPU's own."
)
@click.option("--global-batch-size", type=int, required=True, help="Sequences per optimizer step.")
@click.option("--top", type=int, default=5, show_default=True, help="How many layouts to print.")
@json_option("the layouts")
def plan_command(**flags: Any) -> None:
    """The fastest layouts that fit, for a model on N GPUs.

    Searches the layouts of the model on --gpus GPUs, keeps those that fit the GPU's memory
    (the dry run's estimate) and prints the fastest by an estimated step time, with the exact
    `shardsmith train` flags. The cost model and its constants: shardsmith/sizing/cost.py."""
    from shardsmith.layout import parse_nbytes
    from shardsmith.sizing import gpu, plan, plan_warnings

    model = model_from_flags(flags)
    accel = gpu(flags["gpu_name"])
    device = parse_nbytes(flags["gpu_memory"]) if flags["gpu_memory"] else accel.memory_nbytes
    found = plan(
        model,
        flags["gpus"],
        flags["gpus_per_node"],
        accel,
        flags["global_batch_size"],
        device,
        top=flags["top"],
    )
    model_flags = _model_flags(flags)
    if flags["as_json"]:
        click.echo(
            json.dumps(
                {
                    "gpu": accel.name,
                    "gpus": flags["gpus"],
                    "device_bytes": device,
                    "candidates": [c.to_json(device, model_flags) for c in found],
                },
                indent=1,
            )
        )
        return
    gib = 2**30
    click.echo(
        f"plan: {flags['gpus']:,} x {accel.name} ({device / gib:.1f} GiB), {flags['gpus_per_node']} per node, "
        f"global batch {flags['global_batch_size']} x {model.seq_length} tokens; fastest that fit:"
    )
    for i, c in enumerate(found, 1):
        d = c.to_json(device, model_flags)
        click.echo(
            f"{i}. {d['layout']}: step {d['step_s']:.2f} s, MFU {d['mfu']:.1%}, {d['tokens_per_s']:,.0f} tokens/s, "
            f"{d['peak_bytes'] / gib:.1f} GiB per GPU ({d['headroom_bytes'] / gib:.1f} GiB headroom), "
            f"bubble {d['bubble_fraction']:.0%}"
        )
        click.echo(f"   step: {step_breakdown(d['cost_s'])}")
        click.echo(f"   {d['command']}")
        for line in plan_warnings(c):
            click.echo(f"   warning: {line}")


def register(cli: click.Group) -> None:
    """Add ``plan`` to the command group."""
    cli.add_command(plan_command)
