"""One conformance suite for :class:`shardsmith.storage.store.fs.Store`, run against every backend:
a local directory (plain path and ``file://``), ``memory://`` and a real S3-compatible
server on loopback (moto): reads through obstore (``s3``, the default) and through s3fs
(``s3-s3fs``, ``SHARDSMITH_S3_READER=s3fs``), writes through s3fs. Each backend must give
the same answers.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
from ckpt_factory import assert_bitwise_equal, full_tensors, load_full, save_offline
from click.testing import CliRunner
from s3server import S3Prefix, S3Server, s3_server, s3_url  # noqa: F401  (pytest fixtures)

from shardsmith.cli.main import cli
from shardsmith.errors import StorageError, StorageNotFound
from shardsmith.layout import ParallelDims
from shardsmith.reshard.api import reshard
from shardsmith.storage.commit import (
    find_latest_committed,
    list_steps,
    resolve_checkpoint,
    step_dir,
)
from shardsmith.storage.store.fs import DEFAULT_PART_NBYTES, Store
from shardsmith.storage.store.options import parse_storage_options
from shardsmith.storage.store.retry import RetryPolicy

BACKENDS = ["local", "file", "memory", "s3", "s3-s3fs"]
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.001)
MiB = 2**20


def make_root(kind: str, tmp_path: Path, s3: S3Prefix) -> tuple[str, dict[str, Any]]:
    """(URL, storage options) of a fresh empty root on backend ``kind``."""
    name = f"r-{uuid.uuid4().hex[:8]}"
    if kind == "local":
        return str(tmp_path / name), {}
    if kind == "file":
        return f"file://{tmp_path / name}", {}
    if kind == "memory":
        return f"memory://{name}", {}
    return f"{s3.url}/{name}", s3.storage_options


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """A factory of fresh empty stores on one backend (S3 starts its server only when asked)."""
    kind = request.param
    s3 = request.getfixturevalue("s3_url") if kind.startswith("s3") else None
    if kind == "s3-s3fs":
        request.getfixturevalue("monkeypatch").setenv("SHARDSMITH_S3_READER", "s3fs")

    def new() -> Store:
        url, options = make_root(kind, tmp_path, s3)  # type: ignore[arg-type]
        store = Store(url, options, retry=FAST_RETRY)
        assert (store.backend.fast_reads is not None) == (kind == "s3"), (
            "the s3 backend reads through obstore"
        )
        return store

    return new


@pytest.fixture
def store(backend: Callable[[], Store]) -> Store:
    return backend()


# -- key -> bytes semantics -------------------------------------------------------------


def test_write_read_overwrite_and_empty(store: Store) -> None:
    payload = bytes(range(256)) * 7
    store.write("a/b/obj.bin", payload)
    assert store.read("a/b/obj.bin") == payload
    store.write("a/b/obj.bin", b"second")  # replace, not append
    assert store.read("a/b/obj.bin") == b"second"
    store.write("empty", b"")
    assert store.read("empty") == b"" and store.size("empty") == 0 and store.exists("empty")


def test_write_parts_is_the_concatenation(store: Store) -> None:
    parts = [
        memoryview(b"head-"),
        memoryview(bytearray(b"middle-")),
        memoryview(b""),
        memoryview(b"tail"),
    ]
    store.write_parts("k", parts)
    assert store.read("k") == b"head-middle-tail"
    assert store.size("k") == len(b"head-middle-tail")


@pytest.mark.parametrize(
    "start,end,want",
    [
        (0, 10, b"0123456789"),
        (2, 5, b"234"),
        (8, 20, b"89"),
        (10, 12, b""),
        (15, 20, b""),
        (5, 5, b""),
        (7, 3, b""),
    ],
)
def test_read_range(store: Store, start: int, end: int, want: bytes) -> None:
    store.write("x", b"0123456789")
    assert store.read_range("x", start, end) == want


def test_size_exists_list_dir(store: Store) -> None:
    for key in ("d/one", "d/two", "d/sub/three", "top"):
        store.write(key, key.encode())
    assert store.size("d/sub/three") == len(b"d/sub/three")
    assert store.exists("d/one") and store.exists("d") and store.exists("d/sub")
    assert not store.exists("d/none") and not store.exists("nowhere")
    assert store.list_dir() == ["d", "top"]
    assert store.list_dir("d") == ["one", "sub", "two"]
    assert store.list_dir("d/sub/") == ["three"]
    assert store.list_dir("nowhere") == []
    assert sorted(store.walk("d")) == ["one", "sub/three", "two"]
    assert store.walk("nowhere") == {}


def test_delete(store: Store) -> None:
    for key in ("p/a", "p/q/b", "keep"):
        store.write(key, b"1")
    store.delete("p/a")
    assert not store.exists("p/a") and store.exists("p/q/b")
    store.delete("p/a")  # absent: fine
    store.delete("p", recursive=True)
    assert not store.exists("p") and not store.exists("p/q/b")
    assert store.list_dir() == ["keep"]


def test_child_store_is_rooted_at_its_key(store: Store) -> None:
    child = store.child("step-000000001/")
    child.write("shards/f", b"x")
    assert store.read("step-000000001/shards/f") == b"x"
    assert child.url == store.url + "/step-000000001"
    assert child.url_of("shards/f") == store.url + "/step-000000001/shards/f"
    assert child.list_dir() == ["shards"]


@pytest.mark.parametrize("call", ["read", "read_range", "size"])
def test_missing_key_is_file_not_found_naming_the_url(store: Store, call: str) -> None:
    store.write("present", b"1")
    with pytest.raises(FileNotFoundError) as info:
        if call == "read":
            store.read("absent/key")
        elif call == "read_range":
            store.read_range("absent/key", 0, 4)
        else:
            store.size("absent/key")
    assert isinstance(info.value, StorageNotFound)
    assert store.url_of("absent/key") in str(info.value)


def test_large_object_round_trips(store: Store) -> None:
    """Above the multipart threshold, from uneven parts crossing part boundaries."""
    blocks = [os.urandom(3 * MiB + 1), os.urandom(7 * MiB), os.urandom(7 * MiB + 5)]
    assert sum(map(len, blocks)) > 2 * DEFAULT_PART_NBYTES
    store.write_parts("big", [memoryview(b) for b in blocks])
    joined = b"".join(blocks)
    assert store.size("big") == len(joined)
    assert store.read_range("big", 8 * MiB - 3, 8 * MiB + 3) == joined[8 * MiB - 3 : 8 * MiB + 3]
    assert store.read("big") == joined


# -- checkpoints ------------------------------------------------------------------------


def test_checkpoint_save_load_reshard_round_trip(backend: Callable[[], Store]) -> None:
    """Save in one layout, load bitwise, reshard offline on the same backend, load bitwise."""
    full = full_tensors(seed=1)
    root = backend()
    save_offline(root, 3, ParallelDims(tp=2), full)
    assert [(s.step, s.committed) for s in list_steps(root)] == [(3, True)]
    assert find_latest_committed(root) == 3
    assert_bitwise_equal(load_full(root.child(step_dir(3))), full, f"load from {root.url}")

    target = backend()
    report = reshard(
        root.child(step_dir(3)),
        target.url,
        ParallelDims(pp=2),
        storage_options=target.storage_options,
    )
    assert report.num_files == 2
    _, step_store, step = resolve_checkpoint(target.url, target.storage_options)
    assert step == 3
    assert_bitwise_equal(load_full(step_store), full, f"resharded into {target.url}")


def test_s3_multipart_upload_has_parallel_parts(
    s3_url: S3Prefix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 17 MiB object goes up as a 3-part multipart upload whose parts are in flight at
    the same time (parts 1 and 2 wait for each other at a barrier: a sequential upload
    would break it), and reads back equal. S3 ETags of multipart objects end in ``-<parts>``."""
    store = Store(s3_url.url, s3_url.storage_options, retry=FAST_RETRY)
    barrier = threading.Barrier(2, timeout=60)
    real_call = store.fs.call_s3

    def call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part" and kwargs["PartNumber"] in (1, 2):
            barrier.wait()
        return real_call(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "call_s3", call_s3)
    data = os.urandom(17 * MiB)
    store.write("big.bin", data)
    info: Any = store.fs.info(store._path("big.bin"))
    assert info["ETag"].strip('"').endswith("-3"), info["ETag"]
    assert store.read("big.bin") == data
    store.write("small.bin", data[:MiB])  # one PUT below the threshold
    assert "-" not in store.fs.info(store._path("small.bin"))["ETag"]


def test_s3_missing_bucket_fails_fast_naming_the_url(s3_server: S3Server) -> None:
    store = Store("s3://no-such-bucket-here/run", s3_server.storage_options, retry=FAST_RETRY)
    with pytest.raises(
        StorageNotFound, match=r"s3://no-such-bucket-here/run/k: the bucket does not exist"
    ):
        store.write("k", b"1")
    with pytest.raises(FileNotFoundError, match="no-such-bucket-here"):
        store.read("k")
    with pytest.raises(StorageNotFound, match="the bucket does not exist"):  # not an empty listing
        store.list_dir()
    assert not store.exists("k")


@pytest.mark.parametrize(
    "reader,error",
    [
        ("obstore", r"GenericError: .*error sending request \(Connection refused\)"),
        ("s3fs", "EndpointConnectionError"),
    ],
)
def test_s3_unreachable_endpoint_is_retried_then_named(
    reader: str, error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDSMITH_S3_READER", reader)
    options = {
        "key": "a",
        "secret": "b",
        "config_kwargs": {"retries": {"max_attempts": 1}},
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
    }
    store = Store("s3://bucket/run", options, retry=RetryPolicy(max_attempts=2, backoff_s=0.001))
    assert (store.backend.fast_reads is not None) == (reader == "obstore")
    with pytest.raises(
        StorageError, match=r"read s3://bucket/run/k failed after 2 attempts: " + error
    ) as info:
        store.read("k")
    assert "Debug source" not in str(info.value)


def test_s3_configured_from_the_standard_environment(
    s3_url: S3Prefix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_ENDPOINT_URL`` and the credentials come from the environment alone."""
    for key, value in s3_url.env.items():
        monkeypatch.setenv(key, value)
    store = Store(s3_url.url + "/env", {"skip_instance_cache": True}, retry=FAST_RETRY)
    assert store.backend.fast_reads is not None  # obstore too reads its settings from there
    store.write("k", b"from env")
    assert store.read("k") == b"from env"
    assert Store(s3_url.url, s3_url.storage_options).read("env/k") == b"from env"


def test_storage_option_flags_reach_s3(s3_url: S3Prefix, tmp_path: Path) -> None:
    """``--storage-option`` pairs (dotted keys nest) configure s3fs: ``shardsmith inspect``
    and ``shardsmith reshard`` of an S3 checkpoint into a local directory."""
    endpoint = s3_url.server.endpoint_url
    flags = [
        "key=testing",
        "secret=testing",
        f"client_kwargs.endpoint_url={endpoint}",
        "client_kwargs.region_name=us-east-1",
    ]
    assert parse_storage_options(flags) == s3_url.storage_options
    full = full_tensors(seed=2)
    save_offline(Store(s3_url.url, s3_url.storage_options), 4, ParallelDims(tp=2), full)
    args = [a for f in flags for a in ("--storage-option", f)]
    result = CliRunner().invoke(cli, ["inspect", s3_url.url, "--json", *args])
    assert result.exit_code == 0, result.output
    assert '"tp": 2' in result.output
    result = CliRunner().invoke(
        cli, ["reshard", s3_url.url, str(tmp_path / "dst"), "--pp", "2", "-q", *args]
    )
    assert result.exit_code == 0, result.output
    _, step_store, step = resolve_checkpoint(str(tmp_path / "dst"))
    assert step == 4
    assert_bitwise_equal(load_full(step_store), full, "reshard s3 -> local via the CLI")


def test_reshard_local_to_s3(tmp_path: Path, s3_url: S3Prefix) -> None:
    full = full_tensors(seed=5)
    src = Store(str(tmp_path / "src"))
    save_offline(src, 7, ParallelDims(pp=2, dp_shard=2), full)
    reshard(
        src.child(step_dir(7)),
        f"{s3_url.url}/dst/{step_dir(7)}",
        ParallelDims(tp=2),
        storage_options=s3_url.storage_options,
    )
    dst = Store(f"{s3_url.url}/dst", s3_url.storage_options)
    assert find_latest_committed(dst) == 7
    assert_bitwise_equal(load_full(dst.child(step_dir(7))), full, "local -> s3")
