"""What the launcher decides and checks before any worker starts (``shardsmith train``).

Everything that can be known from the flags and a manifest is decided here, in one process,
without importing torch, instead of 15-45 s later in every worker:

* **which step** a resume loads (:func:`resolve`): ``--resume auto`` -> the newest committed
  step of the root's run that no load marked corrupt; a URL -> exactly that step. The
  result is one absolute step URL, handed to every worker as ``checkpoint.resume_step``
  (``--init-from``: rewritten to its exact step URL too); a worker never chooses again on
  its first start (after an elastic restart the group resumes its own newest step).
* **whether it fits** (:func:`preflight`): the root is reachable and writable, a new run
  does not mix with another run's steps, an explicit source holds a committed step, its
  model record, tensor names, optimizer state and dtypes fit the job
  (:func:`~shardsmith.trainer.checkpoint.run_checks.check_before_load`, pure ``layout/`` code), and a
  change of data is said (``--data-change``).

The workers report what a resume changes (LR schedule, batch size, data position) as
events; what cannot be known before the data is read (a corrupt file) is found while loading
(:meth:`~shardsmith.trainer.checkpoint.policy.CheckpointPolicy.resume`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardsmith.errors import StorageError
from shardsmith.storage import check_new_run_root, read_manifest, resolve_checkpoint
from shardsmith.storage.manifest import check_model_record
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.resume import (
    absolute_url,
    check_data_change,
    check_exists,
    resume_source,
)
from shardsmith.trainer.checkpoint.run_checks import check_before_load, reset_due
from shardsmith.trainer.observe.console import short_url

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig


@dataclass
class Preflight:
    """What the launcher found.

    Attributes:
        resume_step: the step a resume starts from (None: a fresh start).
        resume_url: its step directory (absolute).
        init_from: the exact step URL of ``--init-from`` ("" when not used).
        notes: warnings, one line each, to print before the workers start.
    """

    resume_step: int | None = None
    resume_url: str = ""
    init_from: str = ""
    notes: list[str] = field(default_factory=list)


def resolve(cfg: TrainConfig) -> tuple[TrainConfig, Preflight]:
    """Run :func:`preflight` and return ``cfg`` with the decisions filled in:
    ``checkpoint.resume_step`` (the exact step URL, ``""`` for none) and ``init_from`` (its
    exact step URL). Launcher only (or each process under an external torchrun, which decide
    alike from storage). Raises as :func:`preflight`."""
    found = preflight(cfg)
    ckpt = dataclasses.replace(
        cfg.checkpoint,
        resume_step=found.resume_url,
        init_from=found.init_from or cfg.checkpoint.init_from,
    )
    return dataclasses.replace(cfg, checkpoint=ckpt), found


def prepare(cfg: TrainConfig) -> TrainConfig | None:
    """:func:`resolve` ``cfg`` unless already resolved, printing its notes to stderr (one
    ``warning:`` line each). Launcher only.

    Returns:
        The resolved config; None, with a line saying why, when the step to resume is
        already at or past ``cfg.steps`` (nothing to train).

    Raises:
        As :func:`preflight`.
    """
    if cfg.checkpoint.resume_step is not None:  # resolved (the CLI did it before importing torch)
        return cfg
    cfg, found = resolve(cfg)
    for note in found.notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    if found.resume_step is not None and found.resume_step >= cfg.steps:
        print(
            f"{found.resume_url} is at step {found.resume_step}, at or past --steps {cfg.steps}: nothing "
            "to train (raise --steps to continue)",
            file=sys.stderr,
            flush=True,
        )
        return None
    return cfg


def preflight(cfg: TrainConfig) -> Preflight:
    """Check what a job can check before its workers start (no collectives, no torch).

    Raises:
        CheckpointNotFound: ``--resume``/``--init-from`` names a missing path or one without
            a committed step.
        CheckpointMismatch: a new run into another run's root; another model shape, missing
            tensors, no optimizer state for a resume, a dtype a resume cannot take, or a
            model record that contradicts its tensors.
        ConfigError: the data changed and ``--data-change`` does not say how.
        StorageError: the checkpoint root is unreachable or not writable.
    """
    ckpt = cfg.checkpoint
    local = (
        absolute_url(ckpt.url)
        if ckpt.url and ("://" not in ckpt.url or ckpt.url.startswith("file://"))
        else ""
    )
    fresh = bool(local) and not os.path.exists(local.removeprefix("file://"))
    try:
        return _preflight(cfg)
    except Exception:
        if fresh and os.path.isdir(local) and not os.listdir(local):
            os.rmdir(local)  # a refused job leaves no trace of the root it created
        raise


def _preflight(cfg: TrainConfig) -> Preflight:
    ckpt = cfg.checkpoint
    root = writable_root(absolute_url(ckpt.url), ckpt.storage_options) if ckpt.url else None
    if root is not None:
        check_new_run_root(root, ckpt.resume, ckpt.overwrite)
    out = Preflight()
    src = resume_source(cfg, root, out.notes)
    if src is not None:
        step_store, step = src
        manifest = read_manifest(step_store)
        out.resume_step, out.resume_url = step, step_store.url
        reset = reset_due(manifest, ckpt.reset_optimizer)
        # a record that lies about its tensors first: else its lie reads as "another shape"
        check_model_record(manifest, short_url(step_store.url))
        out.notes += check_before_load(
            manifest, cfg, step_store.url, resume=True, reset_optimizer=reset
        )
        check_data_change(manifest, cfg, step_store.url)
    elif ckpt.init_from:
        check_exists(ckpt.init_from, "--init-from")
        _, step_store, _ = resolve_checkpoint(absolute_url(ckpt.init_from), ckpt.storage_options)
        out.init_from = step_store.url
        manifest = read_manifest(step_store)
        check_model_record(manifest, short_url(step_store.url))
        out.notes += check_before_load(manifest, cfg, step_store.url, resume=False)
    return out


def writable_root(url: str, storage_options: dict[str, Any]) -> Store:
    """The checkpoint root, after writing and deleting a probe object there.

    Raises:
        StorageError: unreachable (the storage's own error, bounded by its timeouts) or
            not writable.
    """
    root = Store(url, storage_options)
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://") :] if url.startswith("file://") else url
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"--ckpt {url}: cannot create it ({exc.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise StorageError(f"--ckpt {url}: not writable by this user")
        return root
    probe = f".shardsmith-probe-{uuid.uuid4().hex[:8]}"
    root.write(probe, b"")
    root.delete(probe)
    return root
