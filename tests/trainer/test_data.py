"""Tests of shardsmith.trainer.data: sources, sample order, DP-independent batches, resume."""

from __future__ import annotations

import json
import uuid

import fsspec
import numpy as np
import pytest
import torch

from shardsmith.errors import ConfigError
from shardsmith.trainer.data import (
    DataConfig,
    GlobalBatchSampler,
    TokenDataset,
    load_tokens,
    stdlib_corpus,
    vocab_size_needed,
)


@pytest.fixture(scope="module")
def stdlib_tokens() -> np.ndarray:
    return load_tokens(DataConfig())


def _dataset(n: int = 1001, seq_length: int = 10, seed: int = 7) -> TokenDataset:
    tokens = np.arange(n, dtype=np.uint32) % 50_000  # token value = its position
    return TokenDataset(tokens, seq_length, seed)


def _sampler(ds: TokenDataset, gb: int, dp: int, rank: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(ds, global_batch_size=gb, dp_degree=dp, dp_rank=rank)


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"token_dtype": "int8"}, "'int8'"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**63}, "2**63"),
        ({"seed": True}, "seed=True"),
        ({"sources": "a.txt"}, "'a.txt'"),
        ({"sources": ("",)}, "''"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        DataConfig(**kwargs)


def test_config_sources_list_becomes_tuple() -> None:
    assert DataConfig(sources=["a", "b"]).sources == ("a", "b")  # type: ignore[arg-type]


# --- default corpus -------------------------------------------------------------------------


def test_stdlib_corpus_is_real_python_and_deterministic(stdlib_tokens: np.ndarray) -> None:
    assert stdlib_tokens.dtype == np.uint8 and stdlib_tokens.ndim == 1
    assert stdlib_tokens.size > 1_000_000
    raw = stdlib_tokens.tobytes()
    assert b"def " in raw and b"import " in raw and b"\n\n" in raw
    assert stdlib_corpus() == raw  # same bytes when found again
    assert vocab_size_needed(stdlib_tokens) == 256


# --- sources --------------------------------------------------------------------------------


def test_text_files_are_bytes_joined_in_order(tmp_path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b.txt").write_bytes(b"\xffworld")
    cfg = DataConfig(sources=(str(tmp_path / "b.txt"), str(tmp_path / "a.txt")))
    tokens = load_tokens(cfg)
    assert tokens.dtype == np.uint8
    assert tokens.tobytes() == b"\xffworld\n\nhello"  # source order kept, not sorted


def test_glob_expands_sorted(tmp_path) -> None:
    for name, body in [("c.txt", b"C"), ("a.txt", b"A"), ("b.txt", b"B"), ("z.md", b"Z")]:
        (tmp_path / name).write_bytes(body)
    tokens = load_tokens(DataConfig(sources=(str(tmp_path / "*.txt"),)))
    assert tokens.tobytes() == b"A\n\nB\n\nC"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_files_load_exactly(tmp_path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    high = 65_536 if dtype == "uint16" else 2**32
    a = rng.integers(0, high, size=333, dtype=np.uint64).astype(dtype)
    b = rng.integers(0, high, size=100, dtype=np.uint64).astype(dtype)
    a.tofile(tmp_path / "train_0.bin")
    b.tofile(tmp_path / "train_1.bin")
    one = load_tokens(DataConfig(sources=(str(tmp_path / "train_0.bin"),), token_dtype=dtype))
    assert one.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(one, a)
    both = load_tokens(DataConfig(sources=(str(tmp_path / "train_*.bin"),), token_dtype=dtype))
    np.testing.assert_array_equal(both, np.concatenate([a, b]))
    assert vocab_size_needed(both) == int(max(a.max(), b.max())) + 1


def test_bin_auto_is_uint16(tmp_path) -> None:
    np.array([1, 2, 65_535], dtype=np.uint16).tofile(tmp_path / "x.bin")
    tokens = load_tokens(DataConfig(sources=(str(tmp_path / "x.bin"),)))
    assert tokens.dtype == np.uint16 and tokens.tolist() == [1, 2, 65_535]
    assert vocab_size_needed(tokens) == 65_536


def test_bin_with_partial_token_is_rejected(tmp_path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="odd.bin"):
        load_tokens(DataConfig(sources=(str(tmp_path / "odd.bin"),)))


def test_memory_url_sources() -> None:
    root = f"memory://data-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/b.txt", b"second")
    fs.pipe(f"{root}/a.txt", b"first")
    fs.pipe(f"{root}/t.bin", np.array([5, 6, 7], dtype="<u4").tobytes())
    try:
        text = load_tokens(DataConfig(sources=(f"{root}/*.txt",)))
        assert text.tobytes() == b"first\n\nsecond"
        bin_tokens = load_tokens(DataConfig(sources=(f"{root}/t.bin",), token_dtype="uint32"))
        assert bin_tokens.dtype == np.uint32 and bin_tokens.tolist() == [5, 6, 7]
    finally:
        fs.rm(root.removeprefix("memory://"), recursive=True)


def test_missing_source_is_named(tmp_path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="nope.txt"):
        load_tokens(DataConfig(sources=(missing,)))
    with pytest.raises(ConfigError, match=r"nothing-\*\.bin"):
        load_tokens(DataConfig(sources=(str(tmp_path / "nothing-*.bin"),)))
    with pytest.raises(ConfigError, match="bogusproto://x"):
        load_tokens(DataConfig(sources=("bogusproto://x",)))


def test_directory_source_suggests_glob(tmp_path) -> None:
    with pytest.raises(ConfigError, match="directory"):
        load_tokens(DataConfig(sources=(str(tmp_path),)))


def test_mixed_text_and_bin_rejected(tmp_path) -> None:
    (tmp_path / "a.txt").write_bytes(b"text")
    np.zeros(4, dtype=np.uint16).tofile(tmp_path / "b.bin")
    with pytest.raises(ConfigError, match=r"mixes .*b\.bin.*a\.txt"):
        load_tokens(DataConfig(sources=(str(tmp_path / "a.txt"), str(tmp_path / "b.bin"))))


# --- dataset --------------------------------------------------------------------------------


def test_windows_are_consecutive_tokens_shifted_by_one() -> None:
    ds = _dataset(n=1001, seq_length=10)
    assert ds.num_samples == 100
    seen = set()
    for i in range(ds.num_samples):
        x, y = ds.get(i)
        assert x.dtype == torch.int64 and x.shape == (10,) and y.shape == (10,)
        start = int(x[0])
        assert start % 10 == 0
        torch.testing.assert_close(x, torch.arange(start, start + 10))
        torch.testing.assert_close(y, torch.arange(start + 1, start + 11))
        seen.add(start // 10)
    assert seen == set(range(100))  # one epoch is a permutation of all windows


def test_order_matches_torch_randperm_and_epochs_wrap() -> None:
    ds = _dataset(n=1001, seq_length=10, seed=7)
    for epoch in range(3):
        perm = torch.randperm(100, generator=torch.Generator().manual_seed(7 + epoch))
        x, _ = ds.batch(epoch * 100, 100)
        torch.testing.assert_close(x[:, 0], perm * 10, rtol=0, atol=0)
    # a batch spanning the epoch boundary equals the two pieces, in either cache order
    fresh = _dataset(n=1001, seq_length=10, seed=7)
    span, _ = fresh.batch(95, 10)
    torch.testing.assert_close(span, torch.cat([ds.batch(95, 5)[0], ds.batch(100, 5)[0]]))
    assert not torch.equal(ds.batch(0, 100)[0], ds.batch(100, 100)[0])


def test_seed_changes_order() -> None:
    a, _ = _dataset(seed=1).batch(0, 100)
    b, _ = _dataset(seed=2).batch(0, 100)
    assert not torch.equal(a, b)
    assert torch.equal(a.sort(dim=0).values, b.sort(dim=0).values)  # same windows


def test_corpus_shorter_than_one_sample() -> None:
    with pytest.raises(ConfigError, match="11 tokens.*seq_length\\+1=12"):
        TokenDataset(np.arange(11, dtype=np.uint16), seq_length=11, seed=0)
    assert TokenDataset(np.arange(12, dtype=np.uint16), seq_length=11, seed=0).num_samples == 1


def test_stdlib_batch_is_bytes(stdlib_tokens: np.ndarray) -> None:
    ds = TokenDataset(stdlib_tokens, seq_length=64, seed=0)
    x, y = ds.batch(10**9, 3)  # far-away epoch works
    assert x.shape == (3, 64) and int(x.max()) < 256
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


# --- sampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_dp_slices_concatenate_to_dp1_batch(dp: int) -> None:
    ds = _dataset(n=1001, seq_length=10)
    gb = 24
    single = _sampler(ds, gb, 1, 0)
    ranks = [_sampler(_dataset(n=1001, seq_length=10), gb, dp, r) for r in range(dp)]
    for _ in range(12):  # crosses epoch boundaries (100 samples per epoch)
        x1, y1 = single.next_local_batch()
        parts = [s.next_local_batch() for s in ranks]
        assert parts[0][0].shape == (gb // dp, 10)
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert {s.state_dict()["sample_index"] for s in ranks} == {single.sample_index} == {12 * gb}


def test_state_dict_round_trip_resumes_same_batch_across_dp() -> None:
    ds = _dataset()
    a = _sampler(ds, 8, 1, 0)
    for _ in range(5):
        a.next_local_batch()
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"sample_index": 40}
    expected, _ = a.next_local_batch()
    b = _sampler(_dataset(), 8, 1, 0)
    b.load_state_dict(state)
    assert torch.equal(b.next_local_batch()[0], expected)
    halves = [_sampler(_dataset(), 8, 2, r) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    assert torch.equal(torch.cat([h.next_local_batch()[0] for h in halves]), expected)


def test_skip_steps_equals_consuming() -> None:
    a, b = _sampler(_dataset(), 6, 2, 1), _sampler(_dataset(), 6, 2, 1)
    for _ in range(7):
        a.next_local_batch()
    b.skip_steps(7)
    assert a.state_dict() == b.state_dict() == {"sample_index": 42}
    assert torch.equal(a.next_local_batch()[0], b.next_local_batch()[0])


def test_sampler_rejects_bad_layout() -> None:
    ds = _dataset()
    with pytest.raises(ConfigError, match=r"global_batch_size=10 .*dp_degree=4.*\[1, 2, 5, 10\]"):
        _sampler(ds, 10, 4, 0)
    with pytest.raises(ConfigError, match="dp_rank=2"):
        _sampler(ds, 8, 2, 2)
    with pytest.raises(ConfigError, match="global_batch_size=0"):
        _sampler(ds, 0, 1, 0)


@pytest.mark.parametrize(
    "state", [{}, {"sample_index": -1}, {"sample_index": 1.0}, {"sample_index": 1, "x": 2}, [1]]
)
def test_load_state_dict_rejects_bad_state(state) -> None:
    s = _sampler(_dataset(), 8, 1, 0)
    with pytest.raises(ValueError, match="sample_index"):
        s.load_state_dict(state)
    assert s.sample_index == 0
