"""The ledger: durable, linear, hash-chained appends (group commit), the in-memory Merkle tree
that answers proofs, signed checkpoints (the last one also kept outside the database, so that
a server never signs over a history that changed behind it), the tree's C2SP tlog-tiles written
and published after each checkpoint, and the queries behind look-ups and the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Final

from sqlalchemy import func, select, text

from vault.digest import digest_from_key, digest_key
from vault.errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    VaultError,
    VerificationError,
    is_disk_full,
)
from vault.ledger import db as tables
from vault.ledger.checkpoint import Checkpoint, SigningKey, Verifier
from vault.ledger.db import LEDGER_RESERVE, Database, Writer
from vault.ledger.last_signed import LastSigned
from vault.ledger.merkle import INNER, STRATUM, TILE_LEAVES, MerkleTree
from vault.ledger.records import (
    LogFilter,
    PinSpec,
    RawColumns,
    RawEntry,
    SignedCheckpoint,
    StoredEntry,
)
from vault.ledger.sequencer import (
    HEAD,
    MAX_BATCH,
    SequencerLink,
    Waiting,
    commits,
    fields,
    settle_all,
    write_commit,
)
from vault.ledger.subject_index import FOLD_ROWS
from vault.ledger.subject_map_store import (
    INDEX_EVERY,
    LATEST_INDEX,
    MapReader,
    MapWriter,
    read_index,
)
from vault.ledger.tile_nodes import TileNodesFile
from vault.ledger.tiles import TILE_HEIGHT, ServedTiles, Tile, TileStore

log = logging.getLogger(__name__)

READ_BATCH: Final = 2_000
QUERY_BATCH: Final = 500
# Entries whose full tiles one step of a catch-up writes while signing waits.
TILES_STEP: Final = 1 << 14
# The file of the tiles' inner nodes, beside the tiles folder.
TILE_NODES: Final = "tile-nodes"
# Leaf hashes loaded from the database at once.
LOAD_BATCH: Final = 1 << 16
# Leaves whose low nodes the tree lets go of at once, once their tiles are on disk.
RETIRE_STEP: Final = 1 << 16
# Seconds between two checks of every tile on disk against the tree (the first is at start).
TILES_CHECK_INTERVAL: Final = 600.0
# Seconds between two logs of a ledger that still fails its check, once the first is logged.
FAULT_LOGGED_EVERY: Final = 600.0


_STOP: Final = object()


def _count(request: Waiting) -> int:
    return request.count


# A checkpoint of a size already signed (by another server, or before a restart) is kept as it
# is: the database refuses any insert over a stored one, so the insert first looks.
_INSERT_CHECKPOINT: Final = text(
    "INSERT INTO checkpoints (size, note) SELECT :size, :note "
    "WHERE NOT EXISTS (SELECT 1 FROM checkpoints WHERE size = :size) ON CONFLICT DO NOTHING"
)
_READ_ENTRIES: Final = (
    "SELECT idx, body, leaf_hash, kind, author, time, external FROM entries "
    "WHERE idx > ? ORDER BY idx LIMIT ?"
)
_READ_ENTRIES_UNTIL: Final = (
    "SELECT idx, body, leaf_hash, kind, author, time, external FROM entries "
    "WHERE idx > ? AND idx < ? ORDER BY idx LIMIT ?"
)
_READ_SUBJECTS: Final = (
    "SELECT idx, digest FROM entry_subjects WHERE idx > ? AND idx <= ? ORDER BY idx"
)
_READ_BODIES: Final = "SELECT body FROM entries WHERE idx >= ? AND idx < ? ORDER BY idx"
_READ_LEAVES: Final = "SELECT idx, leaf_hash FROM entries WHERE idx >= ? AND idx < ? ORDER BY idx"
# The distinct prefixes size // 256**level of the checkpoints signed in a range of sizes: each
# one a partial tile at that level.
_SIGNED_PREFIXES: Final = "SELECT DISTINCT size / ? FROM checkpoints WHERE size > ? AND size <= ?"

Query = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]


class Ledger:
    """One vault server's view of the shared ledger.

    Appends go through one writer that commits whatever has queued up in a single transaction
    (group commit: many appends share one sync) and acknowledges only after the commit: a
    thread of this process, or (`writer=False`) a sequencer process of the server's own, whose
    link the server attaches (`attach`, see vault.ledger.sequencer). The Merkle tree is a cache
    of the stored leaf hashes; it catches up with entries other servers appended to the same
    database before it answers for them. With a tile folder, the checkpointer writes the tiles
    of the latest checkpoint from that tree, then publishes the checkpoint beside them (within
    an interval of its signing).
    """

    def __init__(
        self,
        db: Database,
        key: SigningKey,
        *,
        origin: str,
        checkpoint_interval: float = 1.0,
        commit_window: float = 0.002,
        fold_rows: int = FOLD_ROWS,
        last_signed: Path | None = None,
        tiles: Path | None = None,
        tiles_check_interval: float | None = TILES_CHECK_INTERVAL,
        writer: bool = True,
        index_every: int | None = INDEX_EVERY,
    ) -> None:
        """`last_signed`: a file outside the database where the server keeps the last
        checkpoint it signed; at start the stored entries must agree with it. `tiles`: the
        folder of the tree's C2SP tlog-tiles, written before checkpoints are signed, and every
        file in it checked against the tree at start and every `tiles_check_interval` seconds
        (None: only as the tiles endpoint serves them). `writer`: whether a thread of this
        process writes the appends; without it, appends wait for the link to a sequencer
        process (`attach`). `index_every`: how many uncovered entries make this process's
        writer bring the subject map up to date in a commit (None: only when a look-up asks,
        which a test of the tree alone uses to hold a ledger of exactly the entries it
        appended; a vault's sequencer always keeps the map)."""
        self.db = db
        self.last_signed = None if last_signed is None else LastSigned(last_signed)
        self.tiles = None if tiles is None else TileStore(tiles)
        self._tile_nodes = None if tiles is None else _tile_nodes(tiles.parent / TILE_NODES)
        # The size the tile folder's own checkpoint vouches for at start; whether the tiles of
        # the checkpoints signed since (before this start) are written yet, and whether so many
        # are missing that the checkpointer writes them in steps (see `write_tiles`).
        self._tiles_resumed = 0
        self._tiles_caught_up = False
        # The size of the checkpoint the tile folder publishes, and who writes tiles now.
        self._published = 0
        self._tiles_lock = threading.Lock()
        # Level 0 tiles the tree found missing or damaged, to write again.
        self._damaged_tiles: set[int] = set()
        # Whether the tiles failed to give the signed tree at start: all are checked first.
        self._tiles_suspect = False
        self.key = key
        self.verifier: Verifier = key.verifier()
        self.origin = origin
        self._tree = MerkleTree()
        self._tree_lock = threading.RLock()
        self._checkpoint_lock = threading.Lock()
        self._latest: SignedCheckpoint | None = None
        self._queue: queue.SimpleQueue[Waiting | object] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._commit_window = commit_window
        # Only the ledger's one writer folds the subject index (a server with a sequencer
        # process leaves it to that process).
        self._writer_db = Writer(
            db,
            checkpoints_aside=True,
            reserve=LEDGER_RESERVE,
            fold_rows=fold_rows if writer else None,
        )
        # The subject map: brought up to the head by this server's writer (when it writes),
        # and what this server proves look-ups complete from.
        self._map = MapWriter(index_every)
        self.subject_map = MapReader(db.fetch)
        # A ledger that fails its check still starts, so that an auditor can read it and
        # `vault verify` can say where it broke; appends and proofs past the break are refused.
        self.fault: VerificationError | None = None
        # When the fault was last logged (time.monotonic).
        self._fault_logged = 0.0
        try:
            self._open_tree()
            self._check_last_signed()
        except VerificationError as exc:
            self.fault = exc
            log.error("the stored ledger fails its check (%s); run `vault verify`", exc)
            self._fault_logged = time.monotonic()
        self._latest = self._load_latest_checkpoint()
        if self.tiles is not None and self.fault is None:
            self._tiles_resumed = self.tiles.resume(self.verifier, self._tree.size, self._tree.root)
            self._published = self._tiles_resumed
        # What the tiles endpoint serves: only files that match the tree held.
        self.served_tiles: ServedTiles | None = None
        if self.tiles is not None:
            self.served_tiles = ServedTiles(
                self.tiles,
                size=lambda: self._tree.size,
                nodes=lambda height, start, end: self._tree.nodes(height, start, end),
                rewrite=self._rewrite_tile,
                render=self._render_tile,
                checkpoint_matches=self._checkpoint_matches,
                republish=self._republish,
            )
        if (
            self.tiles is not None
            and self.fault is None
            and self._tree.size == 0
            and not self.tiles.published_note
        ):
            # A new ledger's checkpoint of size 0 is published before the server answers: a
            # probe or a verifier finds one from the start, and the folder does not change
            # under a caller who looks at it once the server is up.
            self._guarded(self._publish_empty)
        self._link: SequencerLink | None = None
        self._writer: threading.Thread | None = None
        if writer:
            self._writer = threading.Thread(
                target=self._write_loop, name="ledger-writer", daemon=True
            )
            self._writer.start()
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, args=(checkpoint_interval,), daemon=True
        )
        self._checkpointer.start()
        self._tile_checker: threading.Thread | None = None
        if self.served_tiles is not None and tiles_check_interval is not None:
            self._tile_checker = threading.Thread(
                target=self._tile_check_loop,
                args=(tiles_check_interval,),
                name="tile-check",
                daemon=True,
            )
            self._tile_checker.start()

    # ------------------------------------------------------------------ appends

    def append(self, pins: Sequence[PinSpec], timeout: float | None = 60.0) -> list[StoredEntry]:
        """Append entries; returns once they are durable. All or none."""
        return self.submit(pins).result(timeout)

    def submit(self, pins: Sequence[PinSpec]) -> Future[list[StoredEntry]]:
        """Queue entries for the next group commit; the future resolves once they are durable."""
        if not pins or not self._admit(pins):
            done: Future[list[StoredEntry]] = Future()
            done.set_result([])
            return done
        if self._link is not None:
            return self._link.submit(pins)
        if self._writer is None:
            raise Unavailable("the ledger's sequencer is not linked yet: retry")
        future: Future[list[StoredEntry]] = Future()
        self._queue.put(Waiting(pins, future))
        return future

    async def append_async(self, pins: Sequence[PinSpec]) -> list[StoredEntry]:
        """`append` for an event loop: waits without a thread."""
        if not pins or not self._admit(pins):
            return []
        if self._link is not None:
            return await self._link.append(pins)
        if self._writer is None:
            raise Unavailable("the ledger's sequencer is not linked yet: retry")
        waiter: asyncio.Future[list[StoredEntry]] = asyncio.get_running_loop().create_future()
        self._queue.put(Waiting(pins, waiter))
        return await waiter

    def _admit(self, pins: Sequence[PinSpec]) -> bool:
        self._refuse_if_faulty("append to")
        if len(pins) > MAX_BATCH:
            raise InvalidArgument(
                f"too many entries in one append: {len(pins)} (at most {MAX_BATCH})"
            )
        if self._closed.is_set():
            raise Unavailable("the ledger is closed")
        return True

    def _write_loop(self) -> None:
        for batch in commits(self._queue, _count, _STOP, self._commit_window):
            outcomes: Sequence[list[StoredEntry] | BaseException]
            try:
                outcomes = self._commit(batch)
            except BaseException as exc:  # every waiter must hear of the failure
                if isinstance(exc, ResourceExhausted):  # a full disk: no fault of the code
                    log.warning("ledger append refused: %s", exc)
                else:
                    log.exception("ledger append failed")
                error = (
                    exc
                    if isinstance(exc, VaultError)
                    else Unavailable(f"ledger append failed: {exc}")
                )
                outcomes = [error] * len(batch)
            settle_all(zip(batch, outcomes, strict=True))

    def _commit(self, batch: Sequence[Waiting]) -> list[list[StoredEntry]]:
        # The tree lock is held from reading the head until the new leaves are in the tree, so
        # no catch-up can load this commit's entries from the database a second time.
        with self._tree_lock:
            results = self._insert(batch)
        return results

    def _insert(self, batch: Sequence[Waiting]) -> list[list[StoredEntry]]:
        try:
            with self._writer_db.begin() as tx:
                ((size, last),) = tx.all(HEAD + ("" if self.db.is_sqlite else " FOR UPDATE"))
                last = bytes(last)
                self._catch_up(tx.all, size, last)
                groups = [[fields(pin) for pin in request.pins] for request in batch]
                bodies, leaves = write_commit(tx, groups, size, last, self._map)
        except BaseException:
            self._map.failed()
            raise
        self._map.committed()
        # Committed: only now do the new leaves become part of what this server proves.
        self._tree.extend(leaves)
        results: list[list[StoredEntry]] = []
        index = size
        for request in batch:
            end = index + request.count
            results.append([StoredEntry(i, bodies[i - size]) for i in range(index, end)])
            index = end
        return results

    def attach(self, link: SequencerLink) -> None:
        """Send appends to a sequencer process from now on (`committed` is what its link tells
        of each commit)."""
        self._link = link

    def committed(self, first: int, leaves: list[bytes]) -> None:
        """A commit of the sequencer process: its leaves join the tree if it has every entry
        before them (else the next catch-up reads them from the database). Told on the event
        loop, which never waits here for a catch-up that holds the tree."""
        if not self._tree_lock.acquire(blocking=False):
            return
        try:
            if self._tree.size == first:
                self._tree.extend(leaves)
        finally:
            self._tree_lock.release()

    def _open_tree(self) -> None:
        """Load the tree: from the tiles of the published checkpoint and the entries stored
        since, when those agree with its signed root; otherwise from every stored leaf hash.
        Either way memory holds the nodes below height 8 of the last tile's leaves only once
        the tiles are written (see `_retire`)."""
        signed = None if self.tiles is None else self.tiles.signed(self.verifier)
        if signed is not None and signed.size >= TILE_LEAVES:
            assert self.tiles is not None
            base = (signed.size >> STRATUM) << STRATUM
            stratum = self.tiles.hashes(1, base >> STRATUM)
            if stratum is not None:
                self._tree = MerkleTree.resume(base, stratum, self._lower_leaves, self._tile_nodes)
                with contextlib.suppress(VerificationError):
                    self.sync()
                    if self._tree.root(signed.size) == signed.root:
                        return
            log.warning(
                "the tiles in %s do not match the stored entries: loading the tree from the "
                "database, and checking every tile",
                self.tiles.root,
            )
            self._tree = MerkleTree()
            self._tiles_suspect = True
        self.sync()

    def _lower_leaves(self, tile: int) -> Iterator[bytes]:
        """The leaf hashes of level 0 tile `tile`: from the tile on disk, else (the tree found
        it missing or damaged) from the database."""
        first = tile * TILE_LEAVES
        if self.tiles is not None:
            found = self.tiles.full(0, tile)
            if found is not None:
                yield found
            log.warning(
                "%s is missing or damaged: reading the leaf hashes of entries %d to %d from "
                "the database, and writing the tile again",
                Tile(0, tile).path,
                first,
                first + TILE_LEAVES - 1,
            )
            self._damaged_tiles.add(tile)
        rows = self.db.fetch(_READ_LEAVES, (first, first + TILE_LEAVES))
        yield b"".join(bytes(leaf) for (_, leaf) in rows)

    def _rewrite_damaged(self) -> None:
        """Write again the level 0 tiles the tree found missing or damaged."""
        if self.tiles is None or not self._damaged_tiles:
            return
        with self._tiles_lock:
            damaged = sorted(self._damaged_tiles)
            self._damaged_tiles.difference_update(damaged)
            self.tiles.rewrite([Tile(0, t) for t in damaged], self._tree.nodes, self._bodies)

    def _write_tile_nodes(self) -> None:
        """Write the nodes of height 4 of the full tiles on disk that have none yet, and again
        those of the tiles the tree suspected (vault/ledger/tile_nodes.py)."""
        nodes = self._tile_nodes
        if nodes is None or self.tiles is None or self.fault is not None:
            return
        span = TILE_LEAVES >> INNER
        missing = range(nodes.filled, self.tiles.complete >> STRATUM)
        for tile in [*nodes.take_suspects(), *missing]:
            if self._closed.is_set():
                return
            nodes.put(tile, self._tree.nodes(INNER, tile * span, (tile + 1) * span))

    def _retire(self) -> None:
        """Let the tree go of the low nodes of leaves whose full tiles are on disk, once enough
        of them are held to be worth it."""
        if self.tiles is None or self.fault is not None:
            return
        if self.tiles.complete - self._tree.base >= RETIRE_STEP:
            with self._tree_lock:
                self._tree.retire(self.tiles.complete, self._lower_leaves, self._tile_nodes)

    def _catch_up(self, query: Query, size: int, last: bytes) -> None:
        """Load leaf hashes that other servers appended since this tree last looked, a batch
        at a time."""
        have = self._tree.size
        if size > have:
            expected = have
            while expected < size:
                rows = query(_READ_LEAVES, (expected, min(size, expected + LOAD_BATCH)))
                leaves = []
                for idx, leaf in rows:
                    if idx != expected:
                        raise VerificationError(
                            f"ledger entry {expected} is missing", index=expected
                        )
                    leaves.append(bytes(leaf))
                    expected += 1
                if not leaves:
                    break
                self._tree.extend(leaves)
            if expected != size:
                raise VerificationError(f"ledger entry {expected} is missing", index=expected)
        elif size < have:
            raise VerificationError(
                f"ledger head says size {size} but this server already proved size {have}",
                index=size,
            )
        if size and self._tree.leaf(size - 1) != last:
            raise VerificationError(
                f"ledger head's last leaf does not match entry {size - 1}", index=size - 1
            )

    def sync(self) -> int:
        """Bring the tree up to the stored head; returns the size."""
        with self._tree_lock:
            ((size, last),) = self.db.fetch(HEAD)
            if size != self._tree.size:
                self._catch_up(self.db.fetch, size, bytes(last))
            return self._tree.size

    @property
    def size(self) -> int:
        return self._tree.size

    @property
    def latest(self) -> SignedCheckpoint | None:
        """The latest checkpoint signed or loaded, without signing one."""
        return self._latest

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, min_size: int = 0) -> SignedCheckpoint:
        """The latest signed checkpoint, signing a new one if it would not cover `min_size`."""
        latest = self._latest
        if latest is not None and latest.size >= min_size:
            return latest
        with self._checkpoint_lock:
            latest = self._latest
            if latest is not None and latest.size >= min_size:
                return latest
            if self._tree.size < min_size:
                self.sync()
            size = self._tree.size
            if size < min_size:
                raise NotFound(f"the ledger has {size} entries, fewer than {min_size}")
            self._refuse_if_faulty("sign")
            signed = self._sign(size)
            self._latest = signed
            return signed

    def _sign(self, size: int) -> SignedCheckpoint:
        checkpoint = Checkpoint(origin=self.origin, size=size, root=self._tree.root(size))
        note = self.key.sign(checkpoint)
        with self.db.write.begin() as conn:
            conn.execute(_INSERT_CHECKPOINT, {"size": size, "note": note})
        return SignedCheckpoint(checkpoint, note)

    def write_tiles(self) -> None:
        """Write the tiles of the latest signed checkpoint that the tile folder lacks, durably,
        then publish that checkpoint beside them: a verifier reading tiles finds every one the
        published size needs. The checkpointer does it once an interval, off the path of
        appends and signing (tiles are derived from the stored entries, so a crash loses none
        that cannot be written again); a long catch-up (a ledger that had no tiles) goes a
        step at a time. Then it writes again the tiles found damaged, and lets the tree go of
        what the tiles on disk now hold."""
        if self.tiles is None:
            return
        self._write_new_tiles()
        self._rewrite_damaged()
        self._write_tile_nodes()
        self._retire()

    def _write_new_tiles(self) -> None:
        assert self.tiles is not None
        while not self._closed.is_set():
            with self._tiles_lock:
                latest = self._latest
                if self.fault is not None:
                    return
                if latest is None:
                    # Nothing signed yet: from now on each signing writes its tiles first.
                    self._tiles_caught_up = True
                    return
                # A ledger with no entries publishes its size-0 checkpoint too: a verifier or
                # a readiness probe finds one from the first interval on.
                if (
                    self._tiles_caught_up
                    and latest.size <= self._published
                    and self.tiles.published_note
                ):
                    return
                if latest.size - self.tiles.complete <= TILES_STEP:
                    self._write_tiles(latest.size)
                    self.tiles.publish(latest.note, latest.size)
                    self._published = max(self._published, latest.size)
                    return
                step = self.tiles.complete + TILES_STEP
                self.tiles.write_full(step, self._tree.nodes, self._bodies)

    def repair_tiles(self) -> list[str]:
        """Check every tile of the latest checkpoint against the stored leaf hashes and entries,
        and write again each one that is missing or damaged; returns their paths."""
        if self.tiles is None:
            return []
        with self._tiles_lock:
            latest = self._latest
            if latest is None:
                return []
            self._refuse_if_faulty("write tiles for")
            bad = self.tiles.repair(latest.size, self._tree.nodes, self._bodies)
            self.tiles.publish(latest.note, latest.size)
            self._published = latest.size
            return [tile.path for tile in bad]

    def check_tiles(self) -> list[str]:
        """Check every tile, entry bundle and the published checkpoint on disk against the tree
        held, and write again from the database each one that is damaged or missing; returns
        their paths (each also logged, and counted in `tiles_rewritten`)."""
        if self.served_tiles is None or self.fault is not None:
            return []
        return self.served_tiles.sweep(stop=self._closed.is_set)

    @property
    def tiles_rewritten(self) -> int:
        """Tile files found damaged or missing and written again since this server started."""
        return 0 if self.served_tiles is None else self.served_tiles.rewritten

    def publish_cosigned(self, note: str, size: int) -> None:
        """Publish in the tile folder `note`, the checkpoint of `size` entries with the
        witnesses' cosignature lines appended, in place of the same checkpoint without them (a
        newer published checkpoint is kept)."""
        if self.tiles is None or self.fault is not None:
            return
        with self._tiles_lock:
            # Tiles of a size signed since the checkpointer last wrote them are made as they
            # are asked for (ServedTiles), so the cosigned note may go out before them.
            if self._published <= size <= self._tree.size and self._tiles_caught_up:
                self.tiles.publish(note, size)
                self._published = size

    def _tile_check_loop(self, interval: float) -> None:
        # The first check once the checkpointer's first pass has had its turn.
        delay = min(interval, 1.0)
        while not self._closed.wait(delay):
            delay = interval
            try:
                bad = self.check_tiles()
            except Exception:
                log.exception("checking the ledger's tiles failed")
                continue
            if bad:
                log.warning(
                    "checked the ledger's tiles: %d written again (%s)",
                    len(bad),
                    ", ".join(bad[:5]),
                )

    def _rewrite_tile(self, tile: Tile) -> None:
        assert self.tiles is not None
        with self._tiles_lock:
            self.tiles.rewrite([tile], self._tree.nodes, self._bodies)

    def _render_tile(self, tile: Tile) -> bytes | None:
        assert self.tiles is not None
        return self.tiles.render(tile, self._tree.nodes, self._bodies)

    def _checkpoint_matches(self, note: bytes) -> bool:
        try:
            checkpoint = self.verifier.open(note.decode("utf-8"))
        except (UnicodeDecodeError, VerificationError):
            return False
        return checkpoint.size <= self._tree.size and checkpoint.root == self._tree.root(
            checkpoint.size
        )

    def _republish(self) -> None:
        """Publish again the checkpoint the tile folder should hold (its file was damaged)."""
        assert self.tiles is not None
        with self._tiles_lock:
            note = self.tiles.published_note
            if not note or not self._checkpoint_matches(note.encode()):
                latest = self._latest
                if latest is None or latest.size != self.tiles.published:
                    return
                note = latest.note
            self.tiles.publish(note, self.tiles.published, again=True)

    def _write_tiles(self, size: int) -> None:
        """The tiles of the tree of `size` leaves (the caller holds the checkpoint lock); the
        first time, also the partial tiles of every checkpoint signed since the tile folder's
        own."""
        assert self.tiles is not None
        # The first time, every signed size's partial tiles (a crash may have lost those written
        # unsynced before signing); then those signed since the last published.
        above = self._published if self._tiles_caught_up else 0
        self.tiles.write(size, self._tree.nodes, self._bodies, self._signed_sizes(above, size))
        self._tiles_caught_up = True

    def _signed_sizes(self, above: int, upto: int) -> list[int]:
        """Sizes of stored checkpoints in (above, upto], one for each partial tile they have that
        no full tile at `upto` replaces: at each level, at most 255, however many were signed."""
        sizes = []
        level = 0
        while upto >> (TILE_HEIGHT * level):
            unit = 1 << (TILE_HEIGHT * level)
            # Sizes below this are in full tiles of this level at `upto`.
            floor = (upto >> (TILE_HEIGHT * (level + 1))) << (TILE_HEIGHT * (level + 1))
            rows = self.db.fetch(_SIGNED_PREFIXES, (unit, max(above, floor), upto))
            sizes += [int(prefix) * unit for (prefix,) in rows]
            level += 1
        return sizes

    def _bodies(self, start: int, end: int) -> list[bytes]:
        return [bytes(body) for (body,) in self.db.fetch(_READ_BODIES, (start, end))]

    def _refuse_if_faulty(self, what: str) -> None:
        if self.fault is not None:
            raise IntegrityError(
                f"the server will not {what} a ledger that fails its check: {self.fault}"
            )

    def _check_last_signed(self) -> None:
        """The stored entries must agree with the last checkpoint this server signed (see
        vault.ledger.last_signed)."""
        if self.last_signed is not None:
            self.last_signed.check(
                self.verifier, self._tree.size, self._tree.root, self._last_matching_checkpoint
            )

    def _last_matching_checkpoint(self, below: int) -> int:
        """The size of the largest stored checkpoint under `below` that is validly signed and
        agrees with the stored entries (0 if none): entries before it are as signed."""
        with self.db.read.connect() as conn:
            notes = conn.execute(
                select(tables.checkpoints.c.note)
                .where(tables.checkpoints.c.size < below)
                .order_by(tables.checkpoints.c.size.desc())
            ).scalars()
            for note in notes:
                try:
                    checkpoint = self.verifier.open(note)
                except VerificationError:
                    continue
                if checkpoint.root == self._tree.root(checkpoint.size):
                    return checkpoint.size
        return 0

    def _load_latest_checkpoint(self) -> SignedCheckpoint | None:
        with self.db.read.connect() as conn:
            row = conn.execute(
                select(tables.checkpoints.c.note)
                .order_by(tables.checkpoints.c.size.desc())
                .limit(1)
            ).first()
        if row is None:
            return None
        try:
            checkpoint = self.verifier.open(row.note)
            if checkpoint.size > self._tree.size or checkpoint.root != self._tree.root(
                checkpoint.size
            ):
                raise VerificationError("its root does not match the stored entries")
        except VerificationError as exc:
            # Never serve a checkpoint we cannot stand behind; `vault verify` reports it.
            log.error("latest stored checkpoint is not valid (%s); signing a new one", exc)
            return None
        return SignedCheckpoint(checkpoint, row.note)

    def _publish_empty(self) -> None:
        self.checkpoint(0)
        self.write_tiles()

    def _checkpoint_loop(self, interval: float) -> None:
        # First the tiles a previous run left unwritten, off the path of start-up.
        self._guarded(self.write_tiles)
        if self._tiles_suspect:
            self._guarded(self.repair_tiles)
        while not self._closed.wait(interval):
            self._guarded(self._checkpoint_step)

    def _index_due(self) -> bool:
        """Whether the newest entry is not an `index` entry covering every entry before it."""
        size = self.sync()
        if size == 0:
            return False
        rows = self.db.fetch(LATEST_INDEX)
        return not (
            rows and int(rows[0][0]) == size - 1 and read_index(bytes(rows[0][1]))[0] == size - 1
        )

    async def index_tick_async(self) -> None:
        """Have the writer bring the subject map up to the head, if the newest entry is not an
        `index` entry covering every entry before it. Appends bring it up themselves every
        INDEX_EVERY entries; a look-up that finds many more uncovered (an upgraded ledger's
        first) asks for this."""
        if not self._index_due():
            return
        if self._link is not None:
            await self._link.append([])
        elif self._writer is not None:
            waiter: asyncio.Future[list[StoredEntry]] = asyncio.get_running_loop().create_future()
            self._queue.put(Waiting([], waiter))
            await waiter

    def _checkpoint_step(self) -> None:
        if self.sync() > (self._latest.size if self._latest else -1):
            self.checkpoint(self._tree.size)
        self.write_tiles()
        # Off the appenders' path: at most once an interval, one small synced file.
        if self._latest is not None and self.fault is None and self.last_signed:
            self.last_signed.record(self._latest.note, self._latest.size)

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except VerificationError as exc:
            if str(exc) != str(self.fault):
                log.error("the stored ledger fails its check (%s); run `vault verify`", exc)
                self._fault_logged = time.monotonic()
            self.fault = exc
        except IntegrityError as exc:
            # A ledger that fails its check is refused every interval: said once, then slowly.
            now = time.monotonic()
            if now - self._fault_logged >= FAULT_LOGGED_EVERY:
                log.error("%s; run `vault verify`", exc)
                self._fault_logged = now
        except Exception as exc:
            if isinstance(exc, ResourceExhausted) or is_disk_full(exc):
                # A full disk: tried again each interval, until space is freed.
                log.warning("periodic checkpoint put off: %s", exc)
            else:
                log.exception("periodic checkpoint failed")

    # ------------------------------------------------------------------ proofs

    def _require(self, size: int) -> None:
        if size > self._tree.size:
            self.sync()
        if size > self._tree.size:
            raise NotFound(f"the ledger has {self._tree.size} entries, fewer than {size}")

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        self._require(size)
        if index >= size:
            raise InvalidArgument(f"index {index} is not in a tree of size {size}")
        return self._tree.inclusion_proof(index, size)

    def inclusion_proofs(self, indexes: Iterable[int], size: int) -> dict[int, tuple[bytes, ...]]:
        """The inclusion proof of each of `indexes` in the tree of `size` leaves, by index, the
        nodes they share read once (a batch look-up's proofs)."""
        self._require(size)
        wanted = set(indexes)
        if wanted and max(wanted) >= size:
            raise InvalidArgument(f"index {max(wanted)} is not in a tree of size {size}")
        return self._tree.inclusion_proofs(wanted, size)

    def multiproof(self, indexes: Iterable[int], size: int) -> list[bytes]:
        """The nodes that prove the entries at `indexes` in the tree of `size` leaves together
        (`MerkleTree.multiproof`: a batch look-up's answer)."""
        self._require(size)
        wanted = set(indexes)
        if wanted and max(wanted) >= size:
            raise InvalidArgument(f"index {max(wanted)} is not in a tree of size {size}")
        return self._tree.multiproof(wanted, size)

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        self._require(new_size)
        if old_size > new_size:
            raise InvalidArgument(f"old size {old_size} is larger than new size {new_size}")
        if old_size == 0 or old_size == new_size:
            return []
        return self._tree.consistency_proof(old_size, new_size)

    def leaf(self, index: int) -> bytes:
        self._require(index + 1)
        return self._tree.leaf(index)

    # ------------------------------------------------------------------ queries

    def entries_naming(self, digest: str, limit: int | None = None) -> list[StoredEntry]:
        """Entries naming one digest, in index order (a look-up's query); the first `limit`
        only, if given."""
        rows = self.db.naming("e.idx, e.body", [digest_key(digest)], limit=limit)
        return [StoredEntry(idx, bytes(body)) for idx, body in rows]

    def entries_between(self, start: int, end: int) -> list[StoredEntry]:
        """The entries at indexes `start` to `end` (excluded), in order."""
        rows = self.db.fetch(_READ_BODIES, (start, end))
        return [StoredEntry(index, bytes(body)) for index, (body,) in enumerate(rows, start)]

    def entries_for(self, digests: Iterable[str]) -> dict[str, list[StoredEntry]]:
        """Entries naming each digest, in index order."""
        wanted = list(dict.fromkeys(digests))
        by_key = self.entries_by_key([digest_key(d) for d in wanted])
        return {d: [StoredEntry(i, body) for i, body in by_key[digest_key(d)]] for d in wanted}

    def entries_by_key(self, keys: Sequence[bytes]) -> dict[bytes, list[tuple[int, bytes]]]:
        """The index and body of each entry naming each of `keys` (raw digest keys, as
        `digest_key` gives them), in index order: `entries_for` for a caller that has the keys
        already, without an object an entry (a batch look-up reads thousands)."""
        found: dict[bytes, list[tuple[int, bytes]]] = {key: [] for key in keys}
        wanted = list(found)
        for start in range(0, len(wanted), QUERY_BATCH):
            # Rows of the entries' subjects not asked for in this statement are left here (see
            # `Database.naming`).
            part = wanted[start : start + QUERY_BATCH]
            get = found.get if len(part) == len(wanted) else {k: found[k] for k in part}.get
            rows = self.db.naming("s.digest, e.idx, e.body", part, every_subject=True)
            for key, idx, body in rows:
                entries = get(key if type(key) is bytes else bytes(key))
                if entries is not None:
                    entries.append((idx, body if type(body) is bytes else bytes(body)))
        return found

    def pins_of_kind(self, digest: str, kind: str) -> list[tuple[StoredEntry, bool]]:
        """The entries of one kind naming `digest`, in index order, each with whether it pins
        external content. Cheaper than `entries_for` on a digest named by many entries of
        other kinds (an image every run names)."""
        key = digest_key(digest)
        columns = "e.idx, e.body, e.external"
        rows = self.db.naming(columns, [key], where=" AND e.kind = ?", params=[kind])
        return [(StoredEntry(idx, bytes(body)), bool(external)) for idx, body, external in rows]

    def entry(self, index: int) -> StoredEntry:
        with self.db.read.connect() as conn:
            row = conn.execute(
                select(tables.entries.c.body).where(tables.entries.c.idx == index)
            ).first()
        if row is None:
            raise NotFound(f"no ledger entry at index {index}")
        return StoredEntry(index, row.body)

    def log(self, start: int, limit: int, where: LogFilter) -> list[StoredEntry]:
        e = tables.entries
        query = tables.listing(
            start, limit, kind=where.kind, author=where.author, since=where.since, until=where.until
        )
        if where.digest:
            # Only entries the subject index gives, of those after `start`.
            key = digest_key(where.digest)
            named = [i for (i,) in self.db.naming("e.idx", [key]) if i >= start]
            found: list[StoredEntry] = []
            with self.db.read.connect() as conn:
                for part in range(0, len(named), QUERY_BATCH):
                    chunk = query.where(e.c.idx.in_(named[part : part + QUERY_BATCH]))
                    found += [StoredEntry(i, body) for i, body in conn.execute(chunk)]
                    if len(found) >= limit:
                        break
            return found[:limit]
        with self.db.read.connect() as conn:
            return [StoredEntry(idx, body) for idx, body in conn.execute(query)]

    def read_raw(
        self, start: int = 0, end: int | None = None, *, from_head: bool = False
    ) -> Iterator[tuple[int, list[RawEntry]]]:
        """The ledger head's size and every stored entry row from `start` (or, `from_head`,
        from the head's size) up to `end`, in index order, in batches, all read in one snapshot
        of the database (one read transaction), so that an audit sees the head and the rows as
        one moment left them while appends go on; no checks. Rows past the head in that
        snapshot are there too: no append leaves them."""
        for head, rows, subject_rows in self._read_rows(start, end, from_head):
            subjects: dict[int, list[str]] = {}
            for idx, key in subject_rows:
                subjects.setdefault(idx, []).append(digest_from_key(bytes(key)))
            yield (
                head,
                [
                    RawEntry(
                        idx,
                        bytes(body),
                        bytes(leaf),
                        kind,
                        author,
                        time,
                        bool(external),
                        tuple(sorted(subjects.get(idx, ()))),
                    )
                    for idx, body, leaf, kind, author, time, external in rows
                ],
            )

    def read_columns(
        self, start: int = 0, end: int | None = None, *, from_head: bool = False
    ) -> Iterator[tuple[int, RawColumns]]:
        """`read_raw`'s rows as columns: an auditor reading millions of rows costs the server
        a few list operations a batch rather than an object a row."""
        for head, rows, subject_rows in self._read_rows(start, end, from_head):
            if not rows:
                yield head, RawColumns((), (), b"", (), (), (), (), (), ())
                continue
            indexes, bodies, leaves, kinds, authors, times, external = zip(*rows, strict=True)
            if not self.db.is_sqlite:
                bodies = tuple(bytes(b) for b in bodies)
                leaves = tuple(bytes(leaf) for leaf in leaves)
            flat: list[str] = []
            counts: list[int] = [0] * len(indexes)
            if subject_rows:
                owners, keys = zip(*subject_rows, strict=True)
                flat = [
                    "sha256:" + key.hex() if len(key) == 32 else digest_from_key(bytes(key))
                    for key in keys
                ]
                per_index = Counter(owners)
                counts = [per_index.get(idx, 0) for idx in indexes]
                if len(per_index) != len(owners):
                    # Some entry has several subjects: each entry's in order.
                    at = 0
                    for count in counts:
                        if count > 1:
                            flat[at : at + count] = sorted(flat[at : at + count])
                        at += count
            yield (
                head,
                RawColumns(
                    indexes, bodies, b"".join(leaves), kinds, authors, times, external, counts, flat
                ),
            )

    def _read_rows(
        self, start: int, end: int | None, from_head: bool
    ) -> Iterator[tuple[int, list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
        """Batches of entry rows and their subject rows (index, stored key), in index order,
        in one read transaction."""
        with self.db.read.connect() as conn:
            if not self.db.is_sqlite:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                driver = conn.connection.driver_connection
                assert driver is not None
                fetch = _fetcher(driver, sqlite=self.db.is_sqlite)
                ((head,),) = fetch("SELECT size FROM ledger_head WHERE id = 1", ())
                head = int(head)
                if from_head:
                    start = head
                after = start - 1
                while True:
                    if end is None:
                        rows = fetch(_READ_ENTRIES, (after, READ_BATCH))
                    else:
                        rows = fetch(_READ_ENTRIES_UNTIL, (after, end, READ_BATCH))
                    if not rows:
                        if after < start:
                            yield head, [], []
                        return
                    last = rows[-1][0]
                    yield head, rows, fetch(_READ_SUBJECTS, (after, last))
                    after = last

    def head_size(self) -> int:
        with self.db.read.connect() as conn:
            return int(conn.execute(select(tables.ledger_head.c.size)).scalar_one())

    def stored_checkpoints(self) -> Iterator[list[str]]:
        """Every checkpoint stored in the database, and the last one this server signed if the
        database lacks it, so that an audit checks the entries against it too."""
        kept = None if self.last_signed is None else self.last_signed.note()
        c = tables.checkpoints
        after = -1
        while True:
            with self.db.read.connect() as conn:
                rows = conn.execute(
                    select(c.c.size, c.c.note).where(c.c.size > after).order_by(c.c.size).limit(500)
                ).all()
            if not rows:
                break
            notes = [note for _, note in rows]
            if kept in notes:
                kept = None
            yield notes
            after = rows[-1][0]
        if kept is not None:
            yield [kept]

    def count(self) -> int:
        with self.db.read.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(tables.entries)).scalar_one())

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join()
        self._checkpointer.join()
        if self._tile_checker is not None:
            self._tile_checker.join()
        if self._latest is not None and self.fault is None and self.last_signed:
            with contextlib.suppress(OSError):
                self.last_signed.record(self._latest.note, self._latest.size)
        self._writer_db.close()
        if self._tile_nodes is not None:
            self._tile_nodes.close()


def _tile_nodes(path: Path) -> TileNodesFile | None:
    """The file of the tiles' inner nodes, or None (proofs then hash whole tiles) if it cannot
    be opened."""
    try:
        return TileNodesFile(path)
    except OSError as exc:
        log.warning("cannot keep the tiles' inner nodes in %s: %s", path, exc.strerror or exc)
        return None


def _fetcher(driver: Any, *, sqlite: bool) -> Query:
    """Plain queries with `?` placeholders on a driver connection inside its transaction."""

    def fetch(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        if sqlite:
            return list(driver.execute(sql, params).fetchall())
        with driver.cursor() as cursor:
            cursor.execute(sql.replace("?", "%s"), params)
            return list(cursor.fetchall())

    return fetch
