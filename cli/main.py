"""The ``shardsmith`` command line. Commands map flags onto configs and call the library.

Errors exit non-zero with one readable line; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click

from shardsmith.cli.options import layout_options, model_options, storage_option
from shardsmith.errors import ShardsmithError
from shardsmith.storage.fs import parse_storage_options


class Group(click.Group):
    """Turns expected errors into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:      # output piped into `head` and closed: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except (ShardsmithError, ValueError, FileNotFoundError, PermissionError, OSError) as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"],
                                          "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="shardsmith")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """shardsmith: 3D-parallel training with per-shard checkpoints you can reshard."""
    ctx.obj = {"debug": debug}
    if debug:
        os.environ["SHARDSMITH_DEBUG"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def make_dims(tp: int, pp: int, dp_shard: int, dp_replicate: int, pipeline_split: str, world: int | None):
    """ParallelDims from flags; ``dp_shard=-1`` takes the rest of ``world``."""
    from shardsmith.errors import LayoutError
    from shardsmith.layout import ParallelDims

    split = tuple(int(x) for x in pipeline_split.split(",") if x.strip()) if pipeline_split else ()
    if dp_shard == -1:
        rest = (world or tp * pp * dp_replicate) / (tp * pp * dp_replicate)
        if rest != int(rest):
            raise LayoutError(f"world size {world} is not a multiple of tp*pp*dp_replicate="
                              f"{tp * pp * dp_replicate}; choose --nproc-per-node as a multiple of it")
        dp_shard = int(rest)
    dims = ParallelDims(tp=tp, pp=pp, dp_shard=dp_shard, dp_replicate=dp_replicate, pipeline_split=split)
    if world is not None and dims.world_size != world:
        raise LayoutError(f"layout {dims.describe()} needs {dims.world_size} processes but "
                          f"{world} were given; set --nproc-per-node {dims.world_size} or change the layout")
    return dims


@cli.command()
@layout_options
@model_options
@click.option("--nproc-per-node", type=int, default=None,
              help="Start this many local workers via torchrun's API (default: the layout's world "
                   "size; ignored under an external torchrun).")
@click.option("--steps", "--train-iters", "steps", type=int, default=40, show_default=True,
              help="Train until this optimizer step (absolute; Megatron: --train-iters).")
@click.option("--global-batch-size", type=int, default=16, show_default=True,
              help="Samples per optimizer step over all DP ranks.")
@click.option("--micro-batch-size", type=int, default=2, show_default=True,
              help="Samples per forward pass (pipeline microbatch / accumulation step).")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Peak learning rate.")
@click.option("--lr-decay-steps", "--lr-decay-iters", "decay_steps", type=int, default=0,
              show_default=True, help="Cosine decay ends at this step (0 = --steps; Megatron: --lr-decay-iters).")
@click.option("--min-lr-ratio", type=float, default=0.1, show_default=True, help="Final LR / peak LR.")
@click.option("--warmup-steps", "--lr-warmup-iters", "warmup_steps", type=int, default=10,
              show_default=True, help="Linear warmup steps.")
@click.option("--weight-decay", type=float, default=0.1, show_default=True, help="AdamW weight decay.")
@click.option("--grad-clip", "--clip-grad", "grad_clip", type=float, default=1.0, show_default=True,
              help="Clip the global gradient norm to this (0 = off).")
@click.option("--seed", type=int, default=1234, show_default=True, help="Init and data-order seed.")
@click.option("--data", multiple=True, metavar="PATH|GLOB|URL",
              help="Training text or nanoGPT .bin token files (repeatable). Default: the Python "
                   "standard library's .py files, found at run time.")
@click.option("--token-dtype", type=click.Choice(["auto", "uint16", "uint32"]), default="auto",
              show_default=True, help="Element type of .bin token files.")
@click.option("--mixed-precision", type=click.Choice(["fp32", "bf16"]), default="fp32",
              show_default=True, help="bf16 autocast compute with fp32 master weights.")
@click.option("--bf16", is_flag=True, help="Same as --mixed-precision bf16 (Megatron name).")
@click.option("--activation-checkpointing", is_flag=True, help="Recompute each block in backward.")
@click.option("--ckpt", "--save", "ckpt", default="", metavar="URL",
              help="Checkpoint root (local dir or fsspec URL). Empty = no checkpoints.")
@click.option("--save-interval", type=int, default=0, show_default=True,
              help="Checkpoint every K steps (0 = only at the end).")
@click.option("--async-save/--no-async-save", default=True, show_default=True,
              help="Write checkpoints in the background after a host snapshot.")
@click.option("--format", "tensor_format", type=click.Choice(["safetensors", "zarr"]), default="safetensors",
              show_default=True, help="Checkpoint tensor format: one safetensors file per rank, or one "
              "zarr v3 array per tensor (opens in plain zarr).")
@click.option("--zarr-codec", default="", metavar="CODEC",
              help="With --format zarr: compress the optimizer state (zstd, gzip, zstd:5 ...).")
@click.option("--init-from", default="", metavar="URL",
              help="Start from this checkpoint's model weights (any layout; fresh optimizer, step 0) "
                   "when there is nothing to resume, e.g. the output of `shardsmith import-hf`.")
@click.option("--keep-last", type=int, default=0, show_default=True,
              help="After each commit keep only the newest N committed steps (0 = all).")
@click.option("--keep-every", type=int, default=0, show_default=True,
              help="...but also keep every step divisible by M (0 = none).")
@click.option("--resume", "--load", "resume", default="auto", show_default=True, metavar="auto|none|URL",
              help="auto: newest committed step under --ckpt; none; or a root/step URL (Megatron: --load).")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="Restart the worker group this many times after a failure (torchrun elastic).")
@click.option("--preempt-deadline", type=float, default=300.0, show_default=True,
              help="Seconds from SIGTERM/SIGUSR1 to a committed checkpoint and exit 0.")
@click.option("--collective-timeout", type=float, default=600.0, show_default=True,
              help="Seconds a collective waits for its peers before the job fails (from the first step on).")
@click.option("--init-timeout", type=float, default=600.0, show_default=True,
              help="Collective timeout during start-up, resume and the first step.")
@click.option("--hang-factor", type=float, default=10.0, show_default=True,
              help="Dump every rank's stacks when a step runs this many times the median step.")
@click.option("--hang-min-seconds", type=float, default=60.0, show_default=True,
              help="...but never before a step has run this long.")
@click.option("--max-bad-steps", type=int, default=3, show_default=True,
              help="Non-finite steps in a row (each skipped) before rolling back to the last checkpoint.")
@click.option("--max-rollbacks", type=int, default=3, show_default=True,
              help="Fail the run after this many rollbacks.")
@click.option("--peak-flops", type=float, default=0.0, show_default=True,
              help="Peak FLOP/s of one device, for MFU (e.g. 989e12: H100 SXM bf16); 0 = no MFU.")
@click.option("--log-interval", type=int, default=1, show_default=True, help="Print every N steps.")
@click.option("--run-dir", default="", help="Where metrics.jsonl goes (default: --ckpt when local).")
@storage_option
def train(**flags: Any) -> None:
    """Train a Llama-style model with TP x PP x DP and periodic checkpoints."""
    from shardsmith.layout import validate_layout
    from shardsmith.trainer import launch as launcher

    external = launcher.under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if external else flags["nproc_per_node"]
    cfg = train_config(flags, world)
    validate_layout(cfg.model, cfg.parallel)          # refuse before any process starts
    cfg.num_microbatches()
    if external:
        from shardsmith.trainer.train import run_training

        run_training(cfg)
        return
    dims = cfg.parallel
    click.echo(f"training {dims.describe()} on {dims.world_size} processes to step {cfg.steps}", err=True)
    launcher.launch(cfg, dims.world_size, max_restarts=flags["max_restarts"])


def train_config(f: dict[str, Any], world: int | None):
    """Map ``train``'s flags onto :class:`~shardsmith.trainer.config.TrainConfig` (one field each)."""
    from shardsmith.trainer.config import (CheckpointConfig, DataConfig, FaultConfig, ModelConfig,
                                           OptimConfig, TrainConfig)

    def pick(*names: str) -> dict[str, Any]:
        return {n: f[n] for n in names}

    return TrainConfig(
        model=ModelConfig(**pick("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                                 "ffn_hidden_size", "vocab_size", "seq_length", "tie_embeddings",
                                 "rope_theta", "norm_eps")),
        parallel=make_dims(f["tp"], f["pp"], f["dp_shard"], f["dp_replicate"], f["pipeline_split"], world),
        optim=OptimConfig(**pick("lr", "decay_steps", "min_lr_ratio", "warmup_steps", "weight_decay",
                                 "grad_clip")),
        data=DataConfig(sources=tuple(f["data"]), token_dtype=f["token_dtype"], seed=f["seed"]),
        checkpoint=CheckpointConfig(
            url=f["ckpt"], storage_options=parse_storage_options(f["storage_options"]),
            **pick("save_interval", "resume", "init_from", "keep_last", "keep_every", "async_save",
                   "tensor_format", "zarr_codec")),
        fault=FaultConfig(derive_dp_shard=f["dp_shard"] == -1,
                          **pick("preempt_deadline", "collective_timeout", "init_timeout", "hang_factor",
                                 "hang_min_seconds", "max_bad_steps", "max_rollbacks", "peak_flops")),
        mixed_precision="bf16" if f["bf16"] else f["mixed_precision"],
        **pick("steps", "global_batch_size", "micro_batch_size", "seed", "activation_checkpointing",
               "log_interval", "run_dir"))


@cli.command()
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
@storage_option
def inspect(ckpt, as_json, storage_options) -> None:
    """Show a checkpoint's layout, configs, tensors and sizes (CKPT: step dir or root)."""
    from shardsmith.storage.commit import read_manifest, resolve_checkpoint

    _, step_store, _ = resolve_checkpoint(ckpt, parse_storage_options(storage_options))
    m = read_manifest(step_store)
    if as_json:
        summary = {"url": step_store.url, "step": m.step, "version": m.version, "layout": m.layout, "model": m.model,
                   "config": m.config, "state": m.state, "nbytes": m.nbytes, "num_files": len(m.files),
                   "tensors": {fqn: {"shape": t.shape, "dtype": t.dtype, "num_shards": len(t.shards),
                                     "nbytes": t.nbytes} for fqn, t in m.tensors.items()}}
        click.echo(json.dumps(summary, indent=1))
        return
    lay = m.layout
    click.echo(f"{step_store.url}\n  step {m.step}  created {m.created}  format {m.tensor_format} "
               f"v{m.version}\n  layout pp{lay['pp']}·dpr{lay['dp_replicate']}·dps{lay['dp_shard']}"
               f"·tp{lay['tp']} ({lay.get('world_size')} ranks)\n  files {len(m.files)}  "
               f"{m.nbytes:,} bytes\n  model {json.dumps(m.model)}\n  state step={m.state.get('step')} "
               f"data={m.state.get('data')}")
    width = max(len(f) for f in m.tensors)
    click.echo(f"  {'tensor':<{width}}  {'shape':<14} dtype  shards  bytes")
    for fqn, t in sorted(m.tensors.items()):
        click.echo(f"  {fqn:<{width}}  {str(tuple(t.shape)):<14} {t.dtype:<5}  {len(t.shards):>6}  {t.nbytes:,}")


@cli.command()
@click.option("--dir", "workdir", default="demo-run", show_default=True,
              help="Where the demo's checkpoints go (replaced if present).")
@click.option("--steps", type=int, default=30, show_default=True, help="Steps before the move.")
@click.option("--more-steps", type=int, default=20, show_default=True, help="Steps after the move.")
def demo(workdir, steps, more_steps) -> None:
    """The main job on the embedded default: train TP2·PP2 on 4 processes on the Python stdlib,
    reshard the last checkpoint to dp_shard=2, resume on 2 processes, compare losses."""
    from shardsmith.trainer.demo import run_demo

    run_demo(workdir, steps, more_steps)


from shardsmith.cli.hf_commands import register as _register_hf  # noqa: E402

_register_hf(cli)
from shardsmith.cli.ckpt_commands import register as _register_ckpt  # noqa: E402

_register_ckpt(cli)
from shardsmith.cli.reshard_commands import register as _register_reshard  # noqa: E402

_register_reshard(cli)

from shardsmith.cli.run_commands import register as _register_run  # noqa: E402

_register_run(cli)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="shardsmith")


if __name__ == "__main__":
    main()
