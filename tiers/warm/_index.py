"""The warm tier's index, root/index.sqlite: which record holds each blob, with its chunk list;
each pack and its acknowledged size; the tombstones of deleted blobs. Every SQL statement the
tier runs is here."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.digest import Digest
from vault.errors import FailedPrecondition
from vault.store.chunks import ChunkList

INDEX_NAME: Final = "index.sqlite"
INDEX_VERSION: Final = 1

# SQLite binds at most 999 parameters in older builds; stay well under.
_QUERY_BATCH: Final = 450

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS packs (
    number INTEGER PRIMARY KEY,
    size INTEGER NOT NULL,
    sealed INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    id INTEGER PRIMARY KEY,
    sha256 BLOB NOT NULL UNIQUE,
    pack INTEGER NOT NULL,
    position INTEGER NOT NULL,
    stored_length INTEGER NOT NULL,
    compression TEXT NOT NULL,
    chunk_list BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS tombstones (
    id INTEGER PRIMARY KEY,
    sha256 BLOB NOT NULL,
    pack INTEGER NOT NULL,
    position INTEGER NOT NULL,
    stored_length INTEGER NOT NULL,
    deleted_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS blobs_pack ON blobs (pack);
CREATE INDEX IF NOT EXISTS tombstones_pack ON tombstones (pack);
"""
_FIND: Final = (
    "SELECT pack, position, stored_length, compression, chunk_list FROM blobs WHERE sha256 = ?"
)
_INSERT: Final = (
    "INSERT INTO blobs (sha256, pack, position, stored_length, compression, chunk_list) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
_TOMBSTONE: Final = (
    "INSERT INTO tombstones (sha256, pack, position, stored_length, deleted_at) "
    "SELECT sha256, pack, position, stored_length, strftime('%Y-%m-%dT%H:%M:%fZ', 'now') "
    "FROM blobs WHERE sha256 = ?"
)

# A blob's row as a commit inserts it: sha256 (raw), pack, position, stored length,
# compression, encoded chunk list.
NewRow = tuple[bytes, int, int, int, str, bytes]


@dataclass(frozen=True, slots=True)
class Row:
    """Where the index says a blob's record is, and the blob's chunk list."""

    pack: int
    position: int
    length: int
    compression: str
    chunks: ChunkList


def connect(path: Path) -> sqlite3.Connection:
    # Autocommit mode, so that transactions are exactly the ones begun by `transaction`.
    return sqlite3.connect(path, isolation_level=None, check_same_thread=False)


def open_index(path: Path) -> sqlite3.Connection:
    """The connection all writes go through (WAL, synchronous=FULL), the schema in place."""
    db = connect(path)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.execute("PRAGMA cache_size = -65536")
        (version,) = db.execute("PRAGMA user_version").fetchone()
        if version not in (0, INDEX_VERSION):
            raise FailedPrecondition(
                f"{path} is a version {version} warm index; this pinvault reads "
                f"version {INDEX_VERSION}"
            )
        with transaction(db):
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
    except BaseException:
        db.close()
        raise
    return db


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise


class Readers:
    """Read connections, one per concurrent reader, kept open between reads."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._all: list[sqlite3.Connection] = []
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reader(self) -> Iterator[sqlite3.Connection]:
        try:
            db = self._idle.pop()
        except IndexError:
            db = connect(self._path)
            with self._lock:
                self._all.append(db)
        try:
            yield db
        finally:
            self._idle.append(db)

    def close(self) -> None:
        with self._lock:
            for db in self._all:
                db.close()
            self._all.clear()
            self._idle.clear()


# -- queries -----------------------------------------------------------------------------------


def find(db: sqlite3.Connection, sha256: Digest, raw: bytes) -> Row | None:
    """The row of blob `sha256` (`raw` its bytes), if it is stored."""
    rows = db.execute(_FIND, (raw,)).fetchall()
    if not rows:
        return None
    pack, position, length, compression, encoded = rows[0]
    return Row(pack, position, length, compression, ChunkList.decode(encoded, sha256))


def live(db: sqlite3.Connection, raws: Sequence[bytes]) -> set[bytes]:
    """Which of these sha256 digests (raw) are stored."""
    found: set[bytes] = set()
    for start in range(0, len(raws), _QUERY_BATCH):
        batch = raws[start : start + _QUERY_BATCH]
        marks = ",".join("?" * len(batch))
        query = f"SELECT sha256 FROM blobs WHERE sha256 IN ({marks})"
        found.update(raw for (raw,) in db.execute(query, list(batch)).fetchall())
    return found


def digests_after(db: sqlite3.Connection, last: bytes, limit: int) -> list[bytes]:
    """Up to `limit` stored sha256 digests (raw) above `last`, in order."""
    rows = db.execute(
        "SELECT sha256 FROM blobs WHERE sha256 > ? ORDER BY sha256 LIMIT ?", (last, limit)
    ).fetchall()
    return [raw for (raw,) in rows]


def reclaimable(db: sqlite3.Connection) -> list[tuple[int, int]]:
    """Each pack with tombstones, and the bytes of the deleted blobs' records in it."""
    rows = db.execute(
        "SELECT pack, sum(stored_length) FROM tombstones GROUP BY pack ORDER BY pack"
    ).fetchall()
    return [(pack, size) for pack, size in rows]


def sparse_packs(db: sqlite3.Connection, fraction: float) -> list[int]:
    """The sealed packs whose deleted blobs' records are at least `fraction` of their size
    and that still hold a live blob."""
    return [
        number
        for (number,) in db.execute(
            "SELECT number FROM packs JOIN (SELECT pack, sum(stored_length) AS dead"
            " FROM tombstones GROUP BY pack) ON pack = number"
            " WHERE sealed = 1 AND dead >= ? * size"
            " AND EXISTS (SELECT 1 FROM blobs WHERE blobs.pack = packs.number)"
            " ORDER BY number",
            (fraction,),
        )
    ]


def live_in_pack(db: sqlite3.Connection, number: int) -> list[tuple[bytes, int, int, bytes]]:
    """The live blobs' records in a pack: sha256 (raw), position, length, chunk list."""
    return db.execute(
        "SELECT sha256, position, stored_length, chunk_list FROM blobs WHERE pack = ?"
        " ORDER BY position",
        (number,),
    ).fetchall()


def move_records(
    db: sqlite3.Connection,
    moved: Iterable[tuple[bytes, int, int]],
    *,
    grown: tuple[int, int],
    emptied: int,
) -> None:
    """In one transaction: the records `moved` (sha256, new pack, new position), the pack
    they went to and its new size (`grown`), and pack `emptied` with its tombstones forgotten."""
    with transaction(db):
        db.executemany(
            "UPDATE blobs SET pack = ?, position = ? WHERE sha256 = ?",
            [(pack, position, raw) for raw, pack, position in moved],
        )
        number, size = grown
        db.execute("UPDATE packs SET size = ? WHERE number = ?", (size, number))
        db.execute("DELETE FROM tombstones WHERE pack = ?", (emptied,))
        db.execute("DELETE FROM packs WHERE number = ?", (emptied,))


def dead_packs(db: sqlite3.Connection) -> list[tuple[int, int]]:
    """The sealed packs (number, size) that hold records of deleted blobs and of no live one."""
    return db.execute(
        "SELECT number, size FROM packs WHERE sealed = 1"
        " AND number IN (SELECT DISTINCT pack FROM tombstones)"
        " AND NOT EXISTS (SELECT 1 FROM blobs WHERE blobs.pack = packs.number)"
        " ORDER BY number"
    ).fetchall()


def packs(db: sqlite3.Connection) -> dict[int, tuple[int, bool]]:
    """Every pack the index knows: its acknowledged size and whether it is sealed."""
    return {
        number: (size, bool(sealed))
        for number, size, sealed in db.execute(
            "SELECT number, size, sealed FROM packs ORDER BY number"
        )
    }


# -- changes -----------------------------------------------------------------------------------


def tombstone(db: sqlite3.Connection, raw: bytes) -> bool:
    """Move a blob's row to the tombstones; False if it is not stored."""
    with transaction(db):
        if db.execute(_TOMBSTONE, (raw,)).rowcount == 0:
            return False
        db.execute("DELETE FROM blobs WHERE sha256 = ?", (raw,))
    return True


def drop_pack(db: sqlite3.Connection, number: int) -> None:
    """Forget a pack and the tombstones of the records in it (its file is removed after)."""
    with transaction(db):
        db.execute("DELETE FROM tombstones WHERE pack = ?", (number,))
        db.execute("DELETE FROM packs WHERE number = ?", (number,))


def add_pack(db: sqlite3.Connection, number: int) -> None:
    """A new, empty, open pack."""
    with transaction(db):
        db.execute("INSERT INTO packs (number, size, sealed) VALUES (?, 0, 0)", (number,))


def seal_pack(db: sqlite3.Connection, number: int) -> None:
    with transaction(db):
        db.execute("UPDATE packs SET sealed = 1 WHERE number = ?", (number,))


def add_records(
    db: sqlite3.Connection,
    rows: Iterable[NewRow],
    *,
    grown: tuple[int, int] | None,
    sealed: Iterable[tuple[int, int]],
) -> None:
    """In one transaction: the rows of a commit's blobs, the open pack's new acknowledged
    size (`grown`: number, size), and the sealed packs it added (number, size each)."""
    with transaction(db):
        db.executemany(_INSERT, rows)
        if grown is not None:
            number, size = grown
            db.execute("UPDATE packs SET size = ? WHERE number = ?", (size, number))
        db.executemany("INSERT INTO packs (number, size, sealed) VALUES (?, ?, 1)", sealed)
