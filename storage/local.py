"""Local-file primitives under :class:`~shardsmith.storage.fs.Store`: atomic publish and scatter reads.

Plain functions with no retries or error mapping; the store runs them under its
retry policy (:meth:`Store._call`), which names the URL in every error.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import BinaryIO, Iterator, Sequence

from shardsmith.storage.crashpoints import crash_point

#: Most iovecs one ``preadv`` takes (IOV_MAX on Linux).
_IOV_MAX = 1024


def tmp_name(path: str) -> str:
    """The hidden temporary sibling a write of ``path`` goes to before its rename."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")


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
        crash_point("fs.before_publish", key=path)              # test hook; inert normally
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_parts(path: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Atomically create or replace ``path`` with the concatenation of ``parts``."""
    with atomic_file(path) as f:
        for i, part in enumerate(parts):
            f.write(part)
            if i == 0:
                crash_point("fs.mid_write", key=path)           # test hook; inert normally


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
            n = os.preadv(fd, pending[i:i + _IOV_MAX], offset + total)
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
