"""Tokenizers (Hugging Face ``tokenizers``, tiktoken), their identity in the config, the
resume check that refuses another tokenizer, and the token cache. Real libraries, trained here."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardsmith.errors import ConfigError
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.data import (
    DataConfig,
    check_same_tokenizer,
    load_tokens,
    resolve_vocab_size,
    tokenizer_identity,
)
from shardsmith.trainer.data.cache import cache_key

tokenizers = pytest.importorskip("tokenizers")
tiktoken = pytest.importorskip("tiktoken")

from tokenizer_factory import sample_text, train_hf_bpe, train_tiktoken  # noqa: E402


@pytest.fixture(scope="module")
def text() -> str:
    return sample_text()


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory: pytest.TempPathFactory, text: str) -> Path:
    return train_hf_bpe(tmp_path_factory.mktemp("hf") / "tokenizer.json", text, vocab_size=400)


@pytest.fixture(scope="module")
def tiktoken_path(tmp_path_factory: pytest.TempPathFactory, text: str) -> Path:
    return train_tiktoken(
        tmp_path_factory.mktemp("tt") / "tiny.tiktoken", text[:8000], vocab_size=300
    )


def _jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


DOCS = ["def f(x):\n    return x + 1\n", "import os\n\nprint(os.getcwd())", "héllo wörld ✓"]


# --- identity -------------------------------------------------------------------------------


def test_hf_identity_is_kind_sha_and_vocab(hf_path: Path) -> None:
    cfg = DataConfig(tokenizer=str(hf_path))
    want = {
        "kind": "hf",
        "sha256": hashlib.sha256(hf_path.read_bytes()).hexdigest(),
        "vocab_size": 400,
        "path": str(hf_path),
    }
    assert tokenizer_identity(cfg) == want
    by_dir = DataConfig(tokenizer=str(hf_path.parent))  # a directory holding tokenizer.json
    assert {k: v for k, v in tokenizer_identity(by_dir).items() if k != "path"} == {
        k: v for k, v in want.items() if k != "path"
    }


def test_tiktoken_identity(tiktoken_path: Path) -> None:
    ident = tokenizer_identity(DataConfig(tokenizer=str(tiktoken_path)))
    assert ident["kind"] == "tiktoken:cl100k"
    assert ident["vocab_size"] == 301  # 300 ranks + <|endoftext|> after the largest
    assert ident["sha256"] == hashlib.sha256(tiktoken_path.read_bytes()).hexdigest()
    o200k = tiktoken_path.with_name("o200k_mine.tiktoken")
    shutil.copy(tiktoken_path, o200k)
    assert tokenizer_identity(DataConfig(tokenizer=str(o200k)))["kind"] == "tiktoken:o200k"


def test_default_is_bytes_and_old_configs_read_as_bytes() -> None:
    bytes_ident = {"kind": "bytes", "sha256": "", "vocab_size": 256, "path": ""}
    assert tokenizer_identity(DataConfig()) == bytes_ident
    old_manifest_config = {"data": {"sources": [], "token_dtype": "auto", "seed": 1}}
    assert tokenizer_identity(old_manifest_config) == bytes_ident
    assert (
        TrainConfig.from_json(
            {**TrainConfig().to_json(), "data": old_manifest_config["data"]}
        ).data.tokenizer_kind
        == "bytes"
    )


def test_identity_survives_the_manifest_without_the_file(tmp_path: Path, hf_path: Path) -> None:
    local = tmp_path / "tokenizer.json"
    shutil.copy(hf_path, local)
    saved = json.loads(json.dumps(TrainConfig(data=DataConfig(tokenizer=str(local))).to_json()))
    local.unlink()  # e.g. `shardsmith inspect` on another machine
    back = TrainConfig.from_json(saved)
    assert tokenizer_identity(back) == tokenizer_identity(saved)
    assert back.data.tokenizer_vocab_size == 400


@pytest.mark.parametrize(
    "bad, needle", [("nope.json", "no such file"), ("x.model", "unknown kind")]
)
def test_bad_tokenizer_path(tmp_path: Path, bad: str, needle: str) -> None:
    if bad.endswith(".model"):
        (tmp_path / bad).write_bytes(b"x")
    with pytest.raises(ConfigError, match=needle):
        DataConfig(tokenizer=str(tmp_path / bad))
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match="without tokenizer.json"):
        DataConfig(tokenizer=str(tmp_path / "dir"))


# --- the resume check -----------------------------------------------------------------------


def test_check_same_tokenizer_accepts_the_same_file_anywhere(tmp_path: Path, hf_path: Path) -> None:
    saved = TrainConfig(data=DataConfig(tokenizer=str(hf_path))).to_json()
    moved = tmp_path / "elsewhere.json"
    shutil.copy(hf_path, moved)
    check_same_tokenizer(saved, TrainConfig(data=DataConfig(tokenizer=str(moved))))
    check_same_tokenizer(TrainConfig().to_json(), TrainConfig())  # bytes and bytes


def test_check_same_tokenizer_refuses_another(tmp_path: Path, hf_path: Path, text: str) -> None:
    other = train_hf_bpe(tmp_path / "other.json", text, vocab_size=300)
    saved = TrainConfig(data=DataConfig(tokenizer=str(hf_path))).to_json()
    sha_saved = hashlib.sha256(hf_path.read_bytes()).hexdigest()[:16]
    sha_job = hashlib.sha256(other.read_bytes()).hexdigest()[:16]
    with pytest.raises(
        ConfigError,
        match=rf"trained with tokenizer {hf_path} \(hf, sha256 {sha_saved}.*"
        rf"this job uses {other} \(hf, sha256 {sha_job}.*"
        rf"pass the same --tokenizer {hf_path} or start a new run "
        "with --init-from",
    ):
        check_same_tokenizer(saved, TrainConfig(data=DataConfig(tokenizer=str(other))))
    with pytest.raises(ConfigError, match=r"this job uses bytes \(no --tokenizer\)"):
        check_same_tokenizer(saved, DataConfig())
    with pytest.raises(
        ConfigError, match=r"trained with tokenizer bytes .*--tokenizer \(none: bytes\)"
    ):
        check_same_tokenizer(TrainConfig().to_json(), DataConfig(tokenizer=str(hf_path)))


def test_vocab_size_comes_from_the_tokenizer(hf_path: Path) -> None:
    cfg = DataConfig(tokenizer=str(hf_path))
    assert resolve_vocab_size(cfg, None) == 400
    assert resolve_vocab_size(cfg, 512) == 512
    with pytest.raises(ConfigError, match=r"--vocab-size 399 is smaller than .*\(400\)"):
        resolve_vocab_size(cfg, 399)
    assert resolve_vocab_size(DataConfig(), None) == 256


# --- tokenizing -----------------------------------------------------------------------------


def test_hf_tokens_are_the_library_encoding_joined_by_eot(tmp_path: Path, hf_path: Path) -> None:
    src = _jsonl(tmp_path / "docs.jsonl", DOCS)
    tokens = load_tokens(DataConfig(sources=(str(src),), tokenizer=str(hf_path), cache_dir="none"))
    tok = tokenizers.Tokenizer.from_file(str(hf_path))
    eot = tok.token_to_id("<|endoftext|>")
    want = []
    for i, doc in enumerate(DOCS):
        want += ([eot] if i else []) + tok.encode(doc, add_special_tokens=False).ids
    assert tokens.dtype == np.uint16 and tokens.tolist() == want
    assert tok.decode(tokens.tolist(), skip_special_tokens=True) == "".join(DOCS)


def test_tiktoken_tokens_are_the_library_encoding(tmp_path: Path, tiktoken_path: Path) -> None:
    from tiktoken.load import load_tiktoken_bpe

    from shardsmith.trainer.data.tokenizer import CL100K_PATTERN

    src = _jsonl(tmp_path / "docs.jsonl", DOCS, key="body")
    tokens = load_tokens(
        DataConfig(
            sources=(str(src),), tokenizer=str(tiktoken_path), text_key="body", cache_dir="none"
        )
    )
    ranks = load_tiktoken_bpe(str(tiktoken_path))
    enc = tiktoken.Encoding(
        "t", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 300}
    )
    want = enc.encode("<|endoftext|>".join(DOCS), allowed_special="all")
    assert tokens.tolist() == want
    assert enc.decode(tokens.tolist()) == "<|endoftext|>".join(DOCS)


def test_changed_tokenizer_file_is_refused(tmp_path: Path, hf_path: Path, text: str) -> None:
    path = tmp_path / "tokenizer.json"
    shutil.copy(hf_path, path)
    cfg = DataConfig(
        sources=(str(_jsonl(tmp_path / "d.jsonl", DOCS)),), tokenizer=str(path), cache_dir="none"
    )
    train_hf_bpe(path, text, vocab_size=300)
    with pytest.raises(ConfigError, match="is now hf sha256 .* but the config recorded"):
        load_tokens(cfg)


def test_cache_is_keyed_by_corpus_and_tokenizer(
    tmp_path: Path, hf_path: Path, tiktoken_path: Path
) -> None:
    src = _jsonl(tmp_path / "docs.jsonl", DOCS)
    cache = tmp_path / "cache"
    cfg = DataConfig(sources=(str(src),), tokenizer=str(hf_path), cache_dir=str(cache))
    first = load_tokens(cfg)
    assert len(list(cache.glob("*.tokens"))) == 1
    again = load_tokens(cfg)
    assert isinstance(again, np.memmap) and np.array_equal(again, first)
    uncached = load_tokens(
        DataConfig(sources=(str(src),), tokenizer=str(hf_path), cache_dir="none")
    )
    assert np.array_equal(uncached, first)
    load_tokens(DataConfig(sources=(str(src),), tokenizer=str(tiktoken_path), cache_dir=str(cache)))
    _jsonl(src, DOCS[::-1])  # same file name, new content: a new entry, not a stale hit
    changed = load_tokens(cfg)
    assert len(list(cache.glob("*.tokens"))) == 3 and not np.array_equal(changed, first)
    assert cache_key({"a": 1}) != cache_key({"a": 2})


def test_concurrent_starts_tokenize_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local ranks ask for the same entry at once: one builds, the other waits, then both
    read it. (Threads: each opens the lock file itself, and flock locks of separate opens
    exclude each other as between processes.) The builder holds the lock until the other
    rank has found it taken, so the wait path is exercised on every run."""
    import fcntl
    import threading

    from shardsmith.trainer.data.cache import cached_tokens

    real_flock = fcntl.flock
    contended = threading.Event()

    def flock(fd: Any, op: int) -> None:
        if op == fcntl.LOCK_EX:
            try:
                return real_flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                contended.set()  # the other rank builds: wait for it below
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    builds: list[int] = []
    results: list[np.ndarray] = []

    def build() -> np.ndarray:
        builds.append(1)
        contended.wait(timeout=60)  # hold the lock until the other rank waits
        return np.arange(1000, dtype=np.uint16)

    def rank() -> None:
        results.append(cached_tokens(tmp_path / "cache", {"corpus": "c"}, build))

    threads = [threading.Thread(target=rank) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert contended.is_set(), "the second rank never found the lock taken"
    assert builds == [1] and len(results) == 2
    assert all(r.tolist() == list(range(1000)) for r in results)
