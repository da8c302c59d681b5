"""The commit protocol, which needs no rename.

``<root>/step-NNNNNNNNN/shards/*`` (data, written by every rank) -> barrier ->
``<root>/step-NNNNNNNNN/manifest.json`` (written last by the coordinator: its presence
is the commit) -> ``<root>/latest`` (a hint naming the newest committed step).

Readers ignore a step without a manifest; when ``latest`` is missing, stale or
names an incomplete step they fall back to the newest committed step and say so.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from shardsmith.errors import (
    BucketNotFound,
    CheckpointNotFound,
    LayoutError,
    ManifestError,
    SaveError,
    TargetCommitted,
)
from shardsmith.storage.crashpoints import crash_point
from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.lineage import ABANDONED_NAME, committed_runs, is_abandoned, run_id_of
from shardsmith.storage.manifest.parse import parse_manifest
from shardsmith.storage.manifest.read import ManifestReader
from shardsmith.storage.manifest.records import MANIFEST_NAME, Manifest
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.steps import (  # noqa: F401 (re-exported)
    LATEST_NAME,
    StepInfo,
    list_steps,
    parse_step_dir,
    read_latest_hint,
    step_dir,
)
from shardsmith.storage.store.fs import Store

log = logging.getLogger(__name__)


def find_latest_committed(root: Store, runs: set[str] | None = None) -> int | None:
    """The newest committed step under ``root`` of one lineage, or ``None`` when there is none.

    Args:
        root: checkpoint root.
        runs: run ids of the lineage (see :mod:`shardsmith.storage.lineage`); ``None``: the
            root's current run, i.e. that of the step ``latest`` names (a newer step of
            another run does not win), else the newest committed step.

    ``latest`` is only a hint: if it names a committed step newer than or equal to every
    other committed step of its run it is used; otherwise the newest committed step of
    the run wins and a warning says why. Steps marked abandoned (a resume of an older step
    left them, see :func:`~shardsmith.storage.lineage.abandon_after`) never win.
    """

    steps = [s.step for s in list_steps(root) if s.committed]
    if not steps:
        return None
    hint = read_latest_hint(root)
    hinted = parse_step_dir(hint) if hint else None
    if runs is not None:
        by_run = committed_runs(root, steps)
        steps = [s for s in steps if by_run.get(s) in runs]
    elif hinted in steps and steps[-1] != hinted:
        by_run = committed_runs(root, [s for s in steps if s >= hinted])
        steps = [s for s in steps if s <= hinted or by_run.get(s) == by_run.get(hinted)]
    while steps and is_abandoned(root, steps[-1]):  # a resume of an older step left it
        steps.pop()
    if not steps:
        return None
    newest = steps[-1]
    said = (root.url, hint, newest)
    if hinted != newest and said not in _LATEST_WARNED:  # once per process: callers ask again
        _LATEST_WARNED.add(said)
        log.warning(
            "%s/latest is %s; using newest committed step %s instead",
            root.url,
            "missing" if hint is None else repr(hint),
            step_dir(newest),
        )
    return newest


#: (root, hint, newest) already warned about by :func:`find_latest_committed` in this process.
_LATEST_WARNED: set[tuple[str, str | None, int]] = set()


def open_manifest(step_store: Store) -> ManifestReader:
    """Open ``manifest.json`` of a step directory for reading piecewise (its head is read
    and validated; :meth:`ManifestReader.manifest` reads the tensors a rank asks for).

    Raises:
        CheckpointNotFound: no manifest (the step is not committed).
        ManifestError: the head is invalid, or its ``step`` is not the one its directory
            name says.
    """
    try:
        reader = ManifestReader(step_store)
    except BucketNotFound:
        raise
    except FileNotFoundError as exc:
        raise CheckpointNotFound(
            f"{step_store.url} is not a committed checkpoint (no {MANIFEST_NAME}); "
            "`shardsmith ls` on its parent lists committed steps"
        ) from exc
    step = reader.whole.step if reader.whole is not None else reader.head.data["step"]  # type: ignore[union-attr]
    name = step_store.url.rstrip("/").rsplit("/", 1)[-1]
    dir_step = parse_step_dir(name)
    if dir_step is not None and dir_step != step:
        raise ManifestError(
            f"{reader.source}: step: the manifest says step {step} but its directory is "
            f"{name}; the checkpoint was tampered with or copied wrongly — do not load it"
        )
    return reader


def read_manifest(step_store: Store, fqns: Iterable[str] | None = None) -> Manifest:
    """Read and validate ``manifest.json`` of a step directory: all of it, or (``fqns``)
    only the head and the records of those tensors (a partial manifest; version 2 reads
    just those byte ranges).

    Raises:
        CheckpointNotFound: no manifest (the step is not committed).
        ManifestError: the manifest is invalid, or its ``step`` is not the one its
            directory name says.
    """
    if fqns is not None:
        return open_manifest(step_store).manifest(fqns)
    try:
        raw = step_store.read(MANIFEST_NAME)
    except BucketNotFound:
        raise
    except FileNotFoundError as exc:
        raise CheckpointNotFound(
            f"{step_store.url} is not a committed checkpoint (no {MANIFEST_NAME}); "
            "`shardsmith ls` on its parent lists committed steps"
        ) from exc
    url = step_store.url_of(MANIFEST_NAME)
    manifest = parse_manifest(raw, url)
    name = step_store.url.rstrip("/").rsplit("/", 1)[-1]
    dir_step = parse_step_dir(name)
    if dir_step is not None and dir_step != manifest.step:
        raise ManifestError(
            f"{url}: step: the manifest says step {manifest.step} but its directory is "
            f"{name}; the checkpoint was tampered with or copied wrongly — do not load it"
        )
    return manifest


def check_files_written(step_store: Store, manifest: Manifest, max_workers: int = 16) -> None:
    """Check that every data file the manifest lists exists with its recorded size.

    The coordinator calls it just before the commit, so a step is never committed
    before every byte of it is on storage (one size query per file, in parallel).

    Raises:
        SaveError: naming each missing or wrongly sized file; nothing was committed.
    """

    def problem(item: tuple[str, int]) -> str:
        name, nbytes = item
        try:
            size = step_store.size(name)
        except FileNotFoundError:
            return f"{step_store.url_of(name)} is missing"
        return (
            ""
            if size == nbytes
            else f"{step_store.url_of(name)} has {size} bytes, expected {nbytes}"
        )

    items = [(name, f.nbytes) for name, f in sorted(manifest.files.items())]
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items)))) as pool:
        problems = [p for p in pool.map(problem, items) if p]
    if problems:
        raise SaveError(
            f"step {manifest.step} not committed: "
            + "; ".join(problems[:20])
            + "; the data files were not fully written — the previous committed step "
            "is untouched"
        )


def commit(root: Store, manifest: Manifest, *, check_files: bool = True) -> None:
    """Validate, then write the manifest (the commit point) and then the ``latest`` hint.

    Called by the coordinator only, after every rank's data is written (barrier).
    The manifest is re-parsed first (schema, coverage, byte ranges) and, with
    ``check_files``, every listed file's size is checked, so nothing inconsistent or
    incomplete is ever committed. ``latest`` is not moved back when it already names a
    newer committed step (e.g. resharding an old step into a live root).

    Raises:
        ManifestError: the manifest does not validate; nothing was committed.
        SaveError: a data file is missing or has the wrong size; nothing was committed.
    """
    name = step_dir(manifest.step)
    step_store = root.child(name)
    with cycle_gc_paused():  # CPU only: no storage call while the collector waits
        raw = dumps_manifest(manifest)
        parse_manifest(raw, step_store.url_of(MANIFEST_NAME))
    crash_point("commit.before_check", step=manifest.step)  # test hooks; inert normally
    if check_files:
        check_files_written(step_store, manifest)
    crash_point("commit.before_manifest")
    root.write(f"{name}/{MANIFEST_NAME}", raw)
    crash_point("commit.after_manifest")
    try:  # `latest` is only a hint: once the manifest is written the step is committed
        hint = read_latest_hint(root)
        hinted = parse_step_dir(hint) if hint else None
        if (
            hinted is not None
            and hinted > manifest.step
            and root.exists(f"{hint}/{MANIFEST_NAME}")
            and not root.exists(f"{hint}/{ABANDONED_NAME}")
            and _same_run(root, hinted, manifest)
        ):
            log.info("committed %s; %s/latest stays at the newer %s", name, root.url, hint)
            return
        root.write(LATEST_NAME, (name + "\n").encode())
    except Exception as exc:  # noqa: BLE001 — readers fall back to the newest committed step
        log.warning(
            "committed %s but could not update %s/latest (%s: %s); readers fall back to "
            "the newest committed step",
            name,
            root.url,
            type(exc).__name__,
            exc,
        )
        return
    crash_point("commit.after_latest")


def _same_run(root: Store, step: int, manifest: Manifest) -> bool:
    """Whether committed ``step`` belongs to the run of ``manifest`` (``latest`` follows the
    run that commits: another run's newer step does not keep it)."""

    return committed_runs(root, [step]).get(step) == run_id_of(manifest.state)


def split_step_url(url: str) -> tuple[str, int | None]:
    """``/x/run/step-000000040`` -> (``/x/run``, 40); a root URL gives (url, None)."""
    url = url.rstrip("/") or url
    name = url.rsplit("/", 1)[-1]
    step = parse_step_dir(name)
    return (url[: -len(name) - 1] or "/", step) if step is not None else (url, None)


def resolve_checkpoint(url: str, storage_options: dict | None = None) -> tuple[Store, Store, int]:
    """Resolve a URL naming a root (use its newest committed step) or a step directory.

    Returns:
        (root store, step store, step).

    Raises:
        CheckpointNotFound: nothing committed there.
    """
    store = Store(url, storage_options)
    root_url, step = split_step_url(store.url)
    if step is not None:
        return Store(root_url, storage_options), store, step
    latest = find_latest_committed(store)
    if latest is None:
        raise CheckpointNotFound(no_checkpoint_message(store, storage_options))
    return store, store.child(step_dir(latest)), latest


def no_checkpoint_message(store: Store, storage_options: dict | None) -> str:
    """The message for a URL with no committed step: whether the path exists at all, and (a
    mistyped step name, ``run/step-00000020``) the committed steps its parent holds."""
    url = store.url.rstrip("/")
    exists = store.exists("")
    what = f"no committed checkpoint under {store.url}" + ("" if exists else " (it does not exist)")
    parent_url = url.rsplit("/", 1)[0] if "/" in url.split("://", 1)[-1] else ""
    if exists or not parent_url:
        return what
    try:
        steps = [s.step for s in list_steps(Store(parent_url, storage_options)) if s.committed]
    except FileNotFoundError:
        return what
    if not steps:
        return what
    shown = ", ".join(str(s) for s in steps[-5:])
    return (
        f"{what}; {parent_url} holds committed steps {'..., ' if len(steps) > 5 else ''}{shown}: "
        f"name one as {parent_url}/{step_dir(steps[-1])}, or give {parent_url} for its newest"
    )


def resolve_target(
    url: str, step: int | None = None, storage_options: dict | None = None
) -> tuple[Store, int]:
    """The root store and step of a write target given as a root or as ``.../step-NNNNNNNNN``.

    Args:
        url: target root or step directory.
        step: the step to write (a reshard: the source's); ``None``: the one the URL names, else 0.

    Raises:
        LayoutError: the URL names a step other than ``step``.
    """
    root_url, named = split_step_url(url)
    if named is not None and step is not None and named != step:
        raise LayoutError(
            f"target {url} names step {named} but step {step} is being written; name the "
            f"target {step_dir(step)} or give its root"
        )
    return Store(root_url, storage_options), named if named is not None else (step or 0)


def ensure_not_committed(step_store: Store) -> None:
    """Refuse to write into a step that is already committed (called before any byte is written).

    Raises:
        TargetCommitted: ``step_store`` holds a manifest.
    """
    if step_store.exists(MANIFEST_NAME):
        raise TargetCommitted(
            f"{step_store.url} is already a committed checkpoint; delete it or choose "
            "another target"
        )
