"""The backends under :class:`~shardsmith.storage.store.fs.Store`, and what each can do.

A backend moves bytes for one kind of storage; :class:`~shardsmith.storage.store.fs.Store`
wraps every call in its retry policy and error mapping, so a backend raises whatever its
library raises. Three today, chosen by :func:`backend_for` from the fsspec filesystem:

* :class:`PosixBackend`: a mounted filesystem (``preadv`` into the caller's buffers, writes
  to a hidden temporary file renamed into place, ``local_path`` for mapped reads);
* :class:`S3Backend`: ``s3://`` (reads through obstore where it is usable, writes as
  parallel multipart uploads through s3fs);
* :class:`FsspecBackend`: any other fsspec URL (``gs://``, ``az://``, ``memory://``, chained
  URLs), through fsspec's generic calls.

**Capabilities** drive strategy, not the backend's class: how many reads a load keeps in
flight, whether reads of one file may run concurrently, how much scratch a load holds
(:mod:`shardsmith.storage.reading.execute`). The storage kind
(:class:`StorageKind`) says what the bytes sit on: a POSIX mount is a node-local disk served
by the page cache unless its filesystem type is a shared or parallel one (Lustre, GPFS, NFS,
BeeGFS, WekaFS, CephFS ...), read from ``/proc/self/mounts``; ``SHARDSMITH_STORAGE_KIND``
(``node-local``, ``shared-fs``, ``object-store``) overrides the guess.

A new backend (a GCS or parallel-filesystem fast path) is one subclass of :class:`Backend`
(or of :class:`FsspecBackend`, to inherit its generic calls) that says which filesystems it
serves in :meth:`Backend.claims`, registered with :func:`register_backend` (as DCP lets a
storage class claim a URL with ``validate_checkpoint_id``); it passes
``tests/storage/test_store_conformance.py``.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, Iterator, Sequence

from fsspec.implementations.local import LocalFileSystem

from shardsmith.storage.store import posix
from shardsmith.storage.store.capabilities import (
    Capabilities,
    StorageKind,
    capabilities_of,
    kind_override,
    posix_kind,
)
from shardsmith.storage.store.multipart import MultipartWriter, part_size
from shardsmith.storage.store.s3_reads import ObstoreReads

Bytes = bytes | bytearray | memoryview
#: Retry wrapper a backend runs one idempotent call under (the store's policy and errors).
Call = Callable[[Callable[[], Any]], Any]


class Backend(abc.ABC):
    """How bytes move for one kind of storage, under :class:`~shardsmith.storage.store.fs.Store`.

    The Store calls a backend from any rank, any thread, and wraps each call in its retry
    policy (``call``: retried; ``call_once``: not retried, for steps that are not idempotent)
    and error mapping, so a backend raises whatever its library raises. Call order, by role:

    * a reader: :meth:`read` / :meth:`read_range` / :meth:`read_into`, in any order and
      concurrently as :attr:`capabilities` allow; :meth:`local_path` for mapped reads;
    * a writer: :meth:`write_parts` (a whole object at once), or :meth:`open_writer` (a stream
      whose object appears only when the ``with`` block exits cleanly). Either is atomic: a
      reader sees the whole object or none.

    A subclass that leaves any of these out cannot be constructed (``TypeError`` at
    construction, not at first use).

    Attributes:
        posix: the backend's paths are POSIX paths (mapped reads, ``preadv``, rename commits).
        capabilities: what the storage can do (:class:`Capabilities`), set at construction.
        fast_reads: the obstore reader of an ``s3://`` store; None elsewhere.
    """

    posix: bool = False
    fast_reads: ObstoreReads | None = None
    capabilities: Capabilities

    @classmethod
    @abc.abstractmethod
    def claims(cls, fs: Any) -> bool:
        """Whether this backend serves the fsspec filesystem ``fs``."""

    @classmethod
    def for_filesystem(cls, fs: Any, root: str, fast_reads: ObstoreReads | None) -> Backend:
        """This backend for ``fs``, rooted at ``root`` (its path). Override to take the
        arguments a subclass needs."""
        return cls(fs)  # type: ignore[call-arg]

    @abc.abstractmethod
    def read(self, path: str) -> bytes | memoryview:
        """The whole object."""

    @abc.abstractmethod
    def read_range(self, path: str, start: int, end: int) -> bytes | memoryview:
        """Bytes ``[start, end)``; fewer when the object ends first."""

    @abc.abstractmethod
    def read_into(
        self,
        path: str,
        start: int,
        dests: Sequence[memoryview],
        call: Call,
        get_range: Callable[[int, int], bytes | memoryview],
    ) -> int:
        """Fill ``dests`` in order from byte ``start``; returns the bytes copied."""

    @abc.abstractmethod
    def local_path(self, path: str) -> str | None:
        """The filesystem path of ``path`` where the backend has one (mapped reads), else None."""

    @abc.abstractmethod
    def write_parts(
        self, path: str, parts: Sequence[Bytes], call: Call, part_nbytes: int, max_concurrency: int
    ) -> None:
        """Create or replace ``path`` with the concatenation of ``parts``, atomically."""

    @abc.abstractmethod
    def open_writer(
        self,
        path: str,
        call: Call,
        call_once: Call,
        nbytes_hint: int | None,
        part_nbytes: int,
        max_concurrency: int,
    ) -> contextlib.AbstractContextManager[Any]:
        """A writable stream whose object appears only when the block exits cleanly."""


#: Registered backends, most specific first; :func:`backend_for` takes the first that claims
#: a filesystem. :class:`FsspecBackend` claims every filesystem and stays last.
BACKENDS: list[type[Backend]] = []


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator: serve the filesystems ``cls.claims``, ahead of those registered before
    it (the generic :class:`FsspecBackend` always last)."""
    BACKENDS.insert(0, cls)
    BACKENDS.sort(key=lambda b: b is FsspecBackend)
    return cls


class FsspecBackend(Backend):
    """Any fsspec filesystem, through its generic calls (``cat_file``, ``pipe_file``, ``open``).

    Args:
        fs: the fsspec filesystem.
        kind: what its bytes sit on.
    """

    @classmethod
    def claims(cls, fs: Any) -> bool:
        return True

    def __init__(self, fs: Any, kind: StorageKind = StorageKind.OBJECT_STORE) -> None:
        self.fs = fs
        self.capabilities = capabilities_of(kind, self.posix)

    def read(self, path: str) -> bytes | memoryview:
        """The whole object."""
        return bytes(self.fs.cat_file(path))

    def read_range(self, path: str, start: int, end: int) -> bytes | memoryview:
        """Bytes ``[start, end)``; fewer when the object ends first."""
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def read_into(
        self,
        path: str,
        start: int,
        dests: Sequence[memoryview],
        call: Call,
        get_range: Callable[[int, int], bytes | memoryview],
    ) -> int:
        """Fill ``dests`` in order from byte ``start`` with one ranged read (``get_range``,
        already retried); returns the bytes copied."""
        data = memoryview(get_range(start, start + sum(len(d) for d in dests))).cast("B")
        pos = 0
        for d in dests:
            take = min(len(d), len(data) - pos)
            d[:take] = data[pos : pos + take]
            pos += take
        return pos

    def local_path(self, path: str) -> str | None:
        """The filesystem path of ``path`` where the backend has one (mapped reads)."""
        return None

    def write_parts(
        self, path: str, parts: Sequence[Bytes], call: Call, part_nbytes: int, max_concurrency: int
    ) -> None:
        """Create or replace ``path`` with the concatenation of ``parts``, atomically."""
        total = sum(memoryview(p).nbytes for p in parts)
        if len(parts) == 1 or total <= part_nbytes:
            body = b"".join(parts) if len(parts) != 1 else bytes(parts[0])
            call(lambda: self.fs.pipe_file(path, body))
            return
        call(lambda: self._write_stream(path, parts))

    def _write_stream(self, path: str, parts: Sequence[Bytes]) -> None:
        with self.fs.open(path, "wb") as f:
            for part in parts:
                f.write(part)

    @contextlib.contextmanager
    def open_writer(
        self,
        path: str,
        call: Call,
        call_once: Call,
        nbytes_hint: int | None,
        part_nbytes: int,
        max_concurrency: int,
    ) -> Iterator[Any]:
        """A stream whose object appears only when the block exits cleanly: fsspec's file with
        ``autocommit=False``, committed on exit (``call_once``: a commit is not idempotent)."""
        f = call(lambda: self.fs.open(path, "wb", autocommit=False))
        try:
            yield f
            call_once(lambda: (f.close(), f.commit()))
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            raise


class PosixBackend(FsspecBackend):
    """A mounted filesystem: ``preadv`` reads, temporary-file-and-rename writes."""

    posix = True

    @classmethod
    def claims(cls, fs: Any) -> bool:
        return isinstance(fs, LocalFileSystem)

    @classmethod
    def for_filesystem(cls, fs: Any, root: str, fast_reads: ObstoreReads | None) -> Backend:
        return cls(fs, kind_override() or posix_kind(root))

    def read_into(
        self,
        path: str,
        start: int,
        dests: Sequence[memoryview],
        call: Call,
        get_range: Callable[[int, int], bytes | memoryview],
    ) -> int:
        """One ``preadv`` straight into ``dests``."""
        return int(call(lambda: posix.preadv_into(path, start, dests)))

    def local_path(self, path: str) -> str | None:
        return path

    def write_parts(
        self, path: str, parts: Sequence[Bytes], call: Call, part_nbytes: int, max_concurrency: int
    ) -> None:
        """The parts in one pass of ``iter(parts)`` into a temporary file, renamed into place."""
        call(lambda: posix.write_parts(path, parts))

    @contextlib.contextmanager
    def open_writer(
        self,
        path: str,
        call: Call,
        call_once: Call,
        nbytes_hint: int | None,
        part_nbytes: int,
        max_concurrency: int,
    ) -> Iterator[Any]:
        """A hidden temporary file renamed into place on a clean exit (the ``fs.mid_write``
        crash point fires after its first write)."""
        with contextlib.ExitStack() as stack:
            yield call(lambda: stack.enter_context(posix.streamed_file(path)))


class S3Backend(FsspecBackend):
    """``s3://``: reads through obstore where usable (``fast_reads``), writes as parallel
    multipart uploads through s3fs (:mod:`shardsmith.storage.store.multipart`).

    Args:
        fs: an s3fs filesystem (or a wrapper exposing ``call_s3``/``split_path``).
        fast_reads: the obstore reader, or None for s3fs reads.
    """

    def __init__(self, fs: Any, fast_reads: ObstoreReads | None = None) -> None:
        super().__init__(fs, StorageKind.OBJECT_STORE)
        self.fast_reads = fast_reads

    @classmethod
    def claims(cls, fs: Any) -> bool:
        return is_s3(fs)

    @classmethod
    def for_filesystem(cls, fs: Any, root: str, fast_reads: ObstoreReads | None) -> Backend:
        return cls(fs, fast_reads)

    def _fast(self) -> ObstoreReads | None:
        """The obstore reader when this process may use it (not in a child forked after it started)."""
        return self.fast_reads if self.fast_reads is not None and self.fast_reads.usable else None

    def read(self, path: str) -> bytes | memoryview:
        fast = self._fast()
        return fast.read(path) if fast else super().read(path)

    def read_range(self, path: str, start: int, end: int) -> bytes | memoryview:
        fast = self._fast()
        return fast.read_range(path, start, end) if fast else super().read_range(path, start, end)

    def write_parts(
        self, path: str, parts: Sequence[Bytes], call: Call, part_nbytes: int, max_concurrency: int
    ) -> None:
        total = sum(memoryview(p).nbytes for p in parts)
        with self.open_writer(path, call, call, total, part_nbytes, max_concurrency) as f:
            for part in parts:
                f.write(part)

    @contextlib.contextmanager
    def open_writer(
        self,
        path: str,
        call: Call,
        call_once: Call,
        nbytes_hint: int | None,
        part_nbytes: int,
        max_concurrency: int,
    ) -> Iterator[Any]:
        """A multipart upload whose parts go up in parallel, each retried; completed on a
        clean exit, aborted otherwise."""
        writer = MultipartWriter(
            self.fs, path, call, part_size(part_nbytes, nbytes_hint), max_concurrency
        )
        try:
            yield writer
            writer.finish()
        except BaseException:
            writer.abort()
            raise


def is_s3(fs: Any) -> bool:
    """s3fs (or a wrapper of it): its ``call_s3`` gives the parallel multipart path."""
    return hasattr(fs, "call_s3") and hasattr(fs, "split_path")


for _cls in (FsspecBackend, PosixBackend, S3Backend):
    register_backend(_cls)


def backend_for(fs: Any, root: str, fast_reads: ObstoreReads | None = None) -> Backend:
    """The backend of an fsspec filesystem whose store is rooted at ``root`` (its path): the
    first of :data:`BACKENDS` that claims ``fs``.

    Raises:
        ValueError: ``SHARDSMITH_STORAGE_KIND`` is set to an unknown kind.
    """
    override = kind_override()
    cls = next(b for b in BACKENDS if b.claims(fs))
    backend = cls.for_filesystem(fs, root, fast_reads)
    if override is not None and override is not backend.capabilities.kind:
        backend.capabilities = capabilities_of(override, backend.posix)
    return backend
