"""From a :class:`DataConfig` to token arrays and to the dataset the trainer samples.

Text sources are tokenized by the configured tokenizer (documents joined by its separator:
its end-of-text token, or ``"\\n\\n"``); with a BPE tokenizer the result is cached on disk
(:mod:`shardsmith.trainer.data.cache`), so only the first start on a machine pays for it.
Pre-tokenized sources (nanoGPT ``.bin``, Megatron indexed) are memory-mapped as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from shardsmith.errors import ConfigError
from shardsmith.trainer.data.blend import BlendedDataset, component_seed
from shardsmith.trainer.data.cache import cache_root, cached_tokens
from shardsmith.trainer.data.config import DataConfig
from shardsmith.trainer.data.dataset import TokenDataset, vocab_size_needed
from shardsmith.trainer.data.indexed import load_indexed
from shardsmith.trainer.data.sources import (
    Piece,
    expand_source,
    fingerprint,
    iter_documents,
    stdlib_documents,
    stdlib_fingerprint,
)
from shardsmith.trainer.data.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    TokenizerIdentity,
    load_tokenizer,
)

_ENCODE_BATCH = 64  # documents per tokenizer call


def _read_bin(piece: Piece, dtype: np.dtype) -> np.ndarray:
    """Reads one flat little-endian token array; local files are memory-mapped (read-only)."""
    fs, path = piece.fs, piece.path
    assert fs is not None
    nbytes = fs.size(path)
    if nbytes % dtype.itemsize:
        raise ConfigError(
            f".bin file {path!r} has {nbytes} bytes, not a multiple of {dtype.itemsize} "
            f"({dtype.name}); check DataConfig.token_dtype"
        )
    if isinstance(fs, LocalFileSystem) and nbytes > 0:  # np.memmap cannot map 0 bytes
        return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r")
    return np.frombuffer(fs.cat_file(path), dtype=dtype.newbyteorder("<")).astype(dtype)


def _token_pieces(pieces: list[Piece], token_dtype: str) -> np.ndarray:
    """Concatenated pre-tokenized pieces (one piece: its memory map, not a copy)."""
    dtype = np.dtype("uint16" if token_dtype == "auto" else token_dtype)
    arrays = [
        load_indexed(p.fs, p.path) if p.kind == "indexed" else _read_bin(p, dtype) for p in pieces
    ]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def tokenize_documents(documents: Any, tokenizer: Tokenizer) -> np.ndarray:
    """Tokenizes documents in batches and joins them with the tokenizer's separator.

    Args:
        documents: an iterable of ``bytes`` or ``str`` documents.
        tokenizer: the tokenizer.

    Returns:
        Shape ``(N,)`` token ids: ``doc_0 sep doc_1 sep ... doc_last`` (no trailing separator),
        ``uint8`` for bytes, else uint16/uint32 by vocab size.
    """
    sep = tokenizer.separator()
    parts: list[np.ndarray] = []
    batch: list[bytes | str] = []

    def flush() -> None:
        for ids in tokenizer.encode(batch):
            parts.extend((sep, ids) if parts else (ids,))
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) >= _ENCODE_BATCH:
            flush()
    flush()
    return np.concatenate(parts).astype(sep.dtype, copy=False) if parts else sep[:0]


def _text_tokens(cfg: DataConfig, pieces: list[Piece] | None, tokenizer: Tokenizer) -> np.ndarray:
    """Tokens of text pieces (None: the default corpus), via the cache for BPE tokenizers."""
    stdlib = stdlib_documents() if pieces is None else None
    docs = (
        stdlib if pieces is None else (d for p in pieces for d in iter_documents(p, cfg.text_key))
    )
    if isinstance(tokenizer, ByteTokenizer):
        return tokenize_documents(docs, tokenizer)  # bytes need no work worth caching
    prints = (
        [stdlib_fingerprint(stdlib)]
        if stdlib is not None
        else [fingerprint(p) for p in pieces or []]
    )
    description = {
        "tokenizer_kind": cfg.tokenizer_kind,
        "tokenizer_sha256": cfg.tokenizer_sha256,
        "text_key": cfg.text_key,
        "pieces": prints,
    }
    return cached_tokens(
        cache_root(cfg.cache_dir), description, lambda: tokenize_documents(docs, tokenizer)
    )


def _load(cfg: DataConfig, sources: Sequence[str], tokenizer: Tokenizer) -> tuple[np.ndarray, bool]:
    """One dataset's tokens and whether they are text (tokenized here) or pre-tokenized."""
    if not sources:
        return _text_tokens(cfg, None, tokenizer), True
    pieces = [p for s in sources for p in expand_source(s)]
    pre = [p.path for p in pieces if p.kind in ("bin", "indexed")]
    text = [p.path for p in pieces if p.kind not in ("bin", "indexed")]
    if pre and text:
        raise ConfigError(
            f"--data mixes pre-tokenized .bin files (e.g. {pre[0]!r}) with text files "
            f"(e.g. {text[0]!r}); use only one kind, or blend them: --data 0.5 A 0.5 B"
        )
    if pre:
        return _token_pieces(pieces, cfg.token_dtype), False
    return _text_tokens(cfg, pieces, tokenizer), True


def _tokenizer(cfg: DataConfig) -> Tokenizer:
    expected = TokenizerIdentity(cfg.tokenizer_kind, cfg.tokenizer_sha256, cfg.tokenizer_vocab_size)
    return load_tokenizer(cfg.tokenizer, expected if cfg.tokenizer else None)


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """Loads all sources (weights ignored) as one flat array of token ids.

    Text is tokenized (files joined by the tokenizer's separator, ``b"\\n\\n"`` for bytes);
    pre-tokenized sources are concatenated as they are; one local one is memory-mapped.

    Returns:
        Shape ``(N,)`` token ids: ``uint8`` for byte text (and the default corpus),
        uint16/uint32 for BPE text, the file's dtype for ``.bin``/indexed data.

    Raises:
        ConfigError: a source matches no file, text and pre-tokenized sources are mixed, a
            ``.bin`` file's size is not a whole number of tokens, an indexed dataset is
            malformed, or the tokenizer file changed since the config was made.
    """
    return _load(cfg, cfg.sources, _tokenizer(cfg))[0]


def _check_vocab(
    tokens: np.ndarray, is_text: bool, tokenizer: Tokenizer, vocab_size: int, where: str
) -> None:
    needed = tokenizer.vocab_size if is_text else vocab_size_needed(tokens)
    if needed > vocab_size:
        raise ConfigError(
            f"{where} needs vocab_size >= {needed}, the model has {vocab_size}; "
            "pass --vocab-size (or a matching --tokenizer)"
        )


def build_dataset(
    cfg: DataConfig, seq_length: int, vocab_size: int
) -> TokenDataset | BlendedDataset:
    """The dataset the trainer samples: one :class:`TokenDataset`, or a weighted blend.

    Every rank calls it with the same arguments and gets the same sample order.

    Args:
        cfg: the data config; with ``weights`` each source is one dataset of the blend.
        seq_length: T, tokens per input sequence.
        vocab_size: the model's vocabulary; every token id must be below it.

    Returns:
        A :class:`TokenDataset` (no weights) or a :class:`BlendedDataset`.

    Raises:
        ConfigError: as :func:`load_tokens`; a token id >= ``vocab_size``; a dataset shorter
            than one sample.
    """
    tokenizer = _tokenizer(cfg)
    if not cfg.weights:
        tokens, is_text = _load(cfg, cfg.sources, tokenizer)
        _check_vocab(tokens, is_text, tokenizer, vocab_size, "the data")
        return TokenDataset(tokens, seq_length, cfg.seed)
    parts = []
    for d, source in enumerate(cfg.sources):
        tokens, is_text = _load(cfg, (source,), tokenizer)
        _check_vocab(tokens, is_text, tokenizer, vocab_size, f"--data source {source!r}")
        parts.append(TokenDataset(tokens, seq_length, component_seed(cfg.seed, d)))
    return BlendedDataset(parts, cfg.weights)
