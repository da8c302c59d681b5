"""Refuse, never guess: the checks a training job makes before it loads or writes a checkpoint,
and the identity of its run.

* :func:`check_before_load`: the checkpoint's model record and tensor names against the job
  (:mod:`shardsmith.layout.compat`), and optimizer state for a resume (never invented: a
  checkpoint without it is refused unless ``--reset-optimizer``).
* :class:`RunIdentity`: the run id (uuid4 hex from rank 0), seed, parent and run events that
  every manifest the job commits records in ``state["run"]`` (:mod:`shardsmith.storage.lineage`).
* :func:`preflight`: both checks from storage alone, before any worker starts (the CLI).

No torch.distributed here: the policy (:mod:`shardsmith.trainer.checkpointing`) agrees the run
id over the process group.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardsmith.layout.compat import check_has_optimizer_state, check_model_compatible, check_tensor_names
from shardsmith.layout.plan import checkpoint_specs
from shardsmith.storage.lineage import UNNAMED, check_new_run_root, run_record
from shardsmith.storage.manifest import Manifest

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig

log = logging.getLogger(__name__)

OPTIM_PREFIX = "optim."


def check_before_load(manifest: Manifest, cfg: TrainConfig, source: str, *, resume: bool,
                      reset_optimizer: bool = False) -> list[str]:
    """Check that a checkpoint fits this job before a byte of tensor data is read.

    Args:
        manifest: the checkpoint's manifest.
        cfg: the job's config (model, layout).
        source: the checkpoint's URL, for messages.
        resume: True for a resume or rollback (optimizer state needed unless
            ``reset_optimizer``); False for ``--init-from`` (weights only).
        reset_optimizer: the resume starts a fresh optimizer (its saved state is ignored).

    Returns:
        Warnings naming model fields that differ without changing a tensor shape.

    Raises:
        CheckpointMismatch: another model shape, missing or unexpected tensors, or no
            optimizer state for a resume (names the difference and the way forward).
    """
    warnings = check_model_compatible(manifest.model, cfg.model, source=source)
    names = manifest.tensor_names                 # every tensor of the step (a partial read too)
    load_optim = resume and not reset_optimizer
    if load_optim:
        check_has_optimizer_state(names, source=source, optimizer_prefix=OPTIM_PREFIX)
    expected = checkpoint_specs(cfg.model, cfg.parallel, with_optimizer=load_optim)
    check_tensor_names(names, expected, source=source, optimizer_prefixes=() if load_optim else (OPTIM_PREFIX,))
    return warnings


@dataclass
class RunIdentity:
    """Who wrote a checkpoint: recorded as ``state["run"]`` of every manifest the job commits.

    Attributes:
        id: uuid4 hex, the same on every rank (rank 0's).
        seed: the run's seed.
        parent: ``{"run", "step", "url"}`` of the checkpoint it was resumed or initialized
            from; None for a run from scratch.
        events: run-level events carried from checkpoint to checkpoint (``reset_optimizer``).
        continues_unnamed: it resumed a checkpoint without a run id, whose steps stay in its
            lineage (retention, ``latest``).
    """

    id: str
    seed: int
    parent: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    continues_unnamed: bool = False

    @staticmethod
    def new_id() -> str:
        """A fresh run id (call on rank 0 and broadcast)."""
        return uuid.uuid4().hex

    def lineage(self) -> set[str]:
        """Run ids whose steps retention and ``latest`` treat as this run's."""
        return {self.id, UNNAMED} if self.continues_unnamed else {self.id}

    def to_json(self) -> dict[str, Any]:
        """The ``state["run"]`` record."""
        return {"id": self.id, "seed": self.seed, "parent": self.parent, "events": list(self.events)}

    def resumed(self, state: dict[str, Any], url: str, step: int) -> None:
        """Continue the run of a resumed checkpoint: adopt its id (an unnamed one keeps this
        id and joins its lineage) and events; the parent is the step resumed."""
        rec = run_record(state)
        old = rec.get("id") or UNNAMED
        if old:
            self.id = old
        else:
            self.continues_unnamed = True
        self.events = list(rec.get("events") or [])
        self.parent = {"run": old, "step": step, "url": url}

    def initialized_from(self, state: dict[str, Any], url: str, step: int) -> None:
        """A new run started from another checkpoint's weights (``--init-from``)."""
        self.parent = {"run": run_record(state).get("id") or UNNAMED, "step": step, "url": url}


def preflight(cfg: TrainConfig) -> list[str]:
    """The checks workers make, from storage alone, before any worker starts (the CLI calls
    it; the workers repeat them). Single process.

    Returns:
        Warnings for harmless model differences.

    Raises:
        CheckpointMismatch: a new run into another run's root, another model shape, missing
            tensors, or a resume without optimizer state.
        CheckpointNotFound: ``--resume URL`` or ``--init-from URL`` without a committed step.
    """
    from shardsmith.storage.commit import read_manifest, resolve_checkpoint
    from shardsmith.storage.fs import Store
    from shardsmith.trainer.checkpointing import choose_resume

    ckpt = cfg.checkpoint
    root = Store(ckpt.url, ckpt.storage_options) if ckpt.url else None
    if root is not None:
        check_new_run_root(root, ckpt.resume, ckpt.overwrite)
    src = choose_resume(ckpt.resume, None if ckpt.overwrite else root, 0, ckpt.storage_options)
    if src is not None:
        return check_before_load(read_manifest(src[0]), cfg, src[0].url, resume=True,
                                 reset_optimizer=ckpt.reset_optimizer)
    if ckpt.init_from:
        _, step_store, _ = resolve_checkpoint(ckpt.init_from, ckpt.storage_options)
        return check_before_load(read_manifest(step_store), cfg, step_store.url, resume=False)
    return []


def reset_due(manifest: Manifest, reset_optimizer: bool) -> bool:
    """``--reset-optimizer``, unless the checkpoint was written after this run's reset (a
    requeued or restarted job loads its own optimizer state)."""
    if not reset_optimizer:
        return False
    has_optim = any(k.startswith(OPTIM_PREFIX) for k in manifest.tensor_names)
    events = manifest.state.get("run", {}).get("events") or []
    return not (has_optim and any(e.get("event") == "reset_optimizer" for e in events))
