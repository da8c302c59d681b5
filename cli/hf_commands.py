"""``shardsmith export-hf`` and ``import-hf``: flags onto :mod:`shardsmith.reshard.foreign.hf_io`."""

from __future__ import annotations

import os

import click

from shardsmith.cli.foreign_commands import echo_import
from shardsmith.cli.options import (
    dtype_option,
    layout_options,
    make_dims,
    plural,
    size_option,
    storage_option,
)
from shardsmith.storage.store import parse_storage_options


@click.command("export-hf")
@click.argument("ckpt")
@click.argument("out_dir")
@dtype_option(
    "dtype of the exported weights.", default_from="shardsmith.reshard.foreign.hf:EXPORT_DTYPE"
)
@size_option(
    "--max-shard-size",
    "max_shard_nbytes",
    default_from="shardsmith.reshard.foreign.hf:EXPORT_MAX_SHARD_NBYTES",
    help="Split the weights into files of at most this size, with model.safetensors.index.json",
)
@click.option("--overwrite", is_flag=True, help="Replace a model already in OUT_DIR.")
@storage_option
def export_hf(ckpt, out_dir, dtype, max_shard_nbytes, overwrite, storage_options) -> None:
    """Write a checkpoint as a Hugging Face Llama directory.

    CKPT is a step directory, or a root (its newest step); OUT_DIR is what transformers'
    LlamaForCausalLM.from_pretrained loads, with the run's --tokenizer (tokenizer.json and
    tokenizer_config.json) when that file is still here and unchanged."""
    from shardsmith.reshard.foreign import export_hf as do_export

    report = do_export(
        ckpt,
        out_dir,
        dtype=dtype,
        max_shard_nbytes=max_shard_nbytes,
        overwrite=overwrite,
        storage_options=parse_storage_options(storage_options),
    )
    click.echo(
        f"exported step {report.step} from {report.source}: {report.num_tensors} tensors, "
        f"{report.nbytes:,} bytes in {plural(len(report.files), 'file')}, {report.seconds:.2f}s "
        f"-> {report.out_dir}"
    )
    if report.tokenizer.files:
        click.echo(f"  tokenizer: {', '.join(report.tokenizer.files)}")
    if report.tokenizer.note:
        click.echo(f"  tokenizer: {report.tokenizer.note}")


@click.command("import-hf", short_help="Import a Hugging Face Llama directory.")
@click.argument("hf_dir")
@click.argument("ckpt")
@layout_options
@click.option(
    "--step", type=int, default=None, help="Step number of the new checkpoint [default: 0]."
)
@storage_option
def import_hf(
    hf_dir,
    ckpt,
    tp,
    pp,
    dp_shard,
    dp_replicate,
    pipeline_split,
    cp,
    expert_parallel,
    step,
    storage_options,
) -> None:
    """Make a shardsmith checkpoint of a Hugging Face Llama directory.

    Turns the local Hugging Face Llama directory HF_DIR into a model-only checkpoint at CKPT
    (a root or step directory) in the given layout; start training from it with
    `train --init-from CKPT`. A tokenizer.json in HF_DIR is recorded as the checkpoint's
    tokenizer (train with --tokenizer HF_DIR)."""
    from shardsmith.reshard.foreign import find_hf_tokenizer, read_model_config
    from shardsmith.reshard.foreign import import_hf as do_import
    from shardsmith.trainer import TrainConfig
    from shardsmith.trainer.data import DataConfig

    dims = make_dims(tp, pp, dp_shard, dp_replicate, pipeline_split, None, expert_parallel, cp)
    tokenizer = find_hf_tokenizer(hf_dir)
    config = TrainConfig(
        model=read_model_config(hf_dir),
        parallel=dims,
        data=DataConfig(tokenizer=os.path.abspath(tokenizer) if tokenizer else ""),
    ).to_json()
    report = do_import(
        hf_dir,
        ckpt,
        dims,
        step=step,
        config=config,
        storage_options=parse_storage_options(storage_options),
    )
    echo_import(report, dims)
    if tokenizer:
        click.echo(
            f"  tokenizer: {tokenizer} recorded (vocab {config['data']['tokenizer_vocab_size']}); "
            f"train from it with --tokenizer {hf_dir}"
        )


def register(group: click.Group) -> None:
    """Add the Hugging Face commands to the ``shardsmith`` group."""
    group.add_command(export_hf)
    group.add_command(import_hf)
