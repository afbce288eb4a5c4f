"""The vault's read-only HTTP endpoints (tiles, metrics) on one bounded server: at most a set
number of requests at once (one more is answered 503 from the accepting thread, which never
waits on a caller), a timeout on every read, GET and HEAD only. Nobody is asked who they are,
so what an endpoint serves must be public."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import TracebackType
from typing import Any, Final, Self

from vault.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

NOT_CACHED: Final = "no-store"
TEXT: Final = "text/plain; charset=utf-8"

_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


class ReadOnlyHandler(BaseHTTPRequestHandler):
    """A request to a read-only endpoint: GET or HEAD (anything else is 405), each read of it
    bounded by the server's timeout. Subclasses answer in `respond`."""

    server: BoundedServer
    protocol_version = "HTTP/1.1"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # A read that waits longer ends the connection (handle_one_request catches it).
        self.connection.settimeout(self.server.request_timeout)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.command not in ("GET", "HEAD"):
            self.answer(405, "method not allowed\n", NOT_CACHED, allow="GET, HEAD")
            self.close_connection = True
            return False
        return True

    def do_GET(self) -> None:
        self.respond(body=True)

    def do_HEAD(self) -> None:
        self.respond(body=False)

    def respond(self, *, body: bool) -> None:
        raise NotImplementedError

    def target(self) -> str:
        """The request target exactly as sent (`path` has had its leading slashes merged)."""
        words = self.requestline.split()
        return words[1] if len(words) > 1 else ""

    def answer(
        self,
        status: int,
        data: bytes | str,
        cache: str,
        *,
        content_type: str = TEXT,
        body: bool = True,
        allow: str | None = None,
    ) -> None:
        payload = data.encode() if isinstance(data, str) else data
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", cache)
        self.send_header("X-Content-Type-Options", "nosniff")
        if allow is not None:
            self.send_header("Allow", allow)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s: " + format, self.server.what, self.address_string(), *args)


class BoundedServer(HTTPServer):
    """An HTTP server with a bounded number of handler threads; `what` names it in messages."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        endpoint: Endpoint,
        *,
        slots: int,
        timeout: float,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.endpoint = endpoint
        self.what = endpoint.what
        self.request_timeout = timeout
        self._slots = threading.BoundedSemaphore(slots)
        super().__init__(address, endpoint.handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Answered from the accepting thread, which must never wait on a caller.
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        threading.Thread(
            target=self._serve_one, args=(request, client_address), daemon=True
        ).start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("%s request from %s failed", self.what, client_address)


class Endpoint:
    """A read-only HTTP endpoint on `host`:`port` (port 0: one the system picks, read back in
    `port` once started), served by `handler` on at most `threads` threads; subclasses set
    `what`, `handler` and `path`, and their handler reads what it serves from
    `self.server.endpoint`."""

    what = "http"
    handler: type[ReadOnlyHandler] = ReadOnlyHandler
    path = "/"

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, threads: int, timeout: float
    ) -> None:
        self.host = host
        self._port = port
        self._threads = threads
        self._timeout = timeout
        self._server: BoundedServer | None = None
        self._loop: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError(f"the {self.what} server is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    def start(self) -> Self:
        if self._server is not None:
            raise RuntimeError(f"the {self.what} server is already started")
        if not 0 <= self._port <= 65535:
            raise InvalidArgument(f"a {self.what} port is 0 to 65535, not {self._port}")
        try:
            server = BoundedServer(
                (self.host, self._port),
                self,
                slots=self._threads,
                timeout=self._timeout,
            )
        except OSError as exc:
            raise Unavailable(
                f"cannot serve {self.what} on {self.host}:{self._port}: {exc.strerror or exc}"
            ) from None
        self._server = server
        self._loop = threading.Thread(
            target=server.serve_forever, name=f"{self.what}-http", daemon=True
        )
        self._loop.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._loop is not None:
            self._loop.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
