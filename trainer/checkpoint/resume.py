"""Which step a job resumes from, and what changes at a resume: the step chosen (the
launcher's once, a restarted group's rank 0 after a restart), the data and LR-schedule changes
it must name, and the way forward from a corrupt step. Pure storage reads, no torch, no
collectives: the launcher's preflight (:mod:`shardsmith.trainer.runtime.preflight`) and
recovery inside the job (:mod:`shardsmith.trainer.checkpoint.recovery`) both call it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from shardsmith.errors import CheckpointNotFound, ConfigError
from shardsmith.storage import (
    CORRUPT_NAME,
    abandon_after,
    corrupt_mark,
    find_latest_committed,
    list_steps,
    loadable_steps,
    read_manifest,
    resolve_checkpoint,
    run_id_of,
    split_step_url,
    step_dir,
)
from shardsmith.storage.manifest import Manifest
from shardsmith.storage.store import Store
from shardsmith.trainer.data.config import data_changed, describe_data
from shardsmith.trainer.observe.console import short_url

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig


def absolute_url(url: str) -> str:
    """A local path made absolute and normalized (``r/./step-2/`` -> ``/cwd/r/step-2``); other
    URLs unchanged. Every process then names the same directory the same way."""
    if not url or ("://" in url and not url.startswith("file://")):
        return url
    path = url[len("file://") :] if url.startswith("file://") else url
    return os.path.normpath(os.path.abspath(path))


def resume_source(
    cfg: TrainConfig, root: Store | None, notes: list[str]
) -> tuple[Store, int] | None:
    """The one step a resume loads (see :func:`~shardsmith.trainer.runtime.preflight.resolve`); ``notes`` gets a line for each step
    skipped because a load marked it corrupt.

    * ``auto``: the newest committed step of the root's run that is not marked corrupt.
    * ``none``: nothing.
    * a URL: that step (a root URL: its newest committed step), unless it lies outside the
      job's root and the root already holds a committed step: a requeued job continues from
      its own newest checkpoint, not from the one it was first started from.

    Raises:
        CheckpointNotFound: ``how`` is a URL without a committed step.
    """
    ckpt = cfg.checkpoint
    how = ckpt.resume
    root = None if ckpt.overwrite else root
    explicit: tuple[Store, int] | None = None
    inside = False
    if how not in ("auto", "none"):
        check_exists(how, "--resume")
        src_root, step_store, step = resolve_checkpoint(absolute_url(how), ckpt.storage_options)
        explicit, inside = (step_store, step), root is not None and src_root.url == root.url
        mark = corrupt_mark(step_store)
        if mark is not None:
            notes.append(
                f"{step_store.url} was marked corrupt by an earlier load ({mark.get('error', '?')}); "
                "loading it anyway, as --resume names it"
            )
    if root is None or not (how == "auto" or (explicit is not None and not inside)):
        return explicit
    newest = find_latest_committed(root)
    if newest is None:
        return explicit
    if explicit is not None:
        notes.append(
            f"--resume {how} lies outside --ckpt {short_url(root.url)}, which holds committed step {newest}: "
            "continuing from the root's own steps (a requeued job continues its run); to load "
            f"{how}, give another --ckpt"
        )
    run = run_id_of(read_manifest(root.child(step_dir(newest))).state)
    steps = loadable_steps(root, {run}, below=newest + 1)
    for skipped in [
        s.step
        for s in list_steps(root)
        if s.committed
        and s.step <= newest
        and (not steps or s.step > steps[0])
        and root.exists(f"{s.name}/{CORRUPT_NAME}")
    ]:
        notes.append(
            f"skipping {root.url_of(step_dir(skipped))}: an earlier load found it corrupt "
            f"(`shardsmith ls` shows it; delete its {CORRUPT_NAME} after restoring its files)"
        )
    if not steps:
        raise CheckpointNotFound(
            f"every committed step of the run under {root.url} is marked corrupt; restore "
            f"one (then delete its {CORRUPT_NAME}) or start anew with --resume none --overwrite"
        )
    return root.child(step_dir(steps[0])), steps[0]


def one_timeline(root: Store | None, resumed: tuple[Store, int] | None, run: str) -> list[int]:
    """After a resume of step N of the job's own root: the newer committed steps there are
    on a timeline the job left, marked abandoned, and ``latest`` names N
    (:func:`~shardsmith.storage.lineage.abandon_after`; rank 0 calls it once). Returns the
    steps marked ([] when the step came from elsewhere or nothing is newer)."""
    if root is None or resumed is None:
        return []
    step_store, step = resumed
    if absolute_url(step_store.url) != absolute_url(root.child(step_dir(step)).url):
        return []
    left = abandon_after(root, step, run=run)
    if left:
        log.warning(
            "resumed step %d of %s: its newer steps %s are on the timeline this job left, marked "
            "abandoned (`shardsmith ls`): never resumed, deleted first by retention",
            step,
            root.url,
            left,
        )
    return left


def choose_resume(
    how: str, root: Store | None, restarts: int, storage_options: dict[str, Any] | None = None
) -> tuple[Store, int] | None:
    """Which step directory a job resumes from: what a restarted group's rank 0 decides
    (:func:`shardsmith.trainer.checkpoint.recovery.persistent_source`); the first start loads the
    launcher's :func:`~shardsmith.trainer.runtime.preflight.resolve` instead.

    * ``how="auto"``: the newest committed step under ``root``, if any.
    * ``how="none"``: nothing, unless this is an elastic restart (``restarts`` > 0): then
      as ``auto``, so a restarted group never starts over.
    * ``how=URL``: that checkpoint, unless ``root`` already holds a committed step and this
      is an elastic restart or the URL lies outside ``root`` (a requeued job continues
      from its own newest checkpoint, not from the one it was first started from).

    Raises:
        CheckpointNotFound: ``how`` is a URL without a committed step.
    """
    explicit: tuple[Store, int] | None = None
    inside = False
    if how not in ("auto", "none"):
        src_root, step_store, step = resolve_checkpoint(how, storage_options)
        explicit = (step_store, step)
        inside = root is not None and absolute_url(src_root.url) == absolute_url(root.url)
    prefer_root = how == "auto" or restarts > 0 or (explicit is not None and not inside)
    if root is not None and prefer_root:
        latest = find_latest_committed(root)
        if latest is not None:  # of its run, the newest not marked corrupt
            run = run_id_of(read_manifest(root.child(step_dir(latest))).state)
            steps = loadable_steps(root, {run}, below=latest + 1) or [latest]
            return root.child(step_dir(steps[0])), steps[0]
    return explicit


def data_differs(manifest: Manifest, cfg: TrainConfig) -> bool:
    """True when ``cfg`` reads other samples than the run that saved ``manifest``. A
    checkpoint imported from another format (its state names a ``source``: import-hf,
    import-dcp, import-megatron) records no data of ours, so there is no position to map."""
    if "source" in manifest.state:
        return False
    return data_changed((manifest.config or {}).get("data") or {}, cfg.data)


def check_data_change(manifest: Manifest, cfg: TrainConfig, source: str) -> None:
    """Refuse a resume whose data differs from the checkpoint's unless ``--data-change`` says
    how the position maps.

    Raises:
        ConfigError: naming both data configs, the sample index and the two choices.
    """
    saved = (manifest.config or {}).get("data") or {}
    if cfg.checkpoint.data_change or not data_differs(manifest, cfg):
        return
    index = (manifest.state.get("data") or {}).get("sample_index", "?")
    raise ConfigError(
        f"{short_url(source)} was trained on {describe_data(saved)}; this job reads "
        f"{describe_data(dataclasses.asdict(cfg.data))}. Say how the data position maps: "
        f"--data-change continue (the new data from global sample index {index}) or --data-change "
        "restart (the new data from sample 0; step, LR schedule and optimizer continue)"
    )


def schedule_change(
    saved_config: dict[str, Any],
    cfg: TrainConfig,
    step: int,
    saved_state: dict[str, Any] | None = None,
) -> str:
    """One line when resuming ``step`` under ``cfg`` changes the LR schedule the checkpoint
    was trained on (its decay length, warmup, peak or final LR), else ``""``.

    The decay length is ``--lr-decay-steps``, or ``--steps`` when that is 0: extending
    ``--steps`` alone stretches the cosine and makes the LR jump at the resume. A checkpoint
    imported from another format (``saved_state``, the manifest's state, names its
    ``source``: import-hf, import-dcp, import-megatron) was trained on no schedule of ours,
    whatever its config records: its first resume sets the schedule, silently.
    """
    optim, steps = saved_config.get("optim") or {}, saved_config.get("steps")
    if not optim or steps is None or "source" in (saved_state or {}):
        return ""
    old_total = optim.get("decay_steps") or steps
    new_total = cfg.optim.decay_steps or cfg.steps
    diffs = []
    if old_total != new_total:
        diffs.append(f"decay ends at step {old_total} -> {new_total}")
    for name, flag in (
        ("lr", "--lr"),
        ("warmup_steps", "--warmup-steps"),
        ("min_lr_ratio", "--min-lr-ratio"),
    ):
        if name in optim and optim[name] != getattr(cfg.optim, name):
            diffs.append(f"{flag} {optim[name]:g} -> {getattr(cfg.optim, name):g}")
    if not diffs:
        return ""
    hint = (
        f" (pass --lr-decay-steps {old_total} to keep it)"
        if old_total != new_total and not cfg.optim.decay_steps
        else ""
    )
    return f"the LR schedule changes at the resume of step {step}: {', '.join(diffs)}{hint}"


def check_exists(url: str, flag: str) -> None:
    """A local ``url`` that does not exist is named as such (not as "no committed checkpoint")."""
    if "://" in url and not url.startswith("file://"):
        return
    path = url[len("file://") :] if url.startswith("file://") else url
    if not os.path.exists(path):
        raise CheckpointNotFound(f"{flag} {url}: {os.path.abspath(path)} does not exist")
    if not os.path.isdir(path):
        raise CheckpointNotFound(
            f"{flag} {url}: {os.path.abspath(path)} is a file, not a checkpoint directory"
        )


# ---- messages: the way forward, in the user's own words -----------------------------------------


def way_forward(error: str, url: str, older: tuple[Store, int] | None) -> str:
    """The error of a corrupt explicit ``--resume`` step: what is wrong, and the command that
    goes on from the older step (the user's own command line with another ``--resume``)."""
    root = split_step_url(url)[0]
    text = f"{error}. {short_url(url)} is now marked corrupt (`shardsmith ls {short_url(root)}` shows it)"
    if older is None:
        return (
            text
            + "; no older committed step of its run is left: restore its files from another copy"
        )
    return (
        text
        + f"; go on from step {older[1]} with: {command_with('--resume', short_url(older[0].url))}"
    )


#: The launcher's command line, as a JSON list (set by ``shardsmith train``).
COMMAND_ENV = "SHARDSMITH_COMMAND"


def command_with(flag: str, value: str) -> str:
    """The command line this job was started with, ``flag``'s value replaced by ``value``
    (``--resume``/``--load`` are one flag); ``shardsmith train ... FLAG VALUE`` when unknown."""
    import json
    import shlex

    try:
        argv = list(json.loads(os.environ.get(COMMAND_ENV, "")))
    except ValueError:
        return f"shardsmith train ... {flag} {value}"
    names = {flag} | ({"--resume", "--load"} if flag in ("--resume", "--load") else set())
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in names:
            skip = True
            continue
        if any(arg.startswith(n + "=") for n in names):
            continue
        out.append(arg)
    return shlex.join([*out, flag, value])
