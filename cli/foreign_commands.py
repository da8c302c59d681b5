"""``shardsmith import-dcp/export-dcp/import-megatron/export-megatron``: flags onto
:mod:`shardsmith.reshard.foreign`."""

from __future__ import annotations

import click

from shardsmith.cli.options import layout_options, make_dims, plural, stack, storage_option
from shardsmith.storage.store import parse_storage_options

hint_options = stack(
    click.option(
        "--num-attention-heads",
        type=int,
        default=None,
        help="Query heads (not told by the tensors' shapes); needed unless SRC records its "
        "model config (DCP written by export-dcp).",
    ),
    click.option(
        "--seq-length",
        type=int,
        default=None,
        help="Training sequence length to record [default: SRC's record, else 2048].",
    ),
    click.option(
        "--rope-theta",
        "--rotary-base",
        "rope_theta",
        type=float,
        default=None,
        help="RoPE base to record (Megatron: --rotary-base) [default: SRC's record, else 10000].",
    ),
    click.option(
        "--norm-eps",
        type=float,
        default=None,
        help="RMSNorm epsilon to record [default: SRC's record, else 1e-5].",
    ),
    click.option(
        "--step",
        type=int,
        default=None,
        help="Step number of the new checkpoint [default: the source's step, else 0].",
    ),
)


def _config_maker(dims):
    from shardsmith.trainer import TrainConfig

    return lambda model: TrainConfig(model=model, parallel=dims).to_json()


def echo_import(report, dims) -> None:
    """Print an importer's :class:`~shardsmith.reshard.foreign.common.ImportReport` (HF, DCP, Megatron)."""
    what = "model weights, AdamW state and step" if report.with_optimizer else "model weights only"
    click.echo(
        f"imported {report.source} as step {report.step} in {dims.describe()} ({what}): "
        f"{plural(report.num_files, 'file')}, {report.nbytes_written:,} bytes, {report.seconds:.2f}s "
        f"-> {report.target}"
    )
    for item in report.dropped:
        click.echo(f"  dropped: {item}")


@click.command("import-dcp", short_help="Import a PyTorch DCP (torchtitan) checkpoint.")
@click.argument("src")
@click.argument("ckpt")
@layout_options
@hint_options
@storage_option
def import_dcp(
    src,
    ckpt,
    tp,
    pp,
    dp_shard,
    dp_replicate,
    pipeline_split,
    cp,
    expert_parallel,
    num_attention_heads,
    seq_length,
    rope_theta,
    norm_eps,
    step,
    storage_options,
) -> None:
    """Turn the torchtitan-style PyTorch DCP directory SRC (.metadata + *.distcp) into a
    shardsmith checkpoint at CKPT (a root or step directory) in the given layout: model
    weights, and AdamW state, step, tokens seen and LR-schedule position when present.
    What is not carried over is listed."""
    from shardsmith.reshard.foreign import ModelHints
    from shardsmith.reshard.foreign import import_dcp as do_import

    dims = make_dims(tp, pp, dp_shard, dp_replicate, pipeline_split, None, expert_parallel, cp)
    hints = ModelHints(
        num_attention_heads=num_attention_heads,
        seq_length=seq_length,
        rope_theta=rope_theta,
        norm_eps=norm_eps,
    )
    report = do_import(
        src,
        ckpt,
        dims,
        hints,
        step=step,
        make_config=_config_maker(dims),
        storage_options=parse_storage_options(storage_options),
    )
    echo_import(report, dims)


@click.command("export-dcp", short_help="Export a checkpoint as a PyTorch DCP directory.")
@click.argument("ckpt")
@click.argument("out_dir")
@click.option("--overwrite", is_flag=True, help="Replace a DCP checkpoint already in OUT_DIR.")
@storage_option
def export_dcp(ckpt, out_dir, overwrite, storage_options) -> None:
    """Write checkpoint CKPT (a step directory, or a root: its newest step) as a torchtitan-style
    PyTorch DCP directory OUT_DIR that torch.distributed.checkpoint.load reads (model keys,
    optimizer.state.* / optimizer.param_groups.*, train_state, lr_scheduler; no dataloader)."""
    from shardsmith.reshard.foreign import export_dcp as do_export

    report = do_export(
        ckpt, out_dir, overwrite=overwrite, storage_options=parse_storage_options(storage_options)
    )
    what = "with AdamW state" if report.with_optimizer else "model only"
    click.echo(
        f"exported step {report.step} from {report.source} ({what}): {report.num_tensors} tensors, "
        f"{report.seconds:.2f}s -> {report.out_dir}"
    )


@click.command("import-megatron", short_help="Import a Megatron-Core torch_dist checkpoint.")
@click.argument("src")
@click.argument("ckpt")
@layout_options
@hint_options
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Unpadded vocabulary; Megatron's padding rows beyond it are dropped [default: every row].",
)
@storage_option
def import_megatron(
    src,
    ckpt,
    tp,
    pp,
    dp_shard,
    dp_replicate,
    pipeline_split,
    cp,
    expert_parallel,
    num_attention_heads,
    seq_length,
    rope_theta,
    norm_eps,
    step,
    vocab_size,
    storage_options,
) -> None:
    """Turn the Megatron-Core GPT checkpoint SRC in the torch_dist format (.metadata, *.distcp,
    metadata.json; saved with any tp/pp/dp) into a shardsmith checkpoint at CKPT in the given
    layout: fused QKV and SwiGLU FC1 split, RoPE rows reordered, vocab padding dropped. The
    Adam state (moments and step) is converted when Megatron saved it in model space (the
    distributed optimizer's fully_reshardable layout, Megatron-LM
    --dist-ckpt-optim-fully-reshardable); the dp_reshardable bucket layout is reported and not
    converted: then start training from the weights with `train --init-from CKPT`."""
    from shardsmith.reshard.foreign import ModelHints
    from shardsmith.reshard.foreign import import_megatron as do_import

    dims = make_dims(tp, pp, dp_shard, dp_replicate, pipeline_split, None, expert_parallel, cp)
    hints = ModelHints(
        num_attention_heads=num_attention_heads,
        seq_length=seq_length,
        rope_theta=rope_theta,
        norm_eps=norm_eps,
    )
    report = do_import(
        src,
        ckpt,
        dims,
        hints,
        vocab_size=vocab_size,
        step=step,
        make_config=_config_maker(dims),
        storage_options=parse_storage_options(storage_options),
    )
    echo_import(report, dims)


@click.command("export-megatron", short_help="Export weights as a Megatron-Core checkpoint.")
@click.argument("ckpt")
@click.argument("out_dir")
@click.option(
    "--tp",
    "--tensor-model-parallel-size",
    "tp",
    type=int,
    default=1,
    show_default=True,
    help="Megatron TP degree the vocabulary is padded for (torch_dist itself loads into any tp).",
)
@click.option(
    "--pp",
    "--pipeline-model-parallel-size",
    "pp",
    type=int,
    default=1,
    show_default=True,
    help="Megatron pipeline stages to check the layers against (torch_dist loads into any pp).",
)
@click.option(
    "--make-vocab-size-divisible-by",
    "divisible_by",
    type=int,
    default=128,
    show_default=True,
    help="Megatron's vocabulary padding unit (times tp).",
)
@click.option("--no-optimizer", is_flag=True, help="Weights only, even when CKPT has Adam state.")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint already in OUT_DIR.")
@storage_option
def export_megatron(
    ckpt, out_dir, tp, pp, divisible_by, no_optimizer, overwrite, storage_options
) -> None:
    """Write checkpoint CKPT as a Megatron-Core GPT torch_dist directory OUT_DIR (Transformer
    Engine key names, layer-stacked) that megatron.core.dist_checkpointing.load reads into a
    GPTModel with SwiGLU, RMSNorm, RoPE, no biases and num_query_groups = the kv heads; with
    the Adam state, when CKPT has it, in the distributed optimizer's fully_reshardable layout
    (load it with metadata distrib_optim_sharding_type=fully_reshardable and the same --lr and
    --min-lr: Megatron pairs param groups by them)."""
    from shardsmith.reshard.foreign import export_megatron as do_export

    report = do_export(
        ckpt,
        out_dir,
        tp=tp,
        pp=pp,
        divisible_by=divisible_by,
        optimizer=not no_optimizer,
        overwrite=overwrite,
        storage_options=parse_storage_options(storage_options),
    )
    what = "weights and Adam state" if report.with_optimizer else "model weights"
    click.echo(
        f"exported step {report.step} from {report.source} ({what}, vocab padded to "
        f"{report.padded_vocab_size}): {report.num_tensors} tensors, {report.seconds:.2f}s "
        f"-> {report.out_dir}"
    )


def register(group: click.Group) -> None:
    """Add the foreign-format commands to the ``shardsmith`` group."""
    group.add_command(import_dcp)
    group.add_command(export_dcp)
    group.add_command(import_megatron)
    group.add_command(export_megatron)
