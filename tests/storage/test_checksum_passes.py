"""The single-pass checksum pieces: CRC combine tables, chunk CRCs handed
over from a verified source, verify-and-split, mapped reads, and reshards across chunk sizes
that take those paths (compared byte for byte with a direct save)."""

from __future__ import annotations

import numpy as np
import pytest
from ckpt_factory import RESHARD_SRC_DIMS as SRC_DIMS
from ckpt_factory import RESHARD_STEP as STEP
from ckpt_factory import assert_same_as_direct_save, full_state, save_direct

from shardsmith.errors import IntegrityError
from shardsmith.layout import ParallelDims
from shardsmith.reshard.api import reshard
from shardsmith.reshard.planner import ReshardOptions, plan_reshard
from shardsmith.storage.checksum import (
    ChunkedCrc,
    chunk_crc32c,
    crc32c,
    crc32c_combine,
    crc32c_update,
    verify_chunks,
    verify_chunks_split,
)
from shardsmith.storage.commit import step_dir
from shardsmith.storage.formats.safetensors import write_stream
from shardsmith.storage.manifest.records import ShardRecord
from shardsmith.storage.store.fs import Store
from shardsmith.storage.store.posix import map_range
from shardsmith.storage.verify import verify_checkpoint


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_crc32c_backend_is_the_rfc3720_function() -> None:
    """Whichever library checksums (``crc32c-rs`` if installed, else ``crc32c``): the RFC 3720
    check values, and equal to the ``crc32c`` package on random lengths, offsets and seeds."""
    import crc32c as reference

    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA and crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4
    data = memoryview(_bytes(1 << 20, 7))
    rng = np.random.default_rng(3)
    for _ in range(300):
        start, n = (
            int(rng.integers(0, 1 << 19)),
            int(rng.choice([0, 1, 15, 64, 255, 4097, int(rng.integers(0, 1 << 19))])),
        )
        seed = int(rng.integers(0, 1 << 32))
        assert crc32c_update(data[start : start + n], seed) == reference.crc32c(
            data[start : start + n], seed
        )


def test_slabs_of_dim0_sharded_tensors_are_single_source_copies(tmp_path) -> None:
    """Slabs are cut at the source shards' rows: a tensor saved split on dim 0 (column-parallel
    TP, vocab-parallel embedding) is copied slab by slab from one read each, zero-copy; a tensor
    split on dim 1 (row-parallel ``wo``/``w2``) still needs assembling."""
    manifest = save_direct(Store(str(tmp_path / "src")), full_state(1), SRC_DIMS)
    plan = plan_reshard(manifest, ParallelDims(), ReshardOptions(slab_nbytes=1 << 20))
    entries = {e.fqn: e for f in plan.files for e in f.entries}
    for fqn in (
        "layers.0.attention.wq.weight",
        "layers.1.feed_forward.w1.weight",
        "tok_embeddings.weight",
    ):
        assert len(entries[fqn].slabs) == 2 and all(s.zero_copy for s in entries[fqn].slabs), fqn
    wo = entries["layers.0.attention.wo.weight"]
    assert len(wo.slabs) == 1 and not wo.slabs[0].zero_copy and len(wo.slabs[0].pieces) == 2


@pytest.mark.parametrize("n", [0, 1, 3, 8, 255, 4096, 262_144, 262_147])
def test_combine_equals_crc_of_concatenation(n: int) -> None:
    a, b = _bytes(37, 1), _bytes(n, 2)
    assert crc32c_combine(crc32c(a), crc32c(b), n) == crc32c(a + b)
    assert crc32c_combine(0, crc32c(b), n) == crc32c(b)  # empty prefix


def test_chunked_crc_uses_known_chunks_only_on_a_chunk_boundary() -> None:
    data = _bytes(1000)
    fed = ChunkedCrc(64)
    fed.update(data[:128], known=chunk_crc32c(data[:128], 64))  # on a boundary: taken as is
    fed.update(data[128:300], known=chunk_crc32c(data[128:300], 64))  # ends mid-chunk: carried on
    fed.update(data[300:500], known=[0xDEAD] * 4)  # mid-chunk: ignored, computed
    fed.update(data[500:])
    assert fed.finish() == chunk_crc32c(data, 64) and fed.nbytes == len(data)
    assert fed.extend_crc(crc32c(b"head")) == crc32c(b"head" + data)


def test_known_chunks_are_trusted_as_given() -> None:
    """The writer does not re-read bytes whose chunk CRCs it is handed: the caller (the reshard,
    from the source chunks it just verified) answers for them."""
    fed = ChunkedCrc(64)
    fed.update(_bytes(64), known=[7])
    assert fed.finish() == [7]


def _shard(data: bytes, chunk: int) -> ShardRecord:
    return ShardRecord(
        key="w",
        file="f",
        byte_offset=0,
        nbytes=len(data),
        offsets=[0],
        lengths=[len(data) // 4],
        crc32c=chunk_crc32c(data, chunk),
    )


@pytest.mark.parametrize("nbytes", [1024, 1000, 64 * 7 + 5])
def test_verify_split_returns_sub_chunk_crcs(nbytes: int) -> None:
    data = _bytes(nbytes)
    shard = _shard(data, 256)
    assert verify_chunks_split(shard, 0, data, 256, 64, "u") == chunk_crc32c(data, 64)
    assert verify_chunks_split(shard, 1, data[256:], 256, 64, "u") == chunk_crc32c(data[256:], 64)


def test_verify_split_refuses_what_verify_refuses() -> None:
    data = bytearray(_bytes(1000))
    shard = _shard(bytes(data), 256)
    data[700] ^= 0x10
    for check in (
        lambda: verify_chunks(shard, 0, [data], 256, "file:///x"),
        lambda: verify_chunks_split(shard, 0, data, 256, 64, "file:///x"),
    ):
        with pytest.raises(
            IntegrityError,
            match=r"file:///x: checksum mismatch in 'w' at bytes \[512, 768\) of the file",
        ):
            check()


def test_verify_chunks_over_scattered_views_of_any_cut() -> None:
    """The bytes in many views cut anywhere (row segments scattered over a destination, a view
    spanning several chunks, bytes, bytearrays, numpy arrays, non-byte memoryviews): verified
    from any first chunk; a flipped byte, bytes ending inside a chunk and bytes past the shard's
    end are refused, naming the byte range."""
    data = _bytes(1000)  # chunks of 256: the last is 232 bytes
    shard = _shard(data, 256)
    rng = np.random.default_rng(5)
    for _ in range(50):
        first = int(rng.integers(0, 4))
        cuts = sorted({int(x) for x in rng.integers(first * 256, 1000, int(rng.integers(0, 40)))})
        bounds = [first * 256, *cuts, 1000]
        kinds = [
            bytes,
            bytearray,
            lambda b: np.frombuffer(b, np.uint8),
            lambda b: memoryview(b),
            lambda b: (
                memoryview(b[: len(b) // 4 * 4]).cast("I") if len(b) % 4 == 0 else memoryview(b)
            ),
        ]
        views = [
            kinds[i % len(kinds)](data[a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        verify_chunks(shard, first, views, 256, "u")
        corrupt = bytearray(data)
        at = int(rng.integers(first * 256, 1000))
        corrupt[at] ^= 0x01
        lo = at // 256 * 256
        with pytest.raises(IntegrityError, match=rf"bytes \[{lo}, {min(lo + 256, 1000)}\)"):
            verify_chunks(
                shard,
                first,
                [memoryview(corrupt)[a:b] for a, b in zip(bounds, bounds[1:])],
                256,
                "u",
            )
    with pytest.raises(IntegrityError, match=r"bytes \[256, 356\)"):
        verify_chunks(shard, 1, [data[256:300], data[300:356]], 256, "u")  # ends inside chunk 1
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        verify_chunks(shard, 3, [data[768:], b"extra"], 256, "u")  # past the shard's end


def test_map_range_reads_local_bytes_and_stops_at_the_end(tmp_path) -> None:
    data = _bytes(3 * 65536 + 11)
    (tmp_path / "f").write_bytes(data)
    path = Store(str(tmp_path)).local_path("f")
    assert path is not None
    for start, n in [(0, 10), (5, 65536 * 2), (65536 * 3 - 1, 100), (len(data), 4)]:
        assert bytes(map_range(path, start, n)) == data[start : start + n]
    assert Store("memory://copy-passes").local_path("f") is None


def test_write_stream_checksums_and_refuses_out_of_order_entries(tmp_path) -> None:
    store = Store(str(tmp_path))
    a, b = _bytes(300, 1), _bytes(129, 2)
    record, crcs = write_stream(
        store, "f", b"HEAD", [(0, a[:100]), (0, a[100:], None), (1, b, chunk_crc32c(b, 64))], 2, 64
    )
    assert (tmp_path / "f").read_bytes() == b"HEAD" + a + b
    assert record.crc32c == crc32c(b"HEAD" + a + b) and crcs == [
        chunk_crc32c(a, 64),
        chunk_crc32c(b, 64),
    ]
    with pytest.raises(ValueError, match="entry 0 after entry 1"):
        write_stream(store, "g", b"", [(1, a), (0, b)], 2, 64)
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("src_chunk,dst_chunk", [(256, 64), (64, 256), (128, 128)])
def test_reshard_across_chunk_sizes_is_byte_identical(
    tmp_path, src_chunk: int, dst_chunk: int
) -> None:
    """A target chunk dividing the source's takes its CRCs from the verifying pass; any other
    computes them: the files and manifest equal a direct save in the target layout either way."""
    full = full_state(3)
    save_direct(Store(str(tmp_path / "src")), full, SRC_DIMS, chunk=src_chunk)
    step = Store(str(tmp_path / "src")).child(step_dir(STEP))
    for dims, slab in (
        (ParallelDims(), 512),
        (ParallelDims(tp=2), 1000),
        (ParallelDims(dp_shard=2, tp=2), 4096),
    ):
        out = tmp_path / f"out-{dims.describe()}"
        reshard(
            step,
            str(out),
            dims,
            options=ReshardOptions(
                chunk_nbytes=dst_chunk, slab_nbytes=slab, max_buffer_nbytes=8192, workers=2
            ),
        )
        got_step = Store(str(out)).child(step_dir(STEP))
        assert_same_as_direct_save(
            got_step, Store(str(tmp_path / f"want-{dims.describe()}")), full, dims, dst_chunk
        )
        assert not verify_checkpoint(got_step).problems


def test_reshard_from_local_to_another_backend_writes_the_mapped_bytes(tmp_path) -> None:
    """A local source's mapped, verified bytes streamed into ``memory://``: the same result
    as a direct save."""
    full = full_state(4)
    save_direct(Store(str(tmp_path / "src")), full, SRC_DIMS, chunk=128)
    step = Store(str(tmp_path / "src")).child(step_dir(STEP))
    dst = f"memory://copy-passes-{tmp_path.name}"
    reshard(step, dst, ParallelDims(), options=ReshardOptions(chunk_nbytes=64, workers=2))
    assert_same_as_direct_save(
        Store(dst).child(step_dir(STEP)), Store(str(tmp_path / "want")), full, ParallelDims(), 64
    )


def test_preallocate_allocates_up_front_and_names_a_full_disk(tmp_path, monkeypatch) -> None:
    import ctypes
    import errno
    import os

    from shardsmith.storage.store import posix

    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if not posix.preallocate(fd, 3 << 20, str(path)):
            pytest.skip("this filesystem has no fallocate")
        st = os.fstat(fd)
        assert (
            st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
        )  # blocks allocated, not a hole
        assert not posix.preallocate(fd, 0)

        def failing(code: int):
            def fallocate(*args) -> int:
                ctypes.set_errno(code)
                return -1

            return fallocate

        monkeypatch.setattr(posix, "_FALLOCATE", failing(errno.ENOSPC))
        with pytest.raises(OSError) as info:
            posix.preallocate(fd, 1 << 40, "/ckpt/step-1/rank-0.safetensors")
        assert info.value.errno == errno.ENOSPC
        assert "/ckpt/step-1/rank-0.safetensors" in str(info.value) and "free space" in str(
            info.value
        )
        monkeypatch.setattr(posix, "_FALLOCATE", failing(errno.EOPNOTSUPP))
        assert not posix.preallocate(fd, 1 << 20)  # unsupported: skipped
    finally:
        os.close(fd)


def test_write_parts_allocates_before_the_first_write_and_a_full_disk_loses_nothing(
    tmp_path, monkeypatch
) -> None:
    import ctypes
    import errno

    from shardsmith.storage.store import posix
    from shardsmith.storage.store.fs import Store

    seen: list[tuple[int, int]] = []
    real = posix.preallocate

    def spy(fd: int, nbytes: int, name: str = "") -> bool:
        seen.append(
            (nbytes, __import__("os").fstat(fd).st_size)
        )  # the size asked, bytes written so far
        return real(fd, nbytes, name)

    monkeypatch.setattr(posix, "preallocate", spy)
    store = Store(str(tmp_path))
    parts = [memoryview(b"a" * 1000), memoryview(bytes(range(256)) * 40)]
    store.write_parts("rank-7.safetensors", parts)
    assert seen == [(1000 + 10240, 0)]  # whole size, before any byte
    assert (tmp_path / "rank-7.safetensors").read_bytes() == b"a" * 1000 + bytes(range(256)) * 40

    def full(*args) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(posix, "preallocate", real)
    monkeypatch.setattr(posix, "_FALLOCATE", full)
    with pytest.raises(Exception) as info:
        store.write_parts("rank-7.safetensors", [memoryview(b"new" * 100)])
    assert "free space" in str(info.value) and "rank-7.safetensors" in str(info.value)
    assert (tmp_path / "rank-7.safetensors").read_bytes() == b"a" * 1000 + bytes(
        range(256)
    ) * 40  # the old object stays
    assert [p.name for p in tmp_path.iterdir()] == [
        "rank-7.safetensors"
    ]  # no temporary left behind


def test_write_parts_file_ends_where_the_written_bytes_end(tmp_path) -> None:
    """Sizes are read by index for the allocation; a sequence whose iteration yields fewer
    bytes than its indexing promised still gives a file of exactly the written bytes."""
    from shardsmith.storage.store.posix import write_parts

    class Shrinking(list):
        def __iter__(self):
            yield memoryview(b"x" * 40)

    write_parts(str(tmp_path / "f"), Shrinking([memoryview(b"y" * 100)]))
    assert (tmp_path / "f").read_bytes() == b"x" * 40
