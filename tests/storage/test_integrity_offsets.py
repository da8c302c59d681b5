"""A damaged byte is reported at the same file offsets by a load (``IntegrityError``) and by
``verify``, so the two can be matched and the file repaired at the place named."""

from __future__ import annotations

import re

import pytest
from ckpt_factory import MODEL, full_tensors, save_offline

from shardsmith.errors import IntegrityError
from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.formats.registry import read_box
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint


def test_a_load_and_verify_name_the_same_file_bytes(tmp_path) -> None:
    root = Store(str(tmp_path / "r"))
    save_offline(root, 3, ParallelDims(dp_shard=2), full_tensors(MODEL, 3), MODEL)
    step = root.child(step_dir(3))
    manifest = read_manifest(step)
    fqn = "layers.1.feed_forward.w2.weight"
    shard = manifest.tensors[fqn].shards[0]
    assert shard.byte_offset > 0  # a file offset differs from the entry's
    path = tmp_path / "r" / step_dir(3) / shard.file
    data = bytearray(path.read_bytes())
    data[shard.byte_offset + shard.nbytes - 1] ^= 0x01  # the entry's last byte
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as exc:
        read_box(step, manifest, fqn, Box((0, 0), tuple(manifest.tensors[fqn].shape)))
    loaded = re.search(r"at bytes \[(\d+), (\d+)\) of the file", str(exc.value))
    problems = [p.what for p in verify_checkpoint(step).problems]
    verified = [re.search(r"first at bytes \[(\d+), (\d+)\)", p) for p in problems if fqn in p]
    assert loaded and verified and verified[0], (str(exc.value), problems)
    assert loaded.groups() == verified[0].groups()
    assert int(loaded.group(1)) <= shard.byte_offset + shard.nbytes - 1 < int(loaded.group(2))
