"""Unfinished multipart uploads under a root: list them, abort the stale ones.

A process killed during a large S3 write leaves its multipart upload open; S3 keeps (and
bills) the uploaded parts until the upload is completed or aborted, and no listing of
objects shows them. :func:`list_uploads` finds them with ``ListMultipartUploads`` under the
root's prefix; :func:`abort_stale_uploads` aborts those older than a grace period (a save in
flight on another machine is younger). Local and in-memory stores have no uploads.

Add a bucket lifecycle rule as well (``AbortIncompleteMultipartUpload`` after a day,
https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpu-abort-incomplete-mpu-lifecycle-config.html):
this module cleans roots that shardsmith is pointed at, the rule cleans everything.
"""

from __future__ import annotations

import datetime as _dt
import functools
from dataclasses import dataclass
from typing import Any

from shardsmith.storage.store.fs import Store

#: Default grace period: uploads younger than this may belong to a save in flight.
DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True)
class Upload:
    """One unfinished multipart upload.

    Attributes:
        key: the object key the upload would create (bucket-relative).
        upload_id: S3's id of the upload.
        age_s: seconds since it was initiated.
    """

    key: str
    upload_id: str
    age_s: float


def _s3_parts(store: Store) -> tuple[Any, str, str] | None:
    """``(s3fs, bucket, prefix)`` of an S3 store, or None for other backends."""
    protocol = store.fs.protocol
    if not (
        ("s3" in protocol) if isinstance(protocol, (tuple, list)) else protocol in ("s3", "s3a")
    ):
        return None
    bucket, prefix, _ = store.fs.split_path(store.root)
    return store.fs, bucket, (prefix.rstrip("/") + "/") if prefix else ""


def has_uploads(store: Store) -> bool:
    """Whether ``store``'s backend has multipart uploads to list (S3); local files and
    ``memory://`` have none."""
    return _s3_parts(store) is not None


def list_uploads(store: Store) -> list[Upload]:
    """Unfinished multipart uploads whose key lies under ``store``'s root, oldest first.

    Any rank or a single process may call it; it only lists.

    Raises:
        StorageError: the listing failed after retries (names the URL).
    """
    parts = _s3_parts(store)
    if parts is None:
        return []
    fs, bucket, prefix = parts
    now = _dt.datetime.now(_dt.timezone.utc)
    uploads: list[Upload] = []
    marker: dict[str, str] = {}
    while True:
        page = store._call(
            "list uploads",
            "",
            lambda: fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker),
        )
        for item in page.get("Uploads", []):
            age = (now - item["Initiated"]).total_seconds()
            uploads.append(Upload(key=item["Key"], upload_id=item["UploadId"], age_s=max(age, 0.0)))
        if not page.get("IsTruncated"):
            break
        marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
    return sorted(uploads, key=lambda u: -u.age_s)


def abort_stale_uploads(
    store: Store, *, grace_s: float = DEFAULT_GRACE_S, dry_run: bool = False
) -> list[Upload]:
    """Abort the unfinished uploads under ``store`` older than ``grace_s`` seconds.

    Called by one process (``shardsmith gc``, or rank 0 after a commit). An upload that
    vanished meanwhile (completed or aborted by its writer) is skipped.

    Returns:
        The uploads aborted (or, with ``dry_run``, those that would be).
    """
    stale = [u for u in list_uploads(store) if u.age_s >= grace_s]
    parts = _s3_parts(store)
    if dry_run or parts is None:
        return stale
    fs, bucket, _ = parts
    done: list[Upload] = []
    for upload in stale:
        try:
            store._call(
                "abort upload",
                upload.key,
                functools.partial(
                    fs.call_s3,
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=upload.key,
                    UploadId=upload.upload_id,
                ),
            )
        except FileNotFoundError:
            continue
        done.append(upload)
    return done
