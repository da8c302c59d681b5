"""Checkpoint commands: ``inspect``, ``verify``, ``ls`` and ``gc``. They map flags onto the
library (:mod:`shardsmith.storage.commit`, ``.verify``, ``.gc``) and print."""

from __future__ import annotations

import json
from math import prod
from typing import Any

import click

from shardsmith.cli.options import FieldOption, dry_run_option, json_option, plural, storage_option
from shardsmith.storage.store import parse_storage_options


@click.command(short_help="Summarize a checkpoint (metadata only).")
@click.argument("ckpt")
@click.option(
    "--tensors",
    "all_tensors",
    is_flag=True,
    help="List every tensor (optimizer state included), not only the largest.",
)
@json_option("the manifest summary")
@storage_option
def inspect(ckpt: str, all_tensors: bool, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """Summarize a checkpoint: layout, configs, sizes, largest tensors.

    CKPT is a step directory, or a root (its newest committed step). Reads the manifest
    only: the data is not checked (`shardsmith verify` does that)."""
    from shardsmith.storage import read_manifest, resolve_checkpoint

    _refuse_file(ckpt)
    _, step_store, _ = resolve_checkpoint(ckpt, parse_storage_options(storage_options))
    m = read_manifest(step_store)
    groups = tensor_groups(m.tensors)
    if as_json:
        summary = {
            "url": step_store.url,
            "step": m.step,
            "version": m.version,
            "layout": m.layout,
            "model": m.model,
            "config": m.config,
            "nbytes": m.nbytes,
            "num_files": len(m.files),
            "groups": groups,
            "checked": "metadata only; run `shardsmith verify` to check the data",
        }
        summary["state"] = {k: v for k, v in m.state.items() if k != "rng"}
        if all_tensors:
            summary["tensors"] = {
                fqn: {
                    "shape": t.shape,
                    "dtype": t.dtype,
                    "num_shards": len(t.shards),
                    "nbytes": t.nbytes,
                }
                for fqn, t in m.tensors.items()
            }
        click.echo(json.dumps(summary, indent=1))
        return
    _print_summary(step_store.url, m, groups)
    shown = sorted(m.tensors.items(), key=lambda kv: (-kv[1].nbytes, kv[0]))
    shown = sorted(m.tensors.items()) if all_tensors else shown[:LARGEST]
    width = max((len(f) for f, _ in shown), default=6)
    click.echo(
        f"  {'all tensors' if all_tensors else f'largest {len(shown)} tensors (--tensors: all)'}:"
    )
    click.echo(f"    {'tensor':<{width}}  {'shape':<14} dtype  shards  bytes")
    for fqn, t in shown:
        click.echo(
            f"    {fqn:<{width}}  {str(tuple(t.shape)):<14} {t.dtype:<5}  {len(t.shards):>6}  {t.nbytes:,}"
        )
    click.echo(
        "  read the manifest only: the data was not checked (run `shardsmith verify` for that)"
    )


#: Tensors the summary of ``inspect`` lists (largest first).
LARGEST = 8


def _refuse_file(url: str) -> None:
    import os

    from shardsmith.errors import CheckpointNotFound

    path = url[len("file://") :] if url.startswith("file://") else url
    if "://" not in path and os.path.isfile(path):
        raise CheckpointNotFound(f"{url} is a file, not a checkpoint (a step directory or a root)")


def tensor_groups(tensors: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Tensors per group (``model``, and ``optim.<state>`` per optimizer state name): count,
    elements and bytes."""
    out: dict[str, dict[str, int]] = {}
    for fqn, t in tensors.items():
        parts = fqn.split(".")
        group = f"optim.{parts[1]}" if parts[0] == "optim" and len(parts) > 2 else "model"
        g = out.setdefault(group, {"num_tensors": 0, "numel": 0, "nbytes": 0})
        g["num_tensors"] += 1
        g["numel"] += prod(t.shape)
        g["nbytes"] += t.nbytes
    return dict(sorted(out.items()))


def _print_summary(url: str, m: Any, groups: dict[str, dict[str, int]]) -> None:
    from shardsmith.cli.dry_run import describe_model
    from shardsmith.layout import ModelConfig, ParallelDims, format_nbytes
    from shardsmith.sizing import preset_of

    model = ModelConfig.from_json(m.model)
    state = {k: v for k, v in m.state.items() if k not in ("rng",)}
    click.echo(
        f"{url}\n  step {m.step}  created {m.created}  format {m.tensor_format} v{m.version}\n"
        f"  layout {ParallelDims.from_json(m.layout).describe()} ({m.layout.get('world_size')} ranks)\n"
        f"  files {len(m.files)}  {format_nbytes(m.nbytes)} ({m.nbytes:,} bytes)\n"
        f"  model {preset_of(model) or 'custom'}: {describe_model(model)}; "
        f"{groups.get('model', {}).get('numel', 0):,} parameters"
    )
    optim, steps = m.config.get("optim") or {}, m.config.get("steps")
    source = m.state.get("source") or {}
    if source:  # its config's schedule is the importer's default, never trained on
        click.echo(f"  imported from {source.get('format')} {source.get('path')}: no LR schedule")
    elif optim:
        click.echo(
            f"  trained with lr {optim.get('lr')}, warmup {optim.get('warmup_steps')}, decay to step "
            f"{optim.get('decay_steps') or steps}, --steps {steps}"
        )
    click.echo(
        f"  state step={state.get('step')} tokens_seen={state.get('tokens_seen')} data={state.get('data')}"
    )
    width = max([14] + [len(name) for name in groups])
    for name, g in groups.items():
        click.echo(
            f"  {name:<{width}} {g['num_tensors']:>5} tensors  {g['numel']:>15,} elements  "
            f"{format_nbytes(g['nbytes']):>10}"
        )


@click.command(short_help="Check files, sizes, checksums and coverage.")
@click.argument("ckpt")
@json_option("the report")
@click.option(
    "--workers",
    "--nproc",
    "workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes the files are split over (each streams its share).",
)
@storage_option
@click.pass_context
def verify(
    ctx: click.Context, ckpt: str, as_json: bool, workers: int, storage_options: tuple[str, ...]
) -> None:
    """Check a checkpoint's files, sizes, checksums and coverage.

    CKPT is a step directory, or a root (its newest committed step). Checks that every
    listed file is present, sizes, safetensors headers, checksums, and that every tensor's
    boxes cover it exactly once. Exits 1 naming each bad file."""
    from shardsmith.errors import CheckpointNotFound
    from shardsmith.storage import no_checkpoint_message, resolve_checkpoint, verify_checkpoint

    options = parse_storage_options(storage_options)
    _, step_store, _ = resolve_checkpoint(ckpt, options)
    if not step_store.exists(""):  # a step name that is not there: not "1 problems in 1 files"
        raise CheckpointNotFound(no_checkpoint_message(step_store, options))
    report = verify_checkpoint(step_store, workers=workers)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        for p in report.problems:
            click.echo(f"BAD {p.file}: {p.what}")
        for name in report.extra_files:
            click.echo(
                f"note: {name} is not listed in the manifest (leftover; `shardsmith gc` ignores it)"
            )
        if report.ok:
            click.echo(
                f"ok: {report.url} step {report.step}: {plural(report.num_files, 'file')}, "
                f"{report.num_tensors} tensors, {report.nbytes_checked:,} bytes verified"
            )
    if not report.ok:
        click.echo(
            f"error: {report.url}: {plural(len(report.problems), 'problem')} in "
            f"{plural(len(report.bad_files), 'file')}: {', '.join(report.bad_files)}",
            err=True,
        )
        ctx.exit(1)


@click.command(name="ls")
@click.argument("root")
@json_option("the steps")
@storage_option
def ls(root: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the steps under ROOT with status, size and layout.

    Status is committed, incomplete, invalid or corrupt (a load found its data corrupt and
    marked it; --resume auto skips it); sizes are in bytes; `*` marks the step
    readers resume from; run is the run id that committed it. Unfinished multipart uploads
    (S3) are counted."""
    from shardsmith.storage import describe_steps, read_latest_hint
    from shardsmith.storage.store import list_uploads

    store = existing_root(root, storage_options)
    steps = describe_steps(store)
    hint = read_latest_hint(store)
    uploads = list_uploads(store)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "root": store.url,
                    "latest_hint": hint,
                    "unfinished_uploads": len(uploads),
                    "steps": [s.to_json() for s in steps],
                },
                indent=1,
            )
        )
        return
    width = max([17] + [len(s.layout or "-") for s in steps])  # cp·ep·v layouts are longer
    if not steps:
        click.echo(f"{store.url}: no steps")
    else:
        click.echo(
            f"  {'step':>10}  {'status':<10} {'bytes':>14}  {'files':>5}  {'layout':<{width}}  run"
        )
    for s in steps:
        click.echo(
            f"{'*' if s.latest else ' '} {s.step:>10}  {s.status:<10} {s.nbytes:>14,}  "
            f"{s.num_files:>5}  {s.layout or '-':<{width}}  {s.run_id[:12] or '-'}"
            + (f"  ({s.error[:120]})" if s.error else "")
        )
    newest = next((s.name for s in steps if s.latest), None)
    if steps and hint != newest:
        click.echo(f"note: {store.url}/latest is {hint!r}; readers use {newest}")
    if len({s.run_id for s in steps if s.status == "committed"}) > 1:
        click.echo(
            "note: steps of several runs (run column; '-': no run id); resume and retention act on "
            "the run `latest` names"
        )
    if uploads:
        click.echo(
            f"note: {len(uploads)} unfinished multipart uploads under {store.url} (oldest "
            f"{uploads[0].age_s / 3600:.1f}h); `shardsmith gc --uploads` aborts them"
        )


class DurationType(click.ParamType):
    """Seconds from ``90``, ``90s``, ``30m``, ``1h`` or ``2d``."""

    name = "duration"
    UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().lower()
        scale = self.UNITS.get(text[-1:], None)
        try:
            seconds = float(text[:-1] if scale else text) * (scale or 1.0)
        except ValueError:
            self.fail(
                f"{value!r}: give seconds or a number with s, m, h or d (e.g. 1h)", param, ctx
            )
        if seconds < 0:
            self.fail(f"{value!r}: must be >= 0", param, ctx)
        return seconds


@click.command(name="gc", short_help="Delete old and incomplete steps and stale uploads.")
@click.argument("root")
@click.option(
    "--keep-last",
    type=click.IntRange(min=1),
    default=None,
    help="Keep this many newest committed steps.  [default: all]",
)
@click.option(
    "--keep-every",
    type=click.IntRange(min=1),
    default=None,
    help="Also keep committed steps divisible by this.",
)
@click.option(
    "--grace-seconds",
    type=click.FloatRange(min=0),
    cls=FieldOption,
    default_from="shardsmith.storage.gc:gc.grace_seconds",
    help="Never delete an incomplete step modified this recently (a save may be running).",
)
@click.option(
    "--uploads",
    "uploads_only",
    is_flag=True,
    help="Only abort unfinished multipart uploads (S3) older than --uploads-grace.",
)
@click.option(
    "--uploads-grace",
    type=DurationType(),
    default="1h",
    show_default=True,
    help="Never abort an unfinished upload younger than this (a save may be running): 90s, 30m, 1h, 2d.",
)
@dry_run_option("Only print what would be deleted.")
@json_option("every decision")
@storage_option
def gc_command(
    root: str,
    keep_last: int | None,
    keep_every: int | None,
    grace_seconds: float,
    uploads_only: bool,
    uploads_grace: float,
    dry_run: bool,
    as_json: bool,
    storage_options: tuple[str, ...],
) -> None:
    """Delete old and incomplete steps and stale uploads under ROOT.

    Deletes incomplete steps and committed steps outside the retention, of the run `latest`
    names (other runs' steps are kept). Never deletes the newest committed step, nor an
    incomplete step that may be being written (newer than the newest committed one, or
    modified within --grace-seconds). Aborts unfinished multipart uploads under ROOT older
    than --uploads-grace (with --uploads, only that)."""
    from shardsmith.storage.gc import gc
    from shardsmith.storage.store import abort_stale_uploads, has_uploads, sweep_stale_tmp

    store = existing_root(root, storage_options)
    aborted = abort_stale_uploads(store, grace_s=uploads_grace, dry_run=dry_run)
    if store.is_posix and not dry_run:  # killed writers' hidden temporary files
        for path in sweep_stale_tmp(store.root):
            if not as_json:
                click.echo(f"removed {path} (a killed writer's temporary file)")
    verb = "would abort" if dry_run else "aborted"
    if not as_json:
        for u in aborted:
            click.echo(f"{verb} upload {u.key} ({u.age_s / 3600:.1f}h old)")
        if aborted or uploads_only or has_uploads(store):  # local roots have no uploads to speak of
            click.echo(f"{verb} {len(aborted)} unfinished uploads older than {uploads_grace:g}s")
    if uploads_only:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "root": store.url,
                        "dry_run": dry_run,
                        "uploads": [u.__dict__ for u in aborted],
                    },
                    indent=1,
                )
            )
        return
    decisions: list = []
    verb = "would delete" if dry_run else "deleted"
    echo = (
        (lambda d: None)
        if as_json
        else (
            lambda d: click.echo(
                f"{verb if d.delete else 'kept':<12} {d.name}  {d.status:<10} {d.reason}"
            )
        )
    )
    gc(
        store,
        keep_last,
        keep_every,
        grace_seconds=grace_seconds,
        dry_run=dry_run,
        on_decision=lambda d: (decisions.append(d), echo(d)),
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "root": store.url,
                    "dry_run": dry_run,
                    "uploads": [u.__dict__ for u in aborted],
                    "decisions": [d.to_json() for d in decisions],
                },
                indent=1,
            )
        )
        return
    click.echo(f"{verb} {sum(d.delete for d in decisions)} of {len(decisions)} steps")


def existing_root(root: str, storage_options: tuple[str, ...]) -> Any:
    """The Store of ROOT; CheckpointNotFound (one line, non-zero exit) when nothing is there."""
    from shardsmith.errors import CheckpointNotFound
    from shardsmith.storage.store import Store, list_uploads

    store = Store(root, parse_storage_options(storage_options))
    if not store.exists("") and not list_uploads(store):  # both retried and error-mapped
        raise CheckpointNotFound(
            f"{store.url}: no such checkpoint root (it does not exist); check the path "
            "(and --storage-option)"
        )
    return store


def register(cli: click.Group) -> None:
    """Add ``inspect``, ``verify``, ``ls`` and ``gc`` to the ``shardsmith`` group."""
    cli.add_command(inspect)
    cli.add_command(verify)
    cli.add_command(ls)
    cli.add_command(gc_command)
