"""``shardsmith train``'s data flags map onto DataConfig (no process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardsmith.cli.main import train, train_config
from shardsmith.errors import ConfigError

pytest.importorskip("tokenizers")

from tokenizer_factory import sample_text, train_hf_bpe  # noqa: E402


def _config(args: list[str]):
    return train_config(train.make_context("train", args).params, 1)


def test_blend_syntax_and_repeated_data_flags() -> None:
    cfg = _config(["--data", "0.7", "a.txt", "0.3", "b.bin", "--steps", "2", "--text-key", "body"])
    assert cfg.data.sources == ("a.txt", "b.bin") and cfg.data.weights == (0.7, 0.3)
    assert cfg.steps == 2 and cfg.data.text_key == "body" and cfg.model.vocab_size == 256
    cfg = _config(["--data", "a.txt", "--data-path", "b.txt", "c.txt", "--data-cache", "none"])
    assert cfg.data.sources == ("a.txt", "b.txt", "c.txt") and cfg.data.weights == ()
    assert cfg.data.cache_dir == "none"
    with pytest.raises(ConfigError, match="weight-path pairs"):
        _config(["--data", "0.7", "a.txt", "0.3"])


def test_vocab_size_from_tokenizer(tmp_path: Path) -> None:
    path = str(train_hf_bpe(tmp_path / "tokenizer.json", sample_text(), vocab_size=300))
    cfg = _config(["--tokenizer", path])
    assert cfg.model.vocab_size == 300 and cfg.data.tokenizer_kind == "hf"
    assert _config(["--tokenizer", path, "--vocab-size", "320"]).model.vocab_size == 320
    with pytest.raises(ConfigError, match="--vocab-size 256 is smaller"):
        _config(["--tokenizer", path, "--vocab-size", "256"])
