"""The backend seam under Store: which backend a URL gets, what storage kind a POSIX path sits
on (from the mount table), and the read strategy each kind's capabilities give."""

from __future__ import annotations

import pytest

from shardsmith.errors import StorageError
from shardsmith.storage.store.backends import FsspecBackend, PosixBackend
from shardsmith.storage.store.capabilities import (
    StorageKind,
    capabilities_of,
    mount_fstype,
    posix_kind,
)
from shardsmith.storage.store.fs import Store

MOUNTS = """\
overlay / overlay rw,relatime 0 0
/dev/nvme0n1p1 /scratch ext4 rw,relatime 0 0
10.0.0.5@o2ib:/lfs /lustre lustre rw,flock 0 0
fs1 /lustre/home/x\\040y gpfs rw 0 0
server:/export /mnt/nfs nfs4 rw 0 0
"""


@pytest.mark.parametrize(
    "path,fstype",
    [
        ("/scratch/ckpt/step-1", "ext4"),
        ("/lustre/proj/run", "lustre"),
        ("/lustre/home/x y/run", "gpfs"),
        ("/mnt/nfs", "nfs4"),
        ("/mnt/nfsother", "overlay"),
        ("/home/u", "overlay"),
    ],
)
def test_the_longest_mount_point_that_holds_a_path_names_its_filesystem(
    path: str, fstype: str
) -> None:
    assert mount_fstype(path, MOUNTS) == fstype


def test_capabilities_follow_the_storage_kind_and_the_cores() -> None:
    """Node-local: one stream per file, at most 2 reads per core and 8 in all; shared
    filesystems: several reads per file, 4 per core within 8..32; object stores: 32 GETs in
    flight on any node, the largest scratch."""
    local1, local64 = (
        capabilities_of(StorageKind.NODE_LOCAL, True, 1),
        capabilities_of(StorageKind.NODE_LOCAL, True, 64),
    )
    assert (local1.read_workers, local64.read_workers) == (2, 8)
    assert not local1.concurrent_reads_per_file
    shared2, shared64 = (
        capabilities_of(StorageKind.SHARED_FS, True, 2),
        capabilities_of(StorageKind.SHARED_FS, True, 64),
    )
    assert (shared2.read_workers, shared64.read_workers) == (
        8,
        32,
    ) and shared2.concurrent_reads_per_file
    obj = capabilities_of(StorageKind.OBJECT_STORE, False, 2)
    assert (
        obj.read_workers == 32
        and obj.scratch_nbytes > shared2.scratch_nbytes > local1.scratch_nbytes
    )


def test_a_store_picks_its_backend_and_kind(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SHARDSMITH_STORAGE_KIND", raising=False)
    local = Store(str(tmp_path))
    assert isinstance(local.backend, PosixBackend) and local.is_posix
    assert local.capabilities.kind is posix_kind(str(tmp_path))
    assert local.local_path("a/b") == str(tmp_path / "a" / "b")
    mem = Store("memory://backends-test")
    assert type(mem.backend) is FsspecBackend and not mem.is_posix and mem.local_path("a") is None
    assert mem.capabilities.kind is StorageKind.OBJECT_STORE
    monkeypatch.setenv("SHARDSMITH_STORAGE_KIND", "shared-fs")
    shared = Store(str(tmp_path))
    assert shared.capabilities.kind is StorageKind.SHARED_FS and shared.capabilities.posix
    shared.write("x/y", b"abc")  # the POSIX mechanics do not change with the kind
    assert local.read("x/y") == b"abc"


def test_an_unknown_storage_kind_is_refused_naming_the_choices(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDSMITH_STORAGE_KIND", "lustre")
    with pytest.raises(
        StorageError, match="SHARDSMITH_STORAGE_KIND='lustre'.*node-local.*shared-fs.*object-store"
    ):
        Store(str(tmp_path))


def test_a_backend_missing_a_call_fails_at_construction() -> None:
    """The Backend ABC: a subclass that leaves out part of the contract cannot be built."""
    from shardsmith.storage.store.backends import Backend

    class Half(Backend):
        @classmethod
        def claims(cls, fs) -> bool:
            return False

        def read(self, path: str) -> bytes:
            return b""

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_a_registered_backend_claims_its_filesystems(tmp_path, monkeypatch) -> None:
    """register_backend puts a backend ahead of the built-in ones for the filesystems it
    claims; the generic fsspec backend stays last and serves the rest."""
    from shardsmith.storage.store import backends

    class MemoryFast(FsspecBackend):
        @classmethod
        def claims(cls, fs) -> bool:
            return "memory" in getattr(fs, "protocol", ())

    monkeypatch.setattr(backends, "BACKENDS", list(backends.BACKENDS))
    backends.register_backend(MemoryFast)
    assert backends.BACKENDS[0] is MemoryFast and backends.BACKENDS[-1] is FsspecBackend
    assert type(Store("memory://claims-test").backend) is MemoryFast
    assert isinstance(Store(str(tmp_path)).backend, PosixBackend)
