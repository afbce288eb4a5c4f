"""The ledger's tiles served read-only over HTTP as C2SP tlog-tiles says (c2sp.org/tlog-tiles),
for verifiers who trust nothing but the vault's verifier key: `checkpoint`, `tile/L/N[.p/W]`
and `tile/entries/N[.p/W]` from the tile folder, and nothing else."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from vault.errors import InvalidArgument, Unavailable
from vault.ledger.tiles import CHECKPOINT, ENTRIES, Tile, parse_tile_path

log = logging.getLogger(__name__)

IMMUTABLE: Final = "public, max-age=31536000, immutable"
# The checkpoint changes with every signature; a partial tile never changes, but it is dropped
# once its full tile is written.
CHECKPOINT_CACHE: Final = "public, max-age=5"
PARTIAL_CACHE: Final = "public, max-age=60"
NOT_CACHED: Final = "no-store"
OCTETS: Final = "application/octet-stream"
TEXT: Final = "text/plain; charset=utf-8"

_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


class TilesServer:
    """An HTTP server for the tile folder `root` on `host`:`port` (port 0: one the system
    picks, read back in `port` once started). At most `threads` requests are served at once;
    a connection beyond them is answered 503 at once, and one that sends nothing for `timeout`
    seconds is closed.

    Nobody is asked who they are: the checkpoint and the hash tiles say nothing but hashes,
    while the entry bundles hold every entry (what only an auditor may list through the gRPC
    service when credentials are on), so `entries=False` leaves them out."""

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        threads: int = 16,
        timeout: float = 10.0,
        entries: bool = True,
    ) -> None:
        self.root = root
        self.entries = entries
        self.host = host
        self._port = port
        self._threads = threads
        self._timeout = timeout
        self._server: _Server | None = None
        self._loop: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the tiles server is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> Self:
        if self._server is not None:
            raise RuntimeError("the tiles server is already started")
        if not 0 <= self._port <= 65535:
            raise InvalidArgument(f"a tiles port is 0 to 65535, not {self._port}")
        try:
            self._server = _Server(
                (self.host, self._port),
                self.root,
                slots=self._threads,
                timeout=self._timeout,
                entries=self.entries,
            )
        except OSError as exc:
            raise Unavailable(
                f"cannot serve tiles on {self.host}:{self._port}: {exc.strerror or exc}"
            ) from None
        self._loop = threading.Thread(
            target=self._server.serve_forever, name="tiles-http", daemon=True
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


class _Server(HTTPServer):
    """An HTTP server with a bounded number of handler threads."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], root: Path, *, slots: int, timeout: float, entries: bool
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.root = root
        self.entries = entries
        self.request_timeout = timeout
        self._slots = threading.BoundedSemaphore(slots)
        super().__init__(address, _Handler)

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
        log.exception("tiles request from %s failed", client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "pinvault-tiles"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # A read that waits longer ends the connection (handle_one_request catches it).
        self.connection.settimeout(self.server.request_timeout)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.command not in ("GET", "HEAD"):
            self._answer(405, "method not allowed\n", NOT_CACHED, allow="GET, HEAD")
            self.close_connection = True
            return False
        return True

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, *, body: bool) -> None:
        # The request target as sent (`path` has had its leading slashes merged) must be exactly
        # a path the spec names: nothing is decoded, joined or normalised, so no spelling of it
        # reaches a file outside the tiles.
        words = self.requestline.split()
        found = _resource(words[1], entries=self.server.entries) if len(words) > 1 else None
        if found is None:
            self._answer(404, "not found\n", NOT_CACHED, body=body)
            return
        relative, content_type, cache = found
        try:
            fd = os.open(self.server.root / relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self._answer(404, "not found\n", NOT_CACHED, body=body)
            return
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                self._answer(404, "not found\n", NOT_CACHED, body=body)
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(info.st_size))
            self.send_header("Cache-Control", cache)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if body:
                shutil.copyfileobj(file, self.wfile, 1 << 16)

    def _answer(
        self, status: int, text: str, cache: str, *, body: bool = True, allow: str | None = None
    ) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", TEXT)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", cache)
        if allow is not None:
            self.send_header("Allow", allow)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("tiles %s: " + format, self.address_string(), *args)


def _resource(target: str, *, entries: bool) -> tuple[str, str, str] | None:
    """The file a request target names in the tile folder, its content type and its caching,
    or None when it names nothing served (entry bundles, unless `entries`)."""
    if not target.startswith("/"):
        return None
    path = target[1:]
    if path == CHECKPOINT:
        return CHECKPOINT, TEXT, CHECKPOINT_CACHE
    tile: Tile | None = parse_tile_path(path)
    if tile is None or (tile.level == ENTRIES and not entries):
        return None
    return tile.path, OCTETS, IMMUTABLE if tile.full else PARTIAL_CACHE
