"""The replication queue: which blob still needs a copy on which mirror, and which copies have
been verified, in one SQLite file in the data folder that survives a restart of the vault."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from vault.digest import Digest
from vault.errors import Unavailable

FILE_NAME: Final = "mirrors.db"
# The server and a `vault mirror` command share the file; a writer waits this long for the
# other's transaction rather than failing.
_BUSY_TIMEOUT_MS: Final = 30_000
_ERROR_LENGTH: Final = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    digest TEXT NOT NULL,
    mirror TEXT NOT NULL,
    size INTEGER NOT NULL,
    queued REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_try REAL NOT NULL,
    last_error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (digest, mirror)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pending_due ON pending (mirror, next_try);
CREATE TABLE IF NOT EXISTS copies (
    digest TEXT NOT NULL,
    mirror TEXT NOT NULL,
    size INTEGER NOT NULL,
    verified REAL NOT NULL,
    PRIMARY KEY (digest, mirror)
) WITHOUT ROWID;
"""


@dataclass(frozen=True, slots=True)
class Pending:
    """One copy still to make."""

    digest: Digest
    mirror: str
    size: int
    queued: float
    attempts: int
    last_error: str


@dataclass(frozen=True, slots=True)
class MirrorCounts:
    """One mirror's verified copies and its queue, as recorded."""

    objects: int = 0
    bytes: int = 0
    queued: int = 0
    queued_bytes: int = 0
    oldest_queued: float | None = None
    last_error: str = ""


class ReplicationQueue:
    """The queue and the record of verified copies. Every change is one transaction, durable
    (synchronous=FULL) before the call returns, so a put acknowledged after `enqueue` cannot
    lose its replication to a crash."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=30
            )
            self._db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as error:
            raise Unavailable(f"cannot open the replication queue {self.path}: {error}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as error:
                raise Unavailable(f"replication queue {self.path}: {error}") from None

    def _query(self, sql: str, arguments: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, arguments).fetchall()
            except sqlite3.Error as error:
                raise Unavailable(f"replication queue {self.path}: {error}") from None

    # -- changes -----------------------------------------------------------------------------

    def enqueue(self, blobs: Iterable[tuple[Digest, int, Sequence[str]]]) -> int:
        """Queue each blob (digest, size, mirrors) for every mirror given that holds no
        verified copy and has none queued; returns how many copies were queued."""
        now = time.time()
        added = 0
        with self._transaction() as db:
            for digest, size, mirrors in blobs:
                for mirror in mirrors:
                    cursor = db.execute(
                        "INSERT INTO pending (digest, mirror, size, queued, next_try) "
                        "SELECT ?, ?, ?, ?, ? WHERE NOT EXISTS "
                        "(SELECT 1 FROM copies WHERE digest = ? AND mirror = ?) "
                        "ON CONFLICT DO NOTHING",
                        (str(digest), mirror, size, now, now, str(digest), mirror),
                    )
                    added += cursor.rowcount
        return added

    def done(self, digest: Digest, mirror: str, size: int) -> None:
        """Record a verified copy and drop it from the queue."""
        self.done_many([(digest, mirror, size)])

    def done_many(self, copies: Sequence[tuple[Digest, str, int]]) -> None:
        """Record verified copies, one commit for them all. A record lost to a crash before
        it commits costs only a second check of that copy: the copy stays queued."""
        now = time.time()
        with self._transaction() as db:
            db.executemany(
                "DELETE FROM pending WHERE digest = ? AND mirror = ?",
                [(str(digest), mirror) for digest, mirror, _ in copies],
            )
            db.executemany(
                "INSERT OR REPLACE INTO copies (digest, mirror, size, verified) VALUES (?,?,?,?)",
                [(str(digest), mirror, size, now) for digest, mirror, size in copies],
            )

    def failed(self, digest: Digest, mirror: str, error: str, retry_at: float) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE pending SET attempts = attempts + 1, next_try = ?, last_error = ? "
                "WHERE digest = ? AND mirror = ?",
                (retry_at, error[:_ERROR_LENGTH], str(digest), mirror),
            )

    def drop(self, digest: Digest, mirror: str) -> None:
        """Forget a queued copy whose blob no longer exists here."""
        with self._transaction() as db:
            db.execute("DELETE FROM pending WHERE digest = ? AND mirror = ?", (str(digest), mirror))

    def forget_copy(self, digest: Digest, mirror: str) -> None:
        """A recorded copy turned out damaged or missing: it no longer counts."""
        with self._transaction() as db:
            db.execute("DELETE FROM copies WHERE digest = ? AND mirror = ?", (str(digest), mirror))

    def retry_now(self) -> None:
        """Make every queued copy due at once (after an operator fixed a mirror)."""
        with self._transaction() as db:
            db.execute("UPDATE pending SET next_try = 0")

    # -- reads -------------------------------------------------------------------------------

    def due(self, mirror: str, *, now: float | None = None, limit: int = 64) -> list[Pending]:
        """Queued copies for `mirror` whose retry time has come, oldest first."""
        rows = self._query(
            "SELECT digest, mirror, size, queued, attempts, last_error FROM pending "
            "WHERE mirror = ? AND next_try <= ? ORDER BY next_try, queued LIMIT ?",
            (mirror, time.time() if now is None else now, limit),
        )
        return [Pending(Digest.parse(d), m, s, q, a, e) for d, m, s, q, a, e in rows]

    def next_try(self, mirror: str) -> float | None:
        (row,) = self._query("SELECT MIN(next_try) FROM pending WHERE mirror = ?", (mirror,))
        return None if row[0] is None else float(row[0])

    def copies(self, digest: Digest) -> set[str]:
        rows = self._query("SELECT mirror FROM copies WHERE digest = ?", (str(digest),))
        return {str(row[0]) for row in rows}

    def known_digests(self) -> list[Digest]:
        """Every blob with a copy recorded or queued anywhere."""
        rows = self._query("SELECT digest FROM copies UNION SELECT digest FROM pending")
        return [Digest.parse(str(row[0])) for row in rows]

    def pending_count(self) -> int:
        (row,) = self._query("SELECT COUNT(*) FROM pending")
        return int(row[0])

    def counts(self) -> dict[str, MirrorCounts]:
        """Per mirror: verified copies and their bytes; queued copies, their bytes, the time
        the oldest was queued and the last error met."""
        found: dict[str, MirrorCounts] = {}
        for mirror, objects, size in self._query(
            "SELECT mirror, COUNT(*), SUM(size) FROM copies GROUP BY mirror"
        ):
            found[mirror] = MirrorCounts(objects=objects, bytes=size or 0)
        for mirror, queued, size, oldest in self._query(
            "SELECT mirror, COUNT(*), SUM(size), MIN(queued) FROM pending GROUP BY mirror"
        ):
            (error,) = self._query(
                "SELECT last_error FROM pending WHERE mirror = ? AND last_error != '' "
                "ORDER BY next_try DESC LIMIT 1",
                (mirror,),
            ) or [("",)]
            base = found.get(str(mirror), MirrorCounts())
            found[str(mirror)] = MirrorCounts(
                objects=base.objects,
                bytes=base.bytes,
                queued=int(queued),
                queued_bytes=int(size or 0),
                oldest_queued=float(oldest),
                last_error=str(error),
            )
        return found
