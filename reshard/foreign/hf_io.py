"""Streaming Hugging Face export and import of shardsmith checkpoints.

Export (:func:`export_hf`) writes a directory ``transformers`` loads with
``LlamaForCausalLM.from_pretrained``: ``config.json`` and the weights as safetensors,
split into ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``
when larger than the shard size (the layout ``transformers``' ``save_pretrained``
writes). Each file's safetensors header is computed up front from the manifest's
shapes, then the tensors are streamed into it one at a time: peak memory is one
logical tensor, whatever the model size.

Import (:func:`import_hf`) reads a local HF Llama directory lazily (``safe_open``
slices: only the rows each target box needs) and writes a model-only shardsmith
checkpoint in any layout, one target file at a time, committed like a save
(data first, manifest last, then ``latest``).

Name mapping, the q/k permutation and the config mapping are in :mod:`shardsmith.reshard.foreign.hf`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from safetensors import safe_open

from shardsmith.errors import CheckpointError, ConfigError
from shardsmith.layout import (
    DTYPE_CHOICES,
    DTYPES,
    Box,
    ModelConfig,
    ParallelDims,
    TensorSpec,
    param_specs,
)
from shardsmith.reshard.foreign.common import ImportReport
from shardsmith.reshard.foreign.hf import (
    EXPORT_DTYPE,
    EXPORT_MAX_SHARD_NBYTES,
    HF_IGNORED,
    expert_hf_names,
    from_hf_name,
    hf_config,
    model_config_from_hf,
    permute_from_hf,
    permute_to_hf,
    rope_heads,
    to_hf_name,
)
from shardsmith.reshard.foreign.hf_tokenizer import TokenizerCopy, copy_tokenizer
from shardsmith.reshard.foreign.write import write_checkpoint
from shardsmith.storage import DEFAULT_CHUNK_NBYTES, read_manifest, resolve_checkpoint
from shardsmith.storage.formats import DTYPE_NAMES, byte_view, encode_header, read_box, write_stream
from shardsmith.storage.manifest import Manifest, check_model_record
from shardsmith.storage.store import Store, sweep_stale_tmp

log = logging.getLogger(__name__)

#: Export dtypes: CLI name -> (torch dtype, config.json name), from the one dtype table.
EXPORT_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    cli: (getattr(torch, DTYPES[name].torch_name), DTYPES[name].torch_name)
    for cli, name in DTYPE_CHOICES.items()
}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_FILE_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


# ---- export -------------------------------------------------------------------------------------


@dataclass
class HFExportReport:
    """What :func:`export_hf` wrote: weight files, bytes (weights only), tensors, seconds."""

    source: str
    out_dir: str
    step: int
    files: list[str] = field(default_factory=list)
    nbytes: int = 0
    num_tensors: int = 0
    seconds: float = 0.0
    tokenizer: TokenizerCopy = field(default_factory=TokenizerCopy)


@dataclass(frozen=True)
class WeightEntry:
    """One exported tensor: HF name, our FQN, global shape (of the HF tensor), and for a
    Mixtral expert matrix the expert (row of our ``[E, ...]`` tensor; -1 otherwise)."""

    hf_name: str
    fqn: str
    shape: tuple[int, ...]
    expert: int = -1


def plan_weight_files(
    entries: list[WeightEntry], itemsize: int, max_nbytes: int
) -> list[list[WeightEntry]]:
    """Split tensors, in order, into files of at most ``max_nbytes`` data bytes each
    (a tensor larger than that gets a file of its own, as in ``save_pretrained``)."""
    files: list[list[WeightEntry]] = [[]]
    size = 0
    for e in entries:
        nbytes = prod(e.shape) * itemsize
        if files[-1] and size + nbytes > max_nbytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += nbytes
    return files


def _check_out_dir(out: Store, overwrite: bool) -> None:
    """Refuse a directory holding a whole model (``config.json``, written last, marks one);
    weight files without it are the leftovers of an interrupted export and are replaced."""
    existing = [n for n in out.list_dir() if n == "config.json" or _WEIGHT_FILE_RE.match(n)]
    if existing and "config.json" not in existing:
        log.warning(
            "%s holds %s but no config.json: leftovers of an interrupted export, replaced",
            out.url,
            ", ".join(existing),
        )
    elif existing and not overwrite:
        raise FileExistsError(
            f"{out.url} already holds a Hugging Face model ({', '.join(existing)}); "
            "choose an empty directory or pass --overwrite"
        )
    for name in existing:
        out.delete(name)


def _export_entries(manifest: Manifest, model: ModelConfig, source: str) -> list[WeightEntry]:
    entries = []
    for fqn, spec in param_specs(model, ParallelDims()).items():
        rec = manifest.tensors.get(fqn)
        if rec is None or tuple(rec.shape) != spec.shape:
            found = "missing" if rec is None else f"of shape {tuple(rec.shape)}"
            raise CheckpointError(
                f"{source}: tensor {fqn} is {found} but the model config needs "
                f"{spec.shape}; the checkpoint is incomplete or not a shardsmith Llama"
            )
        experts = expert_hf_names(fqn, model.num_experts)
        if experts is not None:
            entries += [WeightEntry(name, fqn, spec.shape[1:], e) for e, name in enumerate(experts)]
        else:
            entries.append(WeightEntry(to_hf_name(fqn), fqn, spec.shape))
    return entries


def _hf_tensor(
    step_store: Store,
    manifest: Manifest,
    entry: WeightEntry,
    model: ModelConfig,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One whole tensor read from the checkpoint, in HF row order and the export dtype."""
    if entry.expert >= 0:  # row ``expert`` of an [E, ...] expert tensor
        t = read_box(
            step_store,
            manifest,
            entry.fqn,
            Box((entry.expert,) + (0,) * len(entry.shape), (1,) + entry.shape),
        )[0]
    else:
        t = read_box(step_store, manifest, entry.fqn, Box((0,) * len(entry.shape), entry.shape))
    heads = rope_heads(entry.fqn, model)
    if heads is not None:
        t = permute_to_hf(t, heads)
    return t.to(dtype).contiguous()


def _write_weight_file(
    out: Store,
    name: str,
    entries: list[WeightEntry],
    step_store: Store,
    manifest: Manifest,
    model: ModelConfig,
    dtype: torch.dtype,
) -> int:
    """Write one HF weight file (entries in the given order, ``__metadata__: {format: pt}``),
    published atomically; returns its size in bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, _ = encode_header(
        [(e.hf_name, DTYPE_NAMES[dtype], e.shape, prod(e.shape) * itemsize) for e in entries],
        metadata={"format": "pt"},
    )
    data = (
        (i, byte_view(_hf_tensor(step_store, manifest, e, model, dtype)))
        for i, e in enumerate(entries)
    )
    record, _ = write_stream(
        out,
        name,
        header,
        data,
        len(entries),
        DEFAULT_CHUNK_NBYTES,
        len(header) + sum(prod(e.shape) * itemsize for e in entries),
    )
    return record.nbytes


def export_hf(
    ckpt_url: str,
    out_dir: str,
    *,
    dtype: str = EXPORT_DTYPE,
    max_shard_nbytes: int = EXPORT_MAX_SHARD_NBYTES,
    overwrite: bool = False,
    storage_options: dict | None = None,
) -> HFExportReport:
    """Write the model weights of a checkpoint as a ``transformers`` Llama directory.

    Optimizer state is not exported. Tied embeddings give ``tie_word_embeddings: true``
    and no ``lm_head.weight``. The run's tokenizer is copied along when it is still on this
    machine (:func:`shardsmith.reshard.foreign.hf_tokenizer.copy_tokenizer`; ``report.tokenizer``).

    Args:
        ckpt_url: a step directory, or a root (its newest committed step).
        out_dir: target directory (any fsspec URL; local for ``from_pretrained``).
        dtype: ``fp32``, ``bf16`` or ``fp16`` (see :data:`EXPORT_DTYPES`).
        max_shard_nbytes: largest weight file's data bytes before splitting into several
            files with an index.
        overwrite: replace an existing ``config.json`` / ``model*.safetensors*`` in ``out_dir``.
        storage_options: fsspec options for both URLs.

    Raises:
        CheckpointNotFound / ManifestError / IntegrityError: bad source checkpoint.
        CheckpointError: a model tensor is missing or misshapen.
        FileExistsError: ``out_dir`` already holds a model and ``overwrite`` is false.
        ValueError: unknown ``dtype``.
    """
    t0 = time.perf_counter()
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r}: use one of {sorted(EXPORT_DTYPES)}")
    torch_dtype, dtype_name = EXPORT_DTYPES[dtype]
    _, step_store, step = resolve_checkpoint(ckpt_url, storage_options)
    manifest = read_manifest(step_store)
    check_model_record(manifest, step_store.url)
    model = ModelConfig.from_json(manifest.model)
    entries = _export_entries(manifest, model, step_store.url)
    out = Store(out_dir, storage_options)
    if out.is_posix:
        out.fs.makedirs(out.root, exist_ok=True)
        sweep_stale_tmp(out.root)  # a killed export's hidden temporary files
    _check_out_dir(out, overwrite)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    groups = plan_weight_files(entries, itemsize, max_shard_nbytes)
    names = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)]
    )
    report = HFExportReport(
        source=step_store.url, out_dir=out.url, step=step, files=names, num_tensors=len(entries)
    )
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        report.nbytes += _write_weight_file(
            out, name, group, step_store, manifest, model, torch_dtype
        )
        weight_map.update({e.hf_name: name for e in group})
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(prod(e.shape) * itemsize for e in entries)},
            "weight_map": weight_map,
        }
        out.write(INDEX_FILE, json.dumps(index, indent=2).encode())
    report.tokenizer = copy_tokenizer(manifest.config, out)
    out.write("config.json", json.dumps(hf_config(model, dtype_name), indent=2).encode())
    report.seconds = time.perf_counter() - t0
    return report


# ---- import -------------------------------------------------------------------------------------


class HFSource:
    """A local Hugging Face model directory, read lazily (``safetensors.safe_open`` slices).

    Args:
        hf_dir: directory with ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` plus the files it names.

    Raises:
        FileNotFoundError: no config or no safetensors weights (pickled ``*.bin`` weights
            are refused: loading them can run code).
        ConfigError: an index that names files outside the directory, or invalid JSON.
    """

    def __init__(self, hf_dir: str) -> None:
        self.dir = hf_dir
        self.config = self._json("config.json")
        if os.path.exists(os.path.join(hf_dir, SINGLE_FILE)):
            with safe_open(os.path.join(hf_dir, SINGLE_FILE), framework="pt") as f:
                self.file_of = {k: SINGLE_FILE for k in f.keys()}
        elif os.path.exists(os.path.join(hf_dir, INDEX_FILE)):
            weight_map = self._json(INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{hf_dir}/{INDEX_FILE}: no weight_map object")
            for name, file in weight_map.items():
                if (
                    not isinstance(file, str)
                    or os.path.basename(file) != file
                    or file in ("", ".", "..")
                ):
                    raise ConfigError(
                        f"{hf_dir}/{INDEX_FILE}: {name} is in {file!r}, which is not a "
                        "file of this directory"
                    )
            self.file_of = dict(weight_map)
        else:
            raise FileNotFoundError(
                f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE}; shardsmith imports safetensors only "
                "(pickled pytorch_model.bin can run code: re-save it with save_pretrained)"
            )
        self._open: dict[str, Any] = {}

    def _json(self, name: str) -> dict[str, Any]:
        path = os.path.join(self.dir, name)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{path} does not exist; is {self.dir} a Hugging Face model directory?"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return data

    def _slice(self, name: str) -> Any:
        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.dir, file), framework="pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Global shape of tensor ``name``."""
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part ``index`` of tensor ``name`` (only those bytes are read)."""
        return self._slice(name)[index]


def read_model_config(hf_dir: str) -> ModelConfig:
    """Our :class:`ModelConfig` of the HF model in ``hf_dir`` (see :func:`model_config_from_hf`)."""
    return model_config_from_hf(HFSource(hf_dir).config, os.path.join(hf_dir, "config.json"))


def _match_tensors(
    src: HFSource, specs: dict[str, TensorSpec], model: ModelConfig
) -> dict[str, list[str]]:
    """Our FQN -> HF names (one, or one per expert for a Mixtral expert tensor) for every
    parameter; refuses missing, misshapen or unknown tensors."""
    names = {fqn: expert_hf_names(fqn, model.num_experts) or [to_hf_name(fqn)] for fqn in specs}
    wanted = {name: fqn for fqn, hf in names.items() for name in hf}
    for name in src.file_of:
        if (
            name in wanted
            or HF_IGNORED.match(name)
            or (model.tie_embeddings and name == "lm_head.weight")
        ):
            continue
        try:
            from_hf_name(name)
        except KeyError:
            raise ConfigError(
                f"{src.dir}: tensor {name} has no place in shardsmith's Llama (biases and "
                "extra modules are not supported); it was not imported"
            ) from None
        raise ConfigError(
            f"{src.dir}: tensor {name} is not part of the model its config.json describes"
        )
    for name, fqn in wanted.items():
        shape = (
            specs[fqn].shape[1:] if expert_hf_names(fqn, 1) else specs[fqn].shape
        )  # per-expert matrices
        if name not in src.file_of:
            raise ConfigError(f"{src.dir}: tensor {name} (for {fqn}) is missing")
        if src.shape(name) != shape:
            raise ConfigError(
                f"{src.dir}: tensor {name} has shape {src.shape(name)} but config.json "
                f"implies {shape}"
            )
    return names


def read_hf_box(
    src: HFSource, names: list[str], fqn: str, box: Box, model: ModelConfig
) -> torch.Tensor:
    """``box`` (our row order) of parameter ``fqn`` read from its HF tensors ``names``, as float32.

    For q/k projections the whole heads covering the box's rows are read and un-permuted
    (:func:`permute_from_hf`); a Mixtral expert tensor stacks the box's experts' matrices
    (``names[e]`` holds expert e); other tensors are read exactly.
    """
    index = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))
    if expert_hf_names(fqn, model.num_experts) is not None:
        experts = [
            src.read(names[e], index[1:])
            for e in range(box.offsets[0], box.offsets[0] + box.lengths[0])
        ]
        return (
            (torch.stack(experts) if experts else torch.empty(box.lengths))
            .to(torch.float32)
            .contiguous()
        )
    name = names[0]
    heads = rope_heads(fqn, model)
    if heads is None:
        return src.read(name, index).to(torch.float32).contiguous()
    hd = model.head_dim
    r0, r1 = box.offsets[0], box.offsets[0] + box.lengths[0]
    h0, h1 = r0 // hd, -(-r1 // hd)
    rows = src.read(name, (slice(h0 * hd, h1 * hd),) + index[1:])
    ours = permute_from_hf(rows, h1 - h0)[r0 - h0 * hd : r1 - h0 * hd]
    return ours.to(torch.float32).contiguous()


def import_hf(
    hf_dir: str,
    ckpt_url: str,
    dims: ParallelDims,
    *,
    step: int | None = None,
    config: dict[str, Any] | None = None,
    storage_options: dict | None = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
) -> ImportReport:
    """Write the HF Llama in ``hf_dir`` as a model-only shardsmith checkpoint in layout ``dims``.

    Tensors are stored in float32 (the trainer's master weights) whatever the source dtype.
    The manifest's state is ``{"step", "tokens_seen": 0, "data": {"sample_index": 0},
    "source"}``; it holds no optimizer state and no LR schedule, so a run starts from
    it with fresh optimizer state (``train --init-from``).

    Args:
        hf_dir: local directory (see :class:`HFSource`).
        ckpt_url: target root, or step directory ``.../step-NNNNNNNNN``.
        dims: target layout.
        step: step number to commit (default 0, or the one the target names).
        config: root training config to record (JSON); default ``{"model", "parallel"}``.

    Raises:
        ConfigError: the HF model is not one shardsmith can represent (names the field or tensor).
        LayoutError: ``dims`` does not divide the model.
        TargetCommitted (a FileExistsError): the target step is already committed.
        LayoutError: ``ckpt_url`` names a step other than ``step``.
    """
    t0 = time.perf_counter()
    src = HFSource(hf_dir)
    model = model_config_from_hf(src.config, os.path.join(hf_dir, "config.json"))
    specs = param_specs(model, dims)
    names = _match_tensors(src, specs, model)
    state = {
        "step": step,
        "tokens_seen": 0,
        "data": {"sample_index": 0},
        "source": {"format": "huggingface", "path": os.path.abspath(hf_dir)},
    }
    written = write_checkpoint(
        ckpt_url,
        model,
        dims,
        lambda fqn, box: read_hf_box(src, names[fqn], fqn, box, model),
        state=state,
        config=config or {"model": model.to_json(), "parallel": dims.to_json()},
        with_optimizer=False,
        step=step,
        storage_options=storage_options,
        chunk_nbytes=chunk_nbytes,
    )
    return ImportReport.of(written, source=hf_dir, model=model, with_optimizer=False, started=t0)
