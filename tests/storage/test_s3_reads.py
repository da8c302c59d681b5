"""``s3://`` reads through obstore (storage/store/s3_reads.py) against the loopback moto server:
the same bytes as s3fs, errors named and classified like s3fs's, throttling retried by our
policy (a real proxy answering 503 SlowDown), and the fallback to s3fs where obstore would
not see the same credentials."""

from __future__ import annotations

import logging
import multiprocessing
import os

import pytest
from s3proxy import ThrottlingProxy
from s3server import S3Prefix, s3_server, s3_url  # noqa: F401  (pytest fixtures)

from shardsmith.errors import BucketNotFound, StorageError, StorageNotFound
from shardsmith.storage.commit import read_manifest
from shardsmith.storage.store.fs import Store
from shardsmith.storage.store.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=3, backoff_s=0.001)


def _via(server_options: dict, endpoint: str) -> dict:
    return {
        **server_options,
        "client_kwargs": {**server_options["client_kwargs"], "endpoint_url": endpoint},
    }


def test_reads_match_s3fs_byte_for_byte(s3_url: S3Prefix, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = os.urandom(3 * 2**20 + 17)
    Store(s3_url.url, s3_url.storage_options).write("obj.bin", payload)
    answers = {}
    for reader in ("obstore", "s3fs"):
        monkeypatch.setenv("SHARDSMITH_S3_READER", reader)
        store = Store(s3_url.url, s3_url.storage_options, retry=FAST)
        assert (store.backend.fast_reads is not None) == (reader == "obstore")
        a, b = bytearray(1000), bytearray(2**20)
        got = store.read_into("obj.bin", 5, [memoryview(a), memoryview(b)])
        answers[reader] = (
            store.read("obj.bin"),
            store.read_range("obj.bin", 123, 2**20 + 9),
            store.read_range("obj.bin", len(payload) - 4, len(payload) + 100),
            store.read_range("obj.bin", len(payload), len(payload) + 8),
            got,
            bytes(a),
            bytes(b),
            store.read_into("obj.bin", len(payload) - 10, [memoryview(bytearray(64))]),
        )
    assert answers["obstore"] == answers["s3fs"]
    whole, mid, tail, past, got, a, b, short = answers["obstore"]
    assert (
        whole == payload
        and mid == payload[123 : 2**20 + 9]
        and tail == payload[-4:]
        and past == b""
    )
    assert (
        got == 1000 + 2**20
        and a == payload[5:1005]
        and b == payload[1005 : 1005 + 2**20]
        and short == 10
    )


def test_missing_key_and_bucket_are_named(s3_url: S3Prefix) -> None:
    store = Store(s3_url.url, s3_url.storage_options, retry=FAST)
    assert store.backend.fast_reads is not None
    with pytest.raises(
        StorageNotFound, match=rf"{s3_url.url}/nope does not exist \(read: NoSuchKey: "
    ):
        store.read_range("nope", 0, 10)
    other = Store("s3://no-such-bucket-here/run", s3_url.storage_options, retry=FAST)
    with pytest.raises(BucketNotFound, match="the bucket does not exist") as info:
        other.read("k")
    assert "Debug source" not in str(info.value) and "<?xml" not in str(info.value)
    # a missing bucket is never "no committed checkpoint" / an empty listing
    with pytest.raises(BucketNotFound, match="no-such-bucket-here.*the bucket does not exist"):
        read_manifest(other.child("step-000000006"))
    with pytest.raises(BucketNotFound, match="the bucket does not exist"):
        other.list_dir("")


@pytest.mark.parametrize("fail_gets,ok", [(2, True), (3, False)])
def test_throttled_reads_are_retried_by_our_policy(
    s3_url: S3Prefix, fail_gets: int, ok: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy answers the first GETs with 503 SlowDown: with 3 attempts, 2 throttled GETs are
    retried through (one GET per attempt: obstore's own retries are off), 3 are not."""
    Store(s3_url.url, s3_url.storage_options).write("obj.bin", b"0123456789" * 100)
    with (
        ThrottlingProxy(s3_url.server.endpoint_url, fail_gets) as proxy,
        caplog.at_level(logging.WARNING),
    ):
        store = Store(s3_url.url, _via(s3_url.storage_options, proxy.endpoint_url), retry=FAST)
        assert store.backend.fast_reads is not None
        if ok:
            assert store.read_range("obj.bin", 10, 30) == b"0123456789" * 2
        else:
            with pytest.raises(StorageError, match=r"failed after 3 attempts: SlowDown: .*503"):
                store.read_range("obj.bin", 10, 30)
        assert proxy.throttled == fail_gets and proxy.gets == 3
    retries = [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]
    assert len(retries) == 2 and all("503" in m and "Debug source" not in m for m in retries), (
        retries
    )


EP = {"endpoint_url": "http://127.0.0.1:9000"}


@pytest.mark.parametrize(
    "options,env,obstore",
    [
        ({"key": "k", "secret": "s", **EP}, {}, True),
        ({"anon": True, **EP}, {}, True),
        ({**EP}, {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, True),
        (
            {"key": "k", "secret": "s"},
            {"AWS_DEFAULT_REGION": "eu-west-1"},
            True,
        ),  # AWS, region given
        ({"key": "k", "secret": "s"}, {}, False),  # AWS, no region: botocore follows the redirect
        (
            {"key": "k", "secret": "s", **EP},
            {"AWS_DEFAULT_REGION": "eu-west-1", "AWS_REGION": "us-west-2"},
            False,
        ),
        (
            {"key": "k", "secret": "s", "profile": "dev", **EP},
            {},
            False,
        ),  # only botocore reads profiles
        ({"key": "k", "secret": "s", "client_kwargs": {"verify": False}, **EP}, {}, False),
        (
            {"key": "k", "secret": "s", "config_kwargs": {"region_name": "eu-west-1"}, **EP},
            {},
            False,
        ),
        (
            {"key": "k", "secret": "s", **EP},
            {"AWS_SESSION_TOKEN": "t"},
            False,
        ),  # botocore would not send it
        ({"key": "k", "secret": "s", "token": "t", **EP}, {"AWS_SESSION_TOKEN": "t2"}, True),
        (
            {"key": "k", "secret": "s", **EP},
            {"AWS_REQUEST_PAYER": "true"},
            False,
        ),  # object_store-only variable
        ({**EP}, {"AWS_PROFILE": "dev"}, False),
        ({**EP}, {"AWS_CONFIG_FILE": "exists"}, False),  # a default profile botocore would read
        ({"key": "k", "secret": "s", **EP}, {"SHARDSMITH_S3_READER": "s3fs"}, False),
        (
            {"key": "k", "secret": "s", **EP},
            {"AWS_CA_BUNDLE": "missing"},
            False,
        ),  # unreadable: botocore fails too
        (
            {"key": "k", "secret": "s", **EP},
            {"AWS_CA_BUNDLE": "garbage"},
            False,
        ),  # obstore refuses it: no crash
    ],
)
def test_obstore_only_where_it_sees_what_s3fs_sees(
    options: dict, env: dict, obstore: bool, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for name in [n for n in os.environ if n.startswith("AWS_")] + ["SHARDSMITH_S3_READER"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    (tmp_path / "exists").write_text("[default]\n")
    (tmp_path / "garbage").write_text(
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n"
    )
    for name, value in env.items():
        monkeypatch.setenv(
            name, str(tmp_path / value) if value in ("exists", "missing", "garbage") else value
        )
    assert (Store("s3://bucket/run", options).backend.fast_reads is not None) == obstore


def _read_in_child(store: Store, queue: "multiprocessing.Queue[tuple]") -> None:
    fresh = Store(store.url, store.storage_options)
    queue.put(
        (
            fresh.read_range("obj.bin", 1, 4),
            fresh.read("obj.bin"),
            store.backend._fast() is None,
            fresh.backend.fast_reads,
        )
    )


def test_a_forked_child_reads_through_s3fs(s3_url: S3Prefix) -> None:
    """obstore's runtime does not survive fork (a read in the child hung before the fallback):
    a child forked after the parent read through obstore reads through s3fs (with a store of
    its own: fsspec refuses the parent's filesystem instance in a child, "not fork-safe")."""
    store = Store(s3_url.url, s3_url.storage_options, retry=FAST)
    store.write("obj.bin", b"abcdef")
    assert store.read("obj.bin") == b"abcdef" and store.backend._fast() is not None
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(store, queue))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (b"bcd", b"abcdef", True, None)
