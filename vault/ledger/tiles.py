"""The ledger's Merkle tree as C2SP tlog-tiles (c2sp.org/tlog-tiles) in a folder: hash tiles of
256 hashes, entry bundles and the latest signed checkpoint, laid out as the spec's URLs name them
so that the folder can be served as it is. Every tile is derived from the stored leaf hashes and
entry bodies, so a missing or damaged one can always be written again."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from vault.errors import DiskFull, Unavailable, VerificationError, is_disk_full
from vault.files import fsync_dir, read_upto, write_all
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.merkle import HASH_SIZE, leaf_hash
from vault.ledger.tile_layout import (
    CHECKPOINT,
    ENTRIES,
    MAX_BUNDLE_ENTRY,
    MAX_LEVEL,
    TILE_HEIGHT,
    TILE_WIDTH,
    Tile,
    bundle,
    index_path,
    new_tiles,
    parse_tile_path,
    partial_tiles,
    split_bundle,
    still_partial,
    tiles_of,
)

log = logging.getLogger(__name__)


__all__ = [
    "CHECKPOINT",
    "ENTRIES",
    "MAX_BUNDLE_ENTRY",
    "MAX_LEVEL",
    "TILE_HEIGHT",
    "TILE_WIDTH",
    "ServedTiles",
    "Tile",
    "TileStore",
    "bundle",
    "index_path",
    "new_tiles",
    "parse_tile_path",
    "partial_tiles",
    "split_bundle",
    "tiles_of",
]

# `nodes(height, start, end)`: the roots of the perfect subtrees of 2**height leaves numbered
# start to end - 1, concatenated. `bodies(start, end)`: the entry bodies of those indexes.
Nodes = Callable[[int, int, int], bytes]
Bodies = Callable[[int, int], list[bytes]]

_TEMP: Final = ".tmp"


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
        self._published_note = ""
        # Files written before a signing without a sync of their own: synced, with their
        # folders, before any checkpoint is published (see `publish`).
        self._unsynced: set[Path] = set()

    @property
    def complete(self) -> int:
        return self._complete

    @property
    def published(self) -> int:
        """The size of the checkpoint published (0: none)."""
        return max(self._published, 0)

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
            self._published_note = (self._read(CHECKPOINT, 1 << 16) or b"").decode(
                "utf-8", "replace"
            )
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

    def write(
        self,
        size: int,
        nodes: Nodes,
        bodies: Bodies,
        also: Iterable[int] = (),
        *,
        durable: bool = True,
    ) -> int:
        """Write, durably, the tiles and entry bundles the tree of `size` leaves has that are not
        on disk yet, and the partial tiles of the tree sizes `also` (older checkpoints) that no
        full tile has replaced; returns how many files were written. Without `durable`,
        the files are renamed into place unsynced, and synced before the next checkpoint is
        published (see Ledger.checkpoint)."""
        with self._writing():
            wanted = set(new_tiles(self._complete, size)) | set(partial_tiles(size))
            for other in also:
                if other <= size:
                    wanted.update(t for t in partial_tiles(other) if still_partial(t, size))
            written = self._write_tiles(sorted(wanted), nodes, bodies, durable)
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

    @property
    def published_note(self) -> str:
        """The note last published (empty: none yet)."""
        return self._published_note

    def publish(self, note: str, size: int, *, again: bool = False) -> None:
        """Make `note`, a signed checkpoint of `size` entries whose tiles are on disk, the one
        served; an older one never replaces a newer. `again`: write it even if it is the one
        published (its file was found damaged)."""
        with self._writing():
            # At the same size, the note with the witnesses' newest cosignatures appended
            # replaces the one published, never one with fewer signature lines.
            same = size == self._published
            lines = note.count("\n")
            if size < self._published or (
                same
                and not again
                and (note == self._published_note or lines < self._published_note.count("\n"))
            ):
                return
            self._sync_written()
            synced: set[Path] = set()
            self._put(CHECKPOINT, note.encode(), synced, compare=False)
            for folder in synced:
                fsync_dir(folder)
            self._published = size
            self._published_note = note

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

    def _sync_written(self) -> None:
        """Sync the files written unsynced, and their folders (the caller holds the lock)."""
        folders = set()
        for path in sorted(self._unsynced):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # a partial tile replaced by its full one since
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            folders.add(path.parent)
        for folder in folders:
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(folder)
        self._unsynced.clear()

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

    def _write_tiles(
        self, tiles: Iterable[Tile], nodes: Nodes, bodies: Bodies, durable: bool = True
    ) -> int:
        """Write hash tiles, each level 0 tile with its entry bundle."""
        synced: set[Path] = set()
        unsynced: set[Path] = set()
        written = 0
        replaced: list[Tile] = []
        for tile in tiles:
            data = nodes(tile.height, tile.first, tile.first + tile.width)
            into = synced if durable else unsynced
            sync = into is synced
            written += self._put(tile.path, data, into, sync=sync)
            if tile.level == 0:
                entries = self._bundle(tile.bundle(), data, bodies)
                if entries is not None:
                    written += self._put(tile.bundle().path, entries, into, sync=sync)
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

    def render(self, tile: Tile, nodes: Nodes, bodies: Bodies) -> bytes | None:
        """The bytes `tile` has in the tree `nodes` gives (an entry bundle: the stored bodies,
        each checked against its leaf hash); None for a bundle with an entry too long to
        frame."""
        hashes = nodes(tile.height, tile.first, tile.first + tile.width)
        return self._bundle(tile, hashes, bodies) if tile.level == ENTRIES else hashes

    def _differs(self, tile: Tile, nodes: Nodes, bodies: Bodies) -> bool:
        expected = self.render(tile, nodes, bodies)
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

    def _put(
        self,
        relative: str,
        data: bytes,
        synced: set[Path],
        *,
        compare: bool = True,
        sync: bool = True,
    ) -> int:
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
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, target)
        synced.add(target.parent)
        if not sync:
            self._unsynced.add(target)
        return 1

    def _make_folders(self, folder: Path, synced: set[Path]) -> None:
        missing = []
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for made in reversed(missing):
            made.mkdir(mode=0o755)
            synced.add(made.parent)


# Files whose check the tiles endpoint remembers, by path (a bound on what a caller can make
# the server hold: past it the memory is cleared and files are checked again).
CHECKED_FILES: Final = 1 << 16
# Bytes of tiles made from the tree (not on disk) that the endpoint keeps to serve again: a tile
# path names fixed bytes (a partial tile's path carries its width), so a caller asking again
# costs no database read; the oldest made tile goes first past the bound.
MADE_BYTES: Final = 16 << 20


class ServedTiles:
    """What the tiles endpoint may serve: a tile, an entry bundle or the `checkpoint` file, only
    when its bytes match the tree the vault holds. A file that does not is written again from
    the database first (logged and counted in `rewritten`); one past the tree, or that cannot
    be written again, is not served. A tile within the tree that is not on disk (a partial
    tile of a size signed since the checkpointer last wrote tiles) is made from the tree and
    the stored entries as it is asked for: signing writes no file, and every signed size has
    its tiles all the same.

    A file checked once is not hashed again while its inode, size, modification and change
    times stay the same (`served_bytes` is called on every request); `sweep` checks every file
    in full, whatever it checked before."""

    def __init__(
        self,
        store: TileStore,
        *,
        size: Callable[[], int],
        nodes: Nodes,
        rewrite: Callable[[Tile], None],
        render: Callable[[Tile], bytes | None],
        checkpoint_matches: Callable[[bytes], bool],
        republish: Callable[[], None],
    ) -> None:
        """`size`: the tree's size now; `nodes` as for TileStore; `rewrite(tile)`: write the
        tile (a level 0 one with its bundle) again from the database; `render(tile)`: its
        bytes, made from the tree and the stored entries; `checkpoint_matches`:
        whether a note is a checkpoint of this ledger signed by its key, over the tree held;
        `republish`: publish the latest checkpoint again."""
        self.store = store
        self._size = size
        self._nodes = nodes
        self._rewrite = rewrite
        self._render = render
        self._checkpoint_matches = checkpoint_matches
        self._republish = republish
        self._checked: dict[str, tuple[int, int, int, int]] = {}
        self._made_tiles: OrderedDict[str, bytes] = OrderedDict()
        self._made_bytes = 0
        self._lock = threading.Lock()
        self.rewritten = 0

    def served_bytes(self, relative_path: str) -> bytes | None:
        """The bytes of the file at `relative_path` (a tile path as the spec writes it, or
        `checkpoint`) if they match the tree held, after writing a damaged one again; None when
        there is no such file to serve."""
        return self._serve(relative_path, cached=True)

    def sweep(self, stop: Callable[[], bool] = lambda: False) -> list[str]:
        """Check every tile, entry bundle and the checkpoint on disk in full, and every tile
        the published checkpoint needs for being there; write again each one that is damaged
        or missing. Returns their paths. Ends early, between files, once `stop()` is true: a
        sweep of a large ledger's tiles takes tens of seconds, and a server stopping must
        not wait for it."""
        bad: list[str] = []
        published = self.store.published
        wanted = tiles_of(published)
        for tile in [*wanted, *(t.bundle() for t in wanted if t.level == 0)]:
            if stop():
                return bad
            if not (self.store.root / tile.path).exists():
                self._damaged(tile.path, tile, "missing")
                bad.append(tile.path)
        tile_folder = self.store.root / "tile"
        for folder, _, files in os.walk(tile_folder):
            for name in sorted(files):
                if stop():
                    return bad
                relative = str((Path(folder) / name).relative_to(self.store.root))
                if relative in bad or parse_tile_path(relative) is None:
                    continue
                before = self.rewritten
                self._serve(relative, cached=False)
                if self.rewritten != before:
                    bad.append(relative)
        before = self.rewritten
        self._serve(CHECKPOINT, cached=False)
        if self.rewritten != before:
            bad.append(CHECKPOINT)
        return bad

    def _serve(self, relative: str, *, cached: bool) -> bytes | None:
        tile = None if relative == CHECKPOINT else parse_tile_path(relative)
        if tile is None and relative != CHECKPOINT:
            return None
        for attempt in range(2):
            found = self._read(relative)
            if found is None:
                return self._made(tile)
            data, stamp = found
            if cached:
                with self._lock:
                    if self._checked.get(relative) == stamp:
                        return data
            verdict = self._matches(tile, data)
            if verdict is None:  # past the tree held: nothing to judge it by
                return None
            if verdict:
                with self._lock:
                    if len(self._checked) >= CHECKED_FILES:
                        self._checked.clear()
                    self._checked[relative] = stamp
                return data
            if attempt:
                break
            self._damaged(relative, tile, "damaged")
        log.error("%s still does not match the ledger's tree: not served", relative)
        return None

    def _made(self, tile: Tile | None) -> bytes | None:
        """A tile within the tree that is not on disk, made from the tree and the entries."""
        if tile is None or not self._within(tile):
            return None
        with self._lock:
            made = self._made_tiles.get(tile.path)
            if made is not None:
                self._made_tiles.move_to_end(tile.path)
                return made
        try:
            made = self._render(tile)
        except (VerificationError, Unavailable) as exc:
            log.error("cannot make %s from the database: %s", tile.path, exc)
            return None
        if made is not None and len(made) <= MADE_BYTES:
            with self._lock:
                if tile.path not in self._made_tiles:
                    self._made_tiles[tile.path] = made
                    self._made_bytes += len(made)
                while self._made_bytes > MADE_BYTES:
                    _, dropped = self._made_tiles.popitem(last=False)
                    self._made_bytes -= len(dropped)
        return made

    def _within(self, tile: Tile) -> bool:
        height = TILE_HEIGHT * max(tile.level, 0)
        return (tile.first + tile.width) << height <= self._size()

    def _damaged(self, relative: str, tile: Tile | None, how: str) -> None:
        # A level 0 tile is written again with its entry bundle, and a bundle with its tile:
        # damage to the other one is told and counted too, not mended in silence.
        found = [(relative, how)]
        other = _companion(tile)
        if other is not None:
            read = self._read(other.path)
            if read is not None and self._matches(other, read[0]) is False:
                found.append((other.path, "damaged"))
        for path, what in found:
            log.error(
                "ledger tile %s is %s on disk: writing it again from the database", path, what
            )
        with self._lock:
            for path, _ in found:
                self._checked.pop(path, None)
        try:
            if tile is None:
                self._republish()
            else:
                self._rewrite(Tile(0, tile.index, tile.width) if tile.level == ENTRIES else tile)
        except (VerificationError, Unavailable) as exc:
            log.error("cannot write %s again: %s", relative, exc)
        with self._lock:
            self.rewritten += len(found)

    def _matches(self, tile: Tile | None, data: bytes) -> bool | None:
        if tile is None:
            return self._checkpoint_matches(data)
        if not self._within(tile):
            return None
        height = TILE_HEIGHT * max(tile.level, 0)
        expected = self._nodes(height, tile.first, tile.first + tile.width)
        if tile.level != ENTRIES:
            return data == expected
        entries = split_bundle(data)
        return entries is not None and b"".join(map(leaf_hash, entries)) == expected

    def _read(self, relative: str) -> tuple[bytes, tuple[int, int, int, int]] | None:
        """The file's bytes (at most a full entry bundle's) and what identifies this version of
        it, from one open descriptor."""
        try:
            fd = os.open(self.store.root / relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            data = read_upto(fd, TILE_WIDTH * (2 + MAX_BUNDLE_ENTRY) + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data, (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _companion(tile: Tile | None) -> Tile | None:
    """The file written again with `tile`: a level 0 tile's entry bundle, a bundle's tile."""
    if tile is None:
        return None
    if tile.level == 0:
        return tile.bundle()
    if tile.level == ENTRIES:
        return Tile(0, tile.index, tile.width)
    return None
