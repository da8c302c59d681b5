"""Hugging Face ``datasets`` as a text source (optional: ``pip install 'shardsmith[data]'``).

A source is either a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
(read with ``datasets.load_from_disk``) or ``hf:NAME[?name=CONFIG&split=SPLIT&streaming=1&
revision=REV]``, read with ``datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=...)``;
``NAME`` may be a hub id (needs the network, or the local ``datasets`` cache) or a local path
(a ``save_to_disk`` directory is then loaded from disk) or a builder with local files
(``hf:json?data_files=/data/x.jsonl``, ``hf:parquet?data_files=...``). The split defaults
to ``train``.
Rows are read in order; the field ``text_key`` of each row is one document.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import fsspec

from shardsmith.errors import ConfigError

HF_PREFIX = "hf:"
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_OPTIONS = ("name", "split", "streaming", "revision", "data_files")


def is_saved_dataset(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether the directory ``path`` was written by ``save_to_disk``."""
    return any(fs.isfile(f"{path.rstrip('/')}/{m}") for m in _SAVED_MARKERS)


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            "Hugging Face dataset sources need the 'datasets' package: pip install 'shardsmith[data]'"
        ) from e
    return datasets


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``hf:NAME?k=v&...`` (or a plain local path) -> ``(NAME, options)``.

    Raises:
        ConfigError: an unknown option (names the allowed ones) or no NAME.
    """
    if not spec.startswith(HF_PREFIX):
        return spec, {}
    parts = urlsplit(spec[len(HF_PREFIX) :])
    name = parts.path
    options = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown or not name:
        raise ConfigError(
            f"--data {spec!r}: expected hf:NAME[?name=CONFIG&split=SPLIT&streaming=1&revision=REV"
            "&data_files=PATH]" + (f"; unknown option {unknown[0]!r}" if unknown else "")
        )
    return name, options


def open_dataset(spec: str) -> Any:
    """The ``datasets.Dataset`` (or ``IterableDataset`` when streaming) a spec names.

    Raises:
        ConfigError: the dataset cannot be loaded (names it and the library's reason), or the
            split does not exist (names the splits there are).
    """
    datasets = _import_datasets()
    name, opts = parse_spec(spec)
    split = opts.get("split", "train")
    fs, path = fsspec.core.url_to_fs(name)
    try:
        if fs.isdir(path) and is_saved_dataset(fs, path):
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(
                name,
                opts.get("name"),
                split=split,
                streaming=opts.get("streaming", "0") in ("1", "true"),
                revision=opts.get("revision"),
                data_files=opts.get("data_files"),
            )
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        raise ConfigError(f"--data {spec!r}: cannot load the Hugging Face dataset ({e})") from e
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in ds:
            raise ConfigError(
                f"--data {spec!r}: no split {split!r} (has {sorted(ds)}); add ?split=NAME"
            )
        ds = ds[split]
    return ds


def iter_texts(spec: str, text_key: str) -> Iterator[str]:
    """The documents of a dataset: field ``text_key`` of each row, in order.

    Raises:
        ConfigError: as :func:`open_dataset`, or the rows have no string ``text_key``.
    """
    ds = open_dataset(spec)
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_key not in columns:
        raise ConfigError(
            f"--data {spec!r}: no column {text_key!r} (has {columns}); pass --text-key"
        )
    if hasattr(ds, "iter"):
        for batch in ds.iter(batch_size=1024):
            yield from _check_texts(batch[text_key], spec, text_key)
        return
    for row in ds:  # an IterableDataset without .iter: row by row
        yield from _check_texts([row.get(text_key)], spec, text_key)


def _check_texts(texts: list[Any], spec: str, text_key: str) -> list[str]:
    for t in texts:
        if not isinstance(t, str):
            raise ConfigError(
                f"--data {spec!r}: field {text_key!r} holds {type(t).__name__}, "
                "not text; pass --text-key"
            )
    return texts


def fingerprint(spec: str) -> str:
    """The dataset's identity for the token cache key.

    A dataset read from disk or the local cache: its ``_fingerprint`` (``datasets`` derives it
    from the data files and the transforms). A streamed dataset has none: its name, config,
    split and revision stand in (pin ``revision`` to be safe against upstream changes).
    """
    ds = open_dataset(spec)
    fp = getattr(ds, "_fingerprint", None)
    if fp:
        return f"hf:{fp}"
    name, opts = parse_spec(spec)
    return "hf-stream:" + "|".join([name] + [f"{k}={opts.get(k, '')}" for k in _OPTIONS])
