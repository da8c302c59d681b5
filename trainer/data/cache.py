"""A disk cache of tokenized text: one token file per (corpus, tokenizer), shared by runs.

Tokenizing tens of MB of text with a BPE tokenizer takes tens of seconds; every rank of every
start would pay it. The first process to need a corpus tokenizes it under an exclusive file
lock and writes ``<cache_dir>/<key>.json`` (dtype, token count, what was tokenized), then
``<key>.tokens`` (the raw little-endian ids, as a nanoGPT ``.bin``; a temporary name, then
``os.replace``, so its presence means complete); the other local ranks wait on the lock and
then memory-map the same file. The key is the SHA-256 of a JSON description: the cache format
version, the tokenizer's kind and SHA-256, the text key, and each piece's content fingerprint
(file bytes' SHA-256, or a dataset fingerprint). No pickle: raw ids plus JSON. Delete the
directory to reclaim space.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardsmith.errors import ConfigError

log = logging.getLogger("shardsmith.data")
CACHE_VERSION = 1
ENV_VAR = "SHARDSMITH_DATA_CACHE"


def cache_root(cache_dir: str) -> Path | None:
    """Where the cache lives: ``cache_dir``, else ``$SHARDSMITH_DATA_CACHE``, else
    ``~/.cache/shardsmith/tokens``; None when ``cache_dir == "none"`` (no caching)."""
    if cache_dir == "none":
        return None
    return Path(cache_dir or os.environ.get(ENV_VAR) or "~/.cache/shardsmith/tokens").expanduser()


def cache_key(description: dict[str, Any]) -> str:
    """The hex SHA-256 of ``description`` (JSON, sorted keys) with the cache version."""
    blob = json.dumps({"version": CACHE_VERSION, **description}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached_tokens(
    root: Path | None, description: dict[str, Any], build: Callable[[], np.ndarray]
) -> np.ndarray:
    """The token array for ``description``: from the cache, or built once and stored.

    Args:
        root: the cache directory (see :func:`cache_root`); None: just call ``build``.
        description: JSON-safe; everything the tokens depend on (see module doc).
        build: makes the tokens, shape ``(N,)`` unsigned ints, when they are not cached.

    Returns:
        Shape ``(N,)`` token ids; a read-only memory map when they come from the cache.

    Raises:
        ConfigError: the cache directory cannot be created or written (names it; pass
            ``--data-cache DIR`` or ``none``).
    """
    if root is None:
        return build()
    key = cache_key(description)
    path = root / f"{key}.tokens"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the rest wait, then read
            if not path.is_file():
                _build_and_store(path, description, build)
            else:
                log.info("token cache hit: %s", path)
    except OSError as e:
        raise ConfigError(
            f"token cache {root}: {e}; pass --data-cache DIR (writable) or none"
        ) from e
    return _open(path)


def _open(path: Path) -> np.ndarray:
    """Memory-maps a cached token file, with the dtype and count of its JSON sidecar."""
    meta = json.loads(path.with_suffix(".json").read_text())
    if meta.get("dtype") not in ("uint8", "uint16", "uint32"):
        raise ConfigError(
            f"token cache file {path.with_suffix('.json')}: dtype "
            f"{meta.get('dtype')!r} is not a token dtype; delete it"
        )
    dtype = np.dtype(meta["dtype"])
    if meta["count"] * dtype.itemsize != path.stat().st_size:
        raise ConfigError(
            f"token cache file {path} does not match {path.with_suffix('.json')}; delete both"
        )
    if meta["count"] == 0:  # np.memmap cannot map 0 bytes
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r")


def _build_and_store(
    path: Path, description: dict[str, Any], build: Callable[[], np.ndarray]
) -> None:
    """Builds the tokens and writes them atomically, with the description beside them."""
    start = time.perf_counter()
    tokens = np.ascontiguousarray(build())
    meta = {"dtype": tokens.dtype.name, "count": int(tokens.size), "description": description}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tofile(tmp)
    os.replace(tmp, path)  # last: the token file's presence means the entry is complete
    log.info(
        "tokenized %d tokens in %.1f s; cached at %s",
        tokens.size,
        time.perf_counter() - start,
        path,
    )
