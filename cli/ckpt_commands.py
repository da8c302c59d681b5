"""Checkpoint housekeeping commands: ``verify``, ``ls`` and ``gc``. They map flags onto the
library (:mod:`shardsmith.storage.verify`, :mod:`shardsmith.storage.gc`) and print."""

from __future__ import annotations

import json

import click

from shardsmith.cli.options import storage_option
from shardsmith.storage.fs import parse_storage_options


@click.command()
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--workers", "--nproc", "workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes the files are split over (each streams its share).")
@storage_option
@click.pass_context
def verify(ctx: click.Context, ckpt: str, as_json: bool, workers: int, storage_options: tuple[str, ...]) -> None:
    """Check checkpoint CKPT (a step directory, or a root: its newest committed step):
    every listed file present, sizes, safetensors headers, checksums, and that every
    tensor's boxes cover it exactly once. Exits 1 naming each bad file."""
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
@click.option("--json", "as_json", is_flag=True, help="Print the steps as JSON.")
@storage_option
def ls(root: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the steps under checkpoint ROOT: status (committed / incomplete / invalid),
    size in bytes, saving layout; `*` marks the step readers resume from."""
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
@click.option("--grace-seconds", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Never delete an incomplete step modified this recently (a save may be running).")
@click.option("--dry-run", is_flag=True, help="Only print what would be deleted.")
@click.option("--json", "as_json", is_flag=True, help="Print every decision as JSON.")
@storage_option
def gc_command(root: str, keep_last: int | None, keep_every: int | None, grace_seconds: float,
               dry_run: bool, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Delete incomplete steps and committed steps outside the retention under ROOT.

    Never deletes the newest committed step, nor an incomplete step that may be being
    written (newer than the newest committed one, or modified within --grace-seconds)."""
    from shardsmith.storage.fs import Store
    from shardsmith.storage.gc import delete_step, plan_gc

    store = Store(root, parse_storage_options(storage_options))
    decisions = plan_gc(store, keep_last, keep_every, grace_seconds=grace_seconds)
    for d in decisions:
        if d.delete and not dry_run:
            delete_step(store, d.name)
    if as_json:
        click.echo(json.dumps({"root": store.url, "dry_run": dry_run,
                               "decisions": [d.to_json() for d in decisions]}, indent=1))
        return
    verb = "would delete" if dry_run else "deleted"
    for d in decisions:
        click.echo(f"{verb if d.delete else 'kept':<12} {d.name}  {d.status:<10} {d.reason}")
    click.echo(f"{verb} {sum(d.delete for d in decisions)} of {len(decisions)} steps")


def register(cli: click.Group) -> None:
    """Add ``verify``, ``ls`` and ``gc`` to the ``shardsmith`` group."""
    cli.add_command(verify)
    cli.add_command(ls)
    cli.add_command(gc_command)
