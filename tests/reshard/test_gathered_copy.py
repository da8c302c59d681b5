"""Gathered slabs (a tensor saved split on dim 1, e.g. row-parallel ``wo``/``w2`` merged to a
smaller TP) between local files: ``reshard/posix_copy.py: write_assembled_at`` maps the sources
once per slab and gathers, checksums and writes a few rows at a time, verifying each source
chunk once, just before its first use."""

from __future__ import annotations

from collections import Counter
from math import prod

import pytest
from ckpt_factory import RESHARD_SRC_DIMS as SRC_DIMS
from ckpt_factory import RESHARD_STEP as STEP
from ckpt_factory import assert_same_as_direct_save, full_state, save_direct

import shardsmith.reshard.engine as engine
import shardsmith.reshard.posix_copy as local_copy
from shardsmith.errors import IntegrityError
from shardsmith.layout import ParallelDims
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.reshard.api import reshard
from shardsmith.reshard.planner import ReshardOptions, plan_reshard
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint

SRC_CHUNK = 96  # not a multiple of the 64-byte half-rows: slab cuts split chunks
OPTIONS = ReshardOptions(chunk_nbytes=64, slab_nbytes=1 << 20, max_buffer_nbytes=1 << 22, workers=2)


def _spy(monkeypatch, unit_nbytes: int) -> tuple[list[int], list[tuple[str, int, int, int]]]:
    """Run the engine's gathers in ``unit_nbytes`` units; record each gather's units and every
    verified source range (file, shard byte offset, first chunk, bytes)."""
    units: list[int] = []
    verified: list[tuple[str, int, int, int]] = []
    real_gather, real_verify = local_copy.write_assembled_at, local_copy.verify_chunks

    def gather(*args, **kwargs):
        pieces = real_gather(*args, **kwargs, unit_nbytes=unit_nbytes)
        if pieces is not None:
            slab, entry = args[2], args[3]
            row = prod(slab.box.lengths[1:]) * DTYPE_NBYTES[entry.src_dtype]
            units.append(-(-slab.box.lengths[0] // max(1, unit_nbytes // row)))
        return pieces

    def verify(shard, first, views, chunk, url):
        verified.append((shard.file, shard.byte_offset, first, sum(len(v) for v in views)))
        return real_verify(shard, first, views, chunk, url)

    monkeypatch.setattr(engine, "write_assembled_at", gather)
    monkeypatch.setattr(local_copy, "verify_chunks", verify)
    return units, verified


def test_gathered_slabs_are_written_in_units_verifying_each_source_chunk_once(
    tmp_path, monkeypatch
) -> None:
    """tp2·pp2 -> tp1 with one slab per tensor and 200-byte units: every gathered slab takes
    several units, no source chunk is verified twice, every chunk of every read is verified,
    and the files and manifest equal a direct save in the target layout."""
    full = full_state(6)
    save_direct(Store(str(tmp_path / "src")), full, SRC_DIMS, chunk=SRC_CHUNK)
    step = Store(str(tmp_path / "src")).child(step_dir(STEP))
    units, verified = _spy(monkeypatch, unit_nbytes=200)
    reshard(step, str(tmp_path / "out"), ParallelDims(), options=OPTIONS)

    plan = plan_reshard(read_manifest(step), ParallelDims(), OPTIONS)
    gathered = [s for s in plan.slabs() if not s.zero_copy and len(s.pieces) > 1]
    assert (
        len(units) == len(gathered) > 0 and max(units) > 1
    )  # every gathered slab, in several units
    chunks = Counter(
        (f, off, c)
        for f, off, first, n in verified
        for c in range(first, first + -(-n // SRC_CHUNK))
    )
    assert chunks and max(chunks.values()) == 1  # no chunk verified twice
    wanted = {
        (p.shard.file, p.shard.byte_offset, c)
        for s in gathered
        for p in s.pieces
        for c in range(p.read_start // SRC_CHUNK, -(-p.read_end // SRC_CHUNK))
    }
    assert set(chunks) == wanted  # and none left unverified

    got = Store(str(tmp_path / "out")).child(step_dir(STEP))
    assert_same_as_direct_save(got, Store(str(tmp_path / "want")), full, ParallelDims(), 64)
    assert not verify_checkpoint(got).problems


def test_large_slabs_read_fewer_bytes_than_small_ones(tmp_path) -> None:
    """A gathered slab reads each source's rows once; the source chunks a slab boundary cuts
    are read twice, so fewer, larger slabs read fewer bytes (here: one slab per tensor reads
    exactly the bytes needed)."""
    save_direct(Store(str(tmp_path / "src")), full_state(7), SRC_DIMS, chunk=SRC_CHUNK)
    manifest = read_manifest(Store(str(tmp_path / "src")).child(step_dir(STEP)))

    def read_over_needed(slab_nbytes: int) -> float:
        plan = plan_reshard(
            manifest, ParallelDims(), ReshardOptions(chunk_nbytes=64, slab_nbytes=slab_nbytes)
        )
        slabs = [s for s in plan.slabs() if not s.zero_copy and len(s.pieces) > 1]
        return sum(p.read_nbytes for s in slabs for p in s.pieces) / sum(
            s.src_nbytes for s in slabs
        )

    assert read_over_needed(1 << 20) == 1.0
    assert read_over_needed(300) > 1.2


def test_a_corrupt_chunk_mid_slab_fails_naming_the_file_and_commits_nothing(
    tmp_path, monkeypatch
) -> None:
    """A flipped byte in the last rows of a row-parallel source shard: the gather has written
    earlier units when it meets the chunk; the reshard raises ``IntegrityError`` naming the
    file, and no target file or manifest appears."""
    root = Store(str(tmp_path / "src"))
    manifest = save_direct(root, full_state(8), SRC_DIMS, chunk=SRC_CHUNK)
    shard = manifest.tensors["layers.0.attention.wo.weight"].shards[1]
    path = tmp_path / "src" / step_dir(STEP) / shard.file
    raw = bytearray(path.read_bytes())
    raw[shard.byte_offset + shard.nbytes - 3] ^= 0x40
    path.write_bytes(bytes(raw))
    _spy(monkeypatch, unit_nbytes=200)
    with pytest.raises(IntegrityError, match=shard.file.replace(".", r"\.")):
        reshard(root.child(step_dir(STEP)), str(tmp_path / "out"), ParallelDims(), options=OPTIONS)
    assert not (tmp_path / "out" / step_dir(STEP) / "manifest.json").exists()
    assert not list((tmp_path / "out" / step_dir(STEP)).rglob("*.safetensors*"))
