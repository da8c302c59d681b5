"""Retries and failed saves: error classification, bounded backoff, and injected storage
faults (``faulty::`` wrapper filesystem) under saves, loads and offline reshards.

Transient faults must be absorbed bitwise; permanent ones must fail fast with an error
naming the URL, and leave nothing committed (no manifest, ``latest`` unchanged).
"""

from __future__ import annotations

import errno
import os
import random
import re
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    ReadTimeoutError,
)
from ckpt_factory import MODEL, assert_bitwise_equal, full_tensors, load_full, save_offline
from fsspec.exceptions import FSTimeoutError
from s3fs.errors import translate_boto_error
from s3server import S3Prefix, s3_server, s3_url  # noqa: F401  (pytest fixtures)

from shardsmith.errors import SaveError, StorageAccessDenied, StorageError
from shardsmith.layout import ParallelDims
from shardsmith.reshard.api import reshard
from shardsmith.reshard.planner import ReshardOptions, plan_reshard
from shardsmith.storage.commit import (
    find_latest_committed,
    list_steps,
    read_latest_hint,
    read_manifest,
    step_dir,
)
from shardsmith.storage.store import faults
from shardsmith.storage.store.fs import Store
from shardsmith.storage.store.retry import RetryPolicy, Verdict, classify

MiB = 2**20
FAST = RetryPolicy(max_attempts=5, backoff_s=0.001, max_backoff_s=0.01)
ALL_OPS = ["write", "read", "stat", "list", "delete"]


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores built inside the code under test (reshard, commit) use the env's policy."""
    monkeypatch.setenv("SHARDSMITH_STORAGE_BACKOFF_S", "0.001")
    monkeypatch.setenv("SHARDSMITH_STORAGE_MAX_BACKOFF_S", "0.01")


def faulty(
    url: str, tag: str, *, inner: dict[str, Any] | None = None, **fault: Any
) -> tuple[str, dict]:
    """(``faulty::`` URL, storage options) wrapping ``url``; counts go to ``faults.STATS[tag]``."""
    faults.STATS.pop(tag, None)
    protocol = url.split("://")[0] if "://" in url else "file"
    return f"faulty::{url}", {"faulty": {"tag": tag, **fault}, protocol: inner or {}}


# -- classification ---------------------------------------------------------------------


def client_error(code: str, status: int, op: str = "GetObject") -> ClientError:
    return ClientError(
        {
            "Error": {"Code": code, "Message": f"{code} message"},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        op,
    )


T, NF, DENIED, PERM = Verdict.TRANSIENT, Verdict.NOT_FOUND, Verdict.DENIED, Verdict.PERMANENT
S3_CODES = [
    ("SlowDown", 503, T),
    ("ServiceUnavailable", 503, T),
    ("InternalError", 500, T),
    ("RequestTimeout", 400, T),
    ("Throttling", 400, T),
    ("", 502, T),
    ("Whatever", 504, T),
    ("TooManyRequestsException", 429, T),
    ("AccessDenied", 403, DENIED),
    ("InvalidAccessKeyId", 403, DENIED),
    ("SignatureDoesNotMatch", 403, DENIED),
    ("NoSuchBucket", 404, NF),
    ("NoSuchKey", 404, NF),
    ("404", 404, NF),
    ("InvalidBucketName", 400, PERM),
    ("InvalidRange", 416, PERM),
    ("MalformedXML", 400, PERM),
    ("WeirdNewError", 400, PERM),
]


@pytest.mark.parametrize("code,status,want", S3_CODES)
def test_classify_s3_codes_raw_and_as_s3fs_translates_them(
    code: str, status: int, want: Verdict
) -> None:
    raw = client_error(code, status)
    assert classify(raw) is want
    translated = translate_boto_error(raw)  # what s3fs actually raises
    assert isinstance(translated, OSError)
    assert classify(translated) is want, f"{code}: s3fs raised {type(translated).__name__}"


@pytest.mark.parametrize(
    "exc,want",
    [
        (ConnectionResetError(errno.ECONNRESET, "reset"), T),
        (ConnectionRefusedError(), T),
        (BrokenPipeError(), T),
        (TimeoutError("timed out"), T),
        (socket.timeout(), T),
        (FSTimeoutError(), T),
        (OSError(errno.EBUSY, "SlowDown"), T),
        (OSError(errno.ETIMEDOUT, "t"), T),
        (OSError("no errno"), T),
        (EndpointConnectionError(endpoint_url="http://x"), T),
        (ReadTimeoutError(endpoint_url="http://x"), T),
        (ConnectionClosedError(endpoint_url="http://x"), T),
        (aiohttp.ServerDisconnectedError(), T),
        (aiohttp.ClientPayloadError("cut"), T),
        (aiohttp.ClientResponseError(None, (), status=503), T),  # type: ignore[arg-type]
        (aiohttp.ClientResponseError(None, (), status=403), DENIED),  # type: ignore[arg-type]
        (FileNotFoundError("x"), NF),
        (PermissionError("x"), DENIED),
        (OSError(errno.EACCES, "x"), DENIED),
        (NoCredentialsError(), DENIED),
        (IsADirectoryError("x"), PERM),
        (FileExistsError("x"), PERM),
        (OSError(errno.EINVAL, "bad"), PERM),
        (OSError(errno.ENOSPC, "full"), PERM),
        (ValueError("bad"), PERM),
        (TypeError("bad kwarg"), PERM),
        (ParamValidationError(report="bad bucket name"), PERM),
        (KeyError("x"), PERM),
    ],
)
def test_classify_builtin_and_library_errors(exc: BaseException, want: Verdict) -> None:
    assert classify(exc) is want


def _obstore_error(kind: str, detail: str) -> BaseException:
    """An error as obstore raises it for a GET (``object_store``'s message format)."""
    from obstore import exceptions as ox

    body = f"Error performing GET http://127.0.0.1:9000/b/k in 4ms - {detail}\n\nDebug source:\nGeneric {{ .. }}"
    if kind == "nf":  # what 0.12.1 raised against moto
        return FileNotFoundError(f"Object at location k not found: {body}")
    return getattr(ox, kind)(body)


def _s3_reply(status: str, code: str) -> str:
    return (
        f'Server returned non-2xx status code: {status}: <?xml version="1.0"?><Error><Code>{code}</Code>'
        "<Message>m</Message></Error>"
    )


@pytest.mark.parametrize(
    "kind,detail,want",
    [
        ("GenericError", _s3_reply("503 Service Unavailable", "SlowDown"), T),
        ("GenericError", _s3_reply("500 Internal Server Error", "InternalError"), T),
        ("GenericError", "HTTP error: error sending request", T),  # connect refused / reset
        ("GenericError", "HTTP error: operation timed out", T),
        ("GenericError", _s3_reply("416 Range Not Satisfiable", "InvalidRange"), PERM),
        ("GenericError", _s3_reply("400 Bad Request", "InvalidArgument"), PERM),
        ("GenericError", _s3_reply("403 Forbidden", "AccessDenied"), DENIED),
        ("nf", _s3_reply("404 Not Found", "NoSuchKey"), NF),
        ("NotFoundError", "Object at location k not found", NF),
        (
            "GenericError",
            "Received redirect without LOCATION, this normally indicates an incorrectly configured "
            "region",
            PERM,
        ),
        ("PermissionDeniedError", "denied", DENIED),
        ("UnauthenticatedError", "no credentials", DENIED),
        ("InvalidPathError", "bad path", PERM),
        ("UnknownConfigurationKeyError", "bad key", PERM),
    ],
)
def test_classify_obstore_errors(kind: str, detail: str, want: Verdict) -> None:
    """obstore (the s3:// read path) raises its own exception types; the HTTP status and S3
    code in the message decide, like botocore's ``ClientError`` fields do."""
    assert classify(_obstore_error(kind, detail)) is want


def test_retry_policy_bounds_and_validation() -> None:
    policy = RetryPolicy(max_attempts=6, backoff_s=0.5, max_backoff_s=3.0)
    rng = random.Random(0)
    for attempt, cap in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (5, 3.0)]:
        delays = [policy.delay_s(attempt, rng) for _ in range(50)]
        assert all(0.5 * cap <= d <= cap for d in delays), (attempt, min(delays), max(delays))
    for bad in [dict(max_attempts=0), dict(backoff_s=-1.0), dict(backoff_s=2.0, max_backoff_s=1.0)]:
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def test_retry_policy_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_STORAGE_MAX_ATTEMPTS", "9")
    assert RetryPolicy.from_env() == RetryPolicy(
        max_attempts=9, backoff_s=0.001, max_backoff_s=0.01
    )
    monkeypatch.setenv("SHARDSMITH_STORAGE_MAX_ATTEMPTS", "many")
    with pytest.raises(ValueError, match="SHARDSMITH_STORAGE_MAX_ATTEMPTS='many'"):
        RetryPolicy.from_env()


# -- the store under injected faults ----------------------------------------------------


def test_every_call_fails_twice_then_succeeds_with_three_attempts() -> None:
    url, options = faulty(
        "memory://always", "always", fail_rate=1.0, max_consecutive=2, ops=ALL_OPS
    )
    store = Store(url, options, retry=RetryPolicy(max_attempts=3, backoff_s=0.001))
    store.write("a/k", b"payload")
    assert store.read("a/k") == b"payload"
    assert store.read_range("a/k", 2, 5) == b"ylo"
    assert store.size("a/k") == 7 and store.exists("a/k") and store.list_dir("a") == ["k"]
    store.delete("a/k")
    stats = faults.STATS["always"]
    assert (
        stats["injected:read"] == 4
        and stats["injected:write"] == 2
        and stats["injected:delete"] == 2
    )


def test_transient_faults_outlasting_the_attempts_name_the_url() -> None:
    url, options = faulty("memory://exhaust", "exhaust", fail_rate=1.0, max_consecutive=5)
    store = Store(url, options, retry=RetryPolicy(max_attempts=2, backoff_s=0.001))
    with pytest.raises(
        StorageError, match=r"write faulty::memory://exhaust/k failed after 2 attempts"
    ) as info:
        store.write("k", b"x")
    assert "injected" in str(info.value)


def test_permanent_fault_fails_fast_without_retrying() -> None:
    url, options = faulty("memory://denied", "denied", mode="permanent")
    store = Store(url, options, retry=FAST)
    with pytest.raises(
        StorageAccessDenied, match=r"write faulty::memory://denied/k: access denied"
    ):
        store.write("k", b"x")
    with pytest.raises(PermissionError, match="check the credentials"):
        store.read("k")
    assert faults.STATS["denied"]["calls:write"] == 1 and faults.STATS["denied"]["calls:read"] == 1


@pytest.fixture
def ckpt() -> dict[str, torch.Tensor]:
    return full_tensors(seed=11, with_optimizer=True)


def test_save_load_reshard_succeed_bitwise_under_30pct_transient_faults(
    ckpt: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """30% of writes, reads, stats and listings fail (resets, timeouts, SlowDown, 500/503,
    lost replies of writes that went through) on both the source and the target."""
    src_url, src_opts = faulty("memory://faulty-src", "src", fail_rate=0.3, seed=7, ops=ALL_OPS)
    src = Store(src_url, src_opts)
    save_offline(src, 5, ParallelDims(tp=2, dp_shard=2), ckpt)
    assert_bitwise_equal(load_full(src.child(step_dir(5))), ckpt, "load under faults")

    dst_url, dst_opts = faulty(str(tmp_path / "dst"), "dst", fail_rate=0.3, seed=8, ops=ALL_OPS)
    reshard(src.child(step_dir(5)), dst_url, ParallelDims(pp=2, tp=2), storage_options=dst_opts)
    assert find_latest_committed(Store(str(tmp_path / "dst"))) == 5
    assert_bitwise_equal(
        load_full(Store(str(tmp_path / "dst")).child(step_dir(5))), ckpt, "resharded"
    )
    src_stats, dst_stats = faults.STATS["src"], faults.STATS["dst"]  # the faults did fire
    assert src_stats["injected:write"] >= 1 and src_stats["injected:read"] >= 20, src_stats
    assert dst_stats["injected:write"] >= 1, dst_stats


def test_s3_multipart_upload_survives_part_faults(s3_url: S3Prefix) -> None:
    """Most S3 write calls (create, each part, complete) fail, some after the server already
    applied them; each part is retried on its own. (Which calls fail hashes the test's random
    prefix: at a rate of 0.5, none of the 5 calls failed once in CI, 1 run in 32; at 0.8, 1 in
    3,125; each call fails at most twice in a row, so 14 attempts always get through.)"""
    url, options = faulty(s3_url.url, "mpu", inner=s3_url.storage_options, fail_rate=0.8, seed=3)
    # Parts go up from several threads, so which call draws which fault varies from run to run:
    # with 5 attempts a call failing all of them (1/32 each, 5+ calls) made this test flaky.
    store = Store(
        url, options, retry=RetryPolicy(max_attempts=14, backoff_s=0.001, max_backoff_s=0.01)
    )
    data = os.urandom(20 * MiB)
    store.write_parts("big", [memoryview(data)[: 11 * MiB], memoryview(data)[11 * MiB :]])
    assert Store(s3_url.url, s3_url.storage_options).read("big") == data
    assert faults.STATS["mpu"]["injected:write"] >= 1, faults.STATS["mpu"]


def _committed(root: Store) -> list[int]:
    return [s.step for s in list_steps(root) if s.committed]


@pytest.mark.parametrize("match", ["*/shards/rank-00001.safetensors", "*/manifest.json"])
def test_permanent_fault_during_save_commits_nothing(
    ckpt: dict[str, torch.Tensor], match: str
) -> None:
    root_url = "memory://perm-save-" + match.strip("*/").replace("/", "-")
    save_offline(Store(root_url), 1, ParallelDims(tp=2), ckpt)
    url, options = faulty(root_url, "perm-" + match, mode="permanent", ops=["write"], match=match)
    with pytest.raises(
        StorageAccessDenied,
        match=r"faulty::memory://perm-save-.*/step-000000002/"
        + re.escape(match[2:])
        + ": access denied",
    ):
        save_offline(Store(url, options, retry=FAST), 2, ParallelDims(dp_shard=2), ckpt)
    root = Store(root_url)
    assert _committed(root) == [1] and read_latest_hint(root) == step_dir(1)
    assert not root.exists(f"{step_dir(2)}/manifest.json")
    assert_bitwise_equal(load_full(root.child(step_dir(1))), ckpt, "the previous step")
    assert faults.STATS["perm-" + match]["calls:write"] >= 1


def test_permanent_fault_during_reshard_commits_nothing(
    ckpt: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    src = Store("memory://perm-reshard-src")
    save_offline(src, 3, ParallelDims(tp=2), ckpt)
    dst_root = Store(str(tmp_path / "dst"))
    save_offline(dst_root, 1, ParallelDims(), ckpt)  # an older committed step
    url, options = faulty(
        str(tmp_path / "dst"),
        "perm-reshard",
        mode="permanent",
        ops=["write"],
        match="*/rank-00001.safetensors",
    )
    with pytest.raises(StorageAccessDenied, match=r"rank-00001\.safetensors: access denied"):
        reshard(src.child(step_dir(3)), url, ParallelDims(pp=2), storage_options=options)
    assert _committed(dst_root) == [1] and read_latest_hint(dst_root) == step_dir(1)
    assert not dst_root.exists(f"{step_dir(3)}/manifest.json")


# -- the trainer's save path (a 1-process gloo group in this process) ---------------------


def _trainer_save(root: Store, step: int, tensors: dict[str, torch.Tensor]) -> Any:
    from shardsmith.trainer.checkpoint.save_load import save_checkpoint

    return save_checkpoint(
        root, step, tensors, model_cfg=MODEL, dims=ParallelDims(), config={}, state={"step": step}
    )


def test_trainer_save_retries_transient_and_reports_permanent_faults(
    gloo_group: None, ckpt: dict[str, torch.Tensor]
) -> None:
    url, options = faulty("memory://trainer-save", "trainer", fail_rate=0.5, seed=2, ops=ALL_OPS)
    _trainer_save(Store(url, options), 4, ckpt)
    root = Store("memory://trainer-save")
    assert _committed(root) == [4]
    assert_bitwise_equal(load_full(root.child(step_dir(4))), ckpt, "trainer save under faults")
    stats = faults.STATS["trainer"]
    assert stats["injected:write"] >= 1, stats

    url, options = faulty(
        "memory://trainer-save", "trainer-perm", mode="permanent", ops=["write"], match="*/shards/*"
    )
    with pytest.raises(
        SaveError, match=r"step 6 not committed.*shards/rank-00000\.safetensors: access denied"
    ):
        _trainer_save(Store(url, options, retry=FAST), 6, ckpt)
    assert _committed(root) == [4] and read_latest_hint(root) == step_dir(4)


# -- the wrapper itself -----------------------------------------------------------------


def test_fault_pattern_is_reproducible_and_bounded() -> None:
    """Same seed, same calls -> same faults, whatever the thread interleaving."""

    def run(tag: str) -> Counter[str]:
        url, options = faulty("memory://repro", tag, fail_rate=0.5, seed=99, ops=["write"])
        store = Store(url, options, retry=RetryPolicy(max_attempts=3, backoff_s=0.0))
        threads = [threading.Thread(target=store.write, args=(f"k{i}", b"v")) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return faults.STATS[tag]

    first, second = run("repro-a"), run("repro-b")
    assert first == second and first["injected:write"] > 0


def test_a_failed_source_read_stops_every_read_of_the_reshard(
    ckpt: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The source's shard files refuse every read: the reshard raises the first error after at
    most the reads already in flight, instead of starting every queued slab (each a full retry loop
    against a dead server: 880 retries over 2 min in a user's trial)."""
    save_offline(Store("memory://stop-src"), 3, ParallelDims(tp=2, dp_shard=2), ckpt)
    url, fault = faulty(
        "memory://stop-src", "stop", mode="permanent", ops=["read"], match="*/shards/*.safetensors"
    )
    options = ReshardOptions(slab_nbytes=2**20 // 16, max_buffer_nbytes=2**20 // 2, workers=4)
    src = Store(url, fault, retry=FAST).child(step_dir(3))
    manifest = read_manifest(Store("memory://stop-src").child(step_dir(3)))
    plan_reads = sum(
        len(s.pieces) for s in plan_reshard(manifest, ParallelDims(tp=1), options).slabs()
    )
    with pytest.raises(StorageAccessDenied, match=r"rank-0000\d.safetensors: access denied"):
        reshard(src, str(tmp_path / "dst"), ParallelDims(tp=1), options=options)
    reads = faults.STATS["stop"]["calls:read"]
    assert plan_reads > 200 and reads <= 30, (reads, plan_reads)  # before the fix: 421 reads


def test_the_classifier_knows_a_library_loaded_after_it() -> None:
    """The library exception classes are looked up when classifying, not at import."""
    code = (
        "from shardsmith.storage.store.retry import Verdict, classify\n"
        "import aiohttp\n"
        "assert classify(aiohttp.ServerDisconnectedError()) is Verdict.TRANSIENT\n"
        "from botocore.exceptions import NoCredentialsError\n"
        "assert classify(NoCredentialsError()) is Verdict.DENIED\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_library_masked_in_sys_modules_does_not_break_the_classifier(monkeypatch) -> None:
    """``sys.modules[name] = None`` (how tests hide a library) counts as not loaded."""
    from shardsmith.storage.store.retry import Verdict, classify

    for name in ("botocore", "aiohttp", "obstore"):
        monkeypatch.setitem(sys.modules, name, None)
    assert classify(ConnectionResetError()) is Verdict.TRANSIENT
    assert classify(FileNotFoundError("x")) is Verdict.NOT_FOUND
