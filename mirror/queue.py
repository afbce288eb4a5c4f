"""The replication queue: which blob still needs a copy on which mirror, in one SQLite file in the
data folder that survives a restart of the vault. The copies made are not kept here: each is a
placement on tier `mirror-<name>` in the tier manager's journal, the vault's one placement
record, which the queue reads and writes through."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tiers.placements import JOURNAL_FILE_NAME, MIRROR_TIER_PREFIX, Journal, mirror_tier
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
"""
# Where releases before the one placement record kept the verified mirror copies (digest,
# mirror, size, verified); carried into the placement record and dropped at open.
_OLD_COPIES_TABLE: Final = "copies"


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
    """One mirror's copies, as the placement record has them, and its queue."""

    objects: int = 0
    bytes: int = 0
    queued: int = 0
    queued_bytes: int = 0
    oldest_queued: float | None = None
    last_error: str = ""
    # When a copy on the mirror was last verified (None: none has been).
    last_verified: float | None = None


class ReplicationQueue:
    """The copies still to make, over `placements`, the placement record that holds the copies
    made (default: the journal beside the queue's file, where the vault keeps it in its data
    folder). Every change is one transaction, durable (synchronous=FULL) before the call
    returns, so a put acknowledged after `enqueue` cannot lose its replication to a crash.

    A queue file of an earlier release, which kept its own table of verified copies, has them
    carried into the placement record when it is opened."""

    def __init__(self, path: Path, *, placements: Journal | None = None) -> None:
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
        self._owns_placements = placements is None
        if placements is None:
            journal = self.path.with_name(JOURNAL_FILE_NAME)
            try:
                placements = Journal(journal)
            except sqlite3.Error as error:
                self._db.close()
                raise Unavailable(f"cannot open the placement record {journal}: {error}") from None
        self.placements = placements
        try:
            self._carry_over_copies()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._owns_placements:
            self.placements.close()

    def _carry_over_copies(self) -> None:
        """Record the verified copies an earlier release kept in the queue's file as
        placements, then drop their table: a second record left behind would go stale as
        scrub and repair change the placements, and would bring back, at the next open, copies
        since forgotten. Placements first: a crash before the drop commits only carries the
        same copies over again, and an older verification time never replaces a newer one."""
        with self._transaction() as db:
            found = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                (_OLD_COPIES_TABLE,),
            ).fetchone()
            if found is None:
                return
            rows = db.execute(
                f"SELECT digest, mirror, size, verified FROM {_OLD_COPIES_TABLE}"
            ).fetchall()
            with self._placing():
                self.placements.place_verified(
                    [
                        (Digest.parse(digest), mirror_tier(mirror), int(size), float(verified))
                        for digest, mirror, size, verified in rows
                    ]
                )
            db.execute(f"DROP TABLE {_OLD_COPIES_TABLE}")

    @contextmanager
    def _placing(self) -> Iterator[Journal]:
        """The placement record, its errors made the queue's own (Unavailable)."""
        try:
            yield self.placements
        except sqlite3.Error as error:
            raise Unavailable(f"placement record {self.placements.path}: {error}") from None

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
        """Queue each blob (digest, size, mirrors) for every mirror given on which the
        placement record has no copy and none is queued; returns how many were queued."""
        wanted: list[tuple[Digest, str, int]] = []
        with self._placing() as placements:
            for digest, size, mirrors in blobs:
                placed = placements.placed(digest)
                wanted += [(digest, m, size) for m in mirrors if mirror_tier(m) not in placed]
        if not wanted:
            return 0
        # A copy recorded between the look-up and this commit is queued once more: its next
        # pass finds it there and only checks it.
        now = time.time()
        added = 0
        with self._transaction() as db:
            for digest, mirror, size in wanted:
                cursor = db.execute(
                    "INSERT INTO pending (digest, mirror, size, queued, next_try) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (str(digest), mirror, size, now, now),
                )
                added += cursor.rowcount
        return added

    def done(self, digest: Digest, mirror: str, size: int) -> None:
        """Record a verified copy in the placement record and drop it from the queue."""
        self.done_many([(digest, mirror, size)])

    def done_many(self, copies: Sequence[tuple[Digest, str, int]]) -> None:
        """Record verified copies as placements, one commit for them all, then drop them from
        the queue. A crash before the placements commit costs only a second check of those
        copies (they stay queued); one between the two commits, the same."""
        if not copies:
            return
        now = time.time()
        with self._placing() as placements:
            placements.place_verified(
                [(digest, mirror_tier(mirror), size, now) for digest, mirror, size in copies]
            )
        with self._transaction() as db:
            db.executemany(
                "DELETE FROM pending WHERE digest = ? AND mirror = ?",
                [(str(digest), mirror) for digest, mirror, _ in copies],
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
        with self._placing() as placements:
            placements.unplace(digest, mirror_tier(mirror))

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
        """The mirrors the placement record has a copy of `digest` on."""
        with self._placing() as placements:
            placed = placements.placed(digest)
        return {
            tier.removeprefix(MIRROR_TIER_PREFIX)
            for tier in placed
            if tier.startswith(MIRROR_TIER_PREFIX)
        }

    def known_digests(self) -> list[Digest]:
        """Every blob with a mirror copy recorded or queued anywhere."""
        rows = self._query("SELECT DISTINCT digest FROM pending")
        with self._placing() as placements:
            placed = list(placements.placed_digests(MIRROR_TIER_PREFIX))
        return list(dict.fromkeys([*placed, *(Digest.parse(str(row[0])) for row in rows)]))

    def pending_count(self) -> int:
        (row,) = self._query("SELECT COUNT(*) FROM pending")
        return int(row[0])

    def counts(self) -> dict[str, MirrorCounts]:
        """Per mirror: its copies in the placement record, their bytes and when one was last
        verified; queued copies, their bytes, the time the oldest was queued and the last error
        met."""
        found: dict[str, MirrorCounts] = {}
        with self._placing() as placements:
            totals = placements.totals()
            verified = placements.last_verified()
        for tier, (objects, size) in totals.items():
            if tier.startswith(MIRROR_TIER_PREFIX):
                found[tier.removeprefix(MIRROR_TIER_PREFIX)] = MirrorCounts(
                    objects, size, last_verified=verified.get(tier)
                )
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
                last_verified=base.last_verified,
                queued=int(queued),
                queued_bytes=int(size or 0),
                oldest_queued=float(oldest),
                last_error=str(error),
            )
        return found
