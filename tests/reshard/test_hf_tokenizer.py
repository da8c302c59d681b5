"""The tokenizer travels with Hugging Face export and import (transformers loads it back)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hf_models import save_hf_llama
from tokenizer_factory import sample_text

from shardsmith.cli.main import cli
from shardsmith.storage.commit import read_manifest, resolve_checkpoint

TEXT = "def tokenize(text):\n    return [ord(c) for c in text]  # ids\n"


def _bpe(path: Path) -> Path:
    """A byte-level BPE of vocabulary 200 (fits the 256-row test model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        sample_text().split("\n\n"),
        trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"], show_progress=False),
    )
    tok.save(str(path))
    return path


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_tokenizer_is_recorded_on_import_and_copied_on_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    src = tmp_path / "hf"
    save_hf_llama(src, tied=False)
    raw = _bpe(src / "tokenizer.json").read_bytes()
    (src / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    out = _invoke("import-hf", str(src), str(tmp_path / "ck"))
    assert "tokenizer.json recorded (vocab 200)" in out
    data = read_manifest(resolve_checkpoint(str(tmp_path / "ck"))[1]).config["data"]
    assert (data["tokenizer_kind"], data["tokenizer_sha256"]) == (
        "hf",
        hashlib.sha256(raw).hexdigest(),
    )

    out = _invoke("export-hf", str(tmp_path / "ck"), str(tmp_path / "back"))
    assert "tokenizer: tokenizer.json, tokenizer_config.json" in out
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == raw
    assert (tmp_path / "back" / "tokenizer_config.json").read_text() == (
        src / "tokenizer_config.json"
    ).read_text()
    want = Tokenizer.from_str(raw.decode()).encode(TEXT, add_special_tokens=False).ids
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert (
        loaded.encode(TEXT, add_special_tokens=False) == want
        and loaded.eos_token == "<|endoftext|>"
    )

    # without a tokenizer_config.json next to it: one is written that adds no BOS/EOS, as trained
    (src / "tokenizer_config.json").unlink()
    _invoke("import-hf", str(src), str(tmp_path / "ck2"))
    _invoke("export-hf", str(tmp_path / "ck2"), str(tmp_path / "back2"))
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back2")).encode(TEXT) == want


def test_tokenizer_not_copied_is_said(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    save_hf_llama(src, tied=True)
    _bpe(src / "tokenizer.json")
    _invoke("import-hf", str(src), str(tmp_path / "ck"))
    (src / "tokenizer.json").write_text(
        (src / "tokenizer.json").read_text().replace("<|endoftext|>", "<|eot|>")
    )
    out = _invoke("export-hf", str(tmp_path / "ck"), str(tmp_path / "back"))
    assert "changed since training" in out and not (tmp_path / "back" / "tokenizer.json").exists()
    (src / "tokenizer.json").unlink()
    out = _invoke("export-hf", str(tmp_path / "ck"), str(tmp_path / "back2"))
    assert "not readable here" in out and "copy it into the export yourself" in out
    shutil.copytree(tmp_path / "back2", tmp_path / "plain")  # no tokenizer: a run that used bytes
    _invoke("import-hf", str(tmp_path / "plain"), str(tmp_path / "ck3"))
    out = _invoke("export-hf", str(tmp_path / "ck3"), str(tmp_path / "back3"))
    assert "byte tokenizer" in out and not (tmp_path / "back3" / "tokenizer_config.json").exists()


def test_tiktoken_file_is_copied_under_its_name(tmp_path: Path) -> None:
    from shardsmith.reshard.foreign.hf_tokenizer import copy_tokenizer
    from shardsmith.storage.store.fs import Store

    bpe = tmp_path / "cl100k_base.tiktoken"
    bpe.write_bytes(b"IQ== 0\nIg== 1\n")
    config = {
        "data": {
            "tokenizer": str(bpe),
            "tokenizer_kind": "tiktoken:cl100k",
            "tokenizer_sha256": hashlib.sha256(bpe.read_bytes()).hexdigest(),
        }
    }
    (tmp_path / "out").mkdir()
    copy = copy_tokenizer(config, Store(str(tmp_path / "out")))
    assert copy.files == ["cl100k_base.tiktoken"] and "transformers does not load it" in copy.note
    assert (tmp_path / "out" / "cl100k_base.tiktoken").read_bytes() == bpe.read_bytes()
