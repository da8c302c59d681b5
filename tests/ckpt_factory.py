"""Small hand-built checkpoints for storage tests (no model, no process group).

:func:`make_checkpoint` writes one committed step through the real storage API
(``encode_and_record`` + ``commit``): two shard files, tensors split across them,
a 0-d tensor and a BF16 tensor, with a small checksum chunk so every shard has
several chunks.
"""

from __future__ import annotations

import uuid

import torch

from shardsmith.layout.box import Box
from shardsmith.storage.commit import commit, step_dir
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import FileRecord, Manifest, TensorRecord
from shardsmith.storage.tensor_files import DTYPE_NAMES, encode_and_record

CHUNK_NBYTES = 16
FILE0, FILE1 = "shards/rank-00000.safetensors", "shards/rank-00001.safetensors"
LAYOUT = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "pipeline_split": [], "world_size": 2}


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


def build_manifest(root: Store, step: int, seed: int = 0,
                   chunk_nbytes: int = CHUNK_NBYTES) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Write the data files of a step (not committed) and return its manifest."""
    full = full_tensors(seed)
    tensors = {fqn: TensorRecord(shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype]) for fqn, t in full.items()}
    files = {}
    step_store = root.child(step_dir(step))
    for name, local in placement(full).items():
        encoded, records = encode_and_record(local, name, chunk_nbytes)
        step_store.write(name, encoded.data)
        files[name] = FileRecord(encoded.record.nbytes, encoded.record.crc32c)
        for fqn, rec in records.items():
            tensors[fqn].shards.append(rec)
    manifest = Manifest(step=step, layout=dict(LAYOUT), model={}, config={}, state={"step": step},
                        tensors=tensors, files=files, chunk_nbytes=chunk_nbytes, created="test")
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
