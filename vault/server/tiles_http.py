"""The ledger's tiles served read-only over HTTP as C2SP tlog-tiles says (c2sp.org/tlog-tiles),
for verifiers who trust nothing but the vault's verifier key: `checkpoint`, `tile/L/N[.p/W]`
and `tile/entries/N[.p/W]` from the tile folder, and nothing else."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

from vault.ledger.tiles import CHECKPOINT, ENTRIES, Tile, parse_tile_path
from vault.server.http_endpoint import TEXT, Endpoint, Limits, Request, Response

IMMUTABLE: Final = "public, max-age=31536000, immutable"
# The checkpoint changes with every signature; a partial tile never changes, but it is dropped
# once its full tile is written.
CHECKPOINT_CACHE: Final = "public, max-age=5"
PARTIAL_CACHE: Final = "public, max-age=60"
OCTETS: Final = "application/octet-stream"
# Verifiers fetch many small tiles, a few at a time each; a tile is read from disk in well
# under a millisecond.
LIMITS: Final = Limits(workers=4, queue=64, per_address=32, connections=512)


class TilesServer(Endpoint):
    """An HTTP server for the tile folder `root` on `host`:`port` (port 0: one the system
    picks, read back in `port` once started), bounded by `limits`: a caller who has not sent
    its whole request head within `limits.head_seconds` is let go.

    Nobody is asked who they are: the checkpoint and the hash tiles say nothing but hashes,
    while the entry bundles hold every entry (what only an auditor may list through the gRPC
    service when credentials are on), so `entries=False` leaves them out.

    `checked` (the ledger's `ServedTiles.served_bytes`) reads a file only if its bytes match
    the tree the vault holds, writing a damaged one again first; without it the files are
    served as they are on disk (a folder no ledger of this process keeps)."""

    what = "tiles"

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: Limits = LIMITS,
        entries: bool = True,
        checked: Callable[[str], bytes | None] | None = None,
    ) -> None:
        super().__init__(host, port, limits=limits)
        self.root = root
        self.entries = entries
        self.checked = checked

    def respond(self, request: Request) -> Response:
        # The request target as sent must be exactly a path the spec names: nothing is
        # decoded, joined or normalised, so no spelling of it reaches a file outside the tiles.
        found = _resource(request.target, entries=self.entries)
        if found is None:
            return Response.text(404, "not found")
        relative, content_type, cache = found
        data = self.checked(relative) if self.checked else read_tile(self.root / relative)
        if data is None:
            return Response.text(404, "not found")
        return Response(200, data, content_type, cache)


def read_tile(path: Path) -> bytes | None:
    """The bytes of the regular file at `path` (a link is not followed), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return None
        return file.read()


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
