"""``shardsmith export-hf`` and ``import-hf``: flags onto :mod:`shardsmith.reshard.hf_io`."""

from __future__ import annotations

import click

from shardsmith.layout.dtypes import DTYPE_CHOICES

from shardsmith.cli.options import layout_options, storage_option
from shardsmith.storage.fs import parse_storage_options


@click.command("export-hf")
@click.argument("ckpt")
@click.argument("out_dir")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_CHOICES)), default="fp32", show_default=True,
              help="dtype of the exported weights.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Split the weights into files of at most this size (e.g. 500MB, 2GiB), "
                   "with model.safetensors.index.json.")
@click.option("--overwrite", is_flag=True, help="Replace a model already in OUT_DIR.")
@storage_option
def export_hf(ckpt, out_dir, dtype, max_shard_size, overwrite, storage_options) -> None:
    """Write checkpoint CKPT (a step directory, or a root: its newest step) as a Hugging Face
    Llama directory OUT_DIR that transformers' LlamaForCausalLM.from_pretrained loads."""
    from shardsmith.reshard.hf_io import export_hf as do_export, parse_nbytes

    report = do_export(ckpt, out_dir, dtype=dtype, max_shard_nbytes=parse_nbytes(max_shard_size),
                       overwrite=overwrite, storage_options=parse_storage_options(storage_options))
    click.echo(f"exported step {report.step} from {report.source}: {report.num_tensors} tensors, "
               f"{report.nbytes:,} bytes in {len(report.files)} file(s), {report.seconds:.2f}s "
               f"-> {report.out_dir}")


@click.command("import-hf")
@click.argument("hf_dir")
@click.argument("ckpt")
@layout_options
@click.option("--step", type=int, default=None, help="Step number of the new checkpoint [default: 0].")
@storage_option
def import_hf(hf_dir, ckpt, tp, pp, dp_shard, dp_replicate, pipeline_split, step, storage_options) -> None:
    """Turn the local Hugging Face Llama directory HF_DIR into a model-only shardsmith checkpoint
    at CKPT (a root or step directory) in the given layout; start training from it with
    `train --init-from CKPT`."""
    from shardsmith.cli.main import make_dims
    from shardsmith.reshard.hf_io import import_hf as do_import, read_model_config
    from shardsmith.trainer.config import TrainConfig

    dims = make_dims(tp, pp, dp_shard, dp_replicate, pipeline_split, None)
    config = TrainConfig(model=read_model_config(hf_dir), parallel=dims).to_json()
    report = do_import(hf_dir, ckpt, dims, step=step, config=config,
                       storage_options=parse_storage_options(storage_options))
    click.echo(f"imported {hf_dir} as step {report.step} in {dims.describe()}: {report.num_files} files, "
               f"{report.nbytes_written:,} bytes, {report.seconds:.2f}s -> {report.target}")


def register(group: click.Group) -> None:
    """Add the Hugging Face commands to the ``shardsmith`` group."""
    group.add_command(export_hf)
    group.add_command(import_hf)
