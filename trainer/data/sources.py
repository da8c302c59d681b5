"""Sources: what one ``--data`` value names, and the documents or tokens it holds.

One ``--data`` value resolves to one or more :class:`Piece` objects, each of one kind:

============  ====================================================================
``text``      any other file: the whole file is one document (bytes)
``jsonl``     ``*.jsonl`` / ``*.json`` (JSON Lines): one document per line, ``text_key``
``parquet``   ``*.parquet``: one document per row, column ``text_key`` (needs pyarrow)
``hf``        ``hf:NAME[?name=CONFIG&split=SPLIT&streaming=1]`` or a directory written by
              ``datasets.Dataset.save_to_disk``: one document per row (needs ``datasets``)
``bin``       ``*.bin`` without a sibling ``.idx``: a nanoGPT flat token array
``indexed``   ``PREFIX`` with ``PREFIX.bin`` + ``PREFIX.idx``: a Megatron indexed dataset
============  ====================================================================

The first four are text, tokenized by the tokenizer; the last two are already tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec

from shardsmith.errors import ConfigError
from shardsmith.trainer.data import hf
from shardsmith.trainer.data.indexed import index_paths, is_indexed

TEXT_KINDS = ("text", "jsonl", "parquet", "hf")
TOKEN_KINDS = ("bin", "indexed")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SEPARATOR = b"\n\n"  # between the files of the default corpus


@dataclass(frozen=True)
class Piece:
    """One file (or dataset) of a source, and how to read it.

    Attributes:
        kind: one of :data:`TEXT_KINDS` + :data:`TOKEN_KINDS`.
        path: file path within ``fs`` (the prefix for ``indexed``; the spec for ``hf``).
        fs: its filesystem (None for ``hf``).
    """

    kind: str
    path: str
    fs: fsspec.AbstractFileSystem | None = None


def _stdlib_paths() -> tuple[Path, list[str]]:
    """The stdlib root and its ``.py`` files' POSIX relative paths, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        rel_paths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return root, sorted(rel_paths)


def stdlib_documents() -> list[bytes]:
    """The embedded default corpus as documents: every ``.py`` file of the running stdlib.

    Found at run time under ``sysconfig.get_paths()["stdlib"]``, sorted by POSIX relative
    path. Skips ``site-packages``, ``dist-packages`` and unreadable files. Deterministic for a
    given Python installation (typically tens of MB).

    Raises:
        ConfigError: if no readable ``.py`` file was found.
    """
    root, rel_paths = _stdlib_paths()
    chunks = []
    for rel in rel_paths:
        try:
            chunks.append((root / rel).read_bytes())
        except OSError:
            continue  # unreadable (permissions, broken link): skip, as documented
    if not chunks:
        raise ConfigError(f"no readable .py files under the stdlib {root}; pass --data explicitly")
    return chunks


def stdlib_corpus() -> bytes:
    """The default corpus as bytes: :func:`stdlib_documents` joined by ``b"\\n\\n"``.

    Nothing is cached on disk (bytes need no tokenizing).
    """
    return _SEPARATOR.join(stdlib_documents())


def _url_to_fs(source: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(os.path.expanduser(source))
    except (ValueError, ImportError) as e:
        raise ConfigError(f"--data source {source!r}: cannot open its filesystem ({e})") from e


def _file_kind(path: str) -> str:
    if path.endswith(".bin"):
        return "bin"
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "text"


def expand_source(source: str) -> list[Piece]:
    """Resolves one ``--data`` value to its pieces (globs expanded in sorted order).

    Raises:
        ConfigError: nothing matches, the filesystem cannot be opened, or a directory that is
            not a saved Hugging Face dataset (suggests a glob).
    """
    if source.startswith(hf.HF_PREFIX):
        return [Piece("hf", source)]
    fs, path = _url_to_fs(source)
    if any(c in path for c in "*?["):
        paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
    elif fs.isdir(path):
        if hf.is_saved_dataset(fs, path):
            return [Piece("hf", source)]
        raise ConfigError(
            f"--data source {source!r} is a directory; pass a glob such as '{source}/*.txt'"
        )
    elif is_indexed(fs, path):
        return [Piece("indexed", index_paths(path)[0][: -len(".bin")], fs)]
    else:
        paths = [path] if fs.isfile(path) else []
    if not paths:
        raise ConfigError(f"--data source {source!r} matched no file; check the path or glob")
    pieces = []
    for p in paths:
        if is_indexed(fs, p):
            if p.endswith(".bin"):  # the matching .idx (if the glob took it too) is skipped
                pieces.append(Piece("indexed", p[: -len(".bin")], fs))
        else:
            pieces.append(Piece(_file_kind(p), p, fs))
    return pieces


def _jsonl_documents(piece: Piece, text_key: str) -> Iterator[str]:
    assert piece.fs is not None
    with piece.fs.open(piece.path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{piece.path}:{line_no}: not a JSON line ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ConfigError(
                    f"{piece.path}:{line_no}: no string field {text_key!r} (has {keys}); "
                    "pass --text-key"
                )
            yield row[text_key]


def _parquet_documents(piece: Piece, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(
            f"{piece.path}: Parquet needs pyarrow: pip install 'shardsmith[data]'"
        ) from e
    assert piece.fs is not None
    with piece.fs.open(piece.path, "rb") as f:
        pf = pq.ParquetFile(f)
        if text_key not in pf.schema_arrow.names:
            raise ConfigError(
                f"{piece.path}: no column {text_key!r} (has {pf.schema_arrow.names}); pass --text-key"
            )
        for batch in pf.iter_batches(batch_size=1024, columns=[text_key]):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)


def iter_documents(piece: Piece, text_key: str) -> Iterator[bytes | str]:
    """The documents of a text piece, in order (one per file, line or row).

    Raises:
        ConfigError: a row without a string field ``text_key`` (names file and line), or a
            missing optional dependency.
    """
    if piece.kind == "text":
        assert piece.fs is not None
        yield piece.fs.cat_file(piece.path)
    elif piece.kind == "jsonl":
        yield from _jsonl_documents(piece, text_key)
    elif piece.kind == "parquet":
        yield from _parquet_documents(piece, text_key)
    elif piece.kind == "hf":
        yield from hf.iter_texts(piece.path, text_key)
    else:
        raise AssertionError(f"{piece.kind} pieces hold tokens, not documents")


def fingerprint(piece: Piece) -> str:
    """What identifies a text piece's content, for the token cache key.

    Files: the SHA-256 of their bytes (streamed). Hugging Face datasets: see
    :func:`shardsmith.trainer.data.hf.fingerprint`.
    """
    if piece.kind == "hf":
        return hf.fingerprint(piece.path)
    assert piece.fs is not None
    digest = hashlib.sha256()
    with piece.fs.open(piece.path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return f"{piece.kind}:{digest.hexdigest()}"


def stdlib_fingerprint(documents: list[bytes]) -> str:
    """The default corpus's cache key part: the SHA-256 of its documents."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(len(doc).to_bytes(8, "little"))
        digest.update(doc)
    return f"stdlib:{digest.hexdigest()}"
