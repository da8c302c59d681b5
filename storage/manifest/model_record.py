"""Does a manifest's ``model`` record agree with its tensors? (``verify``, reshard, export.)

The record is what every loader trusts for shapes (``checkpoint_specs``), so a record that
contradicts the stored tensors (say ``vocab_size`` 10^12 over 256-row embeddings) is refused
instead of loading garbage or allocating the impossible. Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardsmith.errors import CheckpointMismatch
from shardsmith.layout import (
    OPTIM_NAMESPACE,
    SHAPE_FIELDS,
    ModelConfig,
    ParallelDims,
    checkpoint_specs,
)
from shardsmith.storage.manifest.records import Manifest

OPTIM_PREFIX = OPTIM_NAMESPACE


def model_record_problems(manifest: Manifest) -> list[str]:
    """Every disagreement between the manifest's model record and its logical tensors.

    Each line names the tensor, both shapes and the model fields whose values the expected
    shape comes from; missing and unexpected tensors are listed too. A manifest without a
    model record (not a model's checkpoint, e.g. storage tests) has nothing to check.
    """
    if not manifest.model:
        return []
    try:
        model = ModelConfig.from_json(manifest.model)
        has_optim = any(f.startswith(OPTIM_PREFIX) for f in manifest.tensors)
        specs = checkpoint_specs(model, ParallelDims(), with_optimizer=has_optim)
    except (ValueError, TypeError, KeyError) as exc:
        return [f"model record is not a valid model config: {exc}"]
    problems: list[str] = []
    bad: set[str] = set()
    for fqn, spec in sorted(specs.items(), key=lambda kv: (kv[0].startswith(OPTIM_PREFIX), kv[0])):
        rec = manifest.tensors.get(fqn)
        if fqn.startswith(OPTIM_PREFIX) and fqn.split(".", 2)[-1] in bad:
            continue  # its parameter is reported already
        if rec is None or tuple(rec.shape) != tuple(spec.shape):
            bad.add(fqn)
        if rec is None:
            problems.append(
                f"model record implies tensor {fqn} {tuple(spec.shape)}, which the manifest lacks"
            )
        elif tuple(rec.shape) != tuple(spec.shape):
            fields = fields_behind(model, fqn, tuple(spec.shape), tuple(rec.shape))
            problems.append(
                f"tensor {fqn} has shape {tuple(rec.shape)} but the model record"
                f"{' (' + ', '.join(fields) + ')' if fields else ''} implies {tuple(spec.shape)}"
            )
    extra = sorted(set(manifest.tensors) - set(specs))
    if extra:
        problems.append(
            f"tensors the model record does not imply: {', '.join(extra[:5])}"
            + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        )
    return problems


def fields_behind(
    model: ModelConfig, fqn: str, want: tuple[int, ...], got: tuple[int, ...]
) -> list[str]:
    """The model fields whose recorded value explains why tensor ``fqn`` is ``got`` and not
    the ``want`` the record implies, each as ``"name=recorded where the tensor implies v"``.

    A field is named when changing it alone, by the ratio of a differing dim
    (``v = recorded * got / want``), gives exactly ``got``: ``num_kv_heads`` behind a K/V
    projection's ``num_kv_heads * head_dim`` rows, ``vocab_size`` behind the embedding's.
    Falls back to the fields equal to a wanted dim when no single change explains the shape.
    """
    named: list[str] = []
    for name in SHAPE_FIELDS:
        value = getattr(model, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        for w, g in zip(want, got):
            if w == g or (g * value) % w:
                continue
            candidate = g * value // w
            if candidate > 0 and _shape_with(model, name, candidate, fqn) == got:
                named.append(f"{name}={value} where the tensor implies {candidate}")
                break
    if named:
        return named
    return [
        f"{n}={getattr(model, n)}"
        for n in SHAPE_FIELDS
        if any(getattr(model, n) == w != g for w, g in zip(want, got))
    ]


def _shape_with(model: ModelConfig, name: str, value: int, fqn: str) -> tuple[int, ...] | None:
    """``fqn``'s shape under ``model`` with field ``name`` set to ``value`` (None: invalid)."""
    try:
        spec = checkpoint_specs(
            dataclasses.replace(model, **dict[str, Any]({name: value})),
            ParallelDims(),
            with_optimizer=False,
        ).get(fqn)
    except (ValueError, TypeError, KeyError, ZeroDivisionError):
        return None
    return None if spec is None else tuple(spec.shape)


def check_model_record(manifest: Manifest, source: str) -> None:
    """Raise :class:`CheckpointMismatch` naming the first problems of :func:`model_record_problems`."""
    problems = model_record_problems(manifest)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointMismatch(
            f"{source}: the manifest's model record contradicts its tensors: "
            f"{'; '.join(problems[:3])}{more}; the checkpoint is damaged or hand-edited"
        )
