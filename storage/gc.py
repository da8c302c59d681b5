"""Housekeeping of a checkpoint root: list its steps (``shardsmith ls``) and delete what
is no longer needed (``shardsmith gc``), also after each commit by the trainer.

Rules of :func:`gc` (see :func:`plan_gc`):

* the newest committed step is never deleted;
* a step marked abandoned (on the timeline a resume of an older step of the root left, see
  :func:`~shardsmith.storage.lineage.abandon_after`) is deleted first: by any retention, and
  it never counts as one of the steps kept;
* retention acts on one lineage (one run id, see :mod:`shardsmith.storage.lineage`):
  committed steps of other runs are kept;
* retention (only when ``keep_last`` or ``keep_every`` is given): keep the last
  ``keep_last`` committed steps and every step divisible by ``keep_every``; delete the
  other committed steps;
* an incomplete step (no manifest) is deleted only when it is older than the newest
  committed step *and* (where the store has modification times) untouched for
  ``grace_seconds`` — an incomplete step newer than every committed one may be a save in
  progress and is left alone.

A committed step is deleted manifest first, so a crash half-way leaves an incomplete
step (ignored by readers, collected next time), never a committed one with missing files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Callable

from shardsmith.errors import ManifestError
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import read_manifest
from shardsmith.storage.lineage import (
    ABANDONED_NAME,
    CORRUPT_NAME,
    committed_runs,
    corrupt_mark,
    current_run,
    describe_run,
    run_id_of,
)
from shardsmith.storage.manifest.records import MANIFEST_NAME
from shardsmith.storage.steps import delete_step, parse_step_dir  # noqa: F401 (delete_step re-exported)
from shardsmith.storage.store.fs import Store

log = logging.getLogger(__name__)

#: Incomplete steps modified more recently than this (seconds) are never deleted.
DEFAULT_GRACE_SECONDS = 600.0

COMMITTED, INCOMPLETE, INVALID, CORRUPT = "committed", "incomplete", "invalid", "corrupt"
ABANDONED = "abandoned"


@dataclass
class StepSummary:
    """One step directory under a checkpoint root, as ``shardsmith ls`` shows it.

    Attributes:
        step, name: step number and directory name.
        status: ``committed``; ``incomplete`` (no manifest: ignored by readers);
            ``invalid`` (a manifest that does not validate; see ``error``); or ``corrupt``
            (committed, but a load found its data corrupt and marked it, see
            :data:`~shardsmith.storage.lineage.CORRUPT_NAME`; ``--resume auto`` skips it); or
            ``abandoned`` (committed, on the timeline a resume of an older step of the root
            left: never resumed by ``auto``, deleted first by retention).
        nbytes: bytes of all its files on storage.
        num_files: number of its files.
        layout: saving layout, e.g. ``pp2·dpr1·dps1·tp2`` (empty when unknown).
        latest: True for the step readers resume from (the newest with a manifest).
        mtime: newest modification time of its files (seconds since the epoch), or
            ``None`` when the store does not report one.
        error: why the manifest is invalid.
        run_id: the run that committed it (empty: unknown, or an older checkpoint).
    """

    step: int
    name: str
    status: str
    nbytes: int = 0
    num_files: int = 0
    layout: str = ""
    latest: bool = False
    mtime: float | None = None
    error: str = ""
    run_id: str = ""

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        return asdict(self)


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time from an fsspec info dict, across backends (local ``mtime``, S3
    ``LastModified``, GCS ``updated``, memory ``created``)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def describe_steps(root: Store, *, read_manifests: bool = True) -> list[StepSummary]:
    """Every step directory under ``root``, oldest first (one recursive listing, plus one
    manifest read per committed step when ``read_manifests``).

    Args:
        root: checkpoint root.
        read_manifests: parse manifests (for ``layout`` and the ``invalid`` status);
            without it a step with a manifest is reported ``committed``.
    """
    files = root.walk()
    by_step: dict[str, dict[str, dict[str, Any]]] = {}
    for key, info in files.items():
        top, _, rest = key.partition("/")
        if rest and parse_step_dir(top) is not None:
            by_step.setdefault(top, {})[rest] = info
    names = set(by_step) | {n for n in root.list_dir() if parse_step_dir(n) is not None}
    out = []
    for name in sorted(names, key=lambda n: parse_step_dir(n) or 0):
        entries = by_step.get(name, {})
        times = [t for t in (_mtime(i) for i in entries.values()) if t is not None]
        summary = StepSummary(
            step=parse_step_dir(name) or 0,
            name=name,
            status=COMMITTED if MANIFEST_NAME in entries else INCOMPLETE,
            nbytes=sum(int(i.get("size") or 0) for i in entries.values()),
            num_files=len(entries),
            mtime=max(times) if times else None,
        )
        if summary.status == COMMITTED and read_manifests:
            try:
                manifest = read_manifest(root.child(name))
                summary.layout = ParallelDims.from_json(manifest.layout).describe()
                summary.run_id = run_id_of(manifest.state)
            except (ManifestError, FileNotFoundError) as exc:
                summary.status, summary.error = INVALID, str(exc)
        if summary.status == COMMITTED and CORRUPT_NAME in entries:
            mark = corrupt_mark(root.child(name)) or {}
            summary.status, summary.error = (
                CORRUPT,
                f"found by a {mark.get('found_by', 'load')}: {mark.get('error', '')}",
            )
        if summary.status == COMMITTED and ABANDONED_NAME in entries:
            summary.status = ABANDONED
        out.append(summary)
    with_manifest = [s for s in out if s.status not in (INCOMPLETE, CORRUPT, ABANDONED)]
    if with_manifest:
        with_manifest[-1].latest = True
    return out


@dataclass
class GcDecision:
    """What :func:`gc` does with one step, and why."""

    step: int
    name: str
    status: str
    delete: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        return asdict(self)


def _check_args(keep_last: int | None, keep_every: int | None, grace_seconds: float) -> None:
    if keep_last is not None and keep_last < 1:
        raise ValueError(
            f"keep_last={keep_last}: must be >= 1 (the newest committed step is always kept)"
        )
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every={keep_every}: must be >= 1")
    if grace_seconds < 0:
        raise ValueError(f"grace_seconds={grace_seconds}: must be >= 0")


def _committed_decision(
    step: int, newest: int, last: set[int], keep_last: int | None, keep_every: int | None
) -> tuple[bool, str]:
    if step == newest:
        return False, "newest committed step"
    if keep_last is None and keep_every is None:
        return False, "committed (no retention given)"
    if step in last:
        return False, f"one of the last {keep_last} committed steps"
    if keep_every is not None and step % keep_every == 0:
        return False, f"multiple of --keep-every {keep_every}"
    return True, "committed, outside the retention"


def _incomplete_decision(
    step: int, newest: int | None, mtime: float | None, now: float, grace_seconds: float
) -> tuple[bool, str]:
    if newest is None or step > newest:
        return False, "incomplete, newer than every committed step: may be a save in progress"
    if mtime is not None and now - mtime < grace_seconds:
        return False, f"incomplete, modified {now - mtime:.0f}s ago (grace {grace_seconds:.0f}s)"
    return True, "incomplete (no manifest), older than the newest committed step"


def _lineage(
    root: Store, committed: list[int], runs: set[str] | None, retention: bool
) -> tuple[set[int], str]:
    """Committed steps retention may act on (one lineage) and a note on the others."""
    if not retention or not committed:
        return set(committed), ""

    by_run = committed_runs(root, committed)
    if runs is None:
        runs = {current_run(root) or ""}
    mine = {s for s in committed if by_run.get(s, "") in runs}
    return (
        mine,
        f"another run's step; retention acts on {', '.join(describe_run(r) for r in sorted(runs))}",
    )


def plan_gc(
    root: Store,
    keep_last: int | None = None,
    keep_every: int | None = None,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    now: float | None = None,
    runs: set[str] | None = None,
) -> list[GcDecision]:
    """Decide, for every step under ``root``, whether :func:`gc` deletes it (pure apart
    from listing the root). See the module docstring for the rules.

    Args:
        root: checkpoint root.
        keep_last: keep this many newest committed steps (>= 1); ``None``: no such rule.
        keep_every: keep committed steps divisible by this (>= 1); ``None``: no such rule.
            With neither rule every committed step is kept.
        grace_seconds: incomplete steps modified more recently are kept.
        now: the current time (seconds since the epoch), for tests.
        runs: the lineage retention acts on (run ids, see :mod:`shardsmith.storage.lineage`);
            ``None``: the root's current run. Committed steps of other runs are kept, so a
            step of the running job is never deleted because another run has a higher step.

    Raises:
        ValueError: an argument is out of range.
    """
    _check_args(keep_last, keep_every, grace_seconds)
    now = time.time() if now is None else now
    steps = describe_steps(root, read_manifests=False)
    committed = [s.step for s in steps if s.status != INCOMPLETE]
    newest_any = committed[-1] if committed else None
    mine, other_reason = _lineage(
        root, committed, runs, keep_last is not None or keep_every is not None
    )
    abandoned = {s.step for s in steps if s.status == ABANDONED}
    lineage = [s for s in committed if s in mine and s not in abandoned]
    newest = lineage[-1] if lineage else None
    last = set(lineage[-keep_last:]) if keep_last else set()
    out = []
    for s in steps:
        if s.status == INCOMPLETE:
            delete, reason = _incomplete_decision(s.step, newest_any, s.mtime, now, grace_seconds)
        elif s.status == ABANDONED:
            retention = keep_last is not None or keep_every is not None
            delete, reason = retention, "abandoned: on the timeline a resume of an older step left"
        elif s.step not in mine or newest is None:
            delete, reason = False, other_reason
        else:
            delete, reason = _committed_decision(s.step, newest, last, keep_last, keep_every)
        out.append(GcDecision(s.step, s.name, s.status, delete, reason))
    return out


def gc(
    root: Store,
    keep_last: int | None = None,
    keep_every: int | None = None,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    now: float | None = None,
    on_decision: Callable[[GcDecision], None] | None = None,
    runs: set[str] | None = None,
) -> list[int]:
    """Delete incomplete steps and committed steps outside the retention.

    Single process (the coordinator, or the CLI). Arguments as :func:`plan_gc`;
    ``on_decision`` is called with every step's decision, after its deletion: the caller
    reports them (``shardsmith gc`` prints them, the trainer's ``gc`` event says them); this
    function logs nothing, so each deletion is said once.

    Returns:
        The steps deleted (or, with ``dry_run``, that would be), oldest first.

    Raises:
        ValueError: an argument is out of range.
        StorageError: a deletion failed (steps deleted before it stay deleted).
    """
    deleted = []
    for d in plan_gc(root, keep_last, keep_every, grace_seconds=grace_seconds, now=now, runs=runs):
        if d.delete:
            if not dry_run:
                delete_step(root, d.name)
            deleted.append(d.step)
        if on_decision is not None:
            on_decision(d)
    return deleted


def gc_after_commit(
    root: Store,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    runs: set[str] | None = None,
    on_decision: Callable[[GcDecision], None] | None = None,
) -> list[int]:
    """Retention after a commit, for the trainer: call on the coordinator (rank 0) only,
    after :func:`~shardsmith.storage.commit.commit` returned. ``on_decision``: as :func:`gc`.

    Never raises on storage trouble: a failed collection is logged as a warning and
    simply retried after the next commit (the checkpoint just committed is safe either
    way). With ``keep_last`` and ``keep_every`` both ``None`` only incomplete steps go.

    Returns:
        The steps deleted.

    Raises:
        ValueError: ``keep_last``/``keep_every``/``grace_seconds`` out of range.
    """
    _check_args(keep_last, keep_every, grace_seconds)
    try:
        return gc(
            root,
            keep_last,
            keep_every,
            grace_seconds=grace_seconds,
            runs=runs,
            on_decision=on_decision,
        )
    except Exception as exc:  # noqa: BLE001 — housekeeping must not stop training
        log.warning(
            "gc of %s after commit failed (%s: %s); will retry after the next commit",
            root.url,
            type(exc).__name__,
            exc,
        )
        return []
