"""``s3://`` reads through obstore (Rust ``object_store``), writes and listings through s3fs.

Measured on the tests' loopback moto server (bench/s3_backends.py, bench/README.md), per
object of 32-256 MiB: obstore's whole GETs 2.4-5x faster than s3fs's, eight ranged GETs
4.2-4.6x, at a quarter to nine tenths of s3fs's client CPU; its PUTs were not >= 1.3x (0.68-1.24),
so uploads stay on s3fs (our parallel multipart writer, :mod:`shardsmith.storage.multipart`).
Reads are what a resume, a resharding load and an offline reshard from object storage spend
their time on.

:class:`~shardsmith.storage.fs.Store` uses this for :meth:`read`, :meth:`read_range` and
:meth:`read_into` of ``s3://`` URLs unless one of these holds, and then s3fs reads as before:

- ``SHARDSMITH_S3_READER=s3fs`` (inherited by torchrun workers);
- obstore is not installed;
- this process was forked from one that had used obstore (its tokio runtime does not survive
  ``fork``: a read in the child hangs; s3fs's event loop does);
- the storage options name something only s3fs/botocore understands (a ``profile``,
  ``requester_pays``, extra client or request arguments ...), or no access key is given
  while an AWS profile or shared credentials file would supply one to botocore
  (``object_store`` reads the environment, web identity and instance metadata, not
  ``~/.aws/credentials``).

obstore's own retries are off: :func:`shardsmith.storage.retry.call_with_retries` retries,
classifying obstore's errors by the HTTP status and S3 error code in their message
(:func:`shardsmith.storage.retry.client_error_info`); each attempt is bounded by the same
per-attempt timeout s3fs gets.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: ``obstore`` (default) or ``s3fs``: which library reads ``s3://`` objects.
READER_ENV = "SHARDSMITH_S3_READER"
_OPTION_KEYS = frozenset({"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs"})
_CLIENT_KEYS = frozenset({"endpoint_url", "region_name"})
_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()
_RUNTIME_PID: list[int] = []          # the process whose obstore runtime is running


@dataclass(frozen=True)
class ObstoreReads:
    """Reads of one bucket through an obstore ``S3Store``; paths are s3fs's
    (``bucket/key``). Thread-safe; every call is one GET, not retried here."""

    store: Any
    bucket: str

    @property
    def usable(self) -> bool:
        """False in a process forked after obstore started (see the module docstring)."""
        return _runtime_usable()

    def _key(self, path: str) -> str:
        bucket, _, key = path.partition("/")
        if bucket != self.bucket:
            raise ValueError(f"{path!r} is not in bucket {self.bucket!r}")
        return key

    def read(self, path: str) -> memoryview:
        """The whole object (a view of obstore's buffer, no copy)."""
        import obstore

        return memoryview(obstore.get(self.store, self._key(path)).bytes())

    def read_range(self, path: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)``; fewer when the object ends first. A range starting at or
        past the end raises obstore's error for S3's 416 ``InvalidRange``."""
        import obstore

        return memoryview(obstore.get_range(self.store, self._key(path), start=start, end=end))


def _runtime_usable() -> bool:
    return not _RUNTIME_PID or _RUNTIME_PID[0] == os.getpid()


def _supported(options: dict[str, Any]) -> bool:
    """True when obstore gets the same credentials and endpoint s3fs would from ``options``."""
    if set(options) - _OPTION_KEYS or set(options.get("client_kwargs") or {}) - _CLIENT_KEYS:
        return False
    if options.get("key") or options.get("anon") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return True
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", os.path.expanduser("~/.aws/credentials"))
    return not (os.environ.get("AWS_PROFILE") or os.path.exists(shared))


def obstore_reads(url: str, options: dict[str, Any], attempt_s: float) -> ObstoreReads | None:
    """The obstore reader for the bucket of ``url`` (``s3://bucket/...``), or ``None`` when s3fs
    should read (see the module docstring). ``options`` are the store's fsspec options;
    ``attempt_s`` bounds one request (connect and whole response), seconds."""
    if os.environ.get(READER_ENV, "obstore").lower() == "s3fs" or not _supported(options) or not _runtime_usable():
        return None
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    client = dict(options.get("client_kwargs") or {})
    config: dict[str, Any] = {}
    endpoint = (options.get("endpoint_url") or client.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    for name, value in (("access_key_id", options.get("key")), ("secret_access_key", options.get("secret")),
                        ("session_token", options.get("token")), ("endpoint", endpoint),
                        ("region", client.get("region_name") or os.environ.get("AWS_REGION")
                         or os.environ.get("AWS_DEFAULT_REGION")),
                        ("skip_signature", True if options.get("anon") else None)):
        if value is not None:
            config[name] = value
    timeout = timedelta(seconds=max(attempt_s, 0.5))
    ident = (os.getpid(), bucket, tuple(sorted((k, str(v)) for k, v in config.items())), timeout)
    with _LOCK:
        _RUNTIME_PID[:] = _RUNTIME_PID or [os.getpid()]
        store = _STORES.get(ident)
        if store is None:
            store = _STORES[ident] = S3Store(
                bucket, config=config, retry_config={"max_retries": 0},  # type: ignore[arg-type]
                client_options={"allow_http": str(endpoint or "").startswith("http://"),
                                "timeout": timeout, "connect_timeout": timeout})
    return ObstoreReads(store, bucket)
