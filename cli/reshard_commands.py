"""``shardsmith reshard`` and ``shardsmith diff``: flags onto the planner, executor and diff.

Registered on the main group by :func:`register` (``cli/main.py`` calls it once).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click

from shardsmith.cli.options import (FieldOption, dry_run_option, dtype_option, layout_options, make_dims,
                                    size_option, storage_option, tensor_format_option, zarr_codec_option)

from shardsmith.layout.dtypes import DTYPE_CHOICES as _DTYPES
from shardsmith.layout.sizes import format_nbytes as _human

PLANNER = "shardsmith.reshard.planner"


@contextmanager
def progress_bar(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar (bytes, throughput, ETA) fed with byte increments; ``None``
    when disabled (``--quiet`` or stderr is not a terminal)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def print_plan(plan: Any, src_url: str) -> None:
    """The ``--dry-run`` summary: files, bytes to read and write, peak buffer, per-rank sizes."""
    from shardsmith.layout import ParallelDims

    m, opts = plan.source, plan.options
    lay = m.layout
    src_layout = ParallelDims.from_json(lay).describe()
    click.echo(f"step {m.step}: {src_layout} ({len(m.files)} files) -> {plan.dims.describe()} "
               f"({len(plan.files)} files)   source {src_url}")
    click.echo(f"  tensors      {len(plan.tensors)}"
               + (f" ({len(plan.dropped)} dropped: optimizer state)" if plan.dropped else "")
               + (f", floats as {opts.dtype}" if opts.dtype else ""))
    click.echo(f"  read         {_human(plan.nbytes_read)} ({plan.nbytes_read:,} bytes; the source holds "
               f"{_human(m.nbytes)}: reads cover whole checksum chunks, some read for several target files)")
    click.echo(f"  write        {_human(plan.nbytes_write)} ({plan.nbytes_write:,} bytes)")
    click.echo(f"  peak buffer  <= {_human(plan.peak_buffer_nbytes)} (--max-buffer "
               f"{_human(opts.max_buffer_nbytes)}; largest tensor shard {_human(plan.largest_shard_nbytes)}; "
               f"{len(plan.slabs())} slabs, {opts.workers} workers)")
    click.echo(f"  {'rank':>6}  {'file':<32} {'tensors':>7}  {'bytes':>15}")
    for tf in plan.files:
        click.echo(f"  {tf.rank:>6}  {tf.name:<32} {len(tf.entries):>7}  {tf.nbytes:>15,}")


def _echo_diff(fqn: str, found: Any) -> None:
    if found is not None:
        what = found.note or f"{found.num_different:,} of {found.numel:,} elements"
        click.echo(f"differs     {fqn}  max abs diff {found.max_abs_diff:.6g}  ({what})")


def run_diff(a_url: str, b_url: str, *, atol: float, storage_options: dict, cast_a: str | None = None,
             fqns: Any = None) -> bool:
    """Print the differences of two checkpoints; True iff equal."""
    from shardsmith.reshard.diff import diff_checkpoints
    from shardsmith.storage.commit import read_manifest, resolve_checkpoint

    _, a, _ = resolve_checkpoint(a_url, storage_options)
    _, b, _ = resolve_checkpoint(b_url, storage_options)
    ma, mb = read_manifest(a), read_manifest(b)
    report = diff_checkpoints(a, ma, b, mb, atol=atol, cast_a=cast_a, fqns=fqns, on_tensor=_echo_diff)
    for fqn in report.only_a:
        click.echo(f"only in A   {fqn}")
    for fqn in report.only_b:
        click.echo(f"only in B   {fqn}")
    if ma.state != mb.state:
        keys = _differing_keys(ma.state, mb.state)
        click.echo("note: the non-tensor state differs (not counted): " + ", ".join(keys[:6])
                   + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
    click.echo(f"{'equal' if report.equal else 'DIFFERENT'}: {report.num_compared} tensors compared, "
               f"{len(report.differing)} differ, {len(report.only_a)} only in A, "
               f"{len(report.only_b)} only in B ({'bitwise' if atol == 0 else f'atol {atol:g}'})")
    return report.equal


def _differing_keys(a: Any, b: Any, path: str = "state") -> list[str]:
    """Dotted paths of the leaves where two JSON values differ (``state.run.parent``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b), key=str)
                for k in _differing_keys(a.get(key), b.get(key), f"{path}.{key}")]
    return [] if a == b else [path]


@click.command()
@click.argument("src")
@click.argument("dst")
@layout_options
@dtype_option("Convert floating tensors (inference copies); optimizer step counters stay F32.")
@click.option("--model-only", is_flag=True, help="Drop the optimizer state (optim.* tensors).")
@tensor_format_option(None, "Tensor format of the result (default: the source's); converts either way.")
@zarr_codec_option
@size_option("--max-buffer", "max_buffer_nbytes", default_from=f"{PLANNER}:ReshardOptions.max_buffer_nbytes",
             help="Bytes of tensor data held in memory at once, beyond one slab")
@click.option("--workers", type=int, cls=FieldOption, default_from=f"{PLANNER}:ReshardOptions.workers",
              help="I/O threads; also target files written at once (local to local: at most one per core).")
@dry_run_option("Validate the target layout and print the plan only.")
@click.option("--verify", is_flag=True, help="Afterwards, diff the result against the source.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--nproc-per-node", type=int, default=1, show_default=True,
              help="Local processes, each converting a share of the target files (rank 0 commits). "
                   "Under torchrun, its RANK and WORLD_SIZE are used instead.")
@storage_option
def reshard(src, dst, tp, pp, dp_shard, dp_replicate, pipeline_split, cp, expert_parallel, dtype, model_only, tensor_format,
            zarr_codec, max_buffer_nbytes, workers, dry_run, verify, quiet, nproc_per_node, storage_options) -> None:
    """Convert a checkpoint to a new layout (and format, dtype).

    SRC is a step directory, or a root (its newest step). DST is a step directory or a root; the result is committed there (manifest last) and the
    root's `latest` updated, so `train --resume auto` finds it. Interrupted? Run the same
    command again: files already written and verified are kept.
    """
    from shardsmith.reshard.engine import execute, target_root
    from shardsmith.reshard.planner import ReshardOptions, plan_reshard
    from shardsmith.reshard.scaleout import Share, assign_files, launch_local
    from shardsmith.storage.commit import read_manifest, resolve_checkpoint
    from shardsmith.storage.store.options import parse_storage_options

    target = make_dims(tp, pp, dp_shard, dp_replicate, pipeline_split, None, expert_parallel, cp)
    if _convert_zarr(src, dst, target, tensor_format, zarr_codec, dtype, model_only, dry_run, verify,
                     parse_storage_options(storage_options)):
        return                                        # zarr source or target: single process
    if nproc_per_node > 1 and "WORLD_SIZE" not in os.environ and not dry_run:
        args = [src, dst, "--tp", str(tp), "--pp", str(pp), "--dp-shard", str(dp_shard), "--dp-replicate",
                str(dp_replicate), "--pipeline-split", ",".join(map(str, pipeline_split)),
                "--ep", str(expert_parallel), "--cp", str(cp),
                "--max-buffer", str(max_buffer_nbytes),
                "--workers", str(workers)] + (["--dtype", dtype] if dtype else []) \
            + (["--model-only"] if model_only else []) + (["--verify"] if verify else []) \
            + (["--quiet"] if quiet else []) + [a for s in storage_options for a in ("--storage-option", s)]
        code = launch_local(args, nproc_per_node)
        if code:
            raise click.exceptions.Exit(code)
        return
    share = Share.from_env()
    options = parse_storage_options(storage_options)
    src_root, src_store, _ = resolve_checkpoint(src, options)
    dims = target
    opts = ReshardOptions(dtype=_DTYPES[dtype] if dtype else None, model_only=model_only,
                          max_buffer_nbytes=max_buffer_nbytes, workers=workers)
    plan = plan_reshard(read_manifest(src_store), dims, opts, src_store.url)
    if dry_run:
        print_plan(plan, src_store.url)
        return
    dst_root = target_root(dst, plan.source.step, options)
    refuse_source_as_target(src_root.url, dst_root.url)
    total = sum(tf.nbytes for tf in assign_files(plan.files, share.world_size)[share.rank])
    with progress_bar(total, "resharding", not quiet and share.rank == 0) as bar, \
            _explain_interrupt(dst_root.url, share.rank):
        report = execute(plan, src_store, dst_root, share=share, progress=bar)
    rate = report.nbytes_written / max(report.seconds, 1e-9)
    if not report.committed:                          # rank 0 reports for every rank
        return
    here = "" if share.world_size == 1 else f" by {share.world_size} processes"
    click.echo(f"resharded step {report.step} to {dims.describe()}: {report.num_target_files} files, "
               f"{_human(report.target_nbytes)}{here}"
               + (f" ({report.num_skipped} kept from an interrupted run here)" if report.num_skipped else "")
               + f"; {'rank 0 ' if here else ''}wrote {_human(report.nbytes_written)} ({_human(rate)}/s), read "
               f"{_human(report.nbytes_read)}, peak buffer {_human(report.peak_buffer_nbytes)}, "
               f"{report.seconds:.2f}s -> {report.target}")
    if verify and not run_diff(src_store.url, report.target, atol=0.0, storage_options=options,
                               cast_a=opts.dtype, fqns=list(plan.tensors)):
        raise click.exceptions.Exit(1)


@contextmanager
def _explain_interrupt(target_url: str, rank: int) -> Iterator[None]:
    """Ctrl-C: say that the target is incomplete and how to finish it; exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        if rank == 0:
            click.echo(f"interrupted: {target_url} is incomplete (nothing committed); run the same "
                       "command again to resume (finished files are kept)", err=True)
        raise click.exceptions.Exit(130) from None


def refuse_source_as_target(src_root_url: str, dst_root_url: str) -> None:
    """A reshard writes the source's step number under DST: with DST the source's own root
    it would overwrite the source.

    Raises:
        ConfigError: DST is the source's checkpoint root (or its step directory).
    """
    from shardsmith.errors import ConfigError

    if src_root_url.rstrip("/") == dst_root_url.rstrip("/"):
        raise ConfigError(f"DST {dst_root_url} is the source's own checkpoint root: the result would "
                          "replace the source step; choose another target directory")


def _convert_zarr(src: str, dst: str, dims: Any, tensor_format: str | None, codec: str, dtype: str | None,
                  model_only: bool, dry_run: bool, verify: bool, options: dict) -> bool:
    """``reshard`` when zarr is involved (source or target), via ``convert_format``; False
    (nothing done) when both are safetensors."""
    from shardsmith.errors import ConfigError
    from shardsmith.reshard.zarr_convert import convert_format
    from shardsmith.storage.commit import read_manifest, resolve_checkpoint

    _, src_store, _ = resolve_checkpoint(src, options)
    source = read_manifest(src_store)
    source_format = source.tensor_format
    tensor_format = tensor_format or source_format
    if "zarr" not in (source_format, tensor_format):
        if codec:
            raise ConfigError("--zarr-codec needs --format zarr")
        return False
    if dtype:
        raise ConfigError("--dtype is not supported when converting to or from zarr; convert the "
                          "dtype in a safetensors reshard first")
    if dry_run:
        click.echo(f"would convert {src_store.url} ({source_format}) to {tensor_format} in layout "
                   f"{dims.describe()} -> {dst}")
        return True
    report = convert_format(src_store, dst, dims, tensor_format, codec=codec, model_only=model_only,
                            storage_options=options)
    click.echo(f"converted step {report.step} to {tensor_format} {dims.describe()}: {report.num_files} files, "
               f"{report.nbytes_written:,} bytes, {report.nbytes_read:,} read, {report.seconds:.2f}s -> "
               f"{report.target}")
    kept = [f for f in source.tensors if not (model_only and f.startswith("optim."))]
    if verify and not run_diff(src_store.url, report.target, atol=0.0, storage_options=options, fqns=kept):
        raise click.exceptions.Exit(1)
    return True


@click.command()
@click.argument("ckpt_a")
@click.argument("ckpt_b")
@click.option("--atol", type=float, default=0.0, show_default=True,
              help="Absolute tolerance; 0 = bitwise equal with equal dtypes.")
@storage_option
def diff(ckpt_a, ckpt_b, atol, storage_options) -> None:
    """Compare two checkpoints tensor by tensor, in any layouts.

    Exits 0 iff all tensors are equal. Prints the max abs difference of each differing tensor and the tensors only one side has.
    """
    from shardsmith.storage.store.options import parse_storage_options

    if not run_diff(ckpt_a, ckpt_b, atol=atol, storage_options=parse_storage_options(storage_options)):
        raise click.exceptions.Exit(1)


def register(group: click.Group) -> None:
    """Add ``reshard`` and ``diff`` to the main command group."""
    group.add_command(reshard)
    group.add_command(diff)
