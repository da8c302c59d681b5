"""The data config: where tokens come from, how text becomes tokens, how sources are blended.

:class:`DataConfig` is part of the root training config, so it is saved in every checkpoint
manifest. It records the tokenizer's *identity* (kind, SHA-256 of its file, vocab size), not
only its path, so a resumed job can refuse a different tokenizer
(:func:`shardsmith.trainer.data.identity.check_same_tokenizer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardsmith.errors import ConfigError

TOKEN_DTYPES = ("auto", "uint16", "uint32")
BYTE_VOCAB_SIZE = 256
BYTES_KIND = "bytes"  # the default tokenizer: one token per byte (or: pre-tokenized data only)
_MAX_SEED = 2**63  # torch.Generator.manual_seed takes < 2**64; leaves room for seed + epoch


@dataclass(kw_only=True)
class DataConfig:
    """Where training tokens come from.

    Attributes:
        sources: ``--data`` sources. Each is a local path, a glob (expanded in sorted order) or
            an fsspec URL (``memory://``, ``s3://`` ...), of one of these kinds (see
            :mod:`shardsmith.trainer.data.sources`): text files (one document each), ``.jsonl``
            and ``.parquet`` (one document per row, field ``text_key``), nanoGPT ``.bin``
            token arrays, Megatron indexed datasets (``PREFIX`` of ``PREFIX.bin`` +
            ``PREFIX.idx``), Hugging Face datasets (``hf:NAME?split=train&name=CONFIG`` or a
            ``save_to_disk`` directory). Empty means the embedded default corpus (the ``.py``
            files of the running Python's standard library).
        weights: blend weights, one per source (Megatron's ``--data-path 0.7 a 0.3 b``);
            normalized to sum 1. Empty: the sources are concatenated into one dataset.
        token_dtype: element type of nanoGPT ``.bin`` files: ``"uint16"``, ``"uint32"`` or
            ``"auto"`` (= ``"uint16"``, nanoGPT's GPT-2 format). Indexed datasets carry theirs.
        seed: seeds the per-epoch sample permutation; in ``[0, 2**63)``.
        tokenizer: path of a Hugging Face ``tokenizer.json`` (or a directory holding one) or of
            a tiktoken ``.tiktoken`` BPE file. Empty: bytes (vocab 256).
        text_key: the field holding the text in JSONL, Parquet and Hugging Face rows.
        cache_dir: where tokenized text is cached (``.npy`` per corpus + tokenizer hash).
            Empty: ``$SHARDSMITH_DATA_CACHE`` or ``~/.cache/shardsmith/tokens``; ``"none"``
            disables the cache. Byte-level text is never cached (it needs no work).
        tokenizer_kind: filled in from ``tokenizer``: ``"bytes"``, ``"hf"``,
            ``"tiktoken:cl100k"`` or ``"tiktoken:o200k"`` (the pre-tokenizer pattern).
        tokenizer_sha256: filled in: hex SHA-256 of the tokenizer file's bytes (``""`` for bytes).
        tokenizer_vocab_size: filled in: the tokenizer's vocabulary (largest id + 1).

    The ``tokenizer_*`` fields are computed from the file when ``tokenizer_sha256`` is empty
    (a new job) and kept as given otherwise (a config read back from a manifest, on a machine
    that may not have the file).

    Raises:
        ConfigError: on a value out of range (names the field, the value and what is allowed),
            or a tokenizer file that is missing or of an unknown kind.
    """

    sources: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    token_dtype: str = "auto"
    seed: int = 1234
    tokenizer: str = ""
    text_key: str = "text"
    cache_dir: str = ""
    tokenizer_kind: str = ""
    tokenizer_sha256: str = ""
    tokenizer_vocab_size: int = 0

    def __post_init__(self) -> None:
        self.sources = _as_str_tuple("sources", self.sources)
        bad = [s for s in self.sources if not s.strip()]
        if bad:
            raise ConfigError(f"DataConfig.sources has {bad[0]!r}: need a path, glob or URL")
        self.weights = _check_weights(self.weights, len(self.sources))
        if self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(
                f"DataConfig.token_dtype={self.token_dtype!r}: allowed values are {TOKEN_DTYPES}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"DataConfig.seed={self.seed!r}: expected an int in [0, 2**63)")
        if not 0 <= self.seed < _MAX_SEED:
            raise ConfigError(f"DataConfig.seed={self.seed}: allowed range is [0, 2**63)")
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"DataConfig.text_key={self.text_key!r}: need a field name")
        self._fill_tokenizer_identity()

    def _fill_tokenizer_identity(self) -> None:
        """Sets ``tokenizer_kind/sha256/vocab_size`` from the tokenizer file (see class doc)."""
        if not self.tokenizer:
            if self.tokenizer_kind not in ("", BYTES_KIND) or self.tokenizer_sha256:
                raise ConfigError(
                    f"DataConfig: tokenizer_kind={self.tokenizer_kind!r} / tokenizer_sha256 "
                    "given without a tokenizer path; set DataConfig.tokenizer"
                )
            self.tokenizer_kind, self.tokenizer_vocab_size = BYTES_KIND, BYTE_VOCAB_SIZE
            return
        if self.tokenizer_sha256:
            if not self.tokenizer_kind or self.tokenizer_vocab_size < 1:
                raise ConfigError(
                    f"DataConfig for tokenizer {self.tokenizer!r}: tokenizer_sha256 is set but "
                    f"tokenizer_kind={self.tokenizer_kind!r}, tokenizer_vocab_size="
                    f"{self.tokenizer_vocab_size}; leave all three empty to compute them"
                )
            return
        from shardsmith.trainer.data.tokenizer import describe_tokenizer

        ident = describe_tokenizer(self.tokenizer)
        self.tokenizer_kind, self.tokenizer_sha256 = ident.kind, ident.sha256
        self.tokenizer_vocab_size = ident.vocab_size


def _as_str_tuple(name: str, value: object) -> tuple[str, ...]:
    """``value`` as a tuple of strings (lists from JSON become tuples)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise ConfigError(f"DataConfig.{name}={value!r}: expected a tuple of strings")
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise ConfigError(f"DataConfig.{name} has {bad[0]!r}: need a path, glob or URL")
    return tuple(value)


def _check_weights(weights: object, num_sources: int) -> tuple[float, ...]:
    """Validates blend weights: empty, or one finite weight > 0 per source."""
    if isinstance(weights, str) or not isinstance(weights, (tuple, list)):
        raise ConfigError(f"DataConfig.weights={weights!r}: expected a tuple of numbers")
    if not weights:
        return ()
    out = []
    for w in weights:
        if (
            isinstance(w, bool)
            or not isinstance(w, (int, float))
            or not (math.isfinite(w) and w > 0)
        ):
            raise ConfigError(f"DataConfig.weights has {w!r}: each weight must be a number > 0")
        out.append(float(w))
    if len(out) != num_sources:
        raise ConfigError(
            f"DataConfig has {len(out)} weights for {num_sources} sources; give one weight per "
            "source (--data 0.7 a 0.3 b) or none"
        )
    return tuple(out)


def parse_data_args(values: Sequence[str]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Splits ``--data`` values into sources and blend weights (Megatron's ``--data-path``).

    ``("a", "b")`` are two sources, concatenated. ``("0.7", "a", "0.3", "b")`` (weight, path
    alternating, as Megatron's ``--data-path``) is a blend: 70% of the samples from ``a``.

    Args:
        values: the ``--data`` values in command-line order.

    Returns:
        ``(sources, weights)``; ``weights`` is empty when no weight was given.

    Raises:
        ConfigError: weights given for some sources but not all, or a weight that is not > 0.
    """
    values = tuple(values)
    if not values or _as_number(values[0]) is None:
        numeric = [v for v in values if _as_number(v) is not None]
        if numeric:
            raise ConfigError(
                f"--data {' '.join(values)}: {numeric[0]!r} looks like a blend weight but the "
                "first value is a path; write weight-path pairs: --data 0.7 a 0.3 b"
            )
        return values, ()
    if len(values) % 2:
        raise ConfigError(
            f"--data {' '.join(values)}: a blend needs weight-path pairs (--data 0.7 a 0.3 b); "
            f"got {len(values)} values"
        )
    weights = tuple(_as_number(w) for w in values[0::2])
    paths = values[1::2]
    if any(w is None for w in weights) or any(_as_number(p) is not None for p in paths):
        raise ConfigError(
            f"--data {' '.join(values)}: expected alternating weight and path (--data 0.7 a 0.3 b)"
        )
    return paths, _check_weights(weights, len(paths))


def _as_number(text: str) -> float | None:
    """``float(text)`` when ``text`` is a plain decimal number, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


#: The fields of a data config that decide which sample a global sample index names.
DATA_IDENTITY_FIELDS = ("sources", "weights", "text_key", "token_dtype")


def describe_data(data: Mapping[str, Any]) -> str:
    """``--data 0.7 a.jsonl 0.3 b.jsonl`` (plus a non-default text key or token dtype), or the
    default corpus, for messages. ``data``: a data config's JSON (a manifest's ``config["data"]``)."""
    sources, weights = list(data.get("sources") or []), list(data.get("weights") or [])
    if not sources:
        text = "the default corpus (the standard library's .py files)"
    elif weights:
        text = "--data " + " ".join(f"{w:g} {s}" for w, s in zip(weights, sources))
    else:
        text = "--data " + " ".join(sources)
    for key, flag, default in (
        ("text_key", "--text-key", "text"),
        ("token_dtype", "--token-dtype", "auto"),
    ):
        if data.get(key, default) != default:
            text += f" {flag} {data[key]}"
    return text


def data_changed(saved: Mapping[str, Any], job: DataConfig) -> bool:
    """True when ``job`` reads other samples than the run that saved ``saved`` (a manifest's
    ``config["data"]``) at the same global sample index: other sources, weights, text key or
    token dtype. Pure; every rank decides alike."""
    now = {
        "sources": list(job.sources),
        "weights": [float(w) for w in job.weights],
        "text_key": job.text_key,
        "token_dtype": job.token_dtype,
    }
    before = {
        "sources": list(saved.get("sources") or []),
        "weights": [float(w) for w in saved.get("weights") or []],
        "text_key": saved.get("text_key", "text"),
        "token_dtype": saved.get("token_dtype", "auto"),
    }
    return now != before
