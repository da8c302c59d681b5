"""Local-file primitives under :class:`~shardsmith.storage.store.fs.Store`: atomic publish and scatter reads.

Plain functions with no retries or error mapping; the store runs them under its
retry policy (:meth:`Store._call`), which names the URL in every error.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import socket
import time
import uuid
from typing import Any, BinaryIO, Iterator, Sequence

from shardsmith.storage.crashpoints import crash_point

#: Most iovecs one ``preadv`` takes (IOV_MAX on Linux).
_IOV_MAX = 1024


#: Largest single write to a local file: every write of a reshard's verified block is one
#: call, and 1 MiB ``pwrite`` s run at disk rate while keeping the kernel's page-cache folios
#: below 2 MiB (which some hosts must fault back in first). Re-measure:
#: ``python bench/reshard_bench.py --gb 2``.
WRITE_PIECE_NBYTES = 1 << 20


#: A hidden temporary file of :func:`tmp_name`: ``.NAME.tmp-HOST-PID-HEX``.
_TMP_RE = re.compile(r"^\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{12}$")
#: Age after which :func:`sweep_stale_tmp` removes a temporary file whose writer it cannot
#: check (another host's): far longer than any one file's write.
TMP_GRACE_S = 6 * 3600.0


def tmp_name(path: str) -> str:
    """The hidden temporary sibling a write of ``path`` goes to before its rename; it names
    the writer's host and process, so :func:`sweep_stale_tmp` can tell a dead writer's."""
    directory, name = os.path.split(path)
    return os.path.join(
        directory, f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    )


def _writer_dead(host: str, pid: int) -> bool:
    """True when process ``pid`` of this host is gone (another host's: unknown, False)."""
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def sweep_stale_tmp(directory: str, grace_s: float = TMP_GRACE_S) -> list[str]:
    """Remove the temporary files killed writers left under ``directory`` (recursively).

    A ``.NAME.tmp-HOST-PID-HEX`` file (:func:`tmp_name`) goes when its writer is provably
    dead (this host, no such process) or its last write is older than ``grace_s`` seconds;
    a live writer's file, and anything else, stays. Any process may call it.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    now = time.time()
    for top, _, files in os.walk(directory):
        for name in files:
            found = _TMP_RE.match(name)
            if found is None:
                continue
            path = os.path.join(top, name)
            try:
                stale = now - os.stat(path).st_mtime > grace_s
                if stale or _writer_dead(found["host"], int(found["pid"])):
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue  # gone meanwhile, or not ours to remove
    return removed


class _MidWriteHook:
    """A file whose first ``write`` reaches the ``fs.mid_write`` crash point, as
    :func:`write_parts`'s first part does (streamed writes go through it too)."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self._f, self._path, self._fired = f, path, False

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        if not self._fired:
            self._fired = True
            crash_point("fs.mid_write", key=self._path)  # test hook; inert normally
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def streamed_file(path: str) -> Iterator[Any]:
    """:func:`atomic_file` for a writer that streams: the ``fs.mid_write`` crash point fires
    after its first write, mid-file, as it does for :func:`write_parts`."""
    with atomic_file(path) as f:
        yield _MidWriteHook(f, path)


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only when the block exits cleanly.

    Written to a hidden temporary sibling, then renamed (``os.replace`` is atomic on
    POSIX: a killed writer never leaves a partial file under ``path``); removed on error.

    Raises:
        OSError: creating, writing or renaming failed.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
        crash_point("fs.before_publish", key=path)  # test hook; inert normally
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_parts(path: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Atomically create or replace ``path`` with the concatenation of ``parts`` (a sequence:
    one pass of ``iter(parts)``, each part written as it is yielded, in
    :data:`WRITE_PIECE_NBYTES` writes). The file's blocks are allocated first
    (:func:`preallocate`, sizes read by index, which does not start the pass), so a full disk
    fails before the first byte is written; the file ends where the written bytes end.

    Raises:
        OSError: the disk is full (naming ``path``), or a write or the rename failed.
    """
    with atomic_file(path) as f:
        preallocate(f.fileno(), sum(memoryview(parts[i]).nbytes for i in range(len(parts))), path)
        for i, part in enumerate(parts):
            view = memoryview(part).cast("B")
            for start in range(0, len(view), WRITE_PIECE_NBYTES):
                f.write(view[start : start + WRITE_PIECE_NBYTES])
            if i == 0:
                crash_point("fs.mid_write", key=path)  # test hook; inert normally
        f.flush()
        if f.tell() != os.fstat(f.fileno()).st_size:  # parts indexed longer than iterated
            os.ftruncate(f.fileno(), f.tell())


def preadv_into(path: str, offset: int, views: Sequence[memoryview]) -> int:
    """Fill ``views`` in order with the bytes of ``path`` from ``offset`` (scatter read).

    Returns:
        Bytes read: ``sum(len(v))``, or fewer when the file ends first.

    Raises:
        OSError: the file cannot be opened or read.
    """
    pending = [v for v in views if len(v)]
    fd = os.open(path, os.O_RDONLY)
    try:
        total, i = 0, 0
        while i < len(pending):
            n = os.preadv(fd, pending[i : i + _IOV_MAX], offset + total)
            if n == 0:
                break
            total += n
            while i < len(pending) and n >= len(pending[i]):
                n -= len(pending[i])
                i += 1
            if n:
                pending[i] = pending[i][n:]
        return total
    finally:
        os.close(fd)


_FALLOCATE: Any = None  # libc's fallocate(2) wrapper, looked up once (False: none)


def preallocate(fd: int, nbytes: int, name: str = "") -> bool:
    """Allocate the blocks of bytes ``[0, nbytes)`` of the open file ``fd`` now (Linux
    ``fallocate(2)``, mode 0: the file's size becomes at least ``nbytes``), so a full disk
    fails here, before anything is written, and the writes that follow fill allocated
    blocks instead of reserving each page as they go (ext4's delayed allocation; re-measure
    with ``python bench/reshard_bench.py --gb 2``). Unlike ``posix_fallocate`` it never
    falls back to writing a byte per block.

    Returns:
        False (nothing done) where the filesystem or platform has no ``fallocate``.

    Raises:
        OSError: ``ENOSPC`` (the disk is full), ``EFBIG``, ``EIO`` ..., naming ``name``.
    """
    global _FALLOCATE
    if _FALLOCATE is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            _FALLOCATE = fn
        except (OSError, AttributeError):
            _FALLOCATE = False
    if not _FALLOCATE or nbytes <= 0:
        return False
    if _FALLOCATE(fd, 0, 0, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
        return False
    raise OSError(
        err,
        f"{name or 'a file'}: cannot allocate {nbytes} bytes: {os.strerror(err)}"
        + (" (free space, or write elsewhere)" if err == errno.ENOSPC else ""),
    )


def map_range(path: str, offset: int, nbytes: int) -> memoryview:
    """A read-only view of bytes ``[offset, offset + nbytes)`` of ``path``, mapped from the
    page cache (``mmap``): no copy into user memory. Shorter when the file ends first. The
    mapping lives as long as the view (or anything made from it).

    Not pre-faulted (no ``MAP_POPULATE``): the first touch of each page faults it in with
    its neighbours (the kernel's fault-around, 64 KiB), on the thread that reads it: less
    CPU and wall time than pre-faulting every mapping, which also faults pages never read
    (``python bench/copy_primitives.py``, ``python bench/reshard_bench.py --gb 2``).

    Raises:
        OSError: the file cannot be opened or mapped.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        nbytes = max(0, min(nbytes, size - offset))
        if nbytes == 0:
            return memoryview(b"")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(
            fd, offset + nbytes - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start
        )
    finally:
        os.close(fd)
    return memoryview(mapped)[offset - start :]


def pwrite_all(out: int, data: Any, pos: int) -> None:
    """Write all of ``data`` (any buffer) at byte ``pos`` of the file open as descriptor
    ``out`` (``os.pwrite`` in :data:`WRITE_PIECE_NBYTES` pieces, repeated after short writes;
    the file position is untouched).

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``: the disk is full).
    """
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(out, view[:WRITE_PIECE_NBYTES], pos)
        view, pos = view[n:], pos + n
