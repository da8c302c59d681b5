"""Run identity: which run wrote each committed step of a checkpoint root.

Every manifest a training job commits names its run in ``state["run"]``::

    {"id": "<uuid4 hex>", "seed": 7,
     "parent": {"run": "<id>", "step": 8, "url": "..."} | null,   # resume, --init-from, reshard
     "events": [{"event": "reset_optimizer", "step": 8, ...}]}

(the manifest's free-form ``state`` dict, so the schema is unchanged). A **lineage** is the
set of steps of one run id; steps of manifests without a run record (older checkpoints) form
one unnamed lineage, id ``""``. ``latest``, ``--resume auto``, ``ls`` and retention act on
one lineage, so a step of the running job is never deleted because another run has a
higher step number; and a new run never starts in a root that holds another run's steps
(:func:`check_new_run_root`). Pure reads of JSON; no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardsmith.errors import CheckpointMismatch, ManifestError
from shardsmith.storage.manifest.records import MANIFEST_NAME
from shardsmith.storage.steps import (
    LATEST_NAME,
    delete_step,
    list_steps,
    parse_step_dir,
    read_latest_hint,
    step_dir,
)
from shardsmith.storage.store.fs import Store

log = logging.getLogger(__name__)

RUN_KEY = "run"
#: The lineage of checkpoints written before run ids existed.
UNNAMED = ""


def run_record(state: Mapping[str, Any]) -> dict[str, Any]:
    """The run record of a manifest's ``state`` (empty for older checkpoints)."""
    rec = state.get(RUN_KEY)
    return dict(rec) if isinstance(rec, Mapping) else {}


def run_id_of(state: Mapping[str, Any]) -> str:
    """The run id of a manifest's ``state``; :data:`UNNAMED` for older checkpoints."""
    rid = run_record(state).get("id", UNNAMED)
    return rid if isinstance(rid, str) else UNNAMED


def describe_run(run_id: str) -> str:
    """``run 3f2a…`` or ``an unnamed run`` (older checkpoints), for messages."""
    return f"run {run_id[:12]}" if run_id else "an unnamed run (no run id)"


def _read_state(step_store: Store) -> dict[str, Any] | None:
    """The ``state`` of a step's manifest, or None when unreadable (reported by ``ls``)."""
    import json

    try:
        raw = json.loads(step_store.read(MANIFEST_NAME))
    except (FileNotFoundError, ValueError, ManifestError):
        return None
    state = raw.get("state") if isinstance(raw, dict) else None
    return state if isinstance(state, dict) else {}


def committed_runs(root: Store, steps: Iterable[int] | None = None) -> dict[int, str]:
    """Run id of each committed step under ``root`` (or of ``steps``), oldest first.

    One manifest read per step, in parallel; a step whose manifest cannot be read is left out.
    """

    if steps is None:
        steps = [s.step for s in list_steps(root) if s.committed]
    steps = sorted(steps)
    if not steps:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(steps))) as pool:
        states = list(pool.map(lambda s: _read_state(root.child(step_dir(s))), steps))
    return {s: run_id_of(st) for s, st in zip(steps, states) if st is not None}


def current_run(root: Store) -> str | None:
    """The run a root belongs to now: the run of the step ``latest`` names when it is
    committed, else of the newest committed step; None for a root without committed steps."""

    committed = [s.step for s in list_steps(root) if s.committed]
    if not committed:
        return None
    hint = read_latest_hint(root)
    hinted = parse_step_dir(hint) if hint else None
    anchor = hinted if hinted is not None and hinted in committed else committed[-1]
    return committed_runs(root, [anchor]).get(anchor, UNNAMED)


def check_new_run_root(
    root: Store, resume_mode: str, overwrite: bool, *, restarts: int = 0
) -> None:
    """Refuse to start a new run in a root that holds committed steps (of another run).

    A job starts a *new* run when ``resume_mode`` is ``none`` (and it is not an elastic
    restart, which continues). ``auto`` continues the root's run, and a step URL is resumed
    (see ``choose_resume``), so neither is refused here. The launcher calls it before any
    worker starts; every worker calls it again.

    Args:
        root: the job's checkpoint root.
        resume_mode: the job's ``--resume`` (``auto``, ``none`` or a URL).
        overwrite: ``--overwrite``: the old run's steps are removed before the first save.
        restarts: torchrun's restart count.

    Raises:
        CheckpointMismatch: naming the root, its committed steps and the ways forward.
    """
    if resume_mode != "none" or overwrite or restarts > 0:
        return

    committed = [s.step for s in list_steps(root) if s.committed]
    if not committed:
        return
    runs = sorted(set(committed_runs(root, committed).values()))
    shown = ", ".join(str(s) for s in committed[:8]) + (
        f" and {len(committed) - 8} more" if len(committed) > 8 else ""
    )
    raise CheckpointMismatch(
        f"{root.url} holds committed steps {shown} of {', '.join(describe_run(r) for r in runs) or 'another run'}; "
        "a new run (--resume none) would mix with them: pass --resume auto to continue that run, choose a "
        "new --ckpt root, or pass --overwrite to remove its steps before this run's first save"
    )


def remove_runs_except(root: Store, keep: str | None) -> list[int]:
    """``--overwrite``: delete every step directory under ``root`` not of run ``keep``
    (committed steps manifest first, incomplete ones too) and the ``latest`` hint.
    Single process (rank 0). Returns the steps deleted."""

    infos = list_steps(root)
    runs = committed_runs(root, [s.step for s in infos if s.committed])
    deleted = []
    for s in infos:
        if keep is not None and s.committed and runs.get(s.step) == keep:
            continue
        log.warning(
            "--overwrite: deleting %s (%s)",
            root.url_of(s.name),
            describe_run(runs.get(s.step, UNNAMED)) if s.committed else "incomplete",
        )
        delete_step(root, s.name)
        deleted.append(s.step)
    if deleted and root.exists(LATEST_NAME):
        root.delete(LATEST_NAME)
    return deleted


def rewritten_state(
    state: Mapping[str, Any], source_url: str, step: int, how: str
) -> dict[str, Any]:
    """The ``state`` of a checkpoint rewritten offline (reshard, conversion): the same run
    (its id is kept, so ``--resume auto`` continues it), with ``parent`` naming the source."""
    rec = run_record(state)
    rec["parent"] = {"run": rec.get("id", UNNAMED), "step": step, "url": source_url, "via": how}
    return {**state, RUN_KEY: rec}


# ---- steps a load found corrupt ---------------------------------------------------------------
#
# Decision: a step whose data fails verification while loading is *left in place* and marked,
# not quarantined. Object stores cannot rename (a quarantine is a copy and a delete of the whole
# step), the bytes are what `shardsmith verify` and a restore from another copy work on, and a
# damage seen through a bad read path (a flaky NIC, a bad page-cache page) may not be on
# storage at all. The marker is a small JSON object beside the manifest: `ls` shows the step as
# `corrupt`, `--resume auto` and rollbacks skip it, retention treats it as any committed step.
# Deleting the marker (after restoring the files) makes the step loadable by `auto` again.

#: Written into a step directory by the load that found its data corrupt.
CORRUPT_NAME = "corrupt.json"


def mark_corrupt(step_store: Store, *, step: int, error: str, found_by: str) -> None:
    """Record that loading ``step`` found its data corrupt (rank 0 calls it once).

    Args:
        step_store: the step directory.
        step: its step number.
        error: the integrity error (names the file and the byte range).
        found_by: what found it (``resume``, ``rollback``).
    """
    import json
    import time

    record = {
        "step": step,
        "error": error,
        "found_by": found_by,
        "time": round(time.time(), 3),
        "note": f"delete {CORRUPT_NAME} after restoring the files to load this step with --resume auto",
    }
    step_store.write(CORRUPT_NAME, json.dumps(record, indent=1).encode())


def corrupt_mark(step_store: Store) -> dict[str, Any] | None:
    """The marker :func:`mark_corrupt` wrote in a step directory, or None."""
    import json

    try:
        raw = json.loads(step_store.read(CORRUPT_NAME))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"error": f"unreadable {CORRUPT_NAME}"}
    return raw if isinstance(raw, dict) else {"error": f"unreadable {CORRUPT_NAME}"}


def loadable_steps(root: Store, runs: set[str] | None, *, below: int | None = None) -> list[int]:
    """Committed steps under ``root`` of the runs ``runs`` (None: any run), newest first,
    without the steps marked corrupt or abandoned; ``below``: only steps older than it. One
    listing, one manifest read per step (only when ``runs`` is given) and two marker probes
    per step."""

    steps = [s.step for s in list_steps(root) if s.committed and (below is None or s.step < below)]
    if runs is not None:
        by_step = committed_runs(root, steps)
        steps = [s for s in steps if by_step.get(s) in runs]
    return [
        s
        for s in reversed(steps)
        if not any(root.exists(f"{step_dir(s)}/{mark}") for mark in (CORRUPT_NAME, ABANDONED_NAME))
    ]


# ---- one timeline per root ---------------------------------------------------------------------
#
# A job that resumes an older step of its own root (ROOT/step-20 of a root holding steps 5-40)
# starts a new timeline there. Its descendants are the head: the newer committed steps (25-40)
# belong to the timeline it left. They are marked, not deleted (the user may have resumed the
# wrong step; deleting the marker undoes it): `ls` shows them `abandoned`, `--resume auto`,
# restarts and rollbacks never choose them, retention deletes them first, and `latest` names
# the resumed step until the new timeline commits. A step the new timeline saves again (25, 30)
# is deleted whole before it is written (``trainer/checkpoint/save_load.py``), so it holds
# only its own files.

#: Written into each committed step of a timeline a resume left.
ABANDONED_NAME = "abandoned.json"


def abandon_after(root: Store, step: int, *, run: str = "") -> list[int]:
    """Make ``step`` of ``root`` the head of its root: mark every newer committed step abandoned
    (a marker beside its manifest) and point ``latest`` at ``step``. Single process (the
    resuming job's rank 0, after loading ``step``). Returns the steps newly marked."""
    import json
    import time

    newer = [s for s in list_steps(root) if s.committed and s.step > step]
    marked = []
    for s in newer:
        if root.exists(f"{s.name}/{ABANDONED_NAME}"):
            continue
        record = {
            "step": s.step,
            "resumed_step": step,
            "run": run,
            "time": round(time.time(), 3),
            "note": f"a job resumed {step_dir(step)} of this root; this step is on the timeline "
            f"it left. Delete {ABANDONED_NAME} to make it eligible again",
        }
        root.child(s.name).write(ABANDONED_NAME, json.dumps(record, indent=1).encode())
        marked.append(s.step)
    if newer:
        root.write(LATEST_NAME, (step_dir(step) + "\n").encode())
    return marked


def is_abandoned(root: Store, step: int) -> bool:
    """True when ``step`` of ``root`` carries the marker :func:`abandon_after` writes."""
    return root.exists(f"{step_dir(step)}/{ABANDONED_NAME}")
