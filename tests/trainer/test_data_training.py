"""Training steps on real tokenizers and datasets, in this process (1-rank gloo group):
a ``tokenizers`` BPE trained here over the default corpus, and a Megatron indexed dataset."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, TINY_MODEL, tiny_train_config
from tokenizer_factory import sample_text, train_hf_bpe

from shardsmith.layout import ParallelDims
from shardsmith.trainer.config import CheckpointConfig, DataConfig, TrainConfig
from shardsmith.trainer.data import TokenDataset, resolve_vocab_size, stdlib_corpus

#: These build a Trainer on an in-process gloo group and train: with the process-group tests.
pytestmark = pytest.mark.distributed

MEGATRON = FIXTURES / "megatron" / "tiny_uint16_text_document"


def _config(data: DataConfig) -> TrainConfig:
    base = tiny_train_config(ParallelDims(), "unused")
    model = dataclasses.replace(TINY_MODEL, vocab_size=resolve_vocab_size(data, None))
    return dataclasses.replace(
        base, model=model, data=data, steps=3, checkpoint=CheckpointConfig(async_save=False)
    )


def _train(cfg: TrainConfig, steps: int):
    from shardsmith.trainer.train import Trainer

    trainer = Trainer.create(cfg)
    return trainer, [trainer.train_step() for _ in range(steps)]


def test_bpe_tokenizer_over_default_corpus(gloo_group, tmp_path: Path, request) -> None:
    """The first run tokenizes the stdlib (~30 MB; tens of seconds) into the pytest cache;
    later runs memory-map it."""
    tokenizers = pytest.importorskip("tokenizers")
    path = train_hf_bpe(tmp_path / "tokenizer.json", sample_text(), vocab_size=400)
    cache = request.config.cache.mkdir("shardsmith-tokens")
    cfg = _config(DataConfig(tokenizer=str(path), cache_dir=str(cache)))
    assert cfg.model.vocab_size == 400
    trainer, metrics = _train(cfg, 3)
    dataset = trainer.state.sampler.dataset
    assert isinstance(dataset, TokenDataset) and dataset.tokens.dtype == np.uint16
    assert int(np.max(dataset.tokens[:1_000_000])) < 400
    tok = tokenizers.Tokenizer.from_file(str(path))
    text = tok.decode(dataset.batch(0, 1)[0][0].tolist(), skip_special_tokens=True)
    assert (
        len(text) > cfg.model.seq_length and text.encode() in stdlib_corpus()
    )  # BPE: > 1 char/token
    assert abs(metrics[0].loss - math.log(400)) < 0.5  # ids cover the 400-token vocab
    assert all(math.isfinite(m.loss) for m in metrics) and metrics[-1].loss < metrics[0].loss


def test_megatron_indexed_dataset(gloo_group) -> None:
    cfg = _config(DataConfig(sources=(str(MEGATRON),)))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=1000))
    trainer, metrics = _train(cfg, 3)
    inputs, _ = trainer.state.sampler.dataset.batch(0, 8)
    bin_tokens = np.fromfile(str(MEGATRON) + ".bin", dtype=np.uint16).astype(np.int64)
    for row in inputs.numpy():  # every sample is a window of the .bin
        starts = np.flatnonzero(bin_tokens == row[0])
        assert any(np.array_equal(bin_tokens[s : s + len(row)], row) for s in starts)
    assert all(abs(m.loss - math.log(1000)) < 0.5 for m in metrics)  # pseudo-random ids: no fall
