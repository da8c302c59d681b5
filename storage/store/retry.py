"""Which storage errors are worth retrying, and the bounded backoff that retries them.

fsspec backends raise a mix of builtins and library exceptions: s3fs turns botocore
``ClientError`` into ``OSError``/``PermissionError``/``FileNotFoundError`` (keeping the
``ClientError`` as ``__cause__``, see ``s3fs.errors.translate_boto_error``), botocore raises
its own connection errors, aiohttp its own. :func:`classify` maps all of them onto four
verdicts; :func:`call_with_retries` retries only :attr:`Verdict.TRANSIENT` ones.

Retryable S3 codes and HTTP statuses follow botocore's "standard" retry mode
(``botocore/retries/standard.py``: throttling codes, transient codes, 500/502/503/504);
backoff is capped exponential with jitter ("Exponential Backoff And Jitter", AWS
Architecture Blog, 2015).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import logging
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Verdict(enum.Enum):
    """What a storage error means for the caller."""

    TRANSIENT = "transient"  # retry: 5xx, throttling, timeouts, dropped connections
    NOT_FOUND = "not found"  # permanent: no such key / prefix / bucket
    DENIED = "access denied"  # permanent: credentials or permissions
    PERMANENT = "permanent"  # permanent: the request itself is wrong


#: S3 error codes retried (botocore standard mode: throttled + transient codes).
TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "EC2ThrottledException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "InternalServerError",
        "ServiceUnavailable",
        "OperationAborted",
        "XAmzContentSHA256Mismatch",
    }
)
#: HTTP statuses retried whatever the code says.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"})
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "AccountProblem",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "InvalidSecurity",
        "NotSignedUp",
        "RequestTimeTooSkewed",
        "InvalidObjectState",
        "InvalidPayer",
        "CrossLocationLoggingProhibited",
    }
)
#: errno values of a dropped connection, a busy server or a timeout (s3fs maps SlowDown/503
#: to EBUSY and InternalError/500 to EREMOTEIO).
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "EBUSY",
        "EAGAIN",
        "EINTR",
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "EREMOTEIO",
    )
    if hasattr(errno, name)
)


#: Modules whose exception classes :func:`classify` knows (botocore, aiohttp, obstore).
_LIBRARY_MODULES = ("botocore", "aiohttp", "obstore")


def _library_types() -> tuple[
    tuple[type[BaseException], ...],
    tuple[type[BaseException], ...],
    tuple[type[BaseException], ...],
]:
    """(transient, denied, not found) exception classes of the HTTP stacks our stores use,
    from those already imported: a library that is not imported cannot have raised, so a
    process that never opens an object store never imports botocore or aiohttp for this
    (~0.2 s of every rank's start-up here)."""
    return _types_of(tuple(sys.modules.get(name) is not None for name in _LIBRARY_MODULES))


@functools.lru_cache(maxsize=16)
def _types_of(
    loaded: tuple[bool, ...],
) -> tuple[
    tuple[type[BaseException], ...],
    tuple[type[BaseException], ...],
    tuple[type[BaseException], ...],
]:
    has_botocore, has_aiohttp, has_obstore = loaded
    transient: list[type[BaseException]] = []
    denied: list[type[BaseException]] = []
    not_found: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):  # (a half-installed library: classify without it)
        if has_botocore:
            from botocore import exceptions as bc
            from botocore.parsers import ResponseParserError  # throttling replies can be bad XML

            transient += [
                getattr(bc, name)
                for name in (
                    "HTTPClientError",
                    "ConnectionError",
                    "IncompleteReadError",
                    "ResponseStreamingError",
                )
                if hasattr(bc, name)
            ] + [ResponseParserError]
            denied += [bc.NoCredentialsError, bc.PartialCredentialsError]
    with contextlib.suppress(ImportError):
        if has_aiohttp:
            import aiohttp

            transient += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    with contextlib.suppress(ImportError):
        if has_obstore:  # obstore (s3:// reads): errors without an HTTP status are the
            from obstore import exceptions as ox  # transport's (connect, timeout, dropped body)

            transient += [ox.GenericError, ox.JoinError]
            denied += [ox.PermissionDeniedError, ox.UnauthenticatedError]
            not_found += [ox.NotFoundError]
    return tuple(transient), tuple(denied), tuple(not_found)


_STATUS_RE = re.compile(r"Server returned non-2xx status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([^<]{1,100})</Code>")


def client_error_info(exc: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of the botocore ``ClientError`` in ``exc``'s cause chain, or
    of an obstore (``object_store``) error, whose message carries the status and the S3
    error document (``... non-2xx status code: 404 Not Found: <Error><Code>NoSuchKey``)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
        seen = seen.__cause__ or seen.__context__
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - some library errors cannot print themselves half-built
        return None
    status_match = _STATUS_RE.search(text)
    if status_match is None:
        return None
    code_match = _CODE_RE.search(text)
    return (code_match.group(1) if code_match else ""), int(status_match.group(1))


_HTTP_KIND_RE = re.compile(r"HttpError \{\s*kind: (\w+)")
_OS_MESSAGE_RE = re.compile(r'message: "([^"]{1,200})"')


def brief(exc: BaseException) -> str:
    """``str(exc)`` without obstore's debug dump and the XML error document it quotes; for
    obstore's transport errors (``HTTP error: error sending request``) the dump's cause
    (``Connection refused``, or the error kind: ``Timeout``, ``Connect`` ...) is appended."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001
        return repr(exc)
    head, _, dump = text.partition("\n\nDebug source:")
    head = head.split(": <?xml")[0]
    if dump and "HTTP error" in head:
        messages, kind = _OS_MESSAGE_RE.findall(dump), _HTTP_KIND_RE.search(dump)
        cause = messages[-1] if messages else (kind.group(1) if kind else "")
        head += f" ({cause})" if cause else ""
    return head


def _classify_code(code: str, status: int) -> Verdict:
    if code in TRANSIENT_CODES or status in TRANSIENT_STATUSES:
        return Verdict.TRANSIENT
    if code in NOT_FOUND_CODES or status == 404:
        return Verdict.NOT_FOUND
    if code in DENIED_CODES or status in (401, 403):
        return Verdict.DENIED
    return Verdict.PERMANENT


def classify(exc: BaseException) -> Verdict:
    """Decide whether a storage error is transient (retry) or permanent (and which kind).

    A server's error code wins over the builtin type a backend translated it into, so
    s3fs's ``OSError(EBUSY)`` for ``SlowDown`` is transient and ``FileNotFoundError`` for
    ``NoSuchBucket`` is not-found. Unknown non-``OSError`` exceptions (programming errors,
    parameter validation) are permanent; unknown ``OSError``\\ s are transient (bounded).
    """
    info = client_error_info(exc)
    if info is not None:
        return _classify_code(*info)
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError (http, gcsfs)
    if isinstance(status, int) and status >= 400:
        return _classify_code("", status)
    library_transient, library_denied, library_not_found = _library_types()
    if isinstance(exc, (FileNotFoundError,) + library_not_found):
        return Verdict.NOT_FOUND
    if isinstance(exc, library_transient) and "redirect" in brief(exc).lower():
        return Verdict.PERMANENT  # obstore: S3's redirect to the bucket's region
    if isinstance(exc, (PermissionError,) + library_denied):
        return Verdict.DENIED
    if isinstance(exc, (TimeoutError, ConnectionError) + library_transient):
        return Verdict.TRANSIENT
    if isinstance(exc, (FileExistsError, IsADirectoryError, NotADirectoryError)):
        return Verdict.PERMANENT
    if isinstance(exc, OSError):
        if exc.errno in (errno.EACCES, errno.EPERM):
            return Verdict.DENIED
        if exc.errno is None or exc.errno in TRANSIENT_ERRNOS:
            return Verdict.TRANSIENT
    return Verdict.PERMANENT


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


@dataclass(kw_only=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter for transient storage errors.

    Attempt ``n`` (1-based) that fails transiently sleeps
    ``min(max_backoff_s, backoff_s * 2**(n-1)) * U(0.5, 1)`` seconds before the next one.

    Attributes:
        max_attempts: tries per operation, >= 1 (1 = no retry).
        backoff_s: first delay in seconds, >= 0.
        max_backoff_s: cap on one delay in seconds, >= backoff_s.
    """

    max_attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if int(self.max_attempts) != self.max_attempts or self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts!r}: must be an integer >= 1")
        self.max_attempts = int(self.max_attempts)
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"backoff_s={self.backoff_s!r}, max_backoff_s={self.max_backoff_s!r}: "
                "need 0 <= backoff_s <= max_backoff_s"
            )

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        """Defaults, overridden by ``SHARDSMITH_STORAGE_MAX_ATTEMPTS``,
        ``SHARDSMITH_STORAGE_BACKOFF_S`` and ``SHARDSMITH_STORAGE_MAX_BACKOFF_S``
        (inherited by torchrun workers)."""
        d = cls()
        return cls(
            max_attempts=int(_env_number("SHARDSMITH_STORAGE_MAX_ATTEMPTS", d.max_attempts)),
            backoff_s=_env_number("SHARDSMITH_STORAGE_BACKOFF_S", d.backoff_s),
            max_backoff_s=_env_number("SHARDSMITH_STORAGE_MAX_BACKOFF_S", d.max_backoff_s),
        )

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """Seconds to sleep after failed attempt ``attempt`` (1-based)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * rng.uniform(0.5, 1.0)


_RNG = random.Random()


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    on_fail: Callable[[BaseException, Verdict, int], BaseException],
    describe: str = "storage call",
) -> T:
    """Run ``fn``, retrying transient failures under ``policy``.

    Args:
        fn: the operation (idempotent: it may run up to ``policy.max_attempts`` times).
        policy: attempts and backoff.
        on_fail: builds the exception to raise from (original error, verdict, attempts made);
            it is raised ``from`` the original.
        describe: what is being done, for the retry log line.

    Raises:
        whatever ``on_fail`` returns, on a permanent error or when attempts run out.
    """
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified right here
            verdict = classify(exc)
            if verdict is not Verdict.TRANSIENT or attempt == policy.max_attempts:
                raise on_fail(exc, verdict, attempt) from exc
            delay = policy.delay_s(attempt, _RNG)
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs",
                describe,
                type(exc).__name__,
                brief(exc),
                attempt,
                policy.max_attempts - 1,
                delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")


#: Seconds an object-store operation may take in all (its tries together), unless
#: ``--storage-timeout`` (``SHARDSMITH_STORAGE_TIMEOUT``) says otherwise.
DEFAULT_STORAGE_TIMEOUT_S = 60.0


def storage_timeout_s() -> float:
    """``SHARDSMITH_STORAGE_TIMEOUT`` (set by ``--storage-timeout``, inherited by workers), else
    :data:`DEFAULT_STORAGE_TIMEOUT_S`."""
    raw = os.environ.get("SHARDSMITH_STORAGE_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_STORAGE_TIMEOUT_S
    except ValueError:
        raise ValueError(f"SHARDSMITH_STORAGE_TIMEOUT={raw!r}: expected seconds") from None
    if value <= 0:
        raise ValueError(f"storage timeout {value:g}: must be > 0 seconds")
    return value


def bounded_s3_options(options: dict[str, Any], attempt_s: float) -> dict[str, Any]:
    """``options`` with botocore's connect and read timeouts at ``attempt_s`` seconds and its own
    retries off (our :class:`RetryPolicy` retries), unless the caller set them."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", max(attempt_s, 0.5))
    config.setdefault("read_timeout", max(attempt_s, 0.5))
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    return {**options, "config_kwargs": config}
