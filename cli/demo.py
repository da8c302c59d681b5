"""``shardsmith demo``: the main job end to end on the embedded default corpus.

1. train TP2·PP2 on 4 processes on the Python standard library's .py files, with
   checkpoints every 10 steps;
2. reshard the last checkpoint offline to dp_shard=2 (tp1·pp1) with the same engine as
   ``shardsmith reshard``;
3. resume on 2 processes from the resharded checkpoint and train further;
4. print the loss before and after the move.
"""

from __future__ import annotations

import os
import shutil

import click

from shardsmith.reshard.engine import reshard
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import step_dir
from shardsmith.storage.fs import Store
from shardsmith.trainer.config import CheckpointConfig, OptimConfig, TrainConfig
from shardsmith.trainer.launch import launch
from shardsmith.trainer.train import iter_json_lines


def _losses(run_dir: str) -> dict[int, float]:
    path = os.path.join(run_dir, "metrics.jsonl")
    return {r["step"]: r["loss"] for r in iter_json_lines(path) if "loss" in r}


def run_demo(workdir: str, steps: int = 30, more_steps: int = 20) -> None:
    """Run the demo under ``workdir`` (replaced). Takes ~1-3 minutes on 2 CPU cores."""
    shutil.rmtree(workdir, ignore_errors=True)
    a, b = os.path.join(workdir, "a"), os.path.join(workdir, "b")
    optim = OptimConfig(decay_steps=steps + more_steps)
    first = TrainConfig(parallel=ParallelDims(tp=2, pp=2), steps=steps, optim=optim,
                        checkpoint=CheckpointConfig(url=a, save_interval=10), log_interval=5)
    click.echo(f"[1/3] training {first.parallel.describe()} on 4 processes to step {steps} "
               f"(checkpoints in {a})")
    launch(first, 4)
    target = ParallelDims(dp_shard=2)
    click.echo(f"[2/3] resharding {a}/{step_dir(steps)} -> {b}/{step_dir(steps)} as {target.describe()}")
    report = reshard(Store(a).child(step_dir(steps)), f"{b}/{step_dir(steps)}", target)
    click.echo(f"      {report.num_files} files, {report.nbytes_written:,} bytes in {report.seconds:.2f}s")
    second = TrainConfig(parallel=target, steps=steps + more_steps, optim=optim,
                         checkpoint=CheckpointConfig(url=b, save_interval=10, resume="auto"),
                         log_interval=5)
    click.echo(f"[3/3] resuming on 2 processes ({target.describe()}) to step {steps + more_steps}")
    launch(second, 2)
    before, after = _losses(a), _losses(b)
    click.echo(f"\nloss at step {steps} (tp2·pp2, 4 procs): {before[steps]:.4f}")
    click.echo(f"loss at step {steps + 1} (dp_shard2, 2 procs, resumed): {after[steps + 1]:.4f}")
    click.echo(f"loss at step {steps + more_steps}: {after[steps + more_steps]:.4f}")
    click.echo(f"inspect with: shardsmith inspect {b}/{step_dir(steps + more_steps)}")
