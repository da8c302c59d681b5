"""A real S3-compatible server on loopback for tests: moto's ``ThreadedMotoServer``.

It speaks the S3 REST protocol over HTTP on ``127.0.0.1:<free port>``; s3fs, botocore
and subprocesses (torchrun workers) talk to it exactly as to AWS. Nothing of s3fs is mocked.

Use the fixtures from a test module (``tests/conftest.py`` belongs to someone else)::

    from s3server import s3_server, s3_url  # noqa: F401  (pytest fixtures)

    def test_x(s3_url):  # s3_url: S3Prefix with .url, .storage_options, .env
        Store(s3_url.url, s3_url.storage_options).write("k", b"v")

Or run it by hand: ``python tests/helpers/s3server.py`` prints the endpoint and the env to export.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

#: Dummy credentials: moto accepts any; botocore needs some to sign requests.
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """A running loopback S3 server and the bucket created on it."""

    endpoint_url: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server (what ``--storage-option`` would give)."""
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment reaching this server (for subprocesses; botocore
        reads ``AWS_ENDPOINT_URL`` itself)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")


@dataclass(frozen=True)
class S3Prefix:
    """A fresh, empty prefix in the test bucket (one per test)."""

    server: S3Server
    url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.server.storage_options

    @property
    def env(self) -> dict[str, str]:
        return self.server.env


def create_bucket(endpoint_url: str, bucket: str) -> None:
    """Create ``bucket`` on the server (no LocationConstraint: us-east-1 refuses one)."""
    import fsspec

    fs = fsspec.filesystem(
        "s3",
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        skip_instance_cache=True,
        client_kwargs={"endpoint_url": endpoint_url, "region_name": REGION},
    )
    fs.call_s3("create_bucket", Bucket=bucket)


def start_server(bucket: str = "shardsmith-test") -> tuple[Any, S3Server]:
    """Start moto on a free loopback port and create ``bucket``.

    Returns:
        (the ``ThreadedMotoServer``, to ``stop()``; the :class:`S3Server` description).
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log on stderr
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    info = S3Server(endpoint_url=f"http://{host}:{port}", bucket=bucket)
    try:
        create_bucket(info.endpoint_url, bucket)
    except BaseException:
        server.stop()
        raise
    return server, info


_RUNNING: tuple[Any, S3Server] | None = None
_LOCK = threading.Lock()


def shared_server() -> S3Server:
    """The one server of this process, started on first use and stopped at exit.

    A process-wide singleton rather than only a session fixture: test modules that import
    the fixtures each get their own fixture definition, and must still share one server.
    """
    global _RUNNING
    with _LOCK:
        if _RUNNING is None:
            _RUNNING = start_server()
            atexit.register(_RUNNING[0].stop)
        return _RUNNING[1]


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """The loopback S3 server (and bucket) shared by the whole test session."""
    return shared_server()


@pytest.fixture
def s3_url(s3_server: S3Server) -> S3Prefix:
    """A unique empty prefix ``s3://<bucket>/t-<hex>`` for one test."""
    return S3Prefix(server=s3_server, url=s3_server.url(f"t-{uuid.uuid4().hex[:12]}"))


if __name__ == "__main__":
    import time

    _server, _info = start_server()
    print(f"S3 endpoint {_info.endpoint_url}, bucket {_info.bucket}; export:")
    for _k, _v in _info.env.items():
        print(f"export {_k}={_v}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _server.stop()
