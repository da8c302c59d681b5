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

A new backend (a GCS or parallel-filesystem fast path) is one subclass of
:class:`FsspecBackend` here and one line in :func:`backend_for`; it passes
``tests/storage/test_store_conformance.py``.
"""

from __future__ import annotations

import contextlib
import enum
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from fsspec.implementations.local import LocalFileSystem

from shardsmith.storage.store import posix
from shardsmith.storage.store.multipart import MultipartWriter, part_size
from shardsmith.storage.store.s3_reads import ObstoreReads

Bytes = bytes | bytearray | memoryview
#: Retry wrapper a backend runs one idempotent call under (the store's policy and errors).
Call = Callable[[Callable[[], Any]], Any]

#: Environment variable that overrides the storage kind guessed for a store.
KIND_ENV = "SHARDSMITH_STORAGE_KIND"
#: Filesystem types (``/proc/self/mounts``) whose files other nodes share: network and
#: parallel filesystems, where one read stream per file cannot fill the link.
SHARED_FS_TYPES = frozenset(
    {
        "lustre",
        "gpfs",
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "fuse.ceph",
        "beegfs",
        "wekafs",
        "panfs",
        "fuse.juicefs",
        "fuse.gcsfuse",
        "fuse.s3fs",
        "fuse.mountpoint-s3",
        "9p",
        "glusterfs",
        "fuse.glusterfs",
        "orangefs",
        "pvfs2",
        "virtiofs",
    }
)


class StorageKind(enum.Enum):
    """What a store's bytes sit on."""

    #: A disk of this node read through its page cache (NVMe, local SSD, tmpfs): reads are
    #: CPU-bound copies, so one stream per file and at most a few per core.
    NODE_LOCAL = "node-local"
    #: A POSIX mount other nodes share (Lustre, GPFS, NFS, WekaFS ...): reads cross a network,
    #: so several ranged reads per file are in flight at once.
    SHARED_FS = "shared-fs"
    #: An object store (S3, GCS, Azure Blob): every read is a ranged GET with tens of ms of
    #: latency, so many are in flight at once and scratch is large.
    OBJECT_STORE = "object-store"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, and the read strategy that follows from it.

    Attributes:
        kind: what the bytes sit on.
        posix: files have a local path (``preadv``/``pwrite``/mapped reads, rename commits).
        concurrent_reads_per_file: several ranged reads of one file may run at once (False
            on node-local disks, where concurrent reads of one page-cached file cost the
            kernel more CPU than they save).
        read_workers: ranged reads one load keeps in flight.
        scratch_nbytes: scratch bytes one load holds for pieces that cannot be read in place.
    """

    kind: StorageKind
    posix: bool
    concurrent_reads_per_file: bool
    read_workers: int
    scratch_nbytes: int

    @property
    def node_local(self) -> bool:
        """A disk of this node served by its page cache: copies between such files are
        CPU-bound, with no latency to hide."""
        return self.kind is StorageKind.NODE_LOCAL


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def capabilities_of(kind: StorageKind, posix: bool, cores: int | None = None) -> Capabilities:
    """The read strategy of a storage kind on a node with ``cores`` usable cores.

    * node-local: reads are memory copies, so at most 2 per core and 8 in all, one stream
      per file, 32 MiB of scratch (kept mapped: no fresh pages to fault in);
    * shared filesystem: 4 per core, 8 to 32, any number per file, 128 MiB;
    * object store: latency-bound GETs, 32 in flight whatever the cores (AWS's guidance is
      one connection per 85-90 MB/s of wanted throughput, so 32 fill ~25 Gb/s per process),
      256 MiB of scratch.
    """
    cores = usable_cores() if cores is None else max(1, cores)
    if kind is StorageKind.NODE_LOCAL:
        return Capabilities(kind, posix, False, max(1, min(8, 2 * cores)), 32 * 2**20)
    if kind is StorageKind.SHARED_FS:
        return Capabilities(kind, posix, True, max(8, min(32, 4 * cores)), 128 * 2**20)
    return Capabilities(kind, posix, True, 32, 256 * 2**20)


def mount_fstype(path: str, mounts: str | None = None) -> str | None:
    """The filesystem type of the mount holding ``path`` (the longest mount point that is a
    prefix of it, ``/proc/self/mounts``), or None where that cannot be read."""
    if mounts is None:
        try:
            with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return None
    path = os.path.realpath(path) if os.path.exists(path) else os.path.abspath(path)
    best, fstype = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, fstype = point, fields[2]
    return fstype


def posix_kind(path: str) -> StorageKind:
    """Node-local unless the mount holding ``path`` is a shared or parallel filesystem."""
    fstype = mount_fstype(path)
    return StorageKind.SHARED_FS if fstype in SHARED_FS_TYPES else StorageKind.NODE_LOCAL


def kind_override() -> StorageKind | None:
    """``SHARDSMITH_STORAGE_KIND``, when set.

    Raises:
        ValueError: naming the variable and the values it takes.
    """
    value = os.environ.get(KIND_ENV, "").strip()
    if not value:
        return None
    try:
        return StorageKind(value)
    except ValueError:
        raise ValueError(
            f"{KIND_ENV}={value!r}: choose one of {[k.value for k in StorageKind]}"
        ) from None


class FsspecBackend:
    """Any fsspec filesystem, through its generic calls (``cat_file``, ``pipe_file``, ``open``).

    Args:
        fs: the fsspec filesystem.
        kind: what its bytes sit on.
    """

    posix = False
    #: The obstore reader of an ``s3://`` store (:class:`S3Backend`); None elsewhere.
    fast_reads: ObstoreReads | None = None

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


def backend_for(fs: Any, root: str, fast_reads: ObstoreReads | None = None) -> FsspecBackend:
    """The backend of an fsspec filesystem whose store is rooted at ``root`` (its path).

    Raises:
        ValueError: ``SHARDSMITH_STORAGE_KIND`` is set to an unknown kind.
    """
    override = kind_override()
    if isinstance(fs, LocalFileSystem):
        backend: FsspecBackend = PosixBackend(fs, override or posix_kind(root))
    elif is_s3(fs):
        backend = S3Backend(fs, fast_reads)
    else:
        backend = FsspecBackend(fs, StorageKind.OBJECT_STORE)
    if override is not None and override is not backend.capabilities.kind:
        backend.capabilities = capabilities_of(override, backend.posix)
    return backend
