"""``shardsmith reshard`` and ``shardsmith diff``: flags onto the planner, executor and diff.

Registered on the main group by :func:`register` (``cli/main.py`` calls it once).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click

from shardsmith.cli.options import (
    FieldOption,
    dry_run_option,
    dtype_option,
    layout_options,
    make_dims,
    plural,
    size_option,
    storage_option,
    tensor_format_option,
    zarr_codec_option,
)
from shardsmith.layout import DTYPE_CHOICES as _DTYPES
from shardsmith.layout import format_nbytes as _human

PLANNER = "shardsmith.reshard.planner"


@contextmanager
def progress_bar(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar (bytes, throughput, ETA) fed with byte increments; ``None``
    when disabled (``--quiet`` or stderr is not a terminal)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def print_plan(plan: Any, src_url: str, workers: int) -> None:
    """The ``--dry-run`` summary: files, bytes to read and write, peak buffer, per-rank sizes."""
    from shardsmith.layout import ParallelDims
    from shardsmith.storage.manifest import SIDECAR_SUFFIX

    m, opts = plan.source, plan.options
    lay = m.layout
    src_layout = ParallelDims.from_json(lay).describe()
    data_files = [f for f in m.files if not f.endswith(SIDECAR_SUFFIX)]  # both sides alike
    click.echo(
        f"step {m.step}: {src_layout} ({plural(len(data_files), 'file')}) -> "
        f"{plan.dims.describe()} ({plural(len(plan.files), 'file')}; checksum sidecars not "
        f"counted)   source {src_url}"
    )
    click.echo(
        f"  tensors      {len(plan.tensors)}"
        + (f" ({len(plan.dropped)} dropped: optimizer state)" if plan.dropped else "")
        + (f", floats as {opts.dtype}" if opts.dtype else "")
    )
    click.echo(
        f"  read         {_human(plan.nbytes_read)} ({plan.nbytes_read:,} bytes; the source holds "
        f"{_human(m.nbytes)}: reads cover whole checksum chunks, some read for several target files)"
    )
    click.echo(f"  write        {_human(plan.nbytes_write)} ({plan.nbytes_write:,} bytes)")
    click.echo(
        f"  peak buffer  <= {_human(plan.peak_buffer_nbytes)} (--max-buffer "
        f"{_human(opts.max_buffer_nbytes)}; largest tensor shard {_human(plan.largest_shard_nbytes)}; "
        f"{len(plan.slabs())} slabs, {workers} workers)"
    )
    click.echo(f"  {'rank':>6}  {'file':<32} {'tensors':>7}  {'bytes':>15}")
    for tf in plan.files:
        click.echo(f"  {tf.rank:>6}  {tf.name:<32} {len(tf.entries):>7}  {tf.nbytes:>15,}")


def _echo_diff(fqn: str, found: Any) -> None:
    if found is not None:
        what = found.note or f"{found.num_different:,} of {found.numel:,} elements"
        click.echo(f"differs     {fqn}  max abs diff {found.max_abs_diff:.6g}  ({what})")


def run_diff(
    a_url: str,
    b_url: str,
    *,
    atol: float,
    storage_options: dict,
    cast_a: str | None = None,
    fqns: Any = None,
) -> bool:
    """Print the differences of two checkpoints; True iff equal."""
    from shardsmith.reshard import diff_checkpoints
    from shardsmith.storage import read_manifest, resolve_checkpoint

    _, a, _ = resolve_checkpoint(a_url, storage_options)
    _, b, _ = resolve_checkpoint(b_url, storage_options)
    report = diff_checkpoints(
        a,
        read_manifest(a),
        b,
        read_manifest(b),
        atol=atol,
        cast_a=cast_a,
        fqns=fqns,
        on_tensor=_echo_diff,
    )
    return print_diff(report, atol)


def print_diff(report: Any, atol: float) -> bool:
    """The lines after the per-tensor ones: one side only, the state note, the verdict; True iff equal."""
    for fqn in report.only_a:
        click.echo(f"only in A   {fqn}")
    for fqn in report.only_b:
        click.echo(f"only in B   {fqn}")
    keys = report.state_keys
    if keys:
        click.echo(
            "note: the non-tensor state differs (not counted): "
            + ", ".join(keys[:6])
            + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        )
    click.echo(
        f"{'equal' if report.equal else 'DIFFERENT'}: {report.num_compared} tensors compared, "
        f"{len(report.differing)} differ, {len(report.only_a)} only in A, "
        f"{len(report.only_b)} only in B ({'bitwise' if atol == 0 else f'atol {atol:g}'})"
    )
    return bool(report.equal)


@click.command()
@click.argument("src")
@click.argument("dst")
@layout_options
@dtype_option("Convert floating tensors (inference copies); optimizer step counters stay F32.")
@click.option("--model-only", is_flag=True, help="Drop the optimizer state (optim.* tensors).")
@tensor_format_option(
    None, "Tensor format of the result (default: the source's); converts either way."
)
@zarr_codec_option
@size_option(
    "--max-buffer",
    "max_buffer_nbytes",
    default_from=f"{PLANNER}:ReshardOptions.max_buffer_nbytes",
    help="Bytes of tensor data held in memory at once, beyond one slab",
)
@click.option(
    "--workers",
    type=int,
    cls=FieldOption,
    default_from=f"{PLANNER}:ReshardOptions.workers",
    show=lambda n: str(n) if n else "auto",
    help="I/O threads per process; also target files written at once. auto: one per core between "
    "local files, two per core otherwise (at least 4), at most 16; local to local: at most one per core.",
)
@dry_run_option("Validate the target layout and print the plan only.")
@click.option("--verify", is_flag=True, help="Afterwards, diff the result against the source.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--nproc-per-node",
    type=int,
    default=1,
    show_default=True,
    help="Local processes, each converting a share of the target files (rank 0 commits). "
    "Under torchrun, its RANK and WORLD_SIZE are used instead.",
)
@storage_option
def reshard(
    src,
    dst,
    tp,
    pp,
    dp_shard,
    dp_replicate,
    pipeline_split,
    cp,
    expert_parallel,
    dtype,
    model_only,
    tensor_format,
    zarr_codec,
    max_buffer_nbytes,
    workers,
    dry_run,
    verify,
    quiet,
    nproc_per_node,
    storage_options,
) -> None:
    """Convert a checkpoint to a new layout (and format, dtype).

    SRC is a step directory, or a root (its newest step). DST is a step directory or a root; the result is committed there (manifest last) and the
    root's `latest` updated, so `train --resume auto` finds it. Interrupted? Run the same
    command again: files already written and verified are kept.
    """
    from shardsmith.reshard import ReshardOptions, Share, prepare, processes_on_node, run
    from shardsmith.storage.store import parse_storage_options

    options = parse_storage_options(storage_options)
    opts = ReshardOptions(
        dtype=_DTYPES[dtype] if dtype else None,
        model_only=model_only,
        max_buffer_nbytes=max_buffer_nbytes,
        workers=workers,
    )
    job = prepare(
        src,
        dst,
        make_dims(tp, pp, dp_shard, dp_replicate, pipeline_split, None, expert_parallel, cp),
        options=opts,
        tensor_format=tensor_format,
        codec=zarr_codec,
        storage_options=options,
    )
    share = Share.launched()
    if dry_run:
        _print_dry_run(job, dst, processes_on_node(share, nproc_per_node))
        return
    rank = share.rank if share else 0
    with (
        progress_bar(
            job.share_nbytes(share), "resharding", job.plan is not None and not quiet and rank == 0
        ) as bar,
        _explain_interrupt(job.dst_root.url, rank, job.plan is not None),
    ):
        report = run(
            job,
            verify=verify,
            nproc=nproc_per_node,
            share=share,
            storage_options=options,
            progress=bar,
            on_tensor=_echo_diff,
        )
    if report.committed:  # rank 0 reports for every rank
        _print_report(job, report, share.world_size if share else nproc_per_node)
    if report.verified is not None and not print_diff(report.verified, 0.0):
        raise click.exceptions.Exit(1)


def _print_dry_run(job: Any, dst: str, processes: int) -> None:
    if job.plan is not None:
        print_plan(job.plan, job.src.url, job.threads(processes))
    else:
        click.echo(
            f"would convert {job.src.url} ({job.manifest.tensor_format}) to {job.tensor_format} in layout "
            f"{job.dims.describe()} -> {dst}"
        )


def _print_report(job: Any, report: Any, world_size: int) -> None:
    """The one line a committed reshard prints (a format conversion: its own)."""
    if job.plan is None:
        click.echo(
            f"converted step {report.step} to {job.tensor_format} {job.dims.describe()}: "
            f"{plural(report.num_files, 'file')}, {report.nbytes_written:,} bytes, {report.nbytes_read:,} read, "
            f"{report.seconds:.2f}s -> {report.target}"
        )
        return
    rate = report.nbytes_written / max(report.seconds, 1e-9)
    here = "" if world_size == 1 else f" by {world_size} processes"
    click.echo(
        f"resharded step {report.step} to {job.dims.describe()}: {plural(report.num_target_files, 'file')}, "
        f"{_human(report.target_nbytes)}{here}"
        + (
            f" ({report.num_skipped} kept from an interrupted run here)"
            if report.num_skipped
            else ""
        )
        + f"; {'rank 0 ' if here else ''}wrote {_human(report.nbytes_written)} ({_human(rate)}/s), read "
        f"{_human(report.nbytes_read)}, peak buffer {_human(report.peak_buffer_nbytes)}, "
        f"{report.seconds:.2f}s -> {report.target}"
    )


@contextmanager
def _explain_interrupt(target_url: str, rank: int, resumable: bool) -> Iterator[None]:
    """Ctrl-C during a resumable reshard: say that the target is incomplete and how to finish
    it; exit 130 (a format conversion: the main group's "interrupted")."""
    try:
        yield
    except KeyboardInterrupt:
        if not resumable:
            raise
        if rank == 0:
            click.echo(
                f"interrupted: {target_url} is incomplete (nothing committed); run the same "
                "command again to resume (finished files are kept)",
                err=True,
            )
        raise click.exceptions.Exit(130) from None


@click.command()
@click.argument("ckpt_a")
@click.argument("ckpt_b")
@click.option(
    "--atol",
    type=float,
    default=0.0,
    show_default=True,
    help="Absolute tolerance; 0 = bitwise equal with equal dtypes.",
)
@storage_option
def diff(ckpt_a, ckpt_b, atol, storage_options) -> None:
    """Compare two checkpoints tensor by tensor, in any layouts.

    Exits 0 iff all tensors are equal. Prints the max abs difference of each differing tensor and the tensors only one side has.
    """
    from shardsmith.storage.store import parse_storage_options

    if not run_diff(
        ckpt_a, ckpt_b, atol=atol, storage_options=parse_storage_options(storage_options)
    ):
        raise click.exceptions.Exit(1)


def register(group: click.Group) -> None:
    """Add ``reshard`` and ``diff`` to the main command group."""
    group.add_command(reshard)
    group.add_command(diff)
