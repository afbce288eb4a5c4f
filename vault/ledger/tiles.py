"""The ledger's Merkle tree as C2SP tlog-tiles (c2sp.org/tlog-tiles) in a folder: hash tiles of
256 hashes, entry bundles and the latest signed checkpoint, laid out as the spec's URLs name them
so that the folder can be served as it is. Every tile is derived from the stored leaf hashes and
entry bodies, so a missing or damaged one can always be written again."""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.errors import DiskFull, Unavailable, VerificationError, is_disk_full
from vault.files import fsync_dir, write_all
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.merkle import HASH_SIZE, leaf_hash

log = logging.getLogger(__name__)

TILE_HEIGHT: Final = 8
TILE_WIDTH: Final = 1 << TILE_HEIGHT
MAX_LEVEL: Final = 63
# An entry bundle frames each entry with a big-endian uint16 length.
MAX_BUNDLE_ENTRY: Final = 0xFFFF
# The level of an entry bundle: it sits beside the level 0 tile of the same index.
ENTRIES: Final = -1
CHECKPOINT: Final = "checkpoint"

# `nodes(height, start, end)`: the roots of the perfect subtrees of 2**height leaves numbered
# start to end - 1, concatenated. `bodies(start, end)`: the entry bodies of those indexes.
Nodes = Callable[[int, int, int], bytes]
Bodies = Callable[[int, int], list[bytes]]

_TEMP: Final = ".tmp"
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


class TileStore:
    """The tiles of one ledger under `root`, written as checkpoints are signed.

    Each file is written whole (a temp file, synced, renamed into place, its folder synced), so a
    crash leaves a tile or none, never part of one. The `checkpoint` file is written last: the
    tiles of every size up to its own are on disk, which is where a restart resumes.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._temp = root / _TEMP
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Temp files of writes a crash cut short are never in a tile's place: drop them.
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp.mkdir(mode=0o700)
        except OSError as exc:
            raise Unavailable(
                f"cannot keep the ledger's tiles in {root}: {exc.strerror or exc}"
            ) from None
        self._lock = threading.Lock()
        # The full tiles of every tree up to this size are on disk.
        self._complete = 0
        self._published = -1

    @property
    def complete(self) -> int:
        return self._complete

    def signed(self, verifier: Verifier) -> Checkpoint | None:
        """The published checkpoint, if it is validly signed by `verifier`'s key."""
        path = self.root / CHECKPOINT
        try:
            note = path.read_text("utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read %s (%s): writing every tile again", path, exc)
            return None
        try:
            return verifier.open(note)
        except VerificationError as exc:
            log.warning("%s is not a checkpoint of this ledger (%s)", path, exc)
            return None

    def resume(self, verifier: Verifier, size: int, root: Callable[[int], bytes]) -> int:
        """Take up from the published checkpoint, if it is one this ledger of `size` entries
        (with Merkle roots `root(n)`) signed; returns the size its tiles reach (0: none)."""
        checkpoint = self.signed(verifier)
        if checkpoint is None:
            return 0
        if checkpoint.size > size or checkpoint.root != root(checkpoint.size):
            log.warning(
                "%s does not match the stored entries: writing every tile again",
                self.root / CHECKPOINT,
            )
            return 0
        with self._lock:
            self._complete = self._published = checkpoint.size
        return checkpoint.size

    def full(self, level: int, index: int) -> bytes | None:
        """The full tile `index` of tile level `level` as it is on disk (unchecked), or None."""
        data = self._read(Tile(level, index).path, TILE_WIDTH * HASH_SIZE + 1)
        return data if data is not None and len(data) == TILE_WIDTH * HASH_SIZE else None

    def rewrite(self, tiles: Iterable[Tile], nodes: Nodes, bodies: Bodies) -> int:
        """Write these tiles (and the entry bundles of level 0 ones) again where they differ
        from the stored hashes and entries; returns how many files were written."""
        with self._writing():
            return self._write_tiles(sorted(set(tiles)), nodes, bodies)

    def hashes(self, level: int, count: int) -> bytes | None:
        """The first `count` hashes of tile level `level` from the tiles on disk (full tiles,
        then a full or partial one for the rest), or None if any is missing or short. Nothing
        here is checked: the caller checks what it reads against a signed root."""
        found = []
        for index in range(0, (count + TILE_WIDTH - 1) // TILE_WIDTH):
            width = min(TILE_WIDTH, count - index * TILE_WIDTH)
            wanted = width * HASH_SIZE
            data = self._read(Tile(level, index).path, TILE_WIDTH * HASH_SIZE)
            if data is None and width < TILE_WIDTH:
                data = self._read(Tile(level, index, width).path, wanted)
            if data is None or len(data) < wanted:
                return None
            found.append(data[:wanted])
        return b"".join(found)

    def write(self, size: int, nodes: Nodes, bodies: Bodies, also: Iterable[int] = ()) -> int:
        """Write, durably, the tiles and entry bundles the tree of `size` leaves has that are not
        on disk yet, and the partial tiles of the tree sizes `also` (older checkpoints) that no
        full tile has replaced; returns how many files were written."""
        with self._writing():
            wanted = set(new_tiles(self._complete, size)) | set(partial_tiles(size))
            for other in also:
                if other <= size:
                    wanted.update(t for t in partial_tiles(other) if _still_partial(t, size))
            written = self._write_tiles(sorted(wanted), nodes, bodies)
            self._complete = max(self._complete, size)
            return written

    def write_full(self, upto: int, nodes: Nodes, bodies: Bodies) -> int:
        """Write, durably, the full tiles and bundles of the trees up to `upto` leaves that are
        not on disk yet (a step of a catch-up); returns how many files were written."""
        with self._writing():
            wanted = [tile for tile in new_tiles(self._complete, upto) if tile.full]
            written = self._write_tiles(wanted, nodes, bodies)
            self._complete = max(self._complete, upto)
            return written

    def publish(self, note: str, size: int) -> None:
        """Make `note`, a signed checkpoint of `size` entries whose tiles are on disk, the one
        served; an older one never replaces a newer."""
        with self._writing():
            if size <= self._published:
                return
            synced: set[Path] = set()
            self._put(CHECKPOINT, note.encode(), synced, compare=False)
            for folder in synced:
                fsync_dir(folder)
            self._published = size

    def repair(self, size: int, nodes: Nodes, bodies: Bodies) -> list[Tile]:
        """Check every tile and entry bundle of the tree of `size` leaves against the stored
        hashes and entries, and write again each one that is missing or differs; returns
        those."""
        with self._writing():
            wanted = tiles_of(size)
            wanted += [t.bundle() for t in wanted if t.level == 0]
            bad = [t for t in wanted if self._differs(t, nodes, bodies)]
            # A bundle is written with its level 0 tile (which is left alone if it is right).
            self._write_tiles(
                sorted({Tile(0, t.index, t.width) if t.level == ENTRIES else t for t in bad}),
                nodes,
                bodies,
            )
            return bad

    # ------------------------------------------------------------------ writing

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """One writer at a time; a file system error is told as the tiles being unavailable."""
        with self._lock:
            try:
                yield
            except OSError as exc:
                if is_disk_full(exc):
                    raise DiskFull(self.root, needed=TILE_WIDTH * HASH_SIZE) from None
                raise Unavailable(
                    f"cannot write the ledger's tiles in {self.root}: {exc.strerror or exc}"
                ) from None

    def _write_tiles(self, tiles: Iterable[Tile], nodes: Nodes, bodies: Bodies) -> int:
        """Write hash tiles, each level 0 tile with its entry bundle."""
        synced: set[Path] = set()
        written = 0
        replaced: list[Tile] = []
        for tile in tiles:
            data = nodes(tile.height, tile.first, tile.first + tile.width)
            written += self._put(tile.path, data, synced)
            if tile.level == 0:
                entries = self._bundle(tile.bundle(), data, bodies)
                if entries is not None:
                    written += self._put(tile.bundle().path, entries, synced)
            if tile.full:
                replaced.append(tile)
        for folder in synced:
            fsync_dir(folder)
        # A full tile is durable: its partial versions are no longer needed (the spec lets a
        # log drop them; a client falls back to the full tile).
        for tile in replaced:
            shutil.rmtree(self.root / tile.partials, ignore_errors=True)
            if tile.level == 0:
                shutil.rmtree(self.root / tile.bundle().partials, ignore_errors=True)
        return written

    def _bundle(self, tile: Tile, hashes: bytes, bodies: Bodies) -> bytes | None:
        """The entry bundle `tile`, each body checked against its leaf hash in `hashes`; None
        when an entry is too long to frame (no append makes one: the limits on an entry's
        fields keep its body under about 35,000 bytes)."""
        found = bodies(tile.first, tile.first + tile.width)
        if len(found) != tile.width:
            raise VerificationError(
                f"ledger entries {tile.first} to {tile.first + tile.width - 1} are not all stored",
                index=tile.first,
            )
        for offset, body in enumerate(found):
            index = tile.first + offset
            if leaf_hash(body) != hashes[offset * HASH_SIZE : (offset + 1) * HASH_SIZE]:
                raise VerificationError(
                    f"ledger entry {index} does not hash to its stored leaf hash", index=index
                )
            if len(body) > MAX_BUNDLE_ENTRY:
                log.error(
                    "ledger entry %d is %d bytes, more than an entry bundle frames (%d): "
                    "%s is not written",
                    index,
                    len(body),
                    MAX_BUNDLE_ENTRY,
                    tile.path,
                )
                return None
        return bundle(found)

    def _differs(self, tile: Tile, nodes: Nodes, bodies: Bodies) -> bool:
        hashes = nodes(tile.height, tile.first, tile.first + tile.width)
        expected = self._bundle(tile, hashes, bodies) if tile.level == ENTRIES else hashes
        return expected is not None and self._read(tile.path, len(expected) + 1) != expected

    def _read(self, relative: str, limit: int) -> bytes | None:
        try:
            fd = os.open(self.root / relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return os.read(fd, limit)
        finally:
            os.close(fd)

    def _put(self, relative: str, data: bytes, synced: set[Path], *, compare: bool = True) -> int:
        """Put `data` at `relative` whole; returns 0 when the file already held exactly it.
        The folders to sync before the file counts as durable are added to `synced`."""
        if compare and self._read(relative, len(data) + 1) == data:
            return 0
        target = self.root / relative
        self._make_folders(target.parent, synced)
        temp = self._temp / secrets.token_hex(8)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, target)
        synced.add(target.parent)
        return 1

    def _make_folders(self, folder: Path, synced: set[Path]) -> None:
        missing = []
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for made in reversed(missing):
            made.mkdir(mode=0o755)
            synced.add(made.parent)


def _still_partial(tile: Tile, size: int) -> bool:
    """Whether the tree of `size` leaves has not completed the full tile `tile` is part of."""
    return (size >> (TILE_HEIGHT * tile.level)) // TILE_WIDTH == tile.index
