"""The one test checkpoint factory (no process group).

:func:`write_step` writes any step through the real storage API: each file streamed by
``write_shard_file`` (the trainer's writer) in safetensors order, the manifest assembled
by :class:`~shardsmith.storage.manifest.records.ManifestBuilder`, then ``commit``. Every test that
needs a checkpoint on disk builds it here:

* :func:`make_checkpoint` writes the tiny step the storage tests share: two shard files,
  tensors split across them, a 0-d tensor and a BF16 tensor, with a small checksum chunk
  so every shard has several chunks;
* :func:`save_in_layout` writes what a job in layout ``dims`` saves (same files, keys,
  boxes, writer assignment from the sharding plan). :func:`save_offline` (the storage
  tests' 2-layer :data:`MODEL`) and :func:`save_direct` (the reshard tests' 3-layer
  :data:`RESHARD_MODEL`, step :data:`RESHARD_STEP`) are its two presets. The result loads
  with ``read_box`` and reshards with ``shardsmith.reshard.api.reshard``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import torch

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.assignment import write_assignment
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import checkpoint_specs, shard_file_name
from shardsmith.storage.commit import commit, read_manifest, step_dir
from shardsmith.storage.formats.registry import read_box
from shardsmith.storage.formats.safetensors import file_order
from shardsmith.storage.formats.tensor_files import DTYPE_NAMES, TORCH_DTYPES, write_shard_file
from shardsmith.storage.manifest.records import Manifest, ManifestBuilder, now_iso
from shardsmith.storage.manifest.sidecar import write_sidecar
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.store.fs import Store

TINY_CHUNK_NBYTES = 16
FILE0, FILE1 = "shards/rank-00000.safetensors", "shards/rank-00001.safetensors"
DIMS = ParallelDims(dp_shard=2)


def memory_root() -> Store:
    """A fresh, empty ``memory://`` root."""
    return Store(f"memory://ckpt-{uuid.uuid4().hex[:12]}")


def tiny_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The logical tensors every :func:`make_checkpoint` step holds."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(6, 4, generator=g),  # rows split over the files
        "h": torch.randn(4, 4, generator=g).to(torch.bfloat16),  # columns split
        "b": torch.randn(5, generator=g),  # whole, in file 0
        "s": torch.tensor(float(seed) + 0.5),  # 0-d, in file 1
    }


def placement(full: dict[str, torch.Tensor]) -> dict[str, dict[str, tuple[torch.Tensor, Box]]]:
    """file -> fqn -> (local piece, box)."""
    w, h = full["w"], full["h"]
    return {
        FILE0: {
            "w": (w[:3], Box((0, 0), (3, 4))),
            "h": (h[:, :2], Box((0, 0), (4, 2))),
            "b": (full["b"], Box((0,), (5,))),
        },
        FILE1: {
            "w": (w[3:], Box((3, 0), (3, 4))),
            "h": (h[:, 2:], Box((0, 2), (4, 2))),
            "s": (full["s"], Box((), ())),
        },
    }


def write_step(
    root: Store,
    step: int,
    files: dict[str, dict[str, tuple[torch.Tensor, Box]]],
    *,
    dims: ParallelDims,
    chunk_nbytes: int,
    tensors: dict[str, tuple[tuple[int, ...], str]] | None = None,
    model: dict | None = None,
    config: dict | None = None,
    state: dict | None = None,
    created: str = "test",
    do_commit: bool = True,
    sidecars: bool = True,
) -> Manifest:
    """Write the data files of a step (file -> fqn -> (local tensor, global box)) and its
    manifest; commit it unless ``do_commit`` is false. ``tensors`` (fqn -> (global shape,
    dtype)) defaults to one whole-tensor shape per fqn taken from the boxes' ends."""
    if tensors is None:
        tensors = {}
        for local in files.values():
            for fqn, (t, box) in local.items():
                ends = tuple(o + n for o, n in zip(box.offsets, box.lengths))
                old = tensors.get(fqn, ((0,) * len(ends), ""))[0]
                tensors[fqn] = (tuple(max(a, b) for a, b in zip(old, ends)), DTYPE_NAMES[t.dtype])
    builder = ManifestBuilder(
        step=step,
        dims=dims,
        model=model or {},
        config=config or {},
        state={"step": step} if state is None else state,
        tensors=tensors,
        chunk_nbytes=chunk_nbytes,
        created=created,
    )
    step_store = root.child(step_dir(step))
    for name, local in files.items():
        entries = sorted(
            ((fqn, t.contiguous()) for fqn, (t, _) in local.items()),
            key=lambda e: file_order(e[0], DTYPE_NAMES[e[1].dtype]),
        )
        record, shards = write_shard_file(
            step_store, name, entries, chunk_nbytes, {fqn: box for fqn, (_, box) in local.items()}
        )
        builder.add_file(
            name,
            record,
            shards,
            sidecar=write_sidecar(step_store, name, shards) if sidecars else None,
        )
    manifest = builder.build()
    if do_commit:
        commit(root, manifest)
    return manifest


def build_manifest(
    root: Store,
    step: int,
    seed: int = 0,
    chunk_nbytes: int = TINY_CHUNK_NBYTES,
    sidecars: bool = True,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Write the data files of a step (not committed) and return its manifest."""
    full = tiny_tensors(seed)
    tensors = {fqn: (tuple(t.shape), DTYPE_NAMES[t.dtype]) for fqn, t in full.items()}
    manifest = write_step(
        root,
        step,
        placement(full),
        dims=DIMS,
        chunk_nbytes=chunk_nbytes,
        tensors=tensors,
        do_commit=False,
        sidecars=sidecars,
    )
    return manifest, full


def make_checkpoint(
    root: Store, step: int, seed: int = 0, chunk_nbytes: int = TINY_CHUNK_NBYTES
) -> dict[str, torch.Tensor]:
    """Write and commit one step; returns its logical tensors."""
    manifest, full = build_manifest(root, step, seed, chunk_nbytes)
    commit(root, manifest)
    return full


def flip_byte(store: Store, key: str, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of an object in place (``offset`` may be negative: from the end)."""
    data = bytearray(store.read(key))
    data[offset] ^= mask
    store.write(key, bytes(data))


def data_start(store: Store, key: str) -> int:
    """Offset of the data region of a safetensors file (8 + header length)."""
    return 8 + int.from_bytes(store.read_range(key, 0, 8), "little")


# ---- model-shaped checkpoints, as a job in a layout saves them ----------------------------

#: Small, but every layout used in the tests shards something (4 heads, 2 kv heads).
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)
#: Small checksum chunks so ranged reads hit several chunks per shard.
CHUNK_NBYTES = 256

#: The reshard tests' model: 3 layers (uneven over pp), a vocab of 61 (uneven over tp).
RESHARD_MODEL = ModelConfig(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=61,
    seq_length=16,
)
RESHARD_SRC_DIMS = ParallelDims(tp=2, pp=2)
RESHARD_STEP = 7
RESHARD_CHUNK = 64  # small checksum chunks: every shard has several


def box_slices(box: Box) -> tuple[slice, ...]:
    """Slices selecting ``box`` inside the whole tensor."""
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))


def full_tensors(
    model: ModelConfig = MODEL, seed: int = 0, *, with_optimizer: bool = False
) -> dict[str, torch.Tensor]:
    """Random logical tensors of ``model`` by FQN, in the plan's dtypes: parameters, and with
    ``with_optimizer`` the AdamW state too (3x the tensors, hence 3x the requests on S3)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    specs = checkpoint_specs(model, ParallelDims(), with_optimizer=with_optimizer)
    for fqn, spec in sorted(specs.items()):
        t = torch.randn(spec.shape, generator=g) if spec.shape else torch.tensor(float(seed + 3))
        out[fqn] = t.to(TORCH_DTYPES[spec.dtype])
    return out


def full_state(seed: int = 0, optim: bool = True) -> dict[str, torch.Tensor]:
    """Random FP32 logical tensors of :data:`RESHARD_MODEL` (params, AdamW state, 0-d step counters)."""
    g = torch.Generator().manual_seed(seed)
    specs = checkpoint_specs(RESHARD_MODEL, ParallelDims(), with_optimizer=optim)
    return {
        fqn: (torch.randn(s.shape, generator=g) if s.shape else torch.tensor(float(seed + 3)))
        for fqn, s in specs.items()
    }


def save_in_layout(
    root: Store,
    step: int,
    dims: ParallelDims,
    full: dict[str, torch.Tensor],
    *,
    model: ModelConfig,
    chunk_nbytes: int,
    config: dict | None = None,
    created: str = "test",
) -> Manifest:
    """Write and commit ``full`` as step ``step`` under ``root`` the way a job in layout
    ``dims`` saves it (write assignment, one file per writing rank, each tensor in the
    dtype of ``full``). Raises whatever the store raises; on failure nothing is committed."""
    with_optim = any(k.startswith("optim.") for k in full)
    specs = {
        fqn: dataclasses.replace(s, dtype=DTYPE_NAMES[full[fqn].dtype])
        for fqn, s in checkpoint_specs(model, dims, with_optimizer=with_optim).items()
    }
    files = {
        shard_file_name(rank): {fqn: (full[fqn][box_slices(b)], b) for fqn, b in items}
        for rank, items in sorted(write_assignment(specs, dims).items())
        if items
    }
    return write_step(
        root,
        step,
        files,
        dims=dims,
        chunk_nbytes=chunk_nbytes,
        model=model.to_json(),
        config=config,
        tensors={f: (s.shape, s.dtype) for f, s in specs.items()},
        created=created,
    )


def save_offline(
    root: Store,
    step: int,
    dims: ParallelDims,
    full: dict[str, torch.Tensor],
    model: ModelConfig = MODEL,
) -> Manifest:
    """:func:`save_in_layout` with the storage tests' chunk size and a real creation time."""
    return save_in_layout(
        root, step, dims, full, model=model, chunk_nbytes=CHUNK_NBYTES, created=now_iso()
    )


def save_direct(
    root: Store, full: dict[str, torch.Tensor], dims: ParallelDims, chunk: int = RESHARD_CHUNK
) -> Manifest:
    """:func:`save_in_layout` of :data:`RESHARD_MODEL` at :data:`RESHARD_STEP`: what a reshard
    to ``dims`` is compared with, byte for byte."""
    return save_in_layout(
        root,
        RESHARD_STEP,
        dims,
        full,
        model=RESHARD_MODEL,
        chunk_nbytes=chunk,
        config={"parallel": dims.to_json()},
    )


def manifest_json(m: Manifest) -> dict:
    """The manifest document (chunk CRCs by sidecar index, whether or not they were fetched),
    without its clock time and the run record a reshard adds (its parent)."""
    data = json.loads(dumps_manifest(m))
    for key in ("created", "head_nbytes"):
        data.pop(key)
    data["state"].pop("run", None)
    return data


def assert_same_as_direct_save(
    got_step: Store,
    want_root: Store,
    full: dict[str, torch.Tensor],
    dims: ParallelDims,
    chunk: int = RESHARD_CHUNK,
) -> Manifest:
    """Assert a resharded step has the manifest and the file bytes of ``full`` saved directly in
    layout ``dims`` (under ``want_root``); returns that direct save's manifest."""
    want = save_direct(want_root, full, dims, chunk=chunk)
    assert manifest_json(read_manifest(got_step)) == manifest_json(want)
    for name in want.files:
        assert got_step.read(name) == want_root.child(step_dir(RESHARD_STEP)).read(name), name
    return want


def load_full(step_store: Store) -> dict[str, torch.Tensor]:
    """Every logical tensor of a committed step, read whole (checksum-verified ranged reads)."""
    manifest = read_manifest(step_store)
    return {
        fqn: read_box(step_store, manifest, fqn, Box((0,) * len(rec.shape), tuple(rec.shape)))
        for fqn, rec in manifest.tensors.items()
    }


def assert_bitwise_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str
) -> None:
    """Same FQNs, dtypes, shapes and bits."""
    assert sorted(got) == sorted(want), f"{where}: FQNs differ: {sorted(set(got) ^ set(want))[:8]}"
    bad = [f for f in want if got[f].dtype != want[f].dtype or not torch.equal(got[f], want[f])]
    assert not bad, f"{where}: {len(bad)} tensors differ, e.g. {bad[:5]}"
