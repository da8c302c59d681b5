"""Does a checkpoint fit the job that loads it? Pure checks, no torch, no I/O.

Every load (resume, ``--init-from``, reshard, export) compares the checkpoint's model record
with the job's model config field by field *before* reading a tensor. A field that changes a
tensor's shape refuses the load with one line naming every differing field and both values;
a harmless one (sequence length, RoPE base, norm epsilon) proceeds with a warning naming it.
Tensor names are compared too: a missing or unexpected logical tensor is always an error,
never a silent drop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from shardsmith.errors import CheckpointMismatch
from shardsmith.layout.model_config import ModelConfig
from shardsmith.layout.sharding import OPTIM_NAMESPACE

#: Model fields that change the shape (or the set) of the stored tensors.
SHAPE_FIELDS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "tie_embeddings",
)
#: Most tensor names listed in one message.
MAX_LISTED = 5


def model_differences(saved: Mapping[str, Any], job: ModelConfig) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's model record with the job's model config.

    Args:
        saved: the manifest's ``model`` record (JSON dict). Fields the record lacks are
            taken at :class:`ModelConfig`'s defaults (records of older versions).
        job: the model this job builds.

    Returns:
        ``(shape, harmless)``: lists of ``"field: checkpoint A, this job B"`` strings, the
        first for fields in :data:`SHAPE_FIELDS`, the second for every other field.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    shape: list[str] = []
    harmless: list[str] = []
    for name, mine in dataclasses.asdict(job).items():
        theirs = saved.get(name, defaults.get(name))
        if theirs != mine:
            line = f"{name}: checkpoint {theirs!r}, this job {mine!r}"
            (shape if name in SHAPE_FIELDS else harmless).append(line)
    return shape, harmless


def check_model_compatible(saved: Mapping[str, Any], job: ModelConfig, *, source: str) -> list[str]:
    """Refuse a checkpoint whose model has another shape; return the harmless differences.

    Args:
        saved: the manifest's ``model`` record.
        job: the model this job builds.
        source: the checkpoint's URL, for the message.

    Returns:
        Warnings (one line each) for differing fields that change no tensor shape.

    Raises:
        CheckpointMismatch: a shape field differs; names every such field and both values,
            and says how to proceed (the checkpoint's flags, or a new run).
    """
    shape, harmless = model_differences(saved, job)
    if shape:
        raise CheckpointMismatch(
            f"{source} holds a model of another shape ({'; '.join(shape)}); pass the checkpoint's "
            "model flags (see `shardsmith inspect`) or train a new model in a new --ckpt root"
        )
    return (
        [
            f"{source}: model differs in fields that change no tensor shape ({'; '.join(harmless)}); "
            "this job's values are used"
        ]
        if harmless
        else []
    )


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def check_tensor_names(
    saved: Iterable[str],
    expected: Iterable[str],
    *,
    source: str,
    optimizer_prefixes: tuple[str, ...] = (),
) -> None:
    """Refuse a load whose logical tensors are not exactly the ones the job needs.

    Args:
        saved: FQNs of the checkpoint's logical tensors.
        expected: FQNs the job loads.
        source: the checkpoint's URL, for the message.
        optimizer_prefixes: saved FQNs with these prefixes are ignored when the job loads
            weights only (``--init-from``, export); pass ``()`` to compare everything.

    Raises:
        CheckpointMismatch: naming up to :data:`MAX_LISTED` missing and unexpected FQNs.
    """
    saved_set = {n for n in saved if not (optimizer_prefixes and n.startswith(optimizer_prefixes))}
    expected_set = set(expected)
    missing, unexpected = expected_set - saved_set, saved_set - expected_set
    if missing or unexpected:
        parts = ([f"missing {len(missing)}: {_listed(missing)}"] if missing else []) + (
            [f"unexpected {len(unexpected)}: {_listed(unexpected)}"] if unexpected else []
        )
        raise CheckpointMismatch(
            f"{source} does not hold the tensors this model needs ({'; '.join(parts)}); check the "
            "model flags against `shardsmith inspect` of the checkpoint"
        )


#: ``source.format`` of an imported checkpoint's state -> how the user made it.
IMPORTED_BY: dict[str, str] = {
    "huggingface": "import-hf (a Hugging Face model)",
    "dcp": "import-dcp (a PyTorch DCP checkpoint)",
    "megatron_torch_dist": "import-megatron (a Megatron-Core checkpoint)",
}


def check_has_optimizer_state(
    saved: Iterable[str],
    *,
    source: str,
    optimizer_prefix: str = OPTIM_NAMESPACE,
    imported: dict | None = None,
) -> None:
    """Refuse to resume from a checkpoint without optimizer state (never invent a fresh one).

    Args:
        saved: FQNs of the checkpoint's logical tensors.
        source: the checkpoint's URL as the user spelled it, for the message.
        optimizer_prefix: the prefix of optimizer-state FQNs.
        imported: the manifest state's ``source`` record (``{"format", "path", ...}``) when
            the step was imported from another format; the message then says so instead of
            guessing at ``--model-only``.

    Raises:
        CheckpointMismatch: no saved FQN starts with ``optimizer_prefix``; points at
            ``--init-from`` (weights only, fresh optimizer, step 0) and ``--reset-optimizer``.
    """
    if any(n.startswith(optimizer_prefix) for n in saved):
        return
    ways = (
        f"start a new run from its weights with --init-from {source} (fresh AdamW, step 0), or "
        "add --reset-optimizer to keep its step count with a fresh AdamW (recorded as an event)"
    )
    if imported:
        how = IMPORTED_BY.get(
            str(imported.get("format")), f"an import from {imported.get('format')}"
        )
        origin = f" of {imported['path']}" if imported.get("path") else ""
        raise CheckpointMismatch(
            f"{source} was written by {how}{origin}: it holds the model weights but no optimizer "
            f"state, so there is nothing to resume exactly; {ways}"
        )
    raise CheckpointMismatch(
        f"{source} holds model weights but no optimizer state (a `reshard --model-only` copy, or an "
        f"export), so it cannot be resumed exactly; {ways}"
    )
