"""The one test checkpoint factory (no model, no process group).

:func:`write_step` writes any step through the real storage API: each file streamed by
``write_shard_file`` (the trainer's writer) in safetensors order, the manifest assembled
by :class:`~shardsmith.storage.manifest.ManifestBuilder`, then ``commit``. Every test and
bench that needs a checkpoint on disk builds it here (``storage_ckpt.save_offline`` for
model-shaped ones).

:func:`make_checkpoint` writes the tiny step the storage tests share: two shard files,
tensors split across them, a 0-d tensor and a BF16 tensor, with a small checksum chunk
so every shard has several chunks.
"""

from __future__ import annotations

import uuid

import torch

from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.storage.commit import commit, step_dir
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import Manifest, ManifestBuilder
from shardsmith.storage.safetensors import file_order
from shardsmith.storage.sidecar import write_sidecar
from shardsmith.storage.tensor_files import DTYPE_NAMES, write_shard_file

CHUNK_NBYTES = 16
FILE0, FILE1 = "shards/rank-00000.safetensors", "shards/rank-00001.safetensors"
DIMS = ParallelDims(dp_shard=2)


def memory_root() -> Store:
    """A fresh, empty ``memory://`` root."""
    return Store(f"memory://ckpt-{uuid.uuid4().hex[:12]}")


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The logical tensors every :func:`make_checkpoint` step holds."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(6, 4, generator=g),                          # rows split over the files
        "h": torch.randn(4, 4, generator=g).to(torch.bfloat16),       # columns split
        "b": torch.randn(5, generator=g),                             # whole, in file 0
        "s": torch.tensor(float(seed) + 0.5),                         # 0-d, in file 1
    }


def placement(full: dict[str, torch.Tensor]) -> dict[str, dict[str, tuple[torch.Tensor, Box]]]:
    """file -> fqn -> (local piece, box)."""
    w, h = full["w"], full["h"]
    return {
        FILE0: {"w": (w[:3], Box((0, 0), (3, 4))), "h": (h[:, :2], Box((0, 0), (4, 2))),
                "b": (full["b"], Box((0,), (5,)))},
        FILE1: {"w": (w[3:], Box((3, 0), (3, 4))), "h": (h[:, 2:], Box((0, 2), (4, 2))),
                "s": (full["s"], Box((), ()))},
    }


def write_step(root: Store, step: int, files: dict[str, dict[str, tuple[torch.Tensor, Box]]], *,
               dims: ParallelDims, chunk_nbytes: int, tensors: dict[str, tuple[tuple[int, ...], str]] | None = None,
               model: dict | None = None, config: dict | None = None, state: dict | None = None,
               created: str = "test", do_commit: bool = True, sidecars: bool = True) -> Manifest:
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
    builder = ManifestBuilder(step=step, dims=dims, model=model or {}, config=config or {},
                              state={"step": step} if state is None else state, tensors=tensors,
                              chunk_nbytes=chunk_nbytes, created=created)
    step_store = root.child(step_dir(step))
    for name, local in files.items():
        entries = sorted(((fqn, t.contiguous()) for fqn, (t, _) in local.items()),
                         key=lambda e: file_order(e[0], DTYPE_NAMES[e[1].dtype]))
        record, shards = write_shard_file(step_store, name, entries, chunk_nbytes,
                                          {fqn: box for fqn, (_, box) in local.items()})
        builder.add_file(name, record, shards, sidecar=write_sidecar(step_store, name, shards) if sidecars else None)
    manifest = builder.build()
    if do_commit:
        commit(root, manifest)
    return manifest


def build_manifest(root: Store, step: int, seed: int = 0, chunk_nbytes: int = CHUNK_NBYTES,
                   sidecars: bool = True) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Write the data files of a step (not committed) and return its manifest."""
    full = full_tensors(seed)
    tensors = {fqn: (tuple(t.shape), DTYPE_NAMES[t.dtype]) for fqn, t in full.items()}
    manifest = write_step(root, step, placement(full), dims=DIMS, chunk_nbytes=chunk_nbytes, tensors=tensors,
                          do_commit=False, sidecars=sidecars)
    return manifest, full


def make_checkpoint(root: Store, step: int, seed: int = 0,
                    chunk_nbytes: int = CHUNK_NBYTES) -> dict[str, torch.Tensor]:
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
