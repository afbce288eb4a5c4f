"""A hostile network in front of a registry, for tests: an HTTP proxy on 127.0.0.1 port 0 that
forwards every request to a real registry and changes one byte in the middle of the blobs a
test names on their way back, keeping every header (the length, the digest the registry
states) as sent, so that only a client's own check of the bytes against their digest can
catch it. A real server cannot be made to lie; this proxy can.

    with TamperingRegistryProxy(registry_address) as proxy:
        proxy.tamper(layer_digest)
        skopeo copy docker://{proxy.address}/lab/img:v1 ...
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self

_PIECE = 64 * 1024
# Headers that belong to one hop of HTTP, not to the message.
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"})


class TamperingRegistryProxy:
    """Forwards to `upstream` (host:port), the client's Host kept (so a registry's challenge
    sends the client back through the proxy); blobs whose digest is in `tampered` come back
    with one byte changed. `paths` lists every request's path, `served` each tampered blob
    once it was sent."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.address = ""
        self.tampered: set[str] = set()
        self.served: list[str] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def tamper(self, digest: str) -> None:
        with self._lock:
            self.tampered.add(digest)

    def _target(self, path: str) -> str | None:
        """The tampered digest a blob GET of `path` asks for, if any."""
        head, _, digest = path.partition("?")[0].rpartition("/")
        with self._lock:
            return digest if head.endswith("/blobs") and digest in self.tampered else None

    def start(self) -> Self:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                host, _, port = proxy.upstream.rpartition(":")
                upstream = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else None
                    with proxy._lock:
                        proxy.paths.append(self.path)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    target = proxy._target(self.path) if self.command == "GET" else None
                    self.send_response(answer.status, answer.reason)
                    for key, value in answer.getheaders():
                        if key.lower() not in _HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    size = answer.getheader("Content-Length")
                    if self.command == "HEAD" or size is not None:
                        self.send_header("Content-Length", size or "0")
                        self.end_headers()
                        if self.command != "HEAD":
                            self._copy(answer, int(size or 0), target)
                    else:
                        data = answer.read()
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                finally:
                    upstream.close()

            def _copy(
                self, answer: http.client.HTTPResponse, size: int, target: str | None
            ) -> None:
                middle, sent = size // 2, 0
                while piece := answer.read(_PIECE):
                    if target is not None and sent <= middle < sent + len(piece):
                        changed = bytearray(piece)
                        changed[middle - sent] ^= 0x01
                        piece = bytes(changed)
                        with proxy._lock:
                            proxy.served.append(target)
                    self.wfile.write(piece)
                    sent += len(piece)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self.address = f"127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(target=server.serve_forever, name="registry-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
