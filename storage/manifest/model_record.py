"""Does a manifest's ``model`` record agree with its tensors? (``verify``, reshard, export.)

The record is what every loader trusts for shapes (``checkpoint_specs``), so a record that
contradicts the stored tensors (say ``vocab_size`` 10^12 over 256-row embeddings) is refused
instead of loading garbage or allocating the impossible. Pure: no torch, no I/O.
"""

from __future__ import annotations

from shardsmith.errors import CheckpointMismatch
from shardsmith.layout.compat import SHAPE_FIELDS
from shardsmith.layout.dims import ParallelDims
from shardsmith.layout.model_config import ModelConfig
from shardsmith.layout.plan import checkpoint_specs
from shardsmith.storage.manifest.records import Manifest

OPTIM_PREFIX = "optim."


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
            continue                                   # its parameter is reported already
        if rec is None or tuple(rec.shape) != tuple(spec.shape):
            bad.add(fqn)
        if rec is None:
            problems.append(f"model record implies tensor {fqn} {tuple(spec.shape)}, which the manifest lacks")
        elif tuple(rec.shape) != tuple(spec.shape):
            fields = [f"{n}={getattr(model, n)}" for n in SHAPE_FIELDS
                      if any(getattr(model, n) == want != got for want, got in zip(spec.shape, rec.shape))]
            problems.append(f"tensor {fqn} has shape {tuple(rec.shape)} but the model record"
                            f"{' (' + ', '.join(fields) + ')' if fields else ''} implies {tuple(spec.shape)}")
    extra = sorted(set(manifest.tensors) - set(specs))
    if extra:
        problems.append(f"tensors the model record does not imply: {', '.join(extra[:5])}"
                        + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    return problems


def check_model_record(manifest: Manifest, source: str) -> None:
    """Raise :class:`CheckpointMismatch` naming the first problems of :func:`model_record_problems`."""
    problems = model_record_problems(manifest)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointMismatch(f"{source}: the manifest's model record contradicts its tensors: "
                                 f"{'; '.join(problems[:3])}{more}; the checkpoint is damaged or hand-edited")
