"""A loopback HTTP proxy in front of the test S3 server that answers some GETs itself with
S3's ``503 SlowDown`` (what a throttled bucket sends), forwarding everything else.

    with ThrottlingProxy(server.endpoint_url, fail_gets=2) as proxy:
        Store(url, {..., "client_kwargs": {"endpoint_url": proxy.endpoint_url, ...}})

``fail_gets``: how many GETs (counted over the proxy's life) get the 503 before GETs go
through; ``gets`` / ``throttled`` count what it saw.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class ThrottlingProxy:
    """Forward to ``upstream`` (``http://host:port``); the first ``fail_gets`` GETs get a 503."""

    def __init__(self, upstream: str, fail_gets: int) -> None:
        self.upstream = urlsplit(upstream)
        self.fail_gets = fail_gets
        self.gets = 0
        self.throttled = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "GET":
                    with proxy.lock:
                        proxy.gets += 1
                        throttle = proxy.throttled < proxy.fail_gets
                        proxy.throttled += throttle
                    if throttle:
                        self.send_response(503)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(SLOW_DOWN)))
                        self.end_headers()
                        self.wfile.write(SLOW_DOWN)
                        return
                conn = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=30
                )
                try:
                    conn.request(
                        self.command, self.path, body=body or None, headers=dict(self.headers)
                    )
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                self.send_response(reply.status)
                head = self.command == "HEAD"  # keeps the upstream's Content-Length
                for name, value in reply.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection") and (
                        head or name.lower() != "content-length"
                    ):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "ThrottlingProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
