"""Refuse, never guess: the checks a training job makes before it loads or writes a checkpoint,
and the identity of its run.

* :func:`check_before_load`: the checkpoint's model record and tensor names against the job
  (:mod:`shardsmith.layout.compat`), and optimizer state for a resume (never invented: a
  checkpoint without it is refused unless ``--reset-optimizer``).
* :class:`RunIdentity`: the run id (uuid4 hex from rank 0), seed, parent and run events that
  every manifest the job commits records in ``state["run"]`` (:mod:`shardsmith.storage.lineage`).
* the launcher makes both checks from storage alone, before any worker starts
  (:func:`shardsmith.trainer.runtime.preflight.preflight`).

No torch.distributed here: the policy (:mod:`shardsmith.trainer.checkpoint.policy`) agrees the run
id over the process group.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardsmith.errors import CheckpointMismatch
from shardsmith.layout import (
    check_has_optimizer_state,
    check_model_compatible,
    check_tensor_names,
    checkpoint_specs,
)
from shardsmith.storage import UNNAMED, run_record
from shardsmith.storage.manifest import Manifest
from shardsmith.trainer.checkpoint.resume import check_data_change, data_differs

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig

log = logging.getLogger(__name__)

OPTIM_PREFIX = "optim."


def check_before_load(
    manifest: Manifest,
    cfg: TrainConfig,
    source: str,
    *,
    resume: bool,
    reset_optimizer: bool = False,
) -> list[str]:
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
        CheckpointMismatch: another model shape, missing or unexpected tensors, no
            optimizer state for a resume, or weights in another dtype than the job's for
            a resume (names the difference and the way forward).
    """
    warnings = check_model_compatible(manifest.model, cfg.model, source=source)
    names = manifest.tensor_names  # every tensor of the step (a partial read too)
    load_optim = resume and not reset_optimizer
    if resume:
        check_resume_dtypes(manifest, source, reset_optimizer=reset_optimizer)
    if load_optim:
        check_has_optimizer_state(
            names,
            source=source,
            optimizer_prefix=OPTIM_PREFIX,
            imported=manifest.state.get("source"),
        )
    expected = checkpoint_specs(cfg.model, cfg.parallel, with_optimizer=load_optim)
    check_tensor_names(
        names, expected, source=source, optimizer_prefixes=() if load_optim else (OPTIM_PREFIX,)
    )
    return warnings


#: The dtype of the job's parameters and optimizer state (fp32 master weights; ``--bf16`` only
#: autocasts the compute).
JOB_DTYPE = "F32"
#: Saved dtypes an ``--init-from`` upcasts to :data:`JOB_DTYPE` exactly (every value representable).
EXACT_UPCASTS = frozenset({"BF16", "F16"})


def saved_dtypes(manifest: Manifest) -> set[str]:
    """The dtypes of the model (not optimizer) tensors a manifest lists."""
    return {rec.dtype for fqn, rec in manifest.tensors.items() if not fqn.startswith(OPTIM_PREFIX)}


def check_resume_dtypes(manifest: Manifest, source: str, *, reset_optimizer: bool = False) -> None:
    """Refuse to resume weights saved in another dtype than the job's (a resume continues
    the optimizer in place; an ``--init-from`` upcasts instead).

    The way forward it names is one that works: a copy without optimizer state (``reshard
    --model-only``) converted to f32 still needs ``--reset-optimizer`` to be resumed.

    Raises:
        CheckpointMismatch: naming the dtypes and the conversion command.
    """
    other = sorted(saved_dtypes(manifest) - {JOB_DTYPE})
    if not other:
        return
    from shardsmith.trainer.observe.console import short_url

    source = short_url(source)
    has_optim = any(n.startswith(OPTIM_PREFIX) for n in manifest.tensor_names)
    then = (
        "--resume NEW_DIR" if has_optim or reset_optimizer else "--resume NEW_DIR --reset-optimizer"
    )
    what = "with its optimizer state" if has_optim else "and holds no optimizer state"
    raise CheckpointMismatch(
        f"{source} holds {'/'.join(other)} weights; a resume continues training in {JOB_DTYPE} {what}: "
        f"start a new run from its weights with --init-from {source} (upcast exactly), or convert it "
        f"first with `shardsmith reshard {source} NEW_DIR --dtype f32` (then {then})"
    )


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
        return {
            "id": self.id,
            "seed": self.seed,
            "parent": self.parent,
            "events": list(self.events),
        }

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


def resume_changes(
    manifest: Manifest, cfg: TrainConfig, url: str, step: int, sample_index: int
) -> list[dict[str, Any]]:
    """What resuming ``step`` under ``cfg`` changes, as events (pure; every rank alike):

    * ``data_change``: other data than the checkpoint was trained on, mapped as
      ``checkpoint.data_change`` says (``sample_index``: where the new data starts: the saved
      index for ``continue``, 0 for ``restart``);
    * ``batch_change``: another global batch size (Megatron's batch ramp-up); the data
      continues at the saved global sample index.

    Raises:
        ConfigError: the data changed and ``checkpoint.data_change`` does not say how (the
            launcher refuses this before any worker starts; see
            :func:`shardsmith.trainer.checkpoint.resume.check_data_change`).
    """
    from dataclasses import asdict

    from shardsmith.trainer.data.config import describe_data

    saved = manifest.config or {}
    out: list[dict[str, Any]] = []
    if data_differs(manifest, cfg):
        check_data_change(manifest, cfg, url)
        how = cfg.checkpoint.data_change
        out.append(
            {
                "event": "data_change",
                "step": step,
                "how": how,
                "from": describe_data(saved.get("data") or {}),
                "to": describe_data(asdict(cfg.data)),
                "saved_sample_index": sample_index,
                "sample_index": 0 if how == "restart" else sample_index,
            }
        )
    old = saved.get("global_batch_size")
    if old is not None and old != cfg.global_batch_size:
        out.append(
            {
                "event": "batch_change",
                "step": step,
                "from": old,
                "to": cfg.global_batch_size,
                "sample_index": out[0]["sample_index"] if out else sample_index,
            }
        )
    return out


def reset_due(manifest: Manifest, reset_optimizer: bool) -> bool:
    """``--reset-optimizer``, unless the checkpoint was written after this run's reset (a
    requeued or restarted job loads its own optimizer state)."""
    if not reset_optimizer:
        return False
    has_optim = any(k.startswith(OPTIM_PREFIX) for k in manifest.tensor_names)
    events = manifest.state.get("run", {}).get("events") or []
    return not (has_optim and any(e.get("event") == "reset_optimizer" for e in events))
