"""Data sources beyond plain text: Megatron indexed datasets (a fixture written by
megatron-core's own builder), JSONL, Parquet, Hugging Face datasets, weighted blends; and
that global batches do not depend on the DP degree."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES

from shardsmith.errors import ConfigError
from shardsmith.trainer.data import (
    BlendedDataset,
    DataConfig,
    GlobalBatchSampler,
    TokenDataset,
    blending_table,
    build_dataset,
    load_tokens,
    parse_data_args,
)

sys.path.insert(0, str(FIXTURES))
from make_megatron_indexed import FIXTURES as MEGATRON  # noqa: E402
from make_megatron_indexed import documents

UINT16 = str(FIXTURES / "megatron" / "tiny_uint16_text_document")
INT32 = str(FIXTURES / "megatron" / "tiny_int32_text_document")
DOCS = ["first document", "second: ünïcode", "third\nwith lines"]


def _expected(name: str) -> np.ndarray:
    dtype, vocab_size, num_docs = MEGATRON[name]
    return np.concatenate(documents(vocab_size, num_docs)).astype(dtype)


def _global_batches(dataset, gb: int, dp: int, steps: int) -> list[torch.Tensor]:
    """Inputs of each global batch, assembled from the DP ranks' slices."""
    ranks = [
        GlobalBatchSampler(dataset, global_batch_size=gb, dp_degree=dp, dp_rank=r)
        for r in range(dp)
    ]
    return [torch.cat([s.next_local_batch()[0] for s in ranks]) for _ in range(steps)]


# --- Megatron indexed datasets --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_reads_megatron_builder_output(name: str) -> None:
    prefix = str(FIXTURES / "megatron" / name)
    want = _expected(name)
    for source in (prefix, prefix + ".bin", prefix + ".idx"):
        tokens = load_tokens(DataConfig(sources=(source,)))
        assert isinstance(tokens, np.memmap) and tokens.dtype == want.dtype
        np.testing.assert_array_equal(tokens, want)


def test_glob_over_indexed_datasets_takes_each_once(tmp_path: Path) -> None:
    for name in MEGATRON:
        for ext in (".bin", ".idx"):
            shutil.copy(FIXTURES / "megatron" / (name + ext), tmp_path / (name + ext))
    tokens = load_tokens(DataConfig(sources=(str(tmp_path / "tiny_*"),)))
    want = [_expected(n) for n in sorted(MEGATRON)]  # int32 sorts first
    np.testing.assert_array_equal(tokens, np.concatenate(want))


def _corrupt_copy(tmp_path: Path, mutate) -> str:
    for ext in (".bin", ".idx"):
        shutil.copy(UINT16 + ext, tmp_path / ("d" + ext))
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    (tmp_path / "d.idx").write_bytes(bytes(mutate(idx)))
    return str(tmp_path / "d")


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda b: b"NOTMMIDX" + b[8:], "no MMIDIDX header"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
        (lambda b: b[:17] + bytes([7]) + b[18:], "dtype code 7"),
        (lambda b: b[:-20], "truncated"),
        (lambda b: b[:34] + struct.pack("<i", 99) + b[38:], "do not tile the .bin"),
    ],
)
def test_malformed_index_is_refused(tmp_path: Path, mutate, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_tokens(DataConfig(sources=(_corrupt_copy(tmp_path, mutate),)))


def test_indexed_batches_are_independent_of_dp() -> None:
    cfg = DataConfig(sources=(UINT16,), seed=5)
    runs = {
        dp: _global_batches(build_dataset(cfg, 16, vocab_size=1000), 8, dp, steps=25)
        for dp in (1, 2, 4)
    }
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[2]))
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[4]))
    starts = {int(x) for batch in runs[1] for x in batch[:, 0]}
    assert starts <= set(_expected("tiny_uint16_text_document").tolist())
    with pytest.raises(ConfigError, match="needs vocab_size >= 1000, the model has 999"):
        build_dataset(cfg, 16, vocab_size=999)  # the fixture's largest id is 999


# --- JSONL, Parquet, Hugging Face -----------------------------------------------------------


def test_jsonl_rows_are_documents(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCS) + "\n")
    tokens = load_tokens(DataConfig(sources=(str(path),), text_key="content"))
    assert tokens.dtype == np.uint8 and tokens.tobytes() == "\n\n".join(DOCS).encode()
    with pytest.raises(
        ConfigError, match=r"d\.jsonl:1: no string field 'text' \(has \['content'\]\)"
    ):
        load_tokens(DataConfig(sources=(str(path),)))


def test_parquet_rows_are_documents(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": DOCS, "n": [1, 2, 3]}), tmp_path / "d.parquet", row_group_size=2
    )
    tokens = load_tokens(DataConfig(sources=(str(tmp_path / "d.parquet"),)))
    assert tokens.tobytes() == "\n\n".join(DOCS).encode()
    with pytest.raises(ConfigError, match=r"no column 'body'"):
        load_tokens(DataConfig(sources=(str(tmp_path / "d.parquet"),), text_key="body"))


def test_hf_datasets_from_disk_and_from_local_json(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    want = "\n\n".join(DOCS).encode()
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    assert load_tokens(DataConfig(sources=(str(tmp_path / "saved"),))).tobytes() == want
    assert load_tokens(DataConfig(sources=(f"hf:{tmp_path / 'saved'}",))).tobytes() == want
    datasets.DatasetDict({"valid": datasets.Dataset.from_dict({"text": DOCS[:1]})}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(ConfigError, match=r"no split 'train' \(has \['valid'\]\)"):
        load_tokens(DataConfig(sources=(str(tmp_path / "dict"),)))
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    for streaming in ("0", "1"):
        spec = f"hf:json?data_files={src}&streaming={streaming}"
        assert load_tokens(DataConfig(sources=(spec,), cache_dir="none")).tobytes() == want
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        load_tokens(DataConfig(sources=("hf:json?bogus=1",)))


# --- blends ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, sources, weights",
    [
        (("a", "b"), ("a", "b"), ()),
        (("0.7", "a", "0.3", "b"), ("a", "b"), (0.7, 0.3)),
        (("1", "x.bin"), ("x.bin",), (1.0,)),
    ],
)
def test_parse_data_args(values, sources, weights) -> None:
    assert parse_data_args(values) == (sources, weights)


@pytest.mark.parametrize(
    "values, needle",
    [
        (("0.7", "a", "0.3"), "weight-path pairs"),
        (("a", "0.3"), "looks like a blend weight"),
        (("0.5", "a", "b", "c"), "alternating"),
        (("0", "a", "1", "b"), "must be a number > 0"),
    ],
)
def test_parse_data_args_rejects(values, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_data_args(values)


def test_blending_table_follows_megatron_rule_and_weights() -> None:
    table, sample = blending_table([0.7, 0.3], size=10)
    # error w*max(i,1) - n: i=0: .7 vs .3 -> 0; i=1: -.3 vs .3 -> 1; i=2: .4 vs -.4 -> 0;
    # i=3: .1 vs -.1 -> 0; i=4: -.2 vs .2 -> 1; ... (worked by hand)
    assert table.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert sample.tolist() == [int((table[:i] == table[i]).sum()) for i in range(10)]
    big, _ = blending_table([2.0, 1.0, 1.0])
    assert np.bincount(big).tolist() == [8192, 4096, 4096]
    assert np.bincount(blending_table([1.0, 1e-6])[0]).tolist() == [16383, 1]  # Megatron's rule
    with pytest.raises(ConfigError, match="below 1/4"):
        blending_table([1.0] * 5, size=4)


def _two_text_sources(tmp_path: Path) -> tuple[str, str]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(bytes(range(65, 91)) * 40)  # A..Z: every sample of a is upper case
    b.write_bytes(bytes(range(97, 123)) * 25)  # a..z
    return str(a), str(b)


def test_blend_batches_are_independent_of_dp_and_weighted(tmp_path: Path) -> None:
    a, b = _two_text_sources(tmp_path)
    cfg = DataConfig(sources=(a, UINT16, b), weights=(0.5, 0.3, 0.2), seed=9)
    runs = {
        dp: _global_batches(build_dataset(cfg, 16, vocab_size=1000), 20, dp, steps=30)
        for dp in (1, 2, 4)
    }
    for dp in (2, 4):
        assert all(torch.equal(x, y) for x, y in zip(runs[1], runs[dp])), f"dp={dp} differs"
    first = torch.cat(runs[1])[:, 0]
    upper = ((first >= 65) & (first <= 90)).float().mean().item()
    lower = ((first >= 97) & (first <= 122)).float().mean().item()
    assert abs(upper - 0.5) < 0.02 and abs(lower - 0.2) < 0.02  # 600 samples, wraps epochs
    ds = build_dataset(cfg, 16, vocab_size=1000)
    assert isinstance(ds, BlendedDataset)
    one_by_one = torch.cat([ds.batch(i, 1)[0] for i in range(599, -1, -1)][::-1])
    assert torch.equal(one_by_one, torch.cat(runs[1]))  # random access = sequential


def test_blend_component_is_its_own_seeded_dataset(tmp_path: Path) -> None:
    a, b = _two_text_sources(tmp_path)
    blend = build_dataset(DataConfig(sources=(a, b), weights=(1, 1), seed=3), 8, vocab_size=256)
    alone = TokenDataset(load_tokens(DataConfig(sources=(a,))), 8, seed=3)
    dataset, sample = blend.locate(np.arange(40))
    assert dataset.tolist() == [0, 1] * 20 and sample.tolist() == sorted(list(range(20)) * 2)
    x, _ = blend.batch(0, 40)
    assert torch.equal(x[0::2], alone.batch(0, 20)[0])  # dataset 0 keeps the base seed
