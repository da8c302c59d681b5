"""PyTorch DCP (torchtitan) checkpoints <-> shardsmith.

torchtitan saves with ``torch.distributed.checkpoint`` a flat state dict: the model's
parameters under their FQNs (torchtitan's Llama FQNs are ours: ``tok_embeddings.weight``,
``layers.{i}.attention.wq.weight`` ...), the optimizer flattened as
``get_flat_optim_state_dict`` / ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``
do, under ``optimizer.``: ``optimizer.state.<fqn>.{exp_avg,exp_avg_sq,step}`` and
``optimizer.param_groups.<fqn>.<hyperparameter>``; then ``train_state.{step,ntokens_seen}``,
``lr_scheduler.last_epoch`` and ``dataloader.*`` (torchtitan 0.3 ``checkpointer/dcp.py``,
``trainer.py``, ``components/optimizer/utils.py``).

Import maps parameters and AdamW moments/steps onto our FQNs, ``train_state.step`` onto the
step, ``ntokens_seen`` onto ``tokens_seen`` and ``lr_scheduler.last_epoch`` onto our LambdaLR
state (shardsmith recomputes the LR from it on resume, as torchtitan does); everything else
is dropped and listed in the report (hyperparameters come from the training flags; the data
position of another data loader has no meaning here).

Tied embeddings: a tied model's state dict names the shared matrix twice, so export writes
``output.weight`` too (a copy of ``tok_embeddings.weight``; no optimizer entry: one parameter),
and import takes an ``output.weight`` bitwise equal to ``tok_embeddings.weight`` and without
optimizer state of its own as that copy (absent ``output.weight`` also means tied).

Export writes those keys with ``torch.distributed.checkpoint`` itself (``FileSystemWriter``,
one file per tensor): the state dict handed to ``dcp.save`` holds zero-byte placeholders and
a planner that reads each tensor from the checkpoint only when DCP writes it, so peak memory
is one logical tensor. It also writes the model config as one JSON string item,
``shardsmith.model`` (:data:`MODEL_RECORD_KEY`), which ``dcp.load`` of a torchtitan state dict
never asks for and import reads instead of the model flags.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardsmith.errors import CheckpointError, ConfigError
from shardsmith.layout import Box, ModelConfig, ParallelDims, optim_fqn, param_specs
from shardsmith.reshard.foreign.common import (
    MODEL_RECORD_KEY,
    ImportReport,
    ModelHints,
    infer_model_config,
)
from shardsmith.reshard.foreign.dcp_reader import METADATA_NAME, DCPCheckpoint
from shardsmith.reshard.foreign.write import write_checkpoint
from shardsmith.storage import read_manifest, resolve_checkpoint
from shardsmith.storage.formats import read_box

#: AdamW state kinds: DCP name (after ``optimizer.state.<fqn>.``) -> our prefix.
OPTIM_KINDS = {
    "exp_avg": "optim.exp_avg.",
    "exp_avg_sq": "optim.exp_avg_sq.",
    "step": "optim.step.",
}


def _model_prefix(ck: DCPCheckpoint) -> str:
    for prefix in ("", "model."):
        if prefix + "tok_embeddings.weight" in ck.chunks:
            return prefix
    raise ConfigError(
        f"{ck.dir}: no tok_embeddings.weight (or model.tok_embeddings.weight); not a "
        "torchtitan Llama checkpoint"
    )


def _scalar(ck: DCPCheckpoint, key: str) -> int | None:
    """An integer saved as a bytes item (torchtitan >= 0.2) or a 0-d tensor (older)."""
    if key in ck.values:
        value = ck.read_value(key)
    elif key in ck.chunks and ck.shape(key) == ():
        value = ck.read(key, Box((), ())).item()
    else:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{ck.dir}: {key} is {value!r:.40}, expected an integer")
    return int(value)


_WHY = {
    "optimizer.param_groups": "hyperparameters come from the train flags",
    "dataloader": "another data loader's position: data restarts at sample 0",
}


def _dropped(keys: list[str]) -> list[str]:
    """``["optimizer.param_groups.* (99 entries; why)", ...]``: keys grouped by their first
    part (two for ``optimizer.*``)."""
    groups: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        head = parts[:2] if parts[0] == "optimizer" else parts[:1]
        group = ".".join(head) + ".*" if len(parts) > len(head) else key
        groups[group] = groups.get(group, 0) + 1
    out = []
    for group, n in sorted(groups.items()):
        why = next((f"; {w}" for p, w in _WHY.items() if group.startswith(p)), "")
        out.append(f"{group} ({n} entr{'y' if n == 1 else 'ies'}{why})")
    return out


def _source_map(ck: DCPCheckpoint, model: ModelConfig, prefix: str) -> tuple[dict[str, str], bool]:
    """Our FQN -> DCP key, and whether AdamW state is present (all of it, or refuse)."""
    names = {fqn: prefix + fqn for fqn in param_specs(model, ParallelDims())}
    optim = {
        ours + fqn: f"optimizer.state.{fqn}.{kind}"
        for fqn in list(names)
        for kind, ours in OPTIM_KINDS.items()
    }
    present = [k for k in optim.values() if k in ck.chunks]
    if present and len(present) != len(optim):
        missing = sorted(set(optim.values()) - set(present))
        raise ConfigError(
            f"{ck.dir}: optimizer state is partial ({len(missing)} of {len(optim)} "
            f"AdamW tensors missing, e.g. {missing[:3]}); only AdamW is supported"
        )
    return ({**names, **optim} if present else names), bool(present)


def _state(ck: DCPCheckpoint, step: int | None) -> tuple[dict[str, Any], set[str]]:
    """Our manifest state from torchtitan's train_state / lr_scheduler, and the keys used."""
    saved = _scalar(ck, "train_state.step")
    step = step if step is not None else (saved or 0)
    state: dict[str, Any] = {
        "step": step,
        "tokens_seen": _scalar(ck, "train_state.ntokens_seen") or 0,
        "data": {"sample_index": 0},
        "source": {"format": "dcp", "path": ck.dir, "step": saved},
    }
    last_epoch = _scalar(ck, "lr_scheduler.last_epoch")
    if last_epoch is not None:
        state["lr_scheduler"] = {
            "last_epoch": last_epoch,
            "_step_count": last_epoch + 1,
            "lr_lambdas": [None],
        }
    return state, {"train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch"}


def _recorded_model(ck: DCPCheckpoint) -> dict | None:
    """The model config ``export-dcp`` recorded (:data:`MODEL_RECORD_KEY`), or None."""
    if MODEL_RECORD_KEY not in ck.values:
        return None
    value = ck.read_value(MODEL_RECORD_KEY)
    try:
        record = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict):
        raise ConfigError(
            f"{ck.dir}: {MODEL_RECORD_KEY} is not a JSON model config; pass the model "
            "flags (--num-attention-heads ...) and remove the item, or re-export"
        )
    return record


def _tied_output(ck: DCPCheckpoint, prefix: str, rows_per_read: int = 4096) -> bool:
    """Whether ``output.weight`` is only the tied copy of ``tok_embeddings.weight`` a tied
    model's state dict also carries: same shape, bitwise equal (compared ``rows_per_read``
    rows at a time), and no optimizer state of its own (a tied parameter is one parameter)."""
    out, emb = prefix + "output.weight", prefix + "tok_embeddings.weight"
    if out not in ck.chunks or ck.shape(out) != ck.shape(emb):
        return False
    if any(k.startswith("optimizer.state.output.weight.") for k in ck.chunks):
        return False
    rows, cols = ck.shape(emb)
    for r in range(0, rows, rows_per_read):
        box = Box((r, 0), (min(rows_per_read, rows - r), cols))
        if not torch.equal(ck.read(out, box), ck.read(emb, box)):
            return False
    return True


def import_dcp(
    src_dir: str,
    ckpt_url: str,
    dims: ParallelDims,
    hints: ModelHints,
    *,
    step: int | None = None,
    make_config: Callable[[ModelConfig], dict] | None = None,
    storage_options: dict | None = None,
) -> ImportReport:
    """Write the torchtitan-style DCP checkpoint in ``src_dir`` as a shardsmith checkpoint.

    Tensors are stored in float32 whatever the source dtype. Each target box is read from
    only the DCP chunks it overlaps, only their needed rows.

    Args:
        src_dir: local DCP directory (``.metadata`` + ``*.distcp``).
        ckpt_url: target root or step directory.
        dims: target layout.
        hints: model fields the shapes do not tell.
        step: step to commit (default: ``train_state.step``, else 0).
        make_config: root config to record for the inferred model (default ``{"model", "parallel"}``).

    Raises:
        CheckpointNotFound / IntegrityError: not a readable DCP directory (see :class:`DCPCheckpoint`).
        ConfigError: the tensors are not a Llama shardsmith can represent (names the tensor).
        LayoutError / FileExistsError: as :func:`write_checkpoint`.
    """
    t0 = time.perf_counter()
    ck = DCPCheckpoint(src_dir)
    try:
        prefix = _model_prefix(ck)
        shapes = {
            k[len(prefix) :]: ck.shape(k)
            for k in ck.chunks
            if k.startswith(prefix) and not k.startswith("optimizer.")
        }
        hints = hints.completed(_recorded_model(ck), ck.dir)
        tied = _tied_output(ck, prefix)
        if tied:
            del shapes["output.weight"]
        model = infer_model_config(shapes, hints, ck.dir)
        source_of, with_optim = _source_map(ck, model, prefix)
        state, used = _state(ck, step)
        config = (
            make_config(model)
            if make_config
            else {"model": model.to_json(), "parallel": dims.to_json()}
        )
        written = write_checkpoint(
            ckpt_url,
            model,
            dims,
            lambda fqn, box: ck.read(source_of[fqn], box),
            state=state,
            config=config,
            with_optimizer=with_optim,
            storage_options=storage_options,
        )
    finally:
        ck.close()
    taken = (
        set(source_of.values())
        | used
        | {MODEL_RECORD_KEY}
        | ({prefix + "output.weight"} if tied else set())
    )
    rest = sorted(k for k in (*ck.chunks, *ck.values) if k not in taken)
    return ImportReport.of(
        written,
        source=ck.dir,
        model=model,
        with_optimizer=with_optim,
        started=t0,
        dropped=_dropped(rest)
        + (
            [
                "output.weight (equal to tok_embeddings.weight and without "
                "optimizer state of its own: imported as tied embeddings)"
            ]
            if tied
            else []
        ),
    )


# ---- export -------------------------------------------------------------------------------------


@dataclass
class DCPExportReport:
    """What :func:`export_dcp` wrote."""

    source: str
    out_dir: str
    step: int
    num_tensors: int
    with_optimizer: bool
    seconds: float = 0.0


def _param_groups(manifest_config: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """One AdamW param group's hyperparameters as torch 2.13 ``AdamW`` + ``LambdaLR`` hold them."""
    optim = manifest_config.get("optim", {})
    base_lr = float(optim.get("lr", 1e-3))
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW(
        [p],
        lr=base_lr,
        betas=(optim.get("beta1", 0.9), optim.get("beta2", 0.999)),
        eps=optim.get("eps", 1e-8),
        weight_decay=optim.get("weight_decay", 1e-2),
    )
    torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    last_lr = state.get("lr_scheduler", {}).get("_last_lr")
    if last_lr:
        group["lr"] = float(last_lr[0])
    return group


def _dcp_state_dict(
    manifest: Any, model: ModelConfig
) -> tuple[dict[str, Any], dict[str, str], bool]:
    """(state dict of placeholders and values, DCP key -> our FQN, with optimizer)."""
    fqns = list(param_specs(model, ParallelDims()))
    with_optim = all(optim_fqn("exp_avg", fqn) in manifest.tensors for fqn in fqns)
    ours = {fqn: fqn for fqn in fqns}
    if model.tie_embeddings:  # torchtitan's tied state dict names the shared weight twice
        ours["output.weight"] = "tok_embeddings.weight"
    optimizer: dict[str, Any] = {}
    if with_optim:
        group = _param_groups(manifest.config, manifest.state)
        for fqn in fqns:
            for kind, prefix in OPTIM_KINDS.items():
                ours[f"optimizer.state.{fqn}.{kind}"] = prefix + fqn
            optimizer.update({f"param_groups.{fqn}.{k}": v for k, v in group.items()})
    placeholders = {
        key: torch.empty((), dtype=torch.float32).expand(manifest.tensors[fqn].shape)
        for key, fqn in ours.items()
    }
    sd: dict[str, Any] = {k: v for k, v in placeholders.items() if not k.startswith("optimizer.")}
    if with_optim:
        optimizer.update(
            {
                k[len("optimizer.") :]: v
                for k, v in placeholders.items()
                if k.startswith("optimizer.")
            }
        )
        sd["optimizer"] = optimizer
    state = manifest.state
    sd["train_state"] = {
        "step": int(state.get("step", manifest.step)),
        "ntokens_seen": int(state.get("tokens_seen", 0)),
    }
    sd["lr_scheduler"] = {
        "last_epoch": int(state.get("lr_scheduler", {}).get("last_epoch", manifest.step))
    }
    sd[MODEL_RECORD_KEY] = json.dumps(model.to_json(), sort_keys=True)
    return sd, ours, with_optim


def save_one_process(state_dict: dict[str, Any], writer: Any, planner: Any) -> None:
    """``dcp.save`` in this one process, without its UserWarning that no process group is
    initialized (an export is one process by design; the warning read as a fault to users)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)


def lazy_planner(
    read: Callable[[str], torch.Tensor], lazy: set[str], *, flatten: bool = True
) -> Any:
    """A ``DefaultSavePlanner`` that asks ``read(key)`` for each key in ``lazy`` only when DCP
    writes it (the state dict holds zero-byte ``expand`` placeholders of the right shape)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        """Reads each tensor from the shardsmith checkpoint when DCP writes it."""

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.index.fqn in lazy:
                return read(write_item.index.fqn)
            return super().resolve_data(write_item)

    return LazySavePlanner(flatten_state_dict=flatten)


def export_dcp(
    ckpt_url: str, out_dir: str, *, overwrite: bool = False, storage_options: dict | None = None
) -> DCPExportReport:
    """Write checkpoint ``ckpt_url`` as a torchtitan-style DCP directory ``out_dir`` (float32).

    Raises:
        CheckpointNotFound / ManifestError / IntegrityError: bad source checkpoint.
        CheckpointError: a model tensor is missing or misshapen.
        FileExistsError: ``out_dir`` already holds ``.metadata`` and ``overwrite`` is false.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    _, step_store, step = resolve_checkpoint(ckpt_url, storage_options)
    manifest = read_manifest(step_store)
    model = ModelConfig.from_json(manifest.model)
    for fqn, spec in param_specs(model, ParallelDims()).items():
        rec = manifest.tensors.get(fqn)
        if rec is None or tuple(rec.shape) != spec.shape:
            raise CheckpointError(
                f"{step_store.url}: tensor {fqn} is missing or misshapen; the "
                "checkpoint is incomplete or not a shardsmith Llama"
            )
    if os.path.exists(os.path.join(out_dir, METADATA_NAME)) and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds a DCP checkpoint ({METADATA_NAME}); choose an "
            "empty directory or pass --overwrite"
        )
    sd, ours, with_optim = _dcp_state_dict(manifest, model)

    def read(key: str) -> torch.Tensor:
        shape = tuple(manifest.tensors[ours[key]].shape)
        return read_box(step_store, manifest, ours[key], Box((0,) * len(shape), shape)).to(
            torch.float32
        )

    os.makedirs(out_dir, exist_ok=True)
    writer = dcp.FileSystemWriter(
        out_dir, single_file_per_rank=False, thread_count=1, sync_files=False
    )
    save_one_process(sd, writer, lazy_planner(read, set(ours)))
    return DCPExportReport(
        source=step_store.url,
        out_dir=os.path.abspath(out_dir),
        step=step,
        num_tensors=len(ours),
        with_optimizer=with_optim,
        seconds=time.perf_counter() - t0,
    )
