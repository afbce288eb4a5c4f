"""The vault's one record of where every copy lives: a placement per copy of a blob on a tier or
a mirror (written by puts, migration, replication and repair; read by scrub, repair, status and
`vault verify --blobs`), and the journal of damaged copies and what was done about them."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.digest import Digest

# The journal's file in the vault's data folder.
JOURNAL_FILE_NAME: Final = "tiers.db"
# A mirror's copies are placements on the tier named `mirror-<name>`, whether replication, a
# repair or the tier manager made them.
MIRROR_TIER_PREFIX: Final = "mirror-"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    digest TEXT NOT NULL,
    tier TEXT NOT NULL,
    chunk_offset INTEGER,
    found TEXT NOT NULL,
    action TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS placements (
    digest TEXT NOT NULL,
    tier TEXT NOT NULL,
    PRIMARY KEY (digest, tier)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS journal_copies ON journal (digest, tier);
"""
# What the journal says was done about a copy that stays damaged or missing: nothing, for want
# of a good copy anywhere, or a rewrite that failed (its action starts so).
LOST: Final = "none: no tier holds a good copy (data loss)"
REWRITE_FAILED: Final = "rewrite failed"
# Added to placements after the first release; a journal without them gains them at open.
# `stored` is when the blob first came to the vault (a migrated copy inherits it), so its age
# survives moves between tiers.
_PLACEMENT_COLUMNS: Final = (
    ("size", "INTEGER"),
    ("stored", "REAL"),
    ("last_read", "REAL"),
    ("last_verified", "REAL"),
)
# Reads are counted in memory and written in one transaction at most this often: a read must
# not pay for a synced write.
READ_FLUSH_INTERVAL: Final = 5.0
# Digests looked up in one query.
_QUERY_BATCH: Final = 500
# The server and a `vault tier` or `vault scrub` command share the journal.
_BUSY_TIMEOUT_MS: Final = 30_000


def unrepaired(action: str) -> bool:
    """Whether a journal record's action leaves its copy damaged or missing."""
    return action == LOST or action.startswith(REWRITE_FAILED)


def mirror_tier(name: str) -> str:
    """The tier a mirror's placements are recorded on."""
    return MIRROR_TIER_PREFIX + name


@dataclass(frozen=True, slots=True)
class Repair:
    """One journal record: a damaged or missing copy, and what was done about it."""

    time: float
    digest: Digest
    tier: str
    offset: int | None
    found: str
    action: str


@dataclass(frozen=True, slots=True)
class Placement:
    """One copy in one tier, as journaled: its size, when the blob first came to the vault,
    when this copy was last read and last verified (None: not since the journal knew it)."""

    digest: Digest
    tier: str
    size: int | None
    stored: float | None
    last_read: float | None
    last_verified: float | None


class Journal:
    """Repairs and placements in one SQLite file; each record is durable (synchronous=FULL)
    before the action it announces is taken.

    Its placements are the vault's one record of where copies are: each copy on each tier,
    made by a put, a migration, a repair or mirror replication (tier `mirror-<name>`), is one
    row, which scrub, repair, `vault mirror status` and `vault verify --blobs` read."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.executescript(_SCHEMA)
        self._upgrade()
        self._reads: dict[tuple[str, str], float] = {}
        self._reads_lock = threading.Lock()
        self._flushed = time.monotonic()

    def _upgrade(self) -> None:
        """Add the placement columns a journal of an earlier version lacks; its placements
        count as stored now, which only keeps them hot longer than their true age would."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                have = {row[1] for row in self._db.execute("PRAGMA table_info(placements)")}
                for name, kind in _PLACEMENT_COLUMNS:
                    if name not in have:
                        self._db.execute(f"ALTER TABLE placements ADD COLUMN {name} {kind}")
                self._db.execute(
                    "UPDATE placements SET stored = ? WHERE stored IS NULL", (time.time(),)
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        self.flush_reads()
        with self._lock:
            self._db.close()

    def record(
        self, digest: Digest, tier: str, offset: int | None, found: str, action: str
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO journal (time, digest, tier, chunk_offset, found, action) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), str(digest), tier, offset, found, action),
            )

    def records(self, digest: Digest | None = None) -> list[Repair]:
        query = "SELECT time, digest, tier, chunk_offset, found, action FROM journal"
        arguments: tuple[str, ...] = ()
        if digest is not None:
            query += " WHERE digest = ?"
            arguments = (str(digest),)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY id", arguments).fetchall()
        return [Repair(row[0], Digest.parse(row[1]), *row[2:]) for row in rows]

    def place(
        self,
        digest: Digest,
        tier: str,
        *,
        size: int | None = None,
        stored: float | None = None,
        last_read: float | None = None,
        verified: float | None = None,
    ) -> None:
        """Record a copy; what is given updates a known one, what is not keeps its value. A
        new placement of a blob the journal already knows inherits its stored time."""
        with self._lock:
            self._db.execute(
                "INSERT INTO placements (digest, tier, size, stored, last_read, last_verified) "
                "VALUES (?1, ?2, ?3, coalesce(?4, (SELECT min(stored) FROM placements "
                "WHERE digest = ?1), ?7), ?5, ?6) "
                "ON CONFLICT (digest, tier) DO UPDATE SET "
                "size = coalesce(excluded.size, size), "
                "last_read = CASE WHEN excluded.last_read IS NULL THEN last_read "
                "ELSE max(excluded.last_read, coalesce(last_read, 0)) END, "
                "last_verified = coalesce(excluded.last_verified, last_verified)",
                (str(digest), tier, size, stored, last_read, verified, time.time()),
            )

    def place_verified(self, copies: Sequence[tuple[Digest, str, int, float]]) -> None:
        """Record verified copies (digest, tier, size, time verified) in one transaction. A
        copy already known keeps the later of its two verification times: a verification
        carried over from an earlier record must not make a copy look checked longer ago."""
        if not copies:
            return
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT INTO placements (digest, tier, size, stored, last_verified) "
                    "VALUES (?1, ?2, ?3, coalesce((SELECT min(stored) FROM placements "
                    "WHERE digest = ?1), ?5), ?4) "
                    "ON CONFLICT (digest, tier) DO UPDATE SET "
                    "size = excluded.size, "
                    "last_verified = max(excluded.last_verified, coalesce(last_verified, 0))",
                    [(str(digest), tier, size, when, now) for digest, tier, size, when in copies],
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def unplace(self, digest: Digest, tier: str | None = None) -> None:
        """Forget the blob's copy on `tier`, or every copy of it."""
        with self._lock:
            if tier is None:
                self._db.execute("DELETE FROM placements WHERE digest = ?", (str(digest),))
            else:
                self._db.execute(
                    "DELETE FROM placements WHERE digest = ? AND tier = ?", (str(digest), tier)
                )

    def note_read(self, digest: Digest, tier: str) -> None:
        """Count a read of a copy; written to the journal in batches (see flush_reads)."""
        now = time.time()
        with self._reads_lock:
            self._reads[str(digest), tier] = now
            due = time.monotonic() - self._flushed >= READ_FLUSH_INTERVAL
        if due:
            self.flush_reads()

    def flush_reads(self) -> None:
        """Write the reads counted since the last flush, all in one transaction."""
        with self._reads_lock:
            reads, self._reads = self._reads, {}
            self._flushed = time.monotonic()
        if not reads:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "UPDATE placements SET last_read = max(coalesce(last_read, 0), ?) "
                    "WHERE digest = ? AND tier = ?",
                    [(when, digest, tier) for (digest, tier), when in reads.items()],
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    _PLACEMENT = "SELECT digest, tier, size, stored, last_read, last_verified FROM placements"

    def placements(self, digest: Digest | None = None) -> list[Placement]:
        """The journaled copies of one blob, or of every blob, in order of digest."""
        query = self._PLACEMENT
        arguments: tuple[str, ...] = ()
        if digest is not None:
            query, arguments = query + " WHERE digest = ?", (str(digest),)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY digest, tier", arguments).fetchall()
        return [Placement(Digest.parse(row[0]), *row[1:]) for row in rows]

    def least_recently_verified(
        self, limit: int, tiers: Sequence[str] | None = None
    ) -> list[Placement]:
        """The copies verified longest ago (never verified first), for the scrubber; only
        those on `tiers` if given, so that copies on a tier the caller does not hold (a mirror
        no longer configured) cannot fill every batch."""
        query = self._PLACEMENT
        arguments: tuple[str, ...] = ()
        if tiers is not None:
            query += f" WHERE tier IN ({', '.join('?' * len(tiers))})"
            arguments = tuple(tiers)
        with self._lock:
            rows = self._db.execute(
                query + " ORDER BY coalesce(last_verified, 0), digest, tier LIMIT ?",
                (*arguments, limit),
            ).fetchall()
        return [Placement(Digest.parse(row[0]), *row[1:]) for row in rows]

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per tier: the copies journaled there and their bytes (of known size)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT tier, count(*), coalesce(sum(size), 0) FROM placements GROUP BY tier"
            ).fetchall()
        return {tier: (count, size) for tier, count, size in rows}

    def last_verified(self) -> dict[str, float]:
        """Per tier: when a copy there was last verified (tiers with none verified left out)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT tier, max(last_verified) FROM placements "
                "WHERE last_verified IS NOT NULL GROUP BY tier"
            ).fetchall()
        return {tier: float(when) for tier, when in rows}

    def suspected(self) -> set[str]:
        """The digests (as text) of which some copy's last journal record says it was lost or
        its rewrite failed: the only ones `damaged` can name."""
        return set(self._unrepaired())

    def _unrepaired(self) -> dict[str, dict[str, float]]:
        """Digest (as text) to the tiers whose copy's last record is unrepaired, and when."""
        bad: dict[str, dict[str, float]] = {}
        with self._lock:
            rows = self._db.execute(
                "SELECT j.digest, j.tier, j.time, j.action FROM journal j JOIN "
                "(SELECT max(id) AS last FROM journal GROUP BY digest, tier) l ON j.id = l.last"
            ).fetchall()
        for digest, tier, when, action in rows:
            if unrepaired(action):
                bad.setdefault(digest, {})[tier] = when
        return bad

    def damaged(self, digests: Iterable[Digest]) -> set[Digest]:
        """Those of `digests` whose every copy is known damaged or missing and not repaired
        since: the journal's last record of the copy says it was lost or its rewrite failed,
        and it has not been verified since; and the placement record has no other copy (one
        never found bad, such as a mirror's that was out of reach, may be good).

        Cheap in a healthy vault: one pass over the journal's last record of each copy it
        names, and over `digests` (sha256) only when some copy is known bad."""
        bad = self._unrepaired()
        if not bad:
            return set()
        # By hex: formatting a million digests would cost more than the rest of the query.
        by_hex = {text.removeprefix("sha256:"): text for text in bad}
        suspects = {d for d in digests if d.hex in by_hex and d.algorithm == "sha256"}
        texts = sorted(by_hex[digest.hex] for digest in suspects)
        cleared: set[str] = set()
        for start in range(0, len(texts), _QUERY_BATCH):
            part = texts[start : start + _QUERY_BATCH]
            with self._lock:
                copies = self._db.execute(
                    "SELECT digest, tier, last_verified FROM placements "
                    f"WHERE digest IN ({', '.join('?' * len(part))})",
                    part,
                ).fetchall()
            for text, tier, verified in copies:
                since = bad[text].get(tier)
                if since is None or (verified is not None and verified > since):
                    # A copy never found bad, or verified since: it may be good.
                    cleared.add(text)
        return {digest for digest in suspects if by_hex[digest.hex] not in cleared}

    def lost_copies(self, digest: Digest) -> set[str]:
        """The tiers whose copy of the blob the journal last recorded as lost or failed to
        rewrite: they held it, even if the copy is gone now."""
        last: dict[str, str] = {}
        for record in self.records(digest):
            last[record.tier] = record.action
        return {tier for tier, action in last.items() if unrepaired(action)}

    def placed(self, digest: Digest) -> set[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT tier FROM placements WHERE digest = ?", (str(digest),)
            ).fetchall()
        return {row[0] for row in rows}

    def placed_digests(self, tier_prefix: str = "") -> Iterator[Digest]:
        """Every blob with a copy recorded, or with one on a tier whose name starts so."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT digest FROM placements WHERE substr(tier, 1, ?) = ?",
                (len(tier_prefix), tier_prefix),
            ).fetchall()
        for (text,) in rows:
            yield Digest.parse(text)
