"""Page-cache hygiene shared by the benches (no torch, no shardsmith: megatron_peer.py runs it
under megatron-core's interpreter too)."""

from __future__ import annotations

import os


def flush_and_evict(base: str) -> None:
    """Flush dirty pages (``os.sync``) and evict every file under ``base`` from the page cache
    (``posix_fadvise(DONTNEED)``: no root needed, other processes' cache is left alone), so
    the next write starts with no dirty backlog and the next read is cold. Call on one rank."""
    os.sync()
    for dirpath, _, names in os.walk(base):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
