"""Where bytes live: a small key -> bytes store over any fsspec URL.

Keys are ``/``-separated paths relative to the store's root URL. The store never
imports ``torch.distributed``. Transient errors are retried with bounded
exponential backoff; permanent ones raise :class:`~shardsmith.errors.StorageError`
or ``FileNotFoundError`` naming the URL.
"""

from __future__ import annotations

import logging
import posixpath
import random
import time
from typing import Any, Callable, TypeVar

import fsspec
from fsspec.core import url_to_fs

from shardsmith.errors import StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Exceptions never retried: the request itself is wrong.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)


def parse_storage_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Turn ``KEY=VALUE`` strings into fsspec storage options.

    Values ``true``/``false`` become bools and integers become ints; a dotted key
    ``client_kwargs.endpoint_url=...`` nests. Raises ``ValueError`` on a pair without ``=``.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--storage-option {pair!r}: expected KEY=VALUE")
        key, value = pair.split("=", 1)
        parsed: Any = value
        if value.lower() in ("true", "false"):
            parsed = value.lower() == "true"
        elif value.lstrip("-").isdigit():
            parsed = int(value)
        target = out
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = parsed
    return out


class Store:
    """Bytes under one root URL (local path, ``file://``, ``memory://``, ``s3://`` ...).

    Args:
        url: root; a plain path is a local directory.
        storage_options: passed to fsspec (credentials, endpoint ...).
        max_attempts: tries per operation for transient errors (>= 1).
        backoff_s: first retry delay in seconds; doubles each attempt, with jitter, capped at 10 s.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 max_attempts: int = 5, backoff_s: float = 0.2) -> None:
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        self.fs, root = url_to_fs(self.url, **self.storage_options)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.is_local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                                   else (self.fs.protocol,))

    def child(self, key: str) -> "Store":
        """A store rooted at ``key`` under this one (same filesystem and options)."""
        sub = Store.__new__(Store)
        sub.__dict__.update(self.__dict__)
        sub.url = self.url + "/" + key.strip("/")
        sub.root = self._path(key)
        return sub

    def _path(self, key: str) -> str:
        key = key.strip("/")
        return posixpath.join(self.root, key) if key else self.root

    def url_of(self, key: str) -> str:
        """Full URL of ``key``, for messages."""
        return self.url + "/" + key.strip("/") if key else self.url

    def _retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except PERMANENT_ERRORS:
                raise
            except Exception as exc:  # transient: network, 5xx, throttling, timeouts
                if attempt == self.max_attempts:
                    raise StorageError(
                        f"{what} {self.url_of(key)} failed after {attempt} attempts: "
                        f"{type(exc).__name__}: {exc}") from exc
                log.warning("%s %s failed (%s: %s); retry %d/%d in %.2fs", what, self.url_of(key),
                            type(exc).__name__, exc, attempt, self.max_attempts - 1, delay)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def read(self, key: str) -> bytes:
        """Whole object. Raises ``FileNotFoundError`` naming the URL when absent."""
        try:
            return self._retry("read", key, lambda: self.fs.cat_file(self._path(key)))
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.url_of(key)} does not exist") from exc

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (one ranged GET on object stores)."""
        if end <= start:
            return b""
        try:
            data = self._retry("read", key, lambda: self.fs.cat_file(self._path(key), start=start, end=end))
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.url_of(key)} does not exist") from exc
        return bytes(data)

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Create or replace an object with ``data`` (one sequential write; multipart on S3)."""
        path = self._path(key)

        def put() -> None:
            if self.is_local:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with self.fs.open(path, "wb") as f:
                f.write(data)

        self._retry("write", key, put)

    def write_parts(self, key: str, parts: list[memoryview]) -> None:
        """Create or replace an object with the concatenation of ``parts``, streamed in order
        (no joined copy is built; multipart on object stores). Retried as a whole."""
        path = self._path(key)

        def put() -> None:
            if self.is_local:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with self.fs.open(path, "wb") as f:
                for part in parts:
                    f.write(part)

        self._retry("write", key, put)

    def exists(self, key: str) -> bool:
        """True when ``key`` is an object (or a non-empty prefix)."""
        return bool(self._retry("stat", key, lambda: self.fs.exists(self._path(key))))

    def size(self, key: str) -> int:
        """Object size in bytes. Raises ``FileNotFoundError`` when absent."""
        try:
            return int(self._retry("stat", key, lambda: self.fs.size(self._path(key))))
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.url_of(key)} does not exist") from exc

    def list_dir(self, key: str = "") -> list[str]:
        """Names (not paths) directly under ``key``; ``[]`` when it does not exist."""
        path = self._path(key)
        try:
            entries = self._retry("list", key, lambda: self.fs.ls(path, detail=False, refresh=True)
                                  if "refresh" in self.fs.ls.__code__.co_varnames
                                  else self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        names = sorted({posixpath.basename(str(e).rstrip("/")) for e in entries})
        return [n for n in names if n]

    def delete(self, key: str, recursive: bool = False) -> None:
        """Remove an object (or a whole prefix with ``recursive``); absent is fine."""
        path = self._path(key)
        try:
            self._retry("delete", key, lambda: self.fs.rm(path, recursive=recursive))
        except FileNotFoundError:
            pass


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The :class:`Store` for ``url`` (convenience for callers holding a URL)."""
    return Store(url, storage_options)


__all__ = ["Store", "open_store", "parse_storage_options", "fsspec"]
