"""The ledger's tiles served read-only over HTTP as C2SP tlog-tiles says (c2sp.org/tlog-tiles),
for verifiers who trust nothing but the vault's verifier key: `checkpoint`, `tile/L/N[.p/W]`
and `tile/entries/N[.p/W]` from the tile folder, and nothing else."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Final

from vault.ledger.tiles import CHECKPOINT, ENTRIES, Tile, parse_tile_path
from vault.server.http_endpoint import NOT_CACHED, TEXT, Endpoint, ReadOnlyHandler

IMMUTABLE: Final = "public, max-age=31536000, immutable"
# The checkpoint changes with every signature; a partial tile never changes, but it is dropped
# once its full tile is written.
CHECKPOINT_CACHE: Final = "public, max-age=5"
PARTIAL_CACHE: Final = "public, max-age=60"
OCTETS: Final = "application/octet-stream"


class _Handler(ReadOnlyHandler):
    server_version = "pinvault-tiles"

    def respond(self, *, body: bool) -> None:
        # The request target as sent must be exactly a path the spec names: nothing is
        # decoded, joined or normalised, so no spelling of it reaches a file outside the tiles.
        tiles = self.server.endpoint
        assert isinstance(tiles, TilesServer)
        found = _resource(self.target(), entries=tiles.entries)
        if found is None:
            self.answer(404, "not found\n", NOT_CACHED, body=body)
            return
        relative, content_type, cache = found
        try:
            fd = os.open(tiles.root / relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self.answer(404, "not found\n", NOT_CACHED, body=body)
            return
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                self.answer(404, "not found\n", NOT_CACHED, body=body)
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(info.st_size))
            self.send_header("Cache-Control", cache)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if body:
                shutil.copyfileobj(file, self.wfile, 1 << 16)


class TilesServer(Endpoint):
    """An HTTP server for the tile folder `root` on `host`:`port` (port 0: one the system
    picks, read back in `port` once started). At most `threads` requests are served at once;
    a connection beyond them is answered 503 at once, and one that sends nothing for `timeout`
    seconds is closed.

    Nobody is asked who they are: the checkpoint and the hash tiles say nothing but hashes,
    while the entry bundles hold every entry (what only an auditor may list through the gRPC
    service when credentials are on), so `entries=False` leaves them out."""

    what = "tiles"
    handler = _Handler

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
        super().__init__(host, port, threads=threads, timeout=timeout)
        self.root = root
        self.entries = entries


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
