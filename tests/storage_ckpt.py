"""A model-shaped checkpoint written without processes, for storage and reshard tests.

:func:`save_offline` writes what a job in layout ``dims`` would save (same files, keys,
boxes, writer assignment from the sharding plan) using the storage API only: each
"rank"'s shard file via ``write_shard_file``, then ``commit`` (:func:`ckpt_factory.write_step`). The result loads with
``read_box`` and reshards with ``shardsmith.reshard.engine.reshard``.
"""

from __future__ import annotations

import torch

from ckpt_factory import write_step

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.plan import checkpoint_specs, shard_file_name, write_assignment
from shardsmith.layout.box import Box
from shardsmith.storage.commit import read_manifest
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import Manifest, now_iso
from shardsmith.storage.formats import read_box
from shardsmith.storage.tensor_files import TORCH_DTYPES

#: Small, but every layout used in the tests shards something (4 heads, 2 kv heads).
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                    ffn_hidden_size=64, vocab_size=256, seq_length=16)
#: Small checksum chunks so ranged reads hit several chunks per shard.
CHUNK_NBYTES = 256


def full_tensors(model: ModelConfig = MODEL, seed: int = 0, *,
                 with_optimizer: bool = False) -> dict[str, torch.Tensor]:
    """Random logical tensors of ``model`` by FQN: parameters, and with ``with_optimizer``
    the AdamW state too (3x the tensors, hence 3x the requests on S3)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    specs = checkpoint_specs(model, ParallelDims(), with_optimizer=with_optimizer)
    for fqn, spec in sorted(specs.items()):
        t = torch.randn(spec.shape, generator=g) if spec.shape else torch.tensor(float(seed + 3))
        out[fqn] = t.to(TORCH_DTYPES[spec.dtype])
    return out


def save_offline(root: Store, step: int, dims: ParallelDims, full: dict[str, torch.Tensor],
                 model: ModelConfig = MODEL) -> Manifest:
    """Write and commit ``full`` as step ``step`` under ``root`` in layout ``dims``.

    Raises whatever the store raises; on failure nothing is committed.
    """
    specs = checkpoint_specs(model, dims, with_optimizer=any(k.startswith("optim.") for k in full))
    files = {}
    for rank, items in sorted(write_assignment(specs, dims).items()):
        if items:
            files[shard_file_name(rank)] = {
                fqn: (full[fqn][box.relative_to(Box((0,) * len(box.lengths), specs[fqn].shape))], box)
                for fqn, box in items}
    return write_step(root, step, files, dims=dims, chunk_nbytes=CHUNK_NBYTES, model=model.to_json(),
                      tensors={fqn: (s.shape, s.dtype) for fqn, s in specs.items()}, created=now_iso())


def load_full(step_store: Store) -> dict[str, torch.Tensor]:
    """Every logical tensor of a committed step, read whole (checksum-verified ranged reads)."""
    manifest = read_manifest(step_store)
    return {fqn: read_box(step_store, manifest, fqn, Box((0,) * len(rec.shape), tuple(rec.shape)))
            for fqn, rec in manifest.tensors.items()}


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    """Same FQNs, dtypes, shapes and bits."""
    assert sorted(got) == sorted(want), f"{where}: FQNs differ: {sorted(set(got) ^ set(want))[:8]}"
    bad = [f for f in want if got[f].dtype != want[f].dtype or not torch.equal(got[f], want[f])]
    assert not bad, f"{where}: {len(bad)} tensors differ, e.g. {bad[:5]}"
