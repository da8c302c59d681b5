"""What a store's storage can do, which decides strategy (never the backend's class).

The storage kind (:class:`StorageKind`) says what the bytes sit on: a POSIX mount is a
node-local disk served by the page cache unless its filesystem type is a shared or parallel
one (Lustre, GPFS, NFS, BeeGFS, WekaFS, CephFS ...), read from ``/proc/self/mounts``;
``SHARDSMITH_STORAGE_KIND`` (``node-local``, ``shared-fs``, ``object-store``) overrides the
guess. :func:`capabilities_of` turns a kind into how many reads a load keeps in flight, whether
reads of one file may run concurrently and how much scratch a load holds
(:mod:`shardsmith.storage.reading.execute`).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

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
