"""``shardsmith demo``: the main job end to end on the embedded default corpus.

1. train TP2·PP2 on 4 processes on the Python standard library's .py files, with
   checkpoints every 10 steps;
2. reshard the last checkpoint offline to dp_shard=2 (tp1·pp1) with the same engine as
   ``shardsmith reshard``;
3. resume on 2 processes from the resharded checkpoint and train further;
4. print the loss before and after the move.

``--moe`` runs the same job on a 4-expert MoE model: PP2·EP2 on 4 processes, resharded to
TP2 (EP1) and resumed on 2 (:func:`demo_layouts`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import click

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.storage import step_dir
from shardsmith.storage.store import Store
from shardsmith.trainer import OptimConfig, TrainConfig
from shardsmith.trainer.checkpoint import CheckpointConfig
from shardsmith.trainer.observe import layout_name


def _losses(run_dir: str) -> dict[int, float]:
    from shardsmith.trainer.observe import iter_json_lines

    path = os.path.join(run_dir, "metrics.jsonl")
    return {r["step"]: r["loss"] for r in iter_json_lines(path) if "loss" in r}


#: The MoE demo's model: the default dense one with a Mixtral-style FFN on every layer.
MOE_MODEL = ModelConfig(
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=176, moe_aux_loss_coeff=0.01
)


def demo_layouts(moe: bool) -> tuple[ModelConfig, ParallelDims, ParallelDims]:
    """(model, training layout on 4 processes, resumed layout on 2) of the demo.

    Dense: TP2·PP2 -> dp_shard 2. MoE: PP2·EP2 (each pipeline stage's 4 experts split 2 + 2
    over its 2 data-parallel ranks) -> TP2 with EP1 (every rank holds all 4 experts, each
    expert's hidden units split over tp): stages, expert groups and the optimizer state
    all move, the failure Megatron's reports describe."""
    if moe:
        return MOE_MODEL, ParallelDims(pp=2, dp_shard=2, expert_parallel=2), ParallelDims(tp=2)
    return ModelConfig(), ParallelDims(tp=2, pp=2), ParallelDims(dp_shard=2)


def run_demo(workdir: str, steps: int = 30, more_steps: int = 20, moe: bool = False) -> None:
    """Run the demo under ``workdir`` (replaced). Takes ~1-3 minutes on 2 CPU cores."""
    from shardsmith.reshard import reshard
    from shardsmith.trainer.runtime.launch import launch

    shutil.rmtree(workdir, ignore_errors=True)
    a, b = os.path.join(workdir, "a"), os.path.join(workdir, "b")
    model, layout, target = demo_layouts(moe)
    optim = OptimConfig(decay_steps=steps + more_steps)
    first = TrainConfig(
        model=model,
        parallel=layout,
        steps=steps,
        optim=optim,
        checkpoint=CheckpointConfig(url=a, save_interval=10),
        log_interval=5,
    )
    what = f"{model.num_experts}-expert MoE " if moe else ""
    click.echo(
        f"[1/3] training a {what}model {layout_name(layout.to_json())} on 4 processes to step "
        f"{steps} (checkpoints in {a})"
    )
    launch(first, 4)
    click.echo(
        f"[2/3] resharding {a}/{step_dir(steps)} -> {b}/{step_dir(steps)} as "
        f"{layout_name(target.to_json())}"
    )
    report = reshard(Store(a).child(step_dir(steps)), f"{b}/{step_dir(steps)}", target)
    click.echo(
        f"      {report.num_files} files, {report.nbytes_written:,} bytes in {report.seconds:.2f}s"
    )
    second = dataclasses.replace(
        first,
        parallel=target,
        steps=steps + more_steps,
        checkpoint=CheckpointConfig(url=b, save_interval=10, resume="auto"),
    )
    click.echo(
        f"[3/3] resuming on 2 processes ({layout_name(target.to_json())}) to step {steps + more_steps}"
    )
    launch(second, 2)
    before, after = _losses(a), _losses(b)
    click.echo(
        f"\nloss at step {steps} ({layout_name(layout.to_json())}, 4 procs): {before[steps]:.4f}"
    )
    click.echo(
        f"loss at step {steps + 1} ({layout_name(target.to_json())}, 2 procs, resumed): "
        f"{after[steps + 1]:.4f}"
    )
    click.echo(f"loss at step {steps + more_steps}: {after[steps + more_steps]:.4f}")
    click.echo(f"inspect with: shardsmith inspect {b}/{step_dir(steps + more_steps)}")
    click.echo(
        f"plot both runs as one curve: shardsmith plot {a} {b}  (needs matplotlib: "
        'pip install -e ".[plot]" in a clone)'
    )
