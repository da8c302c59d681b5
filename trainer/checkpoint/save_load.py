"""Checkpoint save and load inside a training job (every rank calls these, in the same order).

Save: each rank writes the boxes the sharding plan assigns it (replicas once, spread
over ranks) into one safetensors file, sends its manifest records to rank 0 as JSON
over the process group (no pickle), and rank 0 validates coverage, writes
``manifest.json`` (the commit) and then ``latest``.

Load: each rank computes the boxes it holds under the *current* layout and fills
them from whatever boxes the checkpoint saved, reading only intersecting byte ranges.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardsmith.errors import CheckpointError, IntegrityError, SaveNotCommitted
from shardsmith.layout import (
    Box,
    ModelConfig,
    ParallelDims,
    checkpoint_specs,
    rank_boxes,
    shard_file_name,
    write_assignment,
)
from shardsmith.storage import DEFAULT_CHUNK_NBYTES, crash_point, delete_step, step_dir
from shardsmith.storage.commit import commit
from shardsmith.storage.formats import DTYPE_NAMES, TORCH_DTYPES, read_boxes
from shardsmith.storage.formats import tensor_format as get_tensor_format
from shardsmith.storage.manifest import Manifest, ManifestBuilder
from shardsmith.storage.reading import ReadStats
from shardsmith.storage.store import Store
from shardsmith.trainer.comm import broadcast_text, gather_json_to_root
from shardsmith.trainer.rng import pack_rng_states
from shardsmith.trainer.weight_init import local_tensor

log = logging.getLogger(__name__)


@torch.no_grad()  # views of the local shards: no autograd node per DTensor.to_local
def model_state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor]:
    """Global FQN -> local tensor (a view, no copy), for parameters and (when given) AdamW state.

    Optimizer state is keyed ``optim.exp_avg.<fqn>``, ``optim.exp_avg_sq.<fqn>``,
    ``optim.step.<fqn>``; it must exist (see :func:`init_optimizer_state`).
    """
    out: dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters():
        out[fqn] = local_tensor(p.data if not isinstance(p, DTensor) else p)
        if optimizer is not None:
            state = optimizer.state[p]
            out[f"optim.exp_avg.{fqn}"] = local_tensor(state["exp_avg"])
            out[f"optim.exp_avg_sq.{fqn}"] = local_tensor(state["exp_avg_sq"])
            out[f"optim.step.{fqn}"] = state["step"]
    return out


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW state (zeros, step 0) for every parameter that has none, matching the
    parameter's placement, so a checkpoint can be loaded into it before the first step.
    Once every parameter has state (every save after the first) it only checks."""
    for p in model.parameters():
        if not optimizer.state.get(p):
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


@dataclass
class SaveResult:
    """What a save wrote (identical on every rank).

    Attributes:
        step: the step saved.
        nbytes: bytes of all data files.
        seconds: wall time of the whole save (write + commit).
        blocked_seconds: time the training loop was blocked (for async saves: the trainer's
            preparation, the snapshot and waits for it).
        saver_blocked_seconds: the part of it inside ``AsyncCheckpointer.save`` and the
            snapshot waits (what ``bench/checkpoint_vs_dcp.py`` measures); sync saves: all.
    """

    step: int
    nbytes: int
    seconds: float
    blocked_seconds: float = 0.0
    saver_blocked_seconds: float = 0.0


def _check_boxes(
    tensors: dict[str, torch.Tensor], local_shapes: dict[str, tuple[int, ...]], rank: int
) -> None:
    missing = set(local_shapes) ^ set(tensors)
    if missing:
        raise CheckpointError(
            f"rank {rank}: model state and sharding plan disagree on {sorted(missing)[:5]}"
        )
    for fqn, shape in local_shapes.items():
        if tuple(tensors[fqn].shape) != shape:
            raise CheckpointError(
                f"rank {rank}: {fqn} holds local shape {tuple(tensors[fqn].shape)} but "
                f"the sharding plan says {shape} (internal error)"
            )


@dataclass
class WritePlan:
    """What this rank writes in a save: (fqn, local tensor, global box) in file order."""

    step: int
    specs: dict
    entries: list[tuple[str, torch.Tensor, Box]]


#: (model, layout, rank, with optimizer) -> (specs, local shapes, this rank's writes): the
#: plan is pure and a run saves with one layout, so it is computed once per run.
_PLANS: dict[str, tuple[dict, dict[str, tuple[int, ...]], list[tuple[str, Box]]]] = {}


def _rank_plan(
    model_cfg: ModelConfig, dims: ParallelDims, rank: int, with_optim: bool
) -> tuple[dict, dict[str, tuple[int, ...]], list[tuple[str, Box]]]:
    key = json.dumps([model_cfg.to_json(), dims.to_json(), rank, with_optim], sort_keys=True)
    if key not in _PLANS:
        specs = checkpoint_specs(model_cfg, dims, with_optimizer=with_optim)
        coords = dims.coords(rank)
        shapes = {f: specs[f].local_lengths(dims, coords) for f in rank_boxes(specs, dims, rank)}
        if len(_PLANS) >= 16:
            _PLANS.clear()
        _PLANS[key] = (specs, shapes, write_assignment(specs, dims, rank=rank)[rank])
    return _PLANS[key]


def plan_local_writes(
    step: int,
    tensors: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    dims: ParallelDims,
    rank: int,
) -> WritePlan:
    """Check this rank's tensors against the sharding plan and pick the ones it writes
    (each distinct box once over all ranks; see ``layout.sharding.write_assignment``).
    The plan is computed once per (model, layout, rank) and reused by later saves."""
    with_optim = any(k.startswith("optim.") for k in tensors)
    specs, shapes, mine = _rank_plan(model_cfg, dims, rank, with_optim)
    _check_boxes(tensors, shapes, rank)
    return WritePlan(step, specs, [(fqn, unpadded(tensors[fqn], box), box) for fqn, box in mine])


def unpadded(local: torch.Tensor, box: Box) -> torch.Tensor:
    """The part of a local tensor that holds real elements: with vocab padding the local
    tensor has extra trailing rows (dim 0) beyond its box; a view, no copy."""
    if local.ndim and local.shape[0] != box.lengths[0]:
        return local.narrow(0, 0, box.lengths[0])
    return local


def write_and_commit(
    root: Store,
    plan: WritePlan,
    *,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    config: dict[str, Any],
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    tensor_format: str = "safetensors",
    zarr_codec: str = "",
    rng: dict[str, Any] | None = None,
) -> int:
    """Write this rank's boxes in ``tensor_format`` (:mod:`shardsmith.storage.formats.registry`),
    gather every rank's records on ``group`` (JSON, no pickle), and on rank 0 add them (and
    any format metadata) to the manifest, validate coverage and commit it, then ``latest``.

    First rank 0 deletes the step's directory if it exists (a job sent back to an earlier
    step: manifest first, so no reader sees an old manifest with new data, and the step
    holds only its own files; one broadcast orders it before the writes). ``rng``
    (:func:`~shardsmith.trainer.rng.rank_rng_entry`) rides on the records' gather.

    Every rank of ``group`` calls it with the same step. Returns total data bytes.

    Raises:
        SaveNotCommitted: clearing the old step, some rank's write or the commit failed, or
            coverage did not validate; raised on every rank alike; nothing is committed.
    """
    rank = dist.get_rank(group)
    step_store = root.child(step_dir(plan.step))
    fmt = get_tensor_format(tensor_format, zarr_codec)
    crash_point("save.begin", step=plan.step)  # test hooks (storage/crashpoints.py)
    error = broadcast_text(_clear_step(root, plan.step) if rank == 0 else "", group)
    if error:
        raise SaveNotCommitted(f"checkpoint step {plan.step} not committed: {error}")
    records: dict[str, Any] = {}
    try:
        records = fmt.write_rank(step_store, rank, plan.entries, plan.specs, dims, chunk_nbytes)
    except Exception as exc:  # reported to every rank below; nothing is committed
        log.debug(
            "rank %d: writing %s failed",
            rank,
            step_store.url_of(shard_file_name(rank)),
            exc_info=True,
        )
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    payload = {"error": error, **records, **({"rng": rng} if rng is not None else {})}
    gathered = gather_json_to_root(payload, group)  # rank 0 only: records of every rank
    crash_point("save.after_gather")
    outcome = {"error": "", "nbytes": 0}
    if gathered is not None:
        if rngs := [g.pop("rng") for g in gathered if "rng" in g]:
            state = {**state, "rng": pack_rng_states(rngs, dims)}
        outcome = _commit_gathered(
            root,
            plan,
            gathered,
            fmt,
            model_cfg=model_cfg,
            dims=dims,
            config=config,
            state=state,
            chunk_nbytes=chunk_nbytes,
        )
    outcome = json.loads(broadcast_text(json.dumps(outcome), group))
    if outcome["error"]:
        raise SaveNotCommitted(f"checkpoint step {plan.step} not committed: {outcome['error']}")
    crash_point("save.end")
    return int(outcome["nbytes"])


def _clear_step(root: Store, step: int) -> str:
    """Rank 0 of a save: delete ``step``'s directory when it exists, manifest first (see
    :func:`write_and_commit`). Returns ``""`` or what went wrong."""
    name = step_dir(step)
    try:
        if root.exists(name):
            log.warning(
                "%s exists: deleting it (manifest first) to save the step anew", root.url_of(name)
            )
            delete_step(root, name)
    except Exception as exc:  # the store failing: this save fails, on every rank
        return f"clearing {root.url_of(name)}: {type(exc).__name__}: {exc}"
    return ""


def _commit_gathered(
    root: Store,
    plan: WritePlan,
    gathered: list[dict[str, Any]],
    fmt: Any,
    *,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    config: dict[str, Any],
    state: dict[str, Any],
    chunk_nbytes: int,
) -> dict[str, Any]:
    """Rank 0 of a save: every rank's records into the manifest, validated and committed.
    Returns ``{"error": text or "", "nbytes": data bytes}`` (broadcast to every rank)."""
    errors = [g["error"] for g in gathered if g["error"]]
    if errors:
        return {"error": "; ".join(errors), "nbytes": 0}
    try:
        builder = ManifestBuilder(
            step=plan.step,
            dims=dims,
            model=model_cfg.to_json(),
            config=config,
            state=state,
            tensors={f: (s.shape, s.dtype) for f, s in plan.specs.items()},
            chunk_nbytes=chunk_nbytes,
            tensor_format=fmt.name,
        )
        fmt.add_records(builder, gathered, root.child(step_dir(plan.step)), plan.specs, dims)
        commit(root, builder.build())  # validates (schema, coverage) before writing
    except Exception as exc:
        log.debug("committing step %d failed", plan.step, exc_info=True)
        return {"error": f"commit: {type(exc).__name__}: {exc}", "nbytes": 0}
    return {"error": "", "nbytes": fmt.gathered_nbytes(gathered)}


def save_checkpoint(
    root: Store,
    step: int,
    tensors: dict[str, torch.Tensor],
    *,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    config: dict[str, Any],
    state: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    tensor_format: str = "safetensors",
    zarr_codec: str = "",
    rng: dict[str, Any] | None = None,
) -> SaveResult:
    """Write and commit one step synchronously. Called by every rank, in the same order.

    Args:
        root: checkpoint root store.
        step: optimizer step the state belongs to.
        tensors: this rank's local tensors by global FQN (see :func:`model_state_tensors`).
        model_cfg, dims: the model and layout (the plan decides who writes what).
        config, state: JSON-safe root config and non-tensor state (scheduler, data, counters).
        tensor_format: ``"safetensors"`` or ``"zarr"``; zarr_codec: zarr compression of ``optim.*``.
        rng: this rank's RNG entry (see :func:`write_and_commit`).

    Raises:
        SaveNotCommitted: any rank failed to write, or coverage did not validate; nothing is
            committed.
    """
    t0 = time.perf_counter()
    plan = plan_local_writes(step, tensors, model_cfg, dims, dist.get_rank(group))
    nbytes = write_and_commit(
        root,
        plan,
        model_cfg=model_cfg,
        dims=dims,
        config=config,
        state=state,
        group=group,
        chunk_nbytes=chunk_nbytes,
        tensor_format=tensor_format,
        zarr_codec=zarr_codec,
        rng=rng,
    )
    seconds = time.perf_counter() - t0
    return SaveResult(step, nbytes, seconds, seconds, seconds)


def load_into(
    step_store: Store,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    boxes: dict[str, Box],
    shapes: dict[str, tuple[int, ...]],
    *,
    strict: bool = True,
) -> ReadStats:
    """Fill this rank's local tensors from a checkpoint saved in any layout.

    Args:
        step_store: the step directory.
        manifest: its parsed manifest.
        tensors: FQN -> local tensor to overwrite in place (shape = its box's lengths).
        boxes: FQN -> global box each local tensor holds (from the sharding plan).
        shapes: FQN -> global shape the job expects.
        strict: a tensor missing from the checkpoint raises; else it is left as is.

    Raises:
        CheckpointError: a tensor is missing, or its global shape or dtype differs.
        IntegrityError: bytes read do not match their checksums.
    """
    stats = ReadStats()
    with torch.no_grad():
        read_boxes(
            step_store,
            manifest,
            load_requests(step_store, manifest, tensors, boxes, shapes, strict=strict),
            stats=stats,
        )  # coalesced, concurrent reads
    return stats


def load_requests(
    step_store: Store,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    boxes: dict[str, Box],
    shapes: dict[str, tuple[int, ...]],
    *,
    strict: bool = True,
) -> list[tuple[str, Box, torch.Tensor]]:
    """The ``(fqn, box, destination)`` reads that fill ``tensors`` (arguments as :func:`load_into`;
    destinations are the unpadded views), after checking each tensor against the checkpoint.
    Empty boxes and (``strict`` false) tensors the checkpoint lacks are left out.

    Raises:
        CheckpointError: a tensor is missing (``strict``), or its global shape or dtype differs.
    """
    requests: list[tuple[str, Box, torch.Tensor]] = []
    for fqn, box in boxes.items():
        rec = manifest.tensors.get(fqn)
        if rec is None:
            if strict:
                raise CheckpointError(f"{step_store.url}: checkpoint has no tensor {fqn!r}")
            continue
        dest = unpadded(tensors[fqn], box)
        if tuple(rec.shape) != tuple(shapes[fqn]):
            raise CheckpointError(
                f"{step_store.url}: {fqn} has global shape {tuple(rec.shape)} in the "
                f"checkpoint but {tuple(shapes[fqn])} in this model; check the "
                "model flags against `shardsmith inspect`"
            )
        if DTYPE_NAMES.get(dest.dtype) != rec.dtype:
            raise CheckpointError(
                f"{step_store.url}: {fqn} is {rec.dtype} in the checkpoint but "
                f"{dest.dtype} in the job"
            )
        if box.numel:
            requests.append((fqn, box, dest))
    return requests


def raise_agreed(failures: list[str]) -> None:
    """Raise on every rank when any rank's read failed (``failures``: every rank's, all-gathered:
    ``""`` or the error prefixed ``I`` for an integrity failure, ``C`` for another). An integrity
    failure wins, so every rank raises the same ``IntegrityError`` and can fall back alike.

    Raises:
        IntegrityError: some rank's data failed verification (the first such rank's message).
        CheckpointError: some rank's read failed otherwise (naming the rank).
    """
    bad = [(r, f) for r, f in enumerate(failures) if f]
    if not bad:
        return
    integrity = [(r, f) for r, f in bad if f[0] == "I"]
    rank, text = (integrity or bad)[0]
    if integrity:
        raise IntegrityError(text[1:])
    raise CheckpointError(f"rank {rank}: {text[1:]}")


def upcast_staging(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors saved in bf16/fp16 that fill fp32 ones (``--init-from`` a ``reshard --dtype bf16``
    copy): FQN -> a zeroed local tensor of the saved dtype, read in place of the fp32 one;
    :func:`finish_upcast` copies it over (exact: every bf16/fp16 value is an fp32 value)."""
    from shardsmith.trainer.checkpoint.run_checks import EXACT_UPCASTS

    out = {}
    for fqn, local in tensors.items():
        rec = manifest.tensors.get(fqn)
        if rec is not None and rec.dtype in EXACT_UPCASTS and local.dtype == torch.float32:
            out[fqn] = torch.zeros(local.shape, dtype=TORCH_DTYPES[rec.dtype], device=local.device)
    return out


def finish_upcast(
    staged: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], boxes: dict[str, Box]
) -> None:
    """Copy each staged tensor into its fp32 one (the unpadded part; see :func:`upcast_staging`)."""
    with torch.no_grad():
        for fqn, low in staged.items():
            unpadded(tensors[fqn], boxes[fqn]).copy_(unpadded(low, boxes[fqn]))
