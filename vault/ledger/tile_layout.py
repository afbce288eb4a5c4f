"""Where each tile of a C2SP tlog-tiles log lives and what it holds (c2sp.org/tlog-tiles): tile
paths, the tiles of a tree size, and the entry bundle's framing. Pure: no I/O."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

TILE_HEIGHT: Final = 8
TILE_WIDTH: Final = 1 << TILE_HEIGHT
MAX_LEVEL: Final = 63
# An entry bundle frames each entry with a big-endian uint16 length.
MAX_BUNDLE_ENTRY: Final = 0xFFFF
# The level of an entry bundle: it sits beside the level 0 tile of the same index.
ENTRIES: Final = -1
CHECKPOINT: Final = "checkpoint"

_INDEX = r"(?:x[0-9]{3}/)*[0-9]{3}"
_WIDTH = r"[1-9][0-9]{0,2}"
_TILE_PATH = re.compile(
    rf"tile/(?P<level>entries|0|[1-9][0-9]?)/(?P<index>{_INDEX})(?:\.p/(?P<width>{_WIDTH}))?"
)


def index_path(index: int) -> str:
    """A tile index as the spec writes it: three digits a path element, all but the last
    prefixed with `x` (1234067 is `x001/x234/067`)."""
    parts = [f"{index % 1000:03d}"]
    index //= 1000
    while index:
        parts.append(f"x{index % 1000:03d}")
        index //= 1000
    return "/".join(reversed(parts))


@dataclass(frozen=True, slots=True, order=True)
class Tile:
    """One tile: `width` consecutive hashes of tile level `level` (tree height 8 × level) from
    hash `index` × 256, or, at level ENTRIES, the entry bundle of the level 0 tile `index`."""

    level: int
    index: int
    width: int = TILE_WIDTH

    def __post_init__(self) -> None:
        if not ENTRIES <= self.level <= MAX_LEVEL or self.index < 0:
            raise ValueError(f"no tile at level {self.level}, index {self.index}")
        if not 1 <= self.width <= TILE_WIDTH:
            raise ValueError(f"a tile is 1 to {TILE_WIDTH} wide, not {self.width}")

    @property
    def full(self) -> bool:
        return self.width == TILE_WIDTH

    @property
    def path(self) -> str:
        level = "entries" if self.level == ENTRIES else str(self.level)
        width = "" if self.full else f".p/{self.width}"
        return f"tile/{level}/{index_path(self.index)}{width}"

    @property
    def partials(self) -> str:
        """The folder that holds this tile's partial versions."""
        level = "entries" if self.level == ENTRIES else str(self.level)
        return f"tile/{level}/{index_path(self.index)}.p"

    @property
    def height(self) -> int:
        """The tree height of the hashes a hash tile lists (leaves: 0)."""
        return TILE_HEIGHT * max(self.level, 0)

    @property
    def first(self) -> int:
        """The index, at its height, of the tile's first hash (of its first entry for a
        bundle)."""
        return self.index * TILE_WIDTH

    def bundle(self) -> Tile:
        """The entry bundle that goes with this level 0 tile."""
        return Tile(ENTRIES, self.index, self.width)


def parse_tile_path(path: str) -> Tile | None:
    """The tile a path names, or None unless the path is exactly one the spec writes (no other
    spelling of the same tile, nothing that is not a tile)."""
    match = _TILE_PATH.fullmatch(path)
    if match is None:
        return None
    level = ENTRIES if match["level"] == "entries" else int(match["level"])
    # A partial tile is narrower than a full one; a full one has no width in its path.
    width = TILE_WIDTH if match["width"] is None else int(match["width"])
    if level > MAX_LEVEL or (match["width"] is not None and width >= TILE_WIDTH):
        return None
    index = int(match["index"].replace("x", "").replace("/", ""))
    tile = Tile(level, index, width)
    return tile if tile.path == path else None


def partial_tiles(size: int) -> list[Tile]:
    """The partial hash tiles of the tree of `size` leaves: at level l, floor(size / 256**l)
    mod 256 hashes, where that is not zero."""
    found = []
    level = 0
    while size >> (TILE_HEIGHT * level):
        count = size >> (TILE_HEIGHT * level)
        if count % TILE_WIDTH:
            found.append(Tile(level, count // TILE_WIDTH, count % TILE_WIDTH))
        level += 1
    return found


def new_tiles(old_size: int, new_size: int) -> list[Tile]:
    """The hash tiles that the tree of `new_size` leaves has and that of `old_size` lacks: the
    full tiles completed in between, and the new size's partial tiles where they changed
    (golang.org/x/mod/sumdb/tlog's NewTiles)."""
    found = []
    level = 0
    while new_size >> (TILE_HEIGHT * level):
        old = old_size >> (TILE_HEIGHT * level)
        new = new_size >> (TILE_HEIGHT * level)
        if old != new:
            found += [Tile(level, n) for n in range(old // TILE_WIDTH, new // TILE_WIDTH)]
            if new % TILE_WIDTH:
                found.append(Tile(level, new // TILE_WIDTH, new % TILE_WIDTH))
        level += 1
    return found


def tiles_of(size: int) -> list[Tile]:
    """Every hash tile of the tree of `size` leaves."""
    return new_tiles(0, size)


def bundle(bodies: Iterable[bytes]) -> bytes:
    """An entry bundle: each entry body after its length as a big-endian uint16."""
    return b"".join(len(body).to_bytes(2, "big") + body for body in bodies)


def split_bundle(data: bytes) -> list[bytes] | None:
    """The entry bodies of an entry bundle, or None if it is not exactly a sequence of
    length-framed entries."""
    found = []
    at = 0
    while at < len(data):
        if at + 2 > len(data):
            return None
        length = int.from_bytes(data[at : at + 2], "big")
        if at + 2 + length > len(data):
            return None
        found.append(data[at + 2 : at + 2 + length])
        at += 2 + length
    return found


def still_partial(tile: Tile, size: int) -> bool:
    """Whether the tree of `size` leaves has not completed the full tile `tile` is part of."""
    return (size >> (TILE_HEIGHT * tile.level)) // TILE_WIDTH == tile.index
