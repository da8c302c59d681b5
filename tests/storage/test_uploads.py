"""Unfinished multipart uploads left by killed writers: listed and aborted on a real S3 server."""

from __future__ import annotations

from s3server import s3_server, s3_url  # noqa: F401  (pytest fixtures)

from shardsmith.storage.store.fs import Store
from shardsmith.storage.store.multipart import MultipartWriter
from shardsmith.storage.store.uploads import abort_stale_uploads, list_uploads


def _orphan(store: Store, key: str) -> str:
    """Start a multipart upload with one part and never finish it (a killed process)."""
    writer = MultipartWriter(store.fs, store._path(key), lambda fn: fn(), 5 * 2**20, 1)
    writer.write(b"x" * (5 * 2**20))
    writer.write(b"y")
    for fut in writer.parts:
        fut.result()
    writer._pool.shutdown(wait=True)
    assert writer.upload_id is not None
    return writer.upload_id


def test_orphaned_upload_listed_and_aborted(s3_url):
    store = Store(s3_url.url, s3_url.storage_options)
    other = Store(s3_url.url + "-other", s3_url.storage_options)
    upload_id = _orphan(store, "step-000000004/shards/rank-00000.safetensors")
    _orphan(other, "step-000000004/shards/rank-00000.safetensors")
    found = list_uploads(store)
    assert len(found) == 1, "an upload under another root was listed"
    assert found[0].upload_id == upload_id
    assert found[0].key.endswith("step-000000004/shards/rank-00000.safetensors")
    # younger than the grace period: kept (it may be a save in flight). moto reports every
    # upload as initiated on 2010-11-10, so the grace here is longer than that.
    assert abort_stale_uploads(store, grace_s=found[0].age_s + 3600) == []
    assert len(list_uploads(store)) == 1
    assert [u.upload_id for u in abort_stale_uploads(store, grace_s=0, dry_run=True)] == [upload_id]
    assert len(list_uploads(store)) == 1
    aborted = abort_stale_uploads(store, grace_s=0)
    assert [u.upload_id for u in aborted] == [upload_id]
    assert list_uploads(store) == []
    assert len(list_uploads(other)) == 1


def test_local_store_has_no_uploads(tmp_path):
    assert list_uploads(Store(str(tmp_path))) == []
    assert abort_stale_uploads(Store(str(tmp_path)), grace_s=0) == []


def test_ls_counts_and_gc_aborts_orphaned_uploads(s3_url):
    """`ls` mentions unfinished uploads; `gc --uploads --dry-run` lists, `gc` aborts them."""
    from click.testing import CliRunner

    from shardsmith.cli.main import cli

    store = Store(s3_url.url, s3_url.storage_options)
    store.write("step-000000002/shards/x", b"x")  # the root exists
    upload_id = _orphan(store, "step-000000004/shards/rank-00000.safetensors")
    opts = [
        arg
        for k, v in s3_url.storage_options.items()
        if isinstance(v, (str, int, bool))
        for arg in ("--storage-option", f"{k}={v}")
    ]
    opts += [
        arg
        for k, v in s3_url.storage_options.get("client_kwargs", {}).items()
        for arg in ("--storage-option", f"client_kwargs.{k}={v}")
    ]
    run = CliRunner().invoke
    result = run(cli, ["ls", s3_url.url, *opts])
    assert result.exit_code == 0 and "1 unfinished multipart uploads" in result.output, (
        result.output
    )
    result = run(cli, ["gc", "--uploads", "--dry-run", s3_url.url, *opts])
    assert result.exit_code == 0 and "would abort upload" in result.output, result.output
    assert [u.upload_id for u in list_uploads(store)] == [upload_id]
    # moto dates every upload 2010-11-10, so one older than the default grace (1h)
    result = run(cli, ["gc", s3_url.url, *opts])
    assert result.exit_code == 0 and "aborted 1 unfinished uploads" in result.output, result.output
    assert list_uploads(store) == []
    assert store.exists("step-000000002/shards/x")  # no committed step: may be a save in progress
