"""The replication queue: which blob still needs a copy on which mirror, in the database of the
placement record (the data folder's SQLite file on one host; the shared PostgreSQL when several
servers run one vault), so that it survives a restart and any server's replicator can take the
work of one that died. The copies made are not kept here: each is a placement on tier
`mirror-<name>` in the placement record, which the queue reads and writes through.

Work is claimed with a lease: a claimed copy is left to its claimant until the lease runs out,
so several replicators share the queue without copying the same blob twice at once, and a
copy claimed by a server that died is taken up by another once its lease ends."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sqlalchemy import text
from sqlalchemy.engine import Connection

from mirror.uploads import IssuedUploads
from tiers.placements import JOURNAL_FILE_NAME, MIRROR_TIER_PREFIX, Journal, mirror_tier
from vault.digest import Digest
from vault.errors import Unavailable

# Where releases before the shared record kept the queue, in the data folder; its rows are
# carried into the record and the file removed when the queue is opened.
FILE_NAME: Final = "mirrors.db"
# How long a claimed copy stays its claimant's: a replicator that died holds its copies no
# longer. A copy that takes longer may be made twice, which only costs a second check.
LEASE_SECONDS: Final = 300.0
_ERROR_LENGTH: Final = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS replication_queue (
    digest TEXT NOT NULL,
    mirror TEXT NOT NULL,
    size BIGINT NOT NULL,
    queued DOUBLE PRECISION NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_try DOUBLE PRECISION NOT NULL,
    last_error TEXT NOT NULL DEFAULT '',
    lease_owner TEXT NOT NULL DEFAULT '',
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (digest, mirror)
)"""
_INDEX = "CREATE INDEX IF NOT EXISTS replication_queue_due ON replication_queue (mirror, next_try)"
# Where releases before the one placement record kept the verified mirror copies (digest,
# mirror, size, verified), in the queue's own file.
_OLD_COPIES_TABLE: Final = "copies"
_OLD_QUEUE_TABLE: Final = "pending"
_PENDING_COLUMNS: Final = "digest, mirror, size, queued, attempts, next_try, last_error"


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
    """The copies still to make, in the database of `placements`, the placement record that
    holds the copies made (default: the record file beside `path`, where a vault on one host
    keeps it in its data folder). Every change is one transaction, durable before the call
    returns, so a put acknowledged after `enqueue` cannot lose its replication to a crash.

    `path` is where earlier releases kept the queue in a file of its own: its queued copies,
    and the verified copies the release before kept there, are carried into the record when
    the queue is opened, and the file is removed."""

    def __init__(
        self, path: Path | None = None, *, placements: Journal | None = None, owned: bool = False
    ) -> None:
        # The record is closed with the queue if the queue opened it, or was given it `owned`.
        self._owns_placements = placements is None or owned
        if placements is None:
            if path is None:
                raise ValueError("a replication queue needs a placement record or a folder")
            placements = Journal(path.with_name(JOURNAL_FILE_NAME))
        self.placements = placements
        self._greatest = "max" if placements.sqlite else "greatest"
        try:
            with self._transaction() as db:
                db.execute(text(_SCHEMA + (" WITHOUT ROWID" if placements.sqlite else "")))
                db.execute(text(_INDEX))
            if path is not None and path.exists():
                self._carry_over(path)
            # The uploads handed to clients and not yet adopted, in the same database.
            self.uploads = IssuedUploads(placements)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._owns_placements:
            self.placements.close()

    def _carry_over(self, path: Path) -> None:
        """Move what a queue file of an earlier release holds into the record, then remove
        the file: a second record left behind would go stale, and would bring back, at the next
        open, copies since made or forgotten. The record first: a crash before the file is gone
        only carries the same rows over again (a copy queued twice is checked, not copied, and
        an older verification time never replaces a newer one)."""
        try:
            with contextlib.closing(sqlite3.connect(path, timeout=30)) as old:
                names = {row[0] for row in old.execute("SELECT name FROM sqlite_master")}
                copies = (
                    old.execute(
                        f"SELECT digest, mirror, size, verified FROM {_OLD_COPIES_TABLE}"
                    ).fetchall()
                    if _OLD_COPIES_TABLE in names
                    else []
                )
                pending = (
                    old.execute(f"SELECT {_PENDING_COLUMNS} FROM {_OLD_QUEUE_TABLE}").fetchall()
                    if _OLD_QUEUE_TABLE in names
                    else []
                )
        except sqlite3.Error as error:
            raise Unavailable(f"cannot read the replication queue {path}: {error}") from None
        self.placements.place_verified(
            [
                (Digest.parse(digest), mirror_tier(mirror), int(size), float(verified))
                for digest, mirror, size, verified in copies
            ]
        )
        if pending:
            with self._transaction() as db:
                db.execute(
                    text(
                        f"INSERT INTO replication_queue ({_PENDING_COLUMNS}) VALUES (:digest, "
                        ":mirror, :size, :queued, :attempts, :next_try, :last_error) "
                        "ON CONFLICT DO NOTHING"
                    ),
                    [dict(zip(_PENDING_COLUMNS.split(", "), row, strict=True)) for row in pending],
                )
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}{suffix}")

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        with self.placements.writing() as db:
            yield db

    def _query(self, sql: str, arguments: dict[str, Any] | None = None) -> list[Any]:
        return self.placements.query(sql, arguments)

    # -- changes -----------------------------------------------------------------------------

    def enqueue(self, blobs: Iterable[tuple[Digest, int, Sequence[str]]]) -> int:
        """Queue each blob (digest, size, mirrors) for every mirror given on which the
        placement record has no copy and none is queued; returns how many were queued."""
        wanted: list[tuple[Digest, str, int]] = []
        for digest, size, mirrors in blobs:
            placed = self.placements.placed(digest)
            wanted += [(digest, m, size) for m in mirrors if mirror_tier(m) not in placed]
        if not wanted:
            return 0
        # A copy recorded between the look-up and this commit is queued once more: its next
        # pass finds it there and only checks it.
        now = time.time()
        added = 0
        insert = text(
            "INSERT INTO replication_queue (digest, mirror, size, queued, next_try) "
            "VALUES (:digest, :mirror, :size, :now, :now) ON CONFLICT DO NOTHING"
        )
        with self._transaction() as db:
            for digest, mirror, size in wanted:
                result = db.execute(
                    insert, {"digest": str(digest), "mirror": mirror, "size": size, "now": now}
                )
                added += max(0, result.rowcount)
        return added

    def claim(
        self, mirror: str, owner: str, *, limit: int = 64, lease: float = LEASE_SECONDS
    ) -> list[Pending]:
        """Take up to `limit` queued copies for `mirror` that are due and not leased to
        another, oldest first, leased to `owner` for `lease` seconds. On PostgreSQL rows
        another server is claiming at the same moment are skipped, not waited for."""
        now = time.time()
        skip = "" if self.placements.sqlite else " FOR UPDATE SKIP LOCKED"
        with self._transaction() as db:
            rows = list(
                db.execute(
                    text(
                        "UPDATE replication_queue SET lease_owner = :owner, lease_until = :until "
                        "WHERE (digest, mirror) IN (SELECT digest, mirror FROM replication_queue "
                        "WHERE mirror = :mirror AND next_try <= :now AND lease_until <= :now "
                        f"ORDER BY next_try, queued LIMIT :limit{skip}) "
                        "RETURNING digest, mirror, size, queued, attempts, last_error"
                    ),
                    {
                        "owner": owner,
                        "until": now + lease,
                        "mirror": mirror,
                        "now": now,
                        "limit": limit,
                    },
                )
            )
        found = [Pending(Digest.parse(d), m, int(s), q, a, e) for d, m, s, q, a, e in rows]
        return sorted(found, key=lambda item: (item.queued, str(item.digest)))

    def release(self, owner: str) -> None:
        """Give back every copy leased to `owner` (a replicator starting again under the same
        name: what it held before it stopped is due now, not when the lease runs out)."""
        with self._transaction() as db:
            db.execute(
                text(
                    "UPDATE replication_queue SET lease_owner = '', lease_until = 0 "
                    "WHERE lease_owner = :owner"
                ),
                {"owner": owner},
            )

    def unclaim(self, owner: str, items: Sequence[Pending]) -> None:
        """Give back claimed copies not worked on (the mirror turned out unreachable, or the
        replicator is stopping): due again at their retry time, for anyone."""
        if not items:
            return
        with self._transaction() as db:
            db.execute(
                text(
                    "UPDATE replication_queue SET lease_owner = '', lease_until = 0 "
                    "WHERE digest = :digest AND mirror = :mirror AND lease_owner = :owner"
                ),
                [{"digest": str(i.digest), "mirror": i.mirror, "owner": owner} for i in items],
            )

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
        self.placements.place_verified(
            [(digest, mirror_tier(mirror), size, now) for digest, mirror, size in copies]
        )
        with self._transaction() as db:
            db.execute(
                text("DELETE FROM replication_queue WHERE digest = :digest AND mirror = :mirror"),
                [{"digest": str(digest), "mirror": mirror} for digest, mirror, _ in copies],
            )

    def failed(self, digest: Digest, mirror: str, error: str, retry_at: float) -> None:
        with self._transaction() as db:
            db.execute(
                text(
                    "UPDATE replication_queue SET attempts = attempts + 1, next_try = :retry, "
                    "last_error = :error, lease_owner = '', lease_until = 0 "
                    "WHERE digest = :digest AND mirror = :mirror"
                ),
                {
                    "retry": retry_at,
                    "error": error[:_ERROR_LENGTH],
                    "digest": str(digest),
                    "mirror": mirror,
                },
            )

    def drop(self, digest: Digest, mirror: str) -> None:
        """Forget a queued copy whose blob no longer exists here."""
        with self._transaction() as db:
            db.execute(
                text("DELETE FROM replication_queue WHERE digest = :digest AND mirror = :mirror"),
                {"digest": str(digest), "mirror": mirror},
            )

    def forget_copy(self, digest: Digest, mirror: str) -> None:
        """A recorded copy turned out damaged or missing: it no longer counts."""
        self.placements.unplace(digest, mirror_tier(mirror))

    def retry_now(self) -> None:
        """Make every queued copy due at once (after an operator fixed a mirror)."""
        with self._transaction() as db:
            db.execute(text("UPDATE replication_queue SET next_try = 0"))

    # -- reads -------------------------------------------------------------------------------

    def due(self, mirror: str, *, now: float | None = None, limit: int = 64) -> list[Pending]:
        """Queued copies for `mirror` whose retry time has come, oldest first, leased or not."""
        rows = self._query(
            "SELECT digest, mirror, size, queued, attempts, last_error FROM replication_queue "
            "WHERE mirror = :mirror AND next_try <= :now ORDER BY next_try, queued LIMIT :limit",
            {"mirror": mirror, "now": time.time() if now is None else now, "limit": limit},
        )
        return [Pending(Digest.parse(d), m, int(s), q, a, e) for d, m, s, q, a, e in rows]

    def next_try(self, mirror: str) -> float | None:
        """When a copy queued for `mirror` is next due for a claim: its retry time, or the end
        of its lease if later."""
        (row,) = self._query(
            f"SELECT MIN({self._greatest}(next_try, lease_until)) FROM replication_queue "
            "WHERE mirror = :mirror",
            {"mirror": mirror},
        )
        return None if row[0] is None else float(row[0])

    def copies(self, digest: Digest) -> set[str]:
        """The mirrors the placement record has a copy of `digest` on."""
        return {
            tier.removeprefix(MIRROR_TIER_PREFIX)
            for tier in self.placements.placed(digest)
            if tier.startswith(MIRROR_TIER_PREFIX)
        }

    def known_digests(self) -> list[Digest]:
        """Every blob with a mirror copy recorded or queued anywhere."""
        rows = self._query("SELECT DISTINCT digest FROM replication_queue")
        placed = list(self.placements.placed_digests(MIRROR_TIER_PREFIX))
        return list(dict.fromkeys([*placed, *(Digest.parse(str(row[0])) for row in rows)]))

    def pending_count(self) -> int:
        (row,) = self._query("SELECT COUNT(*) FROM replication_queue")
        return int(row[0])

    def counts(self) -> dict[str, MirrorCounts]:
        """Per mirror: its copies in the placement record, their bytes and when one was last
        verified; queued copies, their bytes, the time the oldest was queued and the last error
        met."""
        found: dict[str, MirrorCounts] = {}
        totals = self.placements.totals()
        verified = self.placements.last_verified()
        for tier, (objects, size) in totals.items():
            if tier.startswith(MIRROR_TIER_PREFIX):
                found[tier.removeprefix(MIRROR_TIER_PREFIX)] = MirrorCounts(
                    objects, size, last_verified=verified.get(tier)
                )
        for mirror, queued, size, oldest in self._query(
            "SELECT mirror, COUNT(*), SUM(size), MIN(queued) FROM replication_queue GROUP BY mirror"
        ):
            errors = self._query(
                "SELECT last_error FROM replication_queue WHERE mirror = :mirror "
                "AND last_error != '' ORDER BY next_try DESC LIMIT 1",
                {"mirror": mirror},
            )
            base = found.get(str(mirror), MirrorCounts())
            found[str(mirror)] = MirrorCounts(
                objects=base.objects,
                bytes=base.bytes,
                last_verified=base.last_verified,
                queued=int(queued),
                queued_bytes=int(size or 0),
                oldest_queued=float(oldest),
                last_error=str(errors[0][0]) if errors else "",
            )
        return found
