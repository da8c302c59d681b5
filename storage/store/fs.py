"""Where bytes live: a small key -> bytes store over any fsspec URL.

Keys are ``/``-separated paths relative to the store's root URL (a local path,
``file://``, ``memory://``, ``s3://bucket/prefix``; ``gs://``/``az://`` when gcsfs/adlfs are
installed). The store never imports ``torch.distributed``.

Options and credentials come from fsspec's usual sources: ``storage_options`` (the CLI's
``--storage-option KEY=VALUE``, dotted keys nest: ``client_kwargs.endpoint_url=...``),
fsspec's config files and the backend's standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE`` ... are read by botocore).

Every operation retries transient errors (see :mod:`shardsmith.storage.store.retry`) and
raises, naming the URL and the cause:

- :class:`~shardsmith.errors.StorageNotFound` (a ``FileNotFoundError``): no such key or bucket;
- :class:`~shardsmith.errors.StorageAccessDenied` (a ``PermissionError``): credentials/permissions;
- :class:`~shardsmith.errors.StorageError` (an ``OSError``): anything else permanent, or
  transient errors that outlasted the retries.

Writes never leave a partial object under the final key: local files are written to a
hidden temporary name and renamed; object stores publish an object only when its PUT
(or its multipart upload, whose parts go up in parallel) completes.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import re
from typing import Any, Callable, Iterator, Sequence, TypeVar

import fsspec
from fsspec.core import url_to_fs

from shardsmith.errors import BucketNotFound, StorageAccessDenied, StorageError, StorageNotFound
from shardsmith.storage.store.backends import Backend, Bytes, backend_for
from shardsmith.storage.store.capabilities import Capabilities
from shardsmith.storage.store.retry import (
    RetryPolicy,
    Verdict,
    bounded_s3_options,
    brief,
    call_with_retries,
    client_error_info,
    storage_timeout_s,
)
from shardsmith.storage.store.s3_reads import obstore_reads

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Multipart part size in bytes (S3 allows 5 MiB .. 5 GiB per part, at most 10,000 parts).
DEFAULT_PART_NBYTES = 8 * 2**20
#: Parts uploaded at once per object.
DEFAULT_MAX_CONCURRENCY = 8
_MIN_PART_NBYTES = 5 * 2**20
_TMP_RE = re.compile(
    r"^\..+\.tmp-(.+-\d+-)?[0-9a-f]{12}$"
)  # local.tmp_name (and the older form without writer)


def _describe(exc: BaseException) -> str:
    """``Code: message`` for a server error, else ``Type: message`` (see :func:`brief`)."""
    info = client_error_info(exc)
    message = brief(exc)
    if info is not None and info[0]:
        return f"{info[0]}: {message}"
    return f"{type(exc).__name__}: {message}"


def _no_bucket(exc: BaseException) -> bool:
    """Is this not-found the bucket's own (``NoSuchBucket``), not a missing key or prefix?"""
    info = client_error_info(exc)
    return info is not None and info[0] == "NoSuchBucket"


class Store:
    """Bytes under one root URL (local path, ``file://``, ``memory://``, ``s3://`` ...).

    Thread-safe for concurrent calls on different keys. Every method may be called
    by any rank; nothing here coordinates ranks.

    Args:
        url: root; a plain path is a local directory.
        storage_options: passed to fsspec (credentials, endpoint ...).
        max_attempts: tries per operation for transient errors (>= 1); overrides ``retry``.
        backoff_s: first retry delay in seconds; overrides ``retry``.
        retry: the retry policy (default: :meth:`RetryPolicy.from_env`).
        part_nbytes: multipart part size in bytes on object stores (>= 5 MiB).
        max_concurrency: parts of one object uploaded at once (>= 1).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_attempts: int | None = None,
        backoff_s: float | None = None,
        retry: RetryPolicy | None = None,
        part_nbytes: int = DEFAULT_PART_NBYTES,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    ) -> None:
        if part_nbytes < _MIN_PART_NBYTES:
            raise ValueError(
                f"part_nbytes={part_nbytes}: S3 needs parts of at least {_MIN_PART_NBYTES}"
            )
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}: must be >= 1")
        self.url = url.rstrip("/") or url
        policy = retry or RetryPolicy.from_env()
        self.storage_options = dict(storage_options or {})
        fast_reads = None  # s3:// reads: storage/store/s3_reads.py
        if self.url.startswith(("s3://", "s3a://")):
            attempt_s = storage_timeout_s() / (
                policy.max_attempts if max_attempts is None else max_attempts
            )
            fast_reads = obstore_reads(self.url, self.storage_options, attempt_s)
            self.storage_options = bounded_s3_options(self.storage_options, attempt_s)
        try:
            self.fs, root = url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError, TypeError) as exc:
            raise StorageError(
                f"cannot open {self.url}: {type(exc).__name__}: {exc} (check the URL's "
                "protocol, that its fsspec backend is installed, and --storage-option "
                "names)"
            ) from exc
        self.root = root.rstrip("/") if root not in ("/", "") else root
        if hasattr(self.fs, "retries"):  # s3fs retries 5 times by itself; ours bound the total
            self.fs.retries = 1
        self.retry = RetryPolicy(
            max_attempts=policy.max_attempts if max_attempts is None else max_attempts,
            backoff_s=policy.backoff_s if backoff_s is None else backoff_s,
            max_backoff_s=max(policy.max_backoff_s, backoff_s or 0.0),
        )
        self.part_nbytes = part_nbytes
        self.max_concurrency = max_concurrency
        try:
            self.backend: Backend = backend_for(self.fs, self.root, fast_reads)
        except ValueError as exc:
            raise StorageError(f"cannot open {self.url}: {exc}") from None

    @property
    def capabilities(self) -> Capabilities:
        """What the backend can do and the read strategy that follows (see
        :mod:`shardsmith.storage.store.capabilities`)."""
        return self.backend.capabilities

    @property
    def is_posix(self) -> bool:
        """Files have a local path (a POSIX mount: node-local disk or a shared filesystem)."""
        return self.backend.posix

    def child(self, key: str) -> "Store":
        """A store rooted at ``key`` under this one (same filesystem, options and policy)."""
        sub = Store.__new__(Store)
        sub.__dict__.update(self.__dict__)
        sub.url = self.url_of(key)
        sub.root = self._path(key)
        return sub

    def _path(self, key: str) -> str:
        key = key.strip("/")
        return posixpath.join(self.root, key) if key else self.root

    def url_of(self, key: str) -> str:
        """Full URL of ``key``, for messages."""
        return self.url + "/" + key.strip("/") if key.strip("/") else self.url

    # -- retries and errors ------------------------------------------------------------

    def _call(self, what: str, key: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        """Run ``fn`` under the retry policy (once when not ``retry``: ``fn`` is not
        idempotent); raise the right error naming ``key``'s URL."""
        url = self.url_of(key)

        def fail(exc: BaseException, verdict: Verdict, attempts: int) -> BaseException:
            cause = _describe(exc)
            if verdict is Verdict.NOT_FOUND:
                if _no_bucket(exc):
                    return BucketNotFound(
                        f"{what} {url}: the bucket does not exist ({cause}); "
                        "create it or fix the URL"
                    )
                return StorageNotFound(f"{url} does not exist ({what}: {cause})")
            if verdict is Verdict.DENIED:
                return StorageAccessDenied(
                    f"{what} {url}: access denied ({cause}); check the credentials (AWS_* environment "
                    "or --storage-option key=/secret=) and the permissions on the bucket"
                )
            if verdict is Verdict.TRANSIENT:
                return StorageError(
                    f"{what} {url} failed after {attempts} attempts: {cause}; the "
                    "storage is unreachable or overloaded: check the endpoint, retry later"
                )
            return StorageError(f"{what} {url} failed: {cause} (a permanent error: not retried)")

        policy = self.retry if retry else RetryPolicy(max_attempts=1)
        return call_with_retries(fn, policy, fail, describe=f"{what} {url}")

    # -- reads -------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        """Whole object.

        Raises:
            StorageNotFound: absent (a ``FileNotFoundError`` naming the URL).
            StorageError: other failures, after retries for transient ones.
        """
        path = self._path(key)
        return bytes(self._call("read", key, lambda: self.backend.read(path)))

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (one ranged GET on object stores); shorter when
        the object ends first. Raises like :meth:`read`."""
        return bytes(self._get_range(key, start, end))

    def _get_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        """:meth:`read_range` without copying obstore's buffer."""
        if end <= start:
            return b""
        path = self._path(key)

        def get() -> bytes | memoryview:
            try:
                return self.backend.read_range(path, start, end)
            except Exception as exc:
                info = client_error_info(exc)
                if info is not None and (info[0] == "InvalidRange" or info[1] == 416):
                    return b""  # S3: the range starts at or past the end (local gives b"")
                raise

        return self._call("read", key, get)

    def read_into(self, key: str, start: int, dests: Sequence[memoryview]) -> int:
        """Fill ``dests`` in order with the bytes of ``key`` from byte ``start`` (a scatter read).

        Local files: one ``preadv`` straight into the buffers. Object stores: one ranged
        GET of ``sum(len(d))`` bytes, copied into them. Retried and mapped like :meth:`read`.

        Returns:
            Bytes read: ``sum(len(d))``, or fewer when the object ends first (the caller
            decides whether that is truncation).

        Raises:
            StorageNotFound: absent. StorageError: other failures, after retries.
        """
        return self.backend.read_into(
            self._path(key),
            start,
            dests,
            lambda fn: self._call("read", key, fn),
            lambda s, e: self._get_range(key, s, e),
        )

    def local_path(self, key: str) -> str | None:
        """The filesystem path of ``key`` on a local store (for mapped reads and kernel copies,
        :mod:`shardsmith.storage.store.posix`); ``None`` on any other backend."""
        return self.backend.local_path(self._path(key))

    def exists(self, key: str) -> bool:
        """True when ``key`` is an object (or a non-empty prefix).

        Unlike ``fsspec``'s ``exists``, errors other than not-found are retried and raised,
        never reported as absence.
        """
        path = self._path(key)

        def stat() -> bool:
            self.fs.invalidate_cache(path)
            try:
                self.fs.info(path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True

        return self._call("stat", key, stat)

    def size(self, key: str) -> int:
        """Object size in bytes. Raises :class:`StorageNotFound` when absent."""
        path = self._path(key)

        def stat() -> int:
            self.fs.invalidate_cache(path)
            return int(self.fs.info(path)["size"])

        return self._call("stat", key, stat)

    def list_dir(self, key: str = "") -> list[str]:
        """Names (not paths) directly under ``key``, sorted; ``[]`` when it does not exist."""
        path = self._path(key)

        def ls() -> list[str]:
            self.fs.invalidate_cache(path)
            try:
                return [str(e) for e in self.fs.ls(path, detail=False)]
            except FileNotFoundError as exc:
                if _no_bucket(exc):  # never an empty listing
                    raise
                return []

        names = {posixpath.basename(e.rstrip("/")) for e in self._call("list", key, ls)}
        return sorted(n for n in names if n and not _TMP_RE.match(n))

    def walk(self, key: str = "") -> dict[str, dict[str, Any]]:
        """Every object under ``key``, recursively: key relative to ``key`` -> fsspec info
        (``size``, and a modification time where the backend has one). ``{}`` when absent."""
        path = self._path(key)

        def find() -> dict[str, dict[str, Any]]:
            self.fs.invalidate_cache(path)
            try:
                return dict(self.fs.find(path, detail=True, withdirs=False))
            except FileNotFoundError as exc:
                if _no_bucket(exc):  # never an empty listing
                    raise
                return {}

        prefix = path.rstrip("/") + "/"
        return {
            str(p)[len(prefix) :]: info
            for p, info in self._call("list", key, find).items()
            if str(p).startswith(prefix) and not _TMP_RE.match(posixpath.basename(str(p)))
        }

    # -- writes ------------------------------------------------------------------------

    def write(self, key: str, data: Bytes) -> None:
        """Create or replace an object with ``data`` (atomic: readers see the old object,
        nothing, or the new one). Large objects go up as parallel multipart uploads on S3.

        Raises:
            StorageNotFound / StorageAccessDenied / StorageError: naming the URL.
        """
        self.write_parts(key, [memoryview(data)])

    def write_parts(self, key: str, parts: Sequence[Bytes]) -> None:
        """Create or replace an object with the concatenation of ``parts``, without building
        a joined copy of it (S3 copies one multipart part per upload thread). Atomic like
        :meth:`write`; retried as a whole, or part by part on S3. Local files take the parts
        in one pass of ``iter(parts)``, each written as it is yielded."""
        path = self._path(key)
        try:
            self.backend.write_parts(
                path,
                parts,
                lambda fn: self._call("write", key, fn),
                self.part_nbytes,
                self.max_concurrency,
            )
        finally:
            self.fs.invalidate_cache(path)

    @contextlib.contextmanager
    def open_writer(self, key: str, nbytes_hint: int | None = None) -> Iterator[Any]:
        """A binary stream to write ``key`` front to back; the object appears (atomically,
        replacing any old one) only when the block exits cleanly, never on an error.

        Local: a hidden temporary file renamed into place. S3: a multipart upload whose
        parts go up in parallel, each retried (see :mod:`shardsmith.storage.store.multipart`).
        Other backends: fsspec's file with ``autocommit=False``, committed on exit.

        Args:
            key: the object.
            nbytes_hint: expected size, to size S3 parts for very large objects.

        Raises:
            StorageNotFound / StorageAccessDenied / StorageError: naming the URL.
        """
        path = self._path(key)
        try:
            with self.backend.open_writer(
                path,
                lambda fn: self._call("write", key, fn),
                lambda fn: self._call("write", key, fn, retry=False),
                nbytes_hint,
                self.part_nbytes,
                self.max_concurrency,
            ) as f:
                yield f
        finally:
            self.fs.invalidate_cache(path)

    def delete(self, key: str, recursive: bool = False) -> None:
        """Remove an object (or a whole prefix with ``recursive``); absent is fine."""
        path = self._path(key)

        def rm() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

        self._call("delete", key, rm)


__all__ = ["Store", "fsspec", "RetryPolicy", "DEFAULT_PART_NBYTES", "DEFAULT_MAX_CONCURRENCY"]
