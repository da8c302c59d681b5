"""Streamed S3 multipart upload with parallel, individually retried parts.

s3fs's own file object uploads the parts of a streamed write one after another, and
its ``pipe_file`` needs the whole object in one buffer. :class:`MultipartWriter` takes
bytes as they come, cuts them into parts and uploads up to ``max_concurrency`` parts at
once, each through the caller's retry wrapper, so a transient failure re-sends one part,
not the object. The object appears only at ``CompleteMultipartUpload`` (atomic on S3);
a failure aborts the upload so no parts linger. Objects no larger than one part go up
as a single ``PutObject``.

Memory: at most ``max_concurrency + 1`` parts are held at once.
See https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpuoverview.html (5 MiB to
5 GiB per part except the last, at most 10,000 parts).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from shardsmith.storage.crashpoints import crash_point

MAX_PARTS = 10_000
MIN_PART_NBYTES = 5 * 2**20

#: ``retry(fn)``: run ``fn`` under the store's retry policy, raising its errors.
Retry = Callable[[Callable[[], Any]], Any]


def part_size(part_nbytes: int, nbytes_hint: int | None) -> int:
    """Part size: ``part_nbytes``, grown when ``nbytes_hint`` bytes would need more than
    9,000 parts (headroom below S3's 10,000)."""
    if nbytes_hint:
        return max(part_nbytes, -(-nbytes_hint // 9_000))
    return part_nbytes


class MultipartWriter:
    """A write-only binary stream to one S3 object (``write``, then ``finish`` or ``abort``).

    Args:
        fs: an s3fs ``S3FileSystem`` (or a wrapper exposing its ``call_s3``/``split_path``).
        path: ``bucket/key``.
        retry: the caller's retry wrapper.
        part_nbytes: part size in bytes (>= 5 MiB).
        max_concurrency: parts uploaded at once (>= 1).
    """

    def __init__(
        self, fs: Any, path: str, retry: Retry, part_nbytes: int, max_concurrency: int
    ) -> None:
        if part_nbytes < MIN_PART_NBYTES:
            raise ValueError(
                f"part_nbytes={part_nbytes}: S3 parts must be at least {MIN_PART_NBYTES} bytes"
            )
        self.fs, self.path, self.retry = fs, path, retry
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_nbytes = part_nbytes
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[Future[dict[str, Any]]] = []
        self.nbytes = 0
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="s3-part")
        self._done = False

    def write(self, data: Any) -> int:
        """Append ``data`` (any bytes-like); full parts go up in the background. Each byte
        is copied once into its part (twice when it arrives in pieces smaller than a part)."""
        view = memoryview(data).cast("B")
        count = len(view)
        self.nbytes += count
        while len(view):
            if not self.buffer and len(view) >= self.part_nbytes:
                self._submit(bytes(view[: self.part_nbytes]))
                view = view[self.part_nbytes :]
                continue
            take = view[: self.part_nbytes - len(self.buffer)]
            self.buffer += take
            view = view[len(take) :]
            if len(self.buffer) == self.part_nbytes:
                self._submit(bytes(self.buffer))
                self.buffer = bytearray()
        return count

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)

    def _submit(self, body: bytes) -> None:
        for fut in self.parts:  # surface a failed part early
            if fut.done() and fut.exception() is not None:
                fut.result()
        if self.upload_id is None:
            self.upload_id = self.retry(lambda: self._call("create_multipart_upload"))["UploadId"]
        number = len(self.parts) + 1
        self._slots.acquire()  # bounds the parts held in memory
        try:
            self.parts.append(self._pool.submit(self._upload_part, number, body))
        except BaseException:
            self._slots.release()
            raise

    def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        try:
            out = self.retry(
                lambda: self._call(
                    "upload_part", UploadId=self.upload_id, PartNumber=number, Body=body
                )
            )
            crash_point("fs.mid_write", key=self.path)  # test hook; inert normally
            return {"PartNumber": number, "ETag": out["ETag"]}
        finally:
            self._slots.release()

    def finish(self) -> None:
        """Upload what is left and publish the object (one ``PutObject`` when it fits one part)."""
        try:
            if self.upload_id is None:
                body = bytes(self.buffer)
                self.retry(lambda: self.fs.pipe_file(self.path, body))
            else:
                if self.buffer or not self.parts:
                    self._submit(bytes(self.buffer))
                self.buffer = bytearray()
                etags = [fut.result() for fut in self.parts]
                crash_point("fs.before_publish", key=self.path)  # test hook; inert normally
                self.retry(lambda: self._complete(etags))
            self._done = True
        finally:
            self._pool.shutdown(wait=True)
            self.fs.invalidate_cache(self.path)

    def _complete(self, etags: list[dict[str, Any]]) -> None:
        try:
            self._call(
                "complete_multipart_upload",
                UploadId=self.upload_id,
                MultipartUpload={"Parts": etags},
            )
        except FileNotFoundError:
            # NoSuchUpload on a retry: the earlier attempt completed but its reply was lost.
            self.fs.invalidate_cache(self.path)
            if int(self.fs.info(self.path)["size"]) != self.nbytes:
                raise

    def abort(self) -> None:
        """Drop the upload (best effort); nothing appears under the key."""
        for fut in self.parts:
            fut.cancel()
        self._pool.shutdown(wait=True)
        if self.upload_id is not None and not self._done:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self.upload_id)
