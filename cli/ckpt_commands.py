"""Checkpoint commands: ``inspect``, ``verify``, ``ls`` and ``gc``. They map flags onto the
library (:mod:`shardsmith.storage.commit`, ``.verify``, ``.gc``) and print."""

from __future__ import annotations

import json
from math import prod

import click

from shardsmith.cli.options import FieldOption, dry_run_option, json_option, storage_option
from shardsmith.storage.fs import parse_storage_options


@click.command()
@click.argument("ckpt")
@json_option("the manifest summary")
@storage_option
def inspect(ckpt: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Show a checkpoint's layout, model, tensors and sizes.

    CKPT is a step directory, or a root (its newest committed step)."""
    from shardsmith.layout import ModelConfig
    from shardsmith.layout.dims import ParallelDims
    from shardsmith.layout.presets import preset_of
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
    from shardsmith.cli.train_commands import describe_model

    model = ModelConfig.from_json(m.model)
    num_params = sum(prod(t.shape) for f, t in m.tensors.items() if not f.startswith("optim."))
    click.echo(f"{step_store.url}\n  step {m.step}  created {m.created}  format {m.tensor_format} "
               f"v{m.version}\n  layout {ParallelDims.from_json(m.layout).describe()} "
               f"({m.layout.get('world_size')} ranks)\n  files {len(m.files)}  {m.nbytes:,} bytes\n"
               f"  model {preset_of(model) or 'custom'}: {describe_model(model)}; {num_params:,} parameters\n"
               f"  state step={m.state.get('step')} data={m.state.get('data')}")
    width = max(len(f) for f in m.tensors)
    click.echo(f"  {'tensor':<{width}}  {'shape':<14} dtype  shards  bytes")
    for fqn, t in sorted(m.tensors.items()):
        click.echo(f"  {fqn:<{width}}  {str(tuple(t.shape)):<14} {t.dtype:<5}  {len(t.shards):>6}  {t.nbytes:,}")


@click.command(short_help="Check files, sizes, checksums and coverage.")
@click.argument("ckpt")
@json_option("the report")
@click.option("--workers", "--nproc", "workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes the files are split over (each streams its share).")
@storage_option
@click.pass_context
def verify(ctx: click.Context, ckpt: str, as_json: bool, workers: int, storage_options: tuple[str, ...]) -> None:
    """Check a checkpoint's files, sizes, checksums and coverage.

    CKPT is a step directory, or a root (its newest committed step). Checks that every
    listed file is present, sizes, safetensors headers, checksums, and that every tensor's
    boxes cover it exactly once. Exits 1 naming each bad file."""
    from shardsmith.storage.commit import resolve_checkpoint
    from shardsmith.storage.verify import verify_checkpoint

    _, step_store, _ = resolve_checkpoint(ckpt, parse_storage_options(storage_options))
    report = verify_checkpoint(step_store, workers=workers)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        for p in report.problems:
            click.echo(f"BAD {p.file}: {p.what}")
        for name in report.extra_files:
            click.echo(f"note: {name} is not listed in the manifest (leftover; `shardsmith gc` ignores it)")
        if report.ok:
            click.echo(f"ok: {report.url} step {report.step}: {report.num_files} files, "
                       f"{report.num_tensors} tensors, {report.nbytes_checked:,} bytes verified")
    if not report.ok:
        click.echo(f"error: {report.url}: {len(report.problems)} problems in {len(report.bad_files)} "
                   f"files: {', '.join(report.bad_files)}", err=True)
        ctx.exit(1)


@click.command(name="ls")
@click.argument("root")
@json_option("the steps")
@storage_option
def ls(root: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the steps under ROOT with status, size and layout.

    Status is committed, incomplete or invalid; sizes are in bytes; `*` marks the step
    readers resume from."""
    from shardsmith.storage.commit import read_latest_hint
    from shardsmith.storage.fs import Store
    from shardsmith.storage.gc import describe_steps

    store = Store(root, parse_storage_options(storage_options))
    steps = describe_steps(store)
    hint = read_latest_hint(store)
    if as_json:
        click.echo(json.dumps({"root": store.url, "latest_hint": hint,
                               "steps": [s.to_json() for s in steps]}, indent=1))
        return
    if not steps:
        click.echo(f"{store.url}: no steps")
        return
    click.echo(f"  {'step':>10}  {'status':<10} {'bytes':>14}  {'files':>5}  layout")
    for s in steps:
        click.echo(f"{'*' if s.latest else ' '} {s.step:>10}  {s.status:<10} {s.nbytes:>14,}  "
                   f"{s.num_files:>5}  {s.layout or '-'}" + (f"  ({s.error[:120]})" if s.error else ""))
    newest = next((s.name for s in steps if s.latest), None)
    if hint != newest:
        click.echo(f"note: {store.url}/latest is {hint!r}; readers use {newest}")


@click.command(name="gc")
@click.argument("root")
@click.option("--keep-last", type=click.IntRange(min=1), default=None,
              help="Keep this many newest committed steps.  [default: all]")
@click.option("--keep-every", type=click.IntRange(min=1), default=None,
              help="Also keep committed steps divisible by this.")
@click.option("--grace-seconds", type=click.FloatRange(min=0), cls=FieldOption,
              default_from="shardsmith.storage.gc:gc.grace_seconds",
              help="Never delete an incomplete step modified this recently (a save may be running).")
@dry_run_option("Only print what would be deleted.")
@json_option("every decision")
@storage_option
def gc_command(root: str, keep_last: int | None, keep_every: int | None, grace_seconds: float,
               dry_run: bool, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Delete old and incomplete steps under checkpoint ROOT.

    Deletes incomplete steps and committed steps outside the retention. Never deletes the
    newest committed step, nor an incomplete step that may be being written (newer than
    the newest committed one, or modified within --grace-seconds)."""
    from shardsmith.storage.fs import Store
    from shardsmith.storage.gc import gc

    store = Store(root, parse_storage_options(storage_options))
    decisions: list = []
    verb = "would delete" if dry_run else "deleted"
    echo = (lambda d: None) if as_json else (
        lambda d: click.echo(f"{verb if d.delete else 'kept':<12} {d.name}  {d.status:<10} {d.reason}"))
    gc(store, keep_last, keep_every, grace_seconds=grace_seconds, dry_run=dry_run,
       on_decision=lambda d: (decisions.append(d), echo(d)))
    if as_json:
        click.echo(json.dumps({"root": store.url, "dry_run": dry_run,
                               "decisions": [d.to_json() for d in decisions]}, indent=1))
        return
    click.echo(f"{verb} {sum(d.delete for d in decisions)} of {len(decisions)} steps")


def register(cli: click.Group) -> None:
    """Add ``inspect``, ``verify``, ``ls`` and ``gc`` to the ``shardsmith`` group."""
    cli.add_command(inspect)
    cli.add_command(verify)
    cli.add_command(ls)
    cli.add_command(gc_command)
