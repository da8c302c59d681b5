"""Checks the launcher runs before any worker starts (``shardsmith train --nproc-per-node``).

Everything that can be known from the flags and a manifest is checked here, in one process,
in a second or two, instead of 15-45 s later in every worker: the checkpoint root is
reachable and writable, an explicit ``--resume`` source exists and holds a committed step,
its model record fits the model flags (:func:`shardsmith.layout.compat.check_model_compatible`),
and where a resume would start (the workers report a changed LR schedule themselves, as an event).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import CheckpointNotFound, StorageError
from shardsmith.layout.compat import check_model_compatible
from shardsmith.storage.commit import read_manifest
from shardsmith.storage.fs import Store
from shardsmith.trainer.checkpointing import choose_resume
from shardsmith.trainer.config import TrainConfig


@dataclass
class Preflight:
    """What the launcher found.

    Attributes:
        resume_step: the step a resume would start from (None: a fresh start).
        resume_url: its step directory.
        notes: one line each, to print before the workers start (harmless model differences).
    """

    resume_step: int | None = None
    resume_url: str = ""
    notes: list[str] = field(default_factory=list)


def preflight(cfg: TrainConfig) -> Preflight:
    """Check what a job can check before its workers start (launcher only; no collectives).

    Raises:
        CheckpointNotFound: ``--resume`` names a missing path or one without a committed step.
        CheckpointMismatch: the checkpoint's tensors have other shapes than the model flags give.
        StorageError: the checkpoint root is unreachable or not writable.
    """
    ckpt = cfg.checkpoint
    root = writable_root(ckpt.url, ckpt.storage_options) if ckpt.url else None
    if ckpt.resume not in ("auto", "none"):
        _check_exists(ckpt.resume, "--resume", ckpt.storage_options)
    out = Preflight()
    src = choose_resume(ckpt.resume, root, 0, ckpt.storage_options)
    if src is None:
        if ckpt.init_from:
            from shardsmith.storage.commit import resolve_checkpoint

            _check_exists(ckpt.init_from, "--init-from", ckpt.storage_options)
            _, step_store, _ = resolve_checkpoint(ckpt.init_from, ckpt.storage_options)
            out.notes += check_model_compatible(read_manifest(step_store).model, cfg.model, source=step_store.url)
        return out
    step_store, step = src
    manifest = read_manifest(step_store)
    out.resume_step, out.resume_url = step, step_store.url
    out.notes += check_model_compatible(manifest.model, cfg.model, source=step_store.url)
    return out


def schedule_change(saved_config: dict[str, Any], cfg: TrainConfig, step: int) -> str:
    """One line when resuming ``step`` under ``cfg`` changes the LR schedule the checkpoint
    was trained on (its decay length, warmup, peak or final LR), else ``""``.

    The decay length is ``--lr-decay-steps``, or ``--steps`` when that is 0: extending
    ``--steps`` alone stretches the cosine and makes the LR jump at the resume.
    """
    optim, steps = saved_config.get("optim") or {}, saved_config.get("steps")
    if not optim or steps is None:
        return ""
    old_total = optim.get("decay_steps") or steps
    new_total = cfg.optim.decay_steps or cfg.steps
    diffs = []
    if old_total != new_total:
        diffs.append(f"decay ends at step {old_total} -> {new_total}")
    for name, flag in (("lr", "--lr"), ("warmup_steps", "--warmup-steps"), ("min_lr_ratio", "--min-lr-ratio")):
        if name in optim and optim[name] != getattr(cfg.optim, name):
            diffs.append(f"{flag} {optim[name]:g} -> {getattr(cfg.optim, name):g}")
    if not diffs:
        return ""
    hint = (f" (pass --lr-decay-steps {old_total} to keep it)" if old_total != new_total
            and not cfg.optim.decay_steps else "")
    return f"the LR schedule changes at the resume of step {step}: {', '.join(diffs)}{hint}"


def _check_exists(url: str, flag: str, storage_options: dict[str, Any]) -> None:
    """A local ``url`` that does not exist is named as such (not as "no committed checkpoint")."""
    if "://" in url and not url.startswith("file://"):
        return
    path = url[len("file://"):] if url.startswith("file://") else url
    if not os.path.exists(path):
        raise CheckpointNotFound(f"{flag} {url}: {os.path.abspath(path)} does not exist")
    if not os.path.isdir(path):
        raise CheckpointNotFound(f"{flag} {url}: {os.path.abspath(path)} is a file, not a checkpoint directory")


def writable_root(url: str, storage_options: dict[str, Any]) -> Store:
    """The checkpoint root, after writing and deleting a probe object there.

    Raises:
        StorageError: unreachable (the storage's own error, bounded by its timeouts) or
            not writable.
    """
    root = Store(url, storage_options)
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://"):] if url.startswith("file://") else url
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
