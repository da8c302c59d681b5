"""Tokenizers: bytes (the default), Hugging Face ``tokenizers`` files, tiktoken BPE files.

Every tokenizer turns a batch of documents into arrays of token ids and names the ids put
between documents (its end-of-text token when it has one, else the encoding of ``"\\n\\n"``).
Nothing is downloaded: a tokenizer is a local file.

- ``bytes``: one token per byte, vocab 256; documents joined by ``b"\\n\\n"``.
- ``hf``: a ``tokenizer.json`` (or a directory holding one) read with
  ``tokenizers.Tokenizer.from_file``; encoded without special tokens (no BOS/EOS added).
- ``tiktoken:cl100k`` / ``tiktoken:o200k``: a ``.tiktoken`` file (one ``base64(token) rank``
  per line) read with ``tiktoken.load.load_tiktoken_bpe`` into a ``tiktoken.Encoding`` whose
  pre-tokenizer regex is the cl100k_base one, or the o200k_base one when the file name starts
  with ``o200k`` (patterns copied from tiktoken's ``tiktoken_ext/openai_public.py``). The
  special tokens are the upstream ones for ``cl100k_base.tiktoken`` / ``o200k_base.tiktoken``;
  any other file gets one ``<|endoftext|>`` right after its largest rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardsmith.errors import ConfigError

ENDOFTEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
DOC_SEPARATOR_TEXT = "\n\n"

# From tiktoken_ext/openai_public.py (tiktoken 0.14), cl100k_base and o200k_base.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_PATTERNS = {"tiktoken:cl100k": CL100K_PATTERN, "tiktoken:o200k": O200K_PATTERN}
_UPSTREAM_SPECIALS = {  # tiktoken_ext/openai_public.py
    "cl100k_base": {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    },
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
}


class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer."""

    kind: str
    vocab_size: int

    def encode(self, docs: list[bytes | str]) -> list[np.ndarray]:
        """Token ids of each document, shape ``(n_i,)`` each (no special tokens added)."""
        ...

    def separator(self) -> np.ndarray:
        """The ids put between two documents, shape ``(k,)``, k >= 1."""
        ...


@dataclass(frozen=True)
class TokenizerIdentity:
    """What names a tokenizer: its kind, the SHA-256 of its file and its vocabulary."""

    kind: str
    sha256: str
    vocab_size: int


def _text(doc: bytes | str) -> str:
    """A document as text; invalid UTF-8 becomes U+FFFD (a tokenizer needs ``str``)."""
    return doc if isinstance(doc, str) else doc.decode("utf-8", errors="replace")


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding ids ``< vocab_size``: uint16 or uint32 (uint8 means bytes)."""
    for dtype in (np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ConfigError(f"vocab_size={vocab_size} does not fit uint32 token ids")


class ByteTokenizer:
    """One token per byte (UTF-8 for text); vocab 256; documents joined by ``b"\\n\\n"``."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, docs: list[bytes | str]) -> list[np.ndarray]:
        """Each document's bytes as ``uint8`` ids."""
        raw = [d.encode("utf-8") if isinstance(d, str) else d for d in docs]
        return [np.frombuffer(d, dtype=np.uint8) for d in raw]

    def separator(self) -> np.ndarray:
        """``b"\\n\\n"`` as ids ``[10, 10]``."""
        return np.frombuffer(DOC_SEPARATOR_TEXT.encode(), dtype=np.uint8)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from its ``tokenizer.json`` bytes."""

    kind = "hf"

    def __init__(self, raw: bytes, where: str) -> None:
        tokenizers = _import("tokenizers")
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises a plain Exception on bad JSON
            raise ConfigError(f"tokenizer {where!r} is not a valid tokenizer.json: {e}") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._eot = next((vocab[n] for n in ENDOFTEXT_NAMES if n in vocab), None)

    def encode(self, docs: list[bytes | str]) -> list[np.ndarray]:
        """Ids of each document via ``encode_batch_fast`` (no offsets; no special tokens added)."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: >= 0.21
        encodings = encode([_text(d) for d in docs], add_special_tokens=False)
        dtype = id_dtype(self.vocab_size)
        return [np.asarray(e.ids, dtype=dtype) for e in encodings]

    def separator(self) -> np.ndarray:
        """The end-of-text token when the vocab has one, else the ids of ``"\\n\\n"``."""
        if self._eot is not None:
            return np.asarray([self._eot], dtype=id_dtype(self.vocab_size))
        return self.encode([DOC_SEPARATOR_TEXT])[0]


class TiktokenTokenizer:
    """A tiktoken BPE file (``.tiktoken``) with a cl100k/o200k pre-tokenizer (module doc)."""

    def __init__(self, path: str, kind: str, sha256: str) -> None:
        _import("tiktoken")  # a clear error when it is not installed
        import tiktoken.load

        try:  # expected_hash: tiktoken caches files by path; a changed file must not hit it
            ranks = tiktoken.load.load_tiktoken_bpe(path, expected_hash=sha256)
        except Exception as e:  # bad base64 / line format: ValueError, binascii.Error ...
            raise ConfigError(f"tokenizer {path!r} is not a tiktoken BPE file: {e}") from e
        if not ranks:
            raise ConfigError(f"tokenizer {path!r} has no tokens")
        stem = Path(path).name.removesuffix(".tiktoken")
        specials = _UPSTREAM_SPECIALS.get(stem) or {"<|endoftext|>": max(ranks.values()) + 1}
        self.kind = kind
        self._enc = tiktoken.Encoding(
            name=f"shardsmith-{stem}",
            pat_str=_PATTERNS[kind],
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self.vocab_size = self._enc.n_vocab
        self._eot = specials["<|endoftext|>"]

    def encode(self, docs: list[bytes | str]) -> list[np.ndarray]:
        """Ids of each document via ``encode_ordinary_batch`` (special-token text is plain)."""
        ids = self._enc.encode_ordinary_batch([_text(d) for d in docs], num_threads=1)
        dtype = id_dtype(self.vocab_size)
        return [np.asarray(x, dtype=dtype) for x in ids]

    def separator(self) -> np.ndarray:
        """``<|endoftext|>``."""
        return np.asarray([self._eot], dtype=id_dtype(self.vocab_size))


def _import(name: str) -> Any:
    """Imports an optional dependency or says how to install it."""
    try:
        return __import__(name)
    except ImportError as e:
        raise ConfigError(
            f"--tokenizer needs the {name!r} package: pip install 'shardsmith[data]'"
        ) from e


def tokenizer_file(path: str) -> tuple[str, Path]:
    """The kind of the tokenizer at ``path`` and the file that holds it.

    Args:
        path: a ``tokenizer.json`` (any ``*.json``), a directory holding ``tokenizer.json``,
            or a ``*.tiktoken`` file. Local paths only (``~`` expanded).

    Returns:
        ``(kind, file)``: kind ``"hf"``, ``"tiktoken:cl100k"`` or ``"tiktoken:o200k"``.

    Raises:
        ConfigError: the path does not exist or is of no known kind.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(
                f"--tokenizer {path!r} is a directory without tokenizer.json; pass a Hugging "
                "Face tokenizer.json, a directory holding one, or a .tiktoken file"
            )
    if not p.is_file():
        raise ConfigError(f"--tokenizer {path!r}: no such file (tokenizers are local files)")
    if p.suffix == ".json":
        return "hf", p
    if p.suffix == ".tiktoken":
        return ("tiktoken:o200k" if p.name.startswith("o200k") else "tiktoken:cl100k"), p
    raise ConfigError(
        f"--tokenizer {path!r}: unknown kind; pass a Hugging Face tokenizer.json (or its "
        "directory) or a tiktoken .tiktoken file"
    )


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _build(kind: str, file: Path, raw: bytes) -> Tokenizer:
    if kind == "hf":
        return HFTokenizer(raw, str(file))
    return TiktokenTokenizer(str(file), kind, _sha256(raw))


def describe_tokenizer(path: str) -> TokenizerIdentity:
    """Reads the tokenizer at ``path`` once and names it.

    Raises:
        ConfigError: as :func:`tokenizer_file`, or the file does not parse.
    """
    kind, file = tokenizer_file(path)
    raw = file.read_bytes()
    tok = _build(kind, file, raw)
    return TokenizerIdentity(kind=kind, sha256=_sha256(raw), vocab_size=tok.vocab_size)


def load_tokenizer(path: str, expected: TokenizerIdentity | None = None) -> Tokenizer:
    """The tokenizer at ``path`` (empty: bytes), checked against the identity in the config.

    Args:
        path: as :func:`tokenizer_file`; ``""`` for the byte tokenizer.
        expected: the identity recorded in the config; the file must still match it.

    Raises:
        ConfigError: as :func:`describe_tokenizer`, or the file changed since the config was
            made (names both hashes).
    """
    if not path:
        return ByteTokenizer()
    kind, file = tokenizer_file(path)
    raw = file.read_bytes()
    if expected is not None and (kind, _sha256(raw)) != (expected.kind, expected.sha256):
        raise ConfigError(
            f"tokenizer {str(file)!r} is now {kind} sha256 {_sha256(raw)[:16]}…, but the config "
            f"recorded {expected.kind} sha256 {expected.sha256[:16]}…; restore the file or start "
            "a new run"
        )
    return _build(kind, file, raw)
