"""``s3://`` reads through obstore (Rust ``object_store``), writes and listings through s3fs.

obstore's GETs (whole and ranged) are faster than s3fs's at less client CPU, and its PUTs
are not, so uploads stay on s3fs (our parallel multipart writer,
:mod:`shardsmith.storage.store.multipart`). Only measured on the tests' loopback moto server so
far: ``OMP_NUM_THREADS=1 python bench/s3_backends.py`` re-measures it.
Reads are what a resume, a resharding load and an offline reshard from object storage spend
their time on.

:class:`~shardsmith.storage.store.fs.Store` uses this for :meth:`read`, :meth:`read_range` and
:meth:`read_into` of ``s3://`` URLs unless one of these holds, and then s3fs reads as before:

- ``SHARDSMITH_S3_READER=s3fs`` (inherited by torchrun workers);
- obstore is not installed;
- this process was forked from one that had opened an obstore store (its tokio runtime does
  not survive ``fork``: a read in the child hangs; a store the child opens itself reads
  through s3fs);
- the storage options name something only s3fs/botocore understands (a ``profile``,
  ``requester_pays``, extra client, config or request arguments ...), or no access key is
  given while an AWS profile, shared credentials or config file would supply one to botocore
  (``object_store`` reads the environment, web identity and instance metadata, not
  ``~/.aws/*``), or an environment token that botocore would not use with the given keys;
- an ``AWS_*`` variable only one of the two reads is set (``AWS_ENDPOINT``,
  ``AWS_REQUEST_PAYER``, ``AWS_SSE_*`` ...);
- no region is given (options, ``AWS_DEFAULT_REGION``/``AWS_REGION``) for AWS itself:
  botocore follows S3's redirect to the bucket's region, ``object_store`` does not.

obstore's own retries are off: :func:`shardsmith.storage.store.retry.call_with_retries` retries,
classifying obstore's errors by the HTTP status and S3 error code in their message
(:func:`shardsmith.storage.store.retry.client_error_info`); each attempt is bounded by the same
per-attempt timeout s3fs gets.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)
#: ``obstore`` (default) or ``s3fs``: which library reads ``s3://`` objects.
READER_ENV = "SHARDSMITH_S3_READER"
_OPTION_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "anon",
        "endpoint_url",
        "client_kwargs",
        "config_kwargs",
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
    }
)
_CLIENT_KEYS = frozenset({"endpoint_url", "region_name"})
_CONFIG_KEYS = frozenset(
    {"connect_timeout", "read_timeout", "retries"}
)  # what bounded_s3_options sets
#: AWS_* variables botocore and object_store read alike (credentials, region, endpoint, web
#: identity, container credentials, retry settings botocore's are set aside for); any other
#: AWS_* variable sends reads to s3fs.
_ENV_SHARED = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
        "AWS_ROLE_SESSION_NAME",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_CONFIG_FILE",
        "AWS_PROFILE",
        "AWS_MAX_ATTEMPTS",
        "AWS_RETRY_MODE",
        "AWS_EC2_METADATA_DISABLED",
        "AWS_CA_BUNDLE",
    }
)
_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()
_RUNTIME_PID: list[int] = []  # the process whose obstore runtime is running


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


def _region(options: dict[str, Any], endpoint: str | None) -> str | None:
    """The region botocore would sign for, or ``None`` when obstore would not get the same one
    (no region given for AWS itself: botocore follows S3's region redirect, object_store does
    not; ``AWS_REGION`` that disagrees with ``AWS_DEFAULT_REGION``)."""
    given = (options.get("client_kwargs") or {}).get("region_name") or os.environ.get(
        "AWS_DEFAULT_REGION"
    )
    if os.environ.get("AWS_REGION") and os.environ["AWS_REGION"] != (
        given or os.environ["AWS_REGION"]
    ):
        return None
    given = given or os.environ.get("AWS_REGION")
    if given is None and endpoint:
        return "us-east-1"  # an S3-compatible server at its own endpoint: botocore's default
    return given


def _supported(options: dict[str, Any]) -> bool:
    """True when obstore gets the credentials, endpoint and request style s3fs would from
    ``options`` and the environment (``S3Store`` reads every ``AWS_*`` variable it knows)."""
    if (
        set(options) - _OPTION_KEYS
        or set(options.get("client_kwargs") or {}) - _CLIENT_KEYS
        or set(options.get("config_kwargs") or {}) - _CONFIG_KEYS
    ):
        return False
    if any(name.startswith("AWS_") and name not in _ENV_SHARED for name in os.environ):
        return False  # e.g. AWS_ENDPOINT, AWS_REQUEST_PAYER, AWS_SSE_*: obstore-only
    if options.get("key"):  # explicit keys: botocore ignores an environment token
        return bool(options.get("token")) or not (
            os.environ.get("AWS_SESSION_TOKEN") or os.environ.get("AWS_SECURITY_TOKEN")
        )
    if options.get("anon") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return True
    files = (
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE", os.path.expanduser("~/.aws/credentials")),
        os.environ.get("AWS_CONFIG_FILE", os.path.expanduser("~/.aws/config")),
    )
    return not (os.environ.get("AWS_PROFILE") or any(os.path.exists(f) for f in files))


def obstore_reads(url: str, options: dict[str, Any], attempt_s: float) -> ObstoreReads | None:
    """The obstore reader for the bucket of ``url`` (``s3://bucket/...``), or ``None`` when s3fs
    should read (see the module docstring). ``options`` are the store's fsspec options;
    ``attempt_s`` bounds connecting and each wait for response bytes, seconds (like botocore's
    ``connect_timeout``/``read_timeout``; the whole request may take up to an hour)."""
    if (
        os.environ.get(READER_ENV, "obstore").lower() == "s3fs"
        or not _supported(options)
        or not _runtime_usable()
    ):
        return None
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    client = options.get("client_kwargs") or {}
    endpoint = (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    region = _region(options, endpoint)
    if region is None:
        return None
    config: dict[str, Any] = {"region": region}
    for name, value in (
        ("access_key_id", options.get("key")),
        ("secret_access_key", options.get("secret")),
        ("session_token", options.get("token")),
        ("endpoint", endpoint),
        ("skip_signature", True if options.get("anon") else None),
    ):
        if value is not None:
            config[name] = value
    client_options: dict[str, Any] = {"allow_http": str(endpoint or "").startswith("http://")}
    if os.environ.get("AWS_CA_BUNDLE"):  # botocore's CA bundle: trusted by obstore too
        try:
            with open(os.environ["AWS_CA_BUNDLE"], "rb") as f:
                client_options["root_certificate"] = f.read()
        except OSError:
            return None
    timeout = timedelta(seconds=max(attempt_s, 0.5))
    ident = (
        os.getpid(),
        bucket,
        tuple(sorted((k, str(v)) for k, v in config.items())),
        timeout,
        os.environ.get("AWS_CA_BUNDLE"),
    )
    with _LOCK:
        _RUNTIME_PID[:] = _RUNTIME_PID or [os.getpid()]
        store = _STORES.get(ident)
        if store is None:
            client_options.update(
                connect_timeout=timeout, read_timeout=timeout, timeout=timedelta(hours=1)
            )
            try:
                store = _STORES[ident] = S3Store(
                    bucket,
                    config=config,  # type: ignore[arg-type]
                    client_options=client_options,  # type: ignore[arg-type]
                    retry_config={"max_retries": 0},
                )
            except Exception as exc:  # noqa: BLE001 - a setting obstore refuses: s3fs reads
                log.warning(
                    "s3://%s: reading through s3fs, obstore refused the settings (%s)", bucket, exc
                )
                return None
    return ObstoreReads(store, bucket)
