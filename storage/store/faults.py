"""A fault-injecting fsspec filesystem, for testing retries and failed saves.

``faulty::<url>`` wraps any fsspec URL (fsspec URL chaining, like ``simplecache::``)::

    Store("faulty::memory://ckpt", {"faulty": {"fail_rate": 0.3, "seed": 1}})
    Store("faulty::s3://bucket/run", {"faulty": {"mode": "permanent", "match": "*/manifest.json"},
                                      "s3": {...}})

Whether a call fails depends only on ``(seed, operation, path, byte range, how many
times this same call was made)``, never on thread timing, so a run is reproducible.
Transient faults raise what the real stacks raise (``ConnectionResetError``,
``TimeoutError``, s3fs's ``OSError(EBUSY)`` for ``SlowDown`` and ``OSError(EREMOTEIO)`` for
``InternalError``, botocore's 503 ``ClientError``), and never hit the same call more than
``max_consecutive`` times in a row, so a store retrying at least ``max_consecutive + 1``
times always gets through. Some write faults fire *after* the write went through (a
lost reply), to check that retried writes are idempotent. Permanent faults raise
``PermissionError`` (s3fs's translation of ``AccessDenied``) on every matching call.

Importing this module registers the ``faulty`` protocol with fsspec.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import posixpath
import threading
from collections import Counter, defaultdict
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.chained import ChainedFileSystem  # fsspec >= 2025.10: URL chaining
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faulty"
#: Operation groups a fault can target.
OPS = ("write", "read", "stat", "list", "delete")
_S3_WRITE_CALLS = {
    "put_object",
    "create_multipart_upload",
    "upload_part",
    "complete_multipart_upload",
}
_EREMOTEIO = getattr(errno, "EREMOTEIO", errno.EIO)
#: tag -> Counter of ``calls:<op>`` and ``injected:<op>`` over every instance with that tag
#: (stores build their own filesystem instances, so tests read the totals here).
STATS: defaultdict[str, Counter[str]] = defaultdict(Counter)


def _transient_error(kind: int, what: str) -> Exception:
    if kind == 0:
        return ConnectionResetError(
            errno.ECONNRESET, f"Connection reset by peer (injected, {what})"
        )
    if kind == 1:
        return TimeoutError(f"Read timed out (injected, {what})")
    if kind == 2:
        return OSError(errno.EBUSY, f"SlowDown: Please reduce your request rate (injected, {what})")
    if kind == 3:
        return OSError(_EREMOTEIO, f"We encountered an internal error (injected, {what})")
    try:
        from botocore.exceptions import ClientError
    except ImportError:
        return OSError(errno.EBUSY, f"ServiceUnavailable (injected, {what})")
    return ClientError(
        {
            "Error": {"Code": "ServiceUnavailable", "Message": f"injected, {what}"},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        },
        "PutObject",
    )


class FaultyFileSystem(ChainedFileSystem):
    """Delegates to a target filesystem, failing a deterministic fraction of calls.

    Args:
        fail_rate: probability in [0, 1] that a matching call fails.
        seed: makes the choice of failing calls reproducible.
        mode: ``"transient"`` (retryable errors, at most ``max_consecutive`` in a row per
            call) or ``"permanent"`` (``PermissionError`` on every matching call).
        ops: operation groups to target, from :data:`OPS`.
        match: glob on the target path (e.g. ``"*/manifest.json"``); ``"*"`` = every path.
        tag: name under which :data:`STATS` counts this instance's calls and faults.
        max_consecutive: transient faults in a row for the same call before it is let through.
        target_protocol, target_options, fo, fs: the wrapped filesystem (filled in by fsspec
            URL chaining, or pass ``fs``).

    Attributes:
        stats: ``STATS[tag]``: calls seen and faults injected, by operation group.
    """

    protocol = PROTOCOL
    cachable = False

    def __init__(
        self,
        *,
        fail_rate: float = 0.3,
        seed: int = 0,
        mode: str = "transient",
        ops: tuple[str, ...] | list[str] = ("write", "read"),
        match: str = "*",
        max_consecutive: int = 2,
        tag: str = "",
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        fs: AbstractFileSystem | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate={fail_rate!r}: must be in [0, 1]")
        if mode not in ("transient", "permanent"):
            raise ValueError(f"mode={mode!r}: must be 'transient' or 'permanent'")
        unknown = set(ops) - set(OPS)
        if unknown:
            raise ValueError(f"ops={list(ops)!r}: unknown {sorted(unknown)}; allowed {OPS}")
        self.fs = (
            fs
            if fs is not None
            else fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        )
        self.fail_rate, self.seed, self.mode = fail_rate, seed, mode
        self.ops, self.match, self.max_consecutive = tuple(ops), match, max_consecutive
        self.stats = STATS[tag]
        self._seen: Counter[tuple[str, str]] = Counter()
        self._streak: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    # -- the fault decision -------------------------------------------------------------

    def _draw(self, ident: str, n: int) -> tuple[float, int]:
        digest = hashlib.blake2b(f"{self.seed}|{ident}|{n}".encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        return (value >> 8) / 2**56, value & 0xFF

    def _maybe_fail(self, op: str, path: str, detail: str = "") -> bool:
        """Raise an injected error now, or return whether to raise one after the call."""
        path = str(path)
        with self._lock:
            self.stats[f"calls:{op}"] += 1
            if op not in self.ops or not fnmatch.fnmatch(path, self.match):
                return False
            if self.mode == "permanent":
                self.stats[f"injected:{op}"] += 1
                raise PermissionError(errno.EACCES, f"Access Denied (injected, {op} {path})")
            key = (op, f"{path}|{detail}")
            self._seen[key] += 1
            u, bits = self._draw("|".join(key), self._seen[key])
            if u >= self.fail_rate or self._streak[key] >= self.max_consecutive:
                self._streak[key] = 0
                return False
            self._streak[key] += 1
            self.stats[f"injected:{op}"] += 1
        if op == "write" and bits & 1:
            return True  # let the write happen, then lose the reply
        raise _transient_error((bits >> 1) % 5, f"{op} {path}")

    def _run(
        self, op: str, path: str, fn: Any, *args: Any, call_id: str = "", **kwargs: Any
    ) -> Any:
        after = self._maybe_fail(op, path, call_id)
        out = fn(*args, **kwargs)
        if after:
            raise _transient_error(0, f"{op} {path}, after it went through")
        return out

    # -- delegated filesystem calls -----------------------------------------------------

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def _mkdir_parent(self, path: str) -> None:
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        path = self._strip(path)
        return self._run(
            "read",
            path,
            self.fs.cat_file,
            path,
            start=start,
            end=end,
            call_id=f"{start}:{end}",
            **kw,
        )

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> Any:
        path = self._strip(path)
        self._mkdir_parent(path)
        return self._run("write", path, self.fs.pipe_file, path, value, **kw)

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        path = self._strip(path)
        if "w" in mode or "a" in mode:
            self._mkdir_parent(path)
            if self._maybe_fail("write", path):  # nothing written yet: fail now
                raise _transient_error(0, f"write {path}")
        else:
            self._maybe_fail("read", path)
        return self.fs.open(path, mode, **kw)

    def info(self, path: str, **kw: Any) -> Any:
        path = self._strip(path)
        return self._run("stat", path, self.fs.info, path, **kw)

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        path = self._strip(path)
        return self._run("list", path, self.fs.ls, path, detail=detail, **kw)

    def find(self, path: str, *args: Any, **kw: Any) -> Any:
        path = self._strip(path)
        return self._run("list", path, self.fs.find, path, *args, **kw)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> Any:
        stripped = self._strip(path)
        return self._run(
            "delete", stripped, self.fs.rm, stripped, recursive=recursive, maxdepth=maxdepth
        )

    def makedirs(self, path: str, exist_ok: bool = False) -> Any:
        return self.fs.makedirs(self._strip(path), exist_ok=exist_ok)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(self._strip(path) if path else path)

    def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """s3fs's ``call_s3`` (used by the multipart upload path); write calls may fail."""
        inner = self.fs.call_s3
        if method not in _S3_WRITE_CALLS:
            return inner(method, *args, **kwargs)
        path = f"{kwargs.get('Bucket')}/{kwargs.get('Key')}"
        return self._run(
            "write",
            path,
            inner,
            method,
            *args,
            call_id=f"{method}:{kwargs.get('PartNumber')}",
            **kwargs,
        )

    def __getattr__(self, name: str) -> Any:
        # Backend-specific helpers (s3fs's split_path, call_s3 ...) exist only when the
        # target has them, so ``hasattr(fs, "call_s3")`` answers for the target.
        inner = self.__dict__.get("fs")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(inner, name)
        return self._call_s3 if name == "call_s3" else attr


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
