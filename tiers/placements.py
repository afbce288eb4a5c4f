"""The vault's one record of where every copy lives: a placement per copy of a blob on a tier or
a mirror (written by puts, migration, replication and repair; read by scrub, repair, status and
`vault verify --blobs`), and the journal of damaged copies and what was done about them.

On one host the record is a SQLite file in the data folder; when several servers share a
PostgreSQL ledger, it is tables in that database, written by every server, so that each sees
every copy. A copy on a host's own tiers (its hot and warm folders) is then recorded as
`hot@HOST`: another server's hot copy is not one this server can read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sqlalchemy import Engine, bindparam, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from vault.digest import Digest
from vault.errors import Unavailable
from vault.sql import is_sqlite, server_engine, sqlite_engine

# The record's file in the vault's data folder, on one host.
JOURNAL_FILE_NAME: Final = "tiers.db"
# A mirror's copies are placements on the tier named `mirror-<name>`, whether replication, a
# repair or the tier manager made them.
MIRROR_TIER_PREFIX: Final = "mirror-"
# What separates a host's own tier from the host in a shared record: `hot@a1b2c3`.
HOST_SEPARATOR: Final = "@"

_PLACEMENTS = """
CREATE TABLE IF NOT EXISTS placements (
    digest TEXT NOT NULL,
    tier TEXT NOT NULL,
    size BIGINT,
    stored DOUBLE PRECISION,
    last_read DOUBLE PRECISION,
    last_verified DOUBLE PRECISION,
    PRIMARY KEY (digest, tier)
)"""
_JOURNAL = """
CREATE TABLE IF NOT EXISTS damage_journal (
    id {id},
    time DOUBLE PRECISION NOT NULL,
    digest TEXT NOT NULL,
    tier TEXT NOT NULL,
    chunk_offset BIGINT,
    found TEXT NOT NULL,
    action TEXT NOT NULL
)"""
_JOURNAL_INDEX = "CREATE INDEX IF NOT EXISTS damage_journal_copies ON damage_journal (digest, tier)"
# The damage journal's table before the record could be shared, and its index.
_OLD_JOURNAL_TABLE: Final = "journal"
_OLD_JOURNAL_INDEX: Final = "journal_copies"
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


def record_url(where: Path | str) -> str:
    """The database URL of a record given as a SQLite file's path or as a URL."""
    return f"sqlite:///{where}" if isinstance(where, Path) else where


class Journal:
    """Repairs and placements in one database (`where`: a SQLite file, or a database URL);
    each record is durable before the action it announces is taken.

    Its placements are the vault's one record of where copies are: each copy on each tier,
    made by a put, a migration, a repair or mirror replication (tier `mirror-<name>`), is one
    row, which scrub, repair, `vault mirror status` and `vault verify --blobs` read.

    `host` names this server's own tiers in a record several servers share: the tiers it is
    given and returns are its own names (`hot`), stored as `hot@HOST`; mirror tiers are
    everyone's and stored as they are. Copies on other hosts' tiers are returned with their
    host."""

    def __init__(self, where: Path | str, *, host: str = "") -> None:
        self.url = record_url(where)
        self.sqlite = is_sqlite(self.url)
        self.where = str(where) if isinstance(where, Path) else _shown_url(self.url)
        self.host = host
        self._suffix = HOST_SEPARATOR + host if host else ""
        self._greatest = "max" if self.sqlite else "greatest"
        self._read: Engine
        self._write: Engine
        if self.sqlite:
            self._read = sqlite_engine(self.url, immediate=False, pool_size=4)
            self._write = sqlite_engine(self.url, immediate=True, pool_size=2)
        else:
            self._read = self._write = server_engine(self.url, pool_size=4, max_overflow=16)
        try:
            self._create()
        except BaseException:
            self._dispose()
            raise
        self._reads: dict[tuple[str, str], float] = {}
        self._reads_lock = threading.Lock()
        self._flushed = time.monotonic()

    # -- the database ------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine that writes the record (the replication queue shares its database)."""
        return self._write

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One write transaction; a database error is Unavailable, naming the record."""
        try:
            with self._write.begin() as conn:
                yield conn
        except SQLAlchemyError as error:
            raise Unavailable(f"placement record {self.where}: {_reason(error)}") from None

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        try:
            with self._read.connect() as conn:
                return list(conn.execute(_statement(sql, params), dict(params or {})))
        except SQLAlchemyError as error:
            raise Unavailable(f"placement record {self.where}: {_reason(error)}") from None

    def _run(self, sql: str, params: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        if not params:
            return
        with self.writing() as conn:
            if isinstance(params, Mapping):
                conn.execute(_statement(sql, params), dict(params))
            else:
                conn.execute(text(sql), [dict(row) for row in params])

    def _create(self) -> None:
        identity = (
            "INTEGER PRIMARY KEY"
            if self.sqlite
            else "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"
        )
        rowid = " WITHOUT ROWID" if self.sqlite else ""
        with self.writing() as conn:
            if self.sqlite:
                self._upgrade_sqlite(conn)
            else:
                # Servers starting together must not race to create the same tables.
                conn.execute(text("SELECT pg_advisory_xact_lock(7302016)"))
            conn.execute(text(_PLACEMENTS + rowid))
            conn.execute(text(_JOURNAL.format(id=identity)))
            conn.execute(text(_JOURNAL_INDEX))

    def _upgrade_sqlite(self, conn: Connection) -> None:
        """A record file of an earlier release: its journal table takes its present name, and
        its placements gain the columns they lack (counted as stored now, which only keeps
        them hot longer than their true age would)."""
        names = {row[0] for row in conn.execute(text("SELECT name FROM sqlite_master"))}
        if _OLD_JOURNAL_TABLE in names and "damage_journal" not in names:
            conn.execute(text(f"ALTER TABLE {_OLD_JOURNAL_TABLE} RENAME TO damage_journal"))
            conn.execute(text(f"DROP INDEX IF EXISTS {_OLD_JOURNAL_INDEX}"))
        if "placements" in names:
            have = {row[1] for row in conn.execute(text("PRAGMA table_info(placements)"))}
            for name, kind in _PLACEMENT_COLUMNS:
                if name not in have:
                    conn.execute(text(f"ALTER TABLE placements ADD COLUMN {name} {kind}"))
            conn.execute(
                text("UPDATE placements SET stored = :now WHERE stored IS NULL"),
                {"now": time.time()},
            )

    def _dispose(self) -> None:
        self._read.dispose()
        self._write.dispose()

    # -- tier names --------------------------------------------------------------------------

    def stored_tier(self, tier: str) -> str:
        """The name a tier of this server's has in the record."""
        if not self._suffix or tier.startswith(MIRROR_TIER_PREFIX):
            return tier
        return tier + self._suffix

    def shown_tier(self, stored: str) -> str:
        """A tier as the record names it, in this server's words."""
        return stored.removesuffix(self._suffix) if self._suffix else stored

    def close(self) -> None:
        try:
            self.flush_reads()
        finally:
            self._dispose()

    def adopt(self, other: Journal) -> int:
        """Take in every placement and journal record of `other` (a record of this server's
        alone, from before it shared one): its tiers become this host's, and what is known of
        each copy is kept. Safe to repeat: a placement already here keeps the later of each
        time, and a journal record taken twice says nothing new. Returns the placements."""
        placements = other.placements()
        records = other.records()
        self._run(
            "INSERT INTO placements (digest, tier, size, stored, last_read, last_verified) "
            "VALUES (:digest, :tier, :size, :stored, :last_read, :verified) "
            "ON CONFLICT (digest, tier) DO UPDATE SET "
            "size = coalesce(excluded.size, placements.size), "
            "last_read = coalesce("
            f"{self._greatest}(excluded.last_read, placements.last_read), "
            "excluded.last_read, placements.last_read), "
            "last_verified = coalesce("
            f"{self._greatest}(excluded.last_verified, placements.last_verified), "
            "excluded.last_verified, placements.last_verified)",
            [
                {
                    "digest": str(p.digest),
                    "tier": self.stored_tier(p.tier),
                    "size": p.size,
                    "stored": p.stored,
                    "last_read": p.last_read,
                    "verified": p.last_verified,
                }
                for p in placements
            ],
        )
        self._run(
            "INSERT INTO damage_journal (time, digest, tier, chunk_offset, found, action) "
            "VALUES (:time, :digest, :tier, :offset, :found, :action)",
            [
                {
                    "time": r.time,
                    "digest": str(r.digest),
                    "tier": self.stored_tier(r.tier),
                    "offset": r.offset,
                    "found": r.found,
                    "action": r.action,
                }
                for r in records
            ],
        )
        return len(placements)

    # -- the damage journal ------------------------------------------------------------------

    def record(
        self, digest: Digest, tier: str, offset: int | None, found: str, action: str
    ) -> None:
        self._run(
            "INSERT INTO damage_journal (time, digest, tier, chunk_offset, found, action) "
            "VALUES (:time, :digest, :tier, :offset, :found, :action)",
            {
                "time": time.time(),
                "digest": str(digest),
                "tier": self.stored_tier(tier),
                "offset": offset,
                "found": found,
                "action": action,
            },
        )

    def records(self, digest: Digest | None = None) -> list[Repair]:
        query = "SELECT time, digest, tier, chunk_offset, found, action FROM damage_journal"
        arguments: dict[str, Any] = {}
        if digest is not None:
            query += " WHERE digest = :digest"
            arguments = {"digest": str(digest)}
        rows = self.query(query + " ORDER BY id", arguments)
        return [
            Repair(float(row[0]), Digest.parse(row[1]), self.shown_tier(row[2]), *row[3:])
            for row in rows
        ]

    # -- placements --------------------------------------------------------------------------

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
        self._run(
            "INSERT INTO placements (digest, tier, size, stored, last_read, last_verified) "
            "VALUES (:digest, :tier, CAST(:size AS BIGINT), coalesce("
            "CAST(:stored AS DOUBLE PRECISION), (SELECT min(p.stored) FROM placements p "
            "WHERE p.digest = :digest), :now), CAST(:last_read AS DOUBLE PRECISION), "
            "CAST(:verified AS DOUBLE PRECISION)) "
            "ON CONFLICT (digest, tier) DO UPDATE SET "
            "size = coalesce(excluded.size, placements.size), "
            "last_read = CASE WHEN excluded.last_read IS NULL THEN placements.last_read "
            f"ELSE {self._greatest}(excluded.last_read, coalesce(placements.last_read, 0)) END, "
            "last_verified = coalesce(excluded.last_verified, placements.last_verified)",
            {
                "digest": str(digest),
                "tier": self.stored_tier(tier),
                "size": size,
                "stored": stored,
                "last_read": last_read,
                "verified": verified,
                "now": time.time(),
            },
        )

    def place_verified(self, copies: Sequence[tuple[Digest, str, int, float]]) -> None:
        """Record verified copies (digest, tier, size, time verified) in one transaction. A
        copy already known keeps the later of its two verification times: a verification
        carried over from an earlier record must not make a copy look checked longer ago."""
        now = time.time()
        self._run(
            "INSERT INTO placements (digest, tier, size, stored, last_verified) "
            "VALUES (:digest, :tier, :size, coalesce((SELECT min(p.stored) FROM placements p "
            "WHERE p.digest = :digest), :now), :verified) "
            "ON CONFLICT (digest, tier) DO UPDATE SET "
            "size = excluded.size, "
            f"last_verified = {self._greatest}(excluded.last_verified, "
            "coalesce(placements.last_verified, 0))",
            [
                {
                    "digest": str(digest),
                    "tier": self.stored_tier(tier),
                    "size": size,
                    "verified": float(when),
                    "now": now,
                }
                for digest, tier, size, when in copies
            ],
        )

    def unplace(self, digest: Digest, tier: str | None = None) -> None:
        """Forget the blob's copy on `tier`, or every copy of it."""
        if tier is None:
            self._run("DELETE FROM placements WHERE digest = :digest", {"digest": str(digest)})
        else:
            self._run(
                "DELETE FROM placements WHERE digest = :digest AND tier = :tier",
                {"digest": str(digest), "tier": self.stored_tier(tier)},
            )

    def note_read(self, digest: Digest, tier: str) -> None:
        """Count a read of a copy; written to the journal in batches (see flush_reads)."""
        now = time.time()
        with self._reads_lock:
            self._reads[str(digest), self.stored_tier(tier)] = now
            due = time.monotonic() - self._flushed >= READ_FLUSH_INTERVAL
        if due:
            self.flush_reads()

    def flush_reads(self) -> None:
        """Write the reads counted since the last flush, all in one transaction."""
        with self._reads_lock:
            reads, self._reads = self._reads, {}
            self._flushed = time.monotonic()
        self._run(
            "UPDATE placements SET last_read = "
            f"{self._greatest}(coalesce(last_read, 0), :when) "
            "WHERE digest = :digest AND tier = :tier",
            [
                {"when": when, "digest": digest, "tier": tier}
                for (digest, tier), when in reads.items()
            ],
        )

    _PLACEMENT = "SELECT digest, tier, size, stored, last_read, last_verified FROM placements"

    def _placement(self, row: Sequence[Any]) -> Placement:
        return Placement(Digest.parse(row[0]), self.shown_tier(row[1]), *row[2:])

    def placements(self, digest: Digest | None = None) -> list[Placement]:
        """The journaled copies of one blob, or of every blob, in order of digest."""
        query = self._PLACEMENT
        arguments: dict[str, Any] = {}
        if digest is not None:
            query, arguments = query + " WHERE digest = :digest", {"digest": str(digest)}
        rows = self.query(query + " ORDER BY digest, tier", arguments)
        return [self._placement(row) for row in rows]

    def least_recently_verified(
        self, limit: int, tiers: Sequence[str] | None = None
    ) -> list[Placement]:
        """The copies verified longest ago (never verified first), for the scrubber; only
        those on `tiers` if given, so that copies on a tier the caller does not hold (a mirror
        no longer configured, another host's disk) cannot fill every batch."""
        query = self._PLACEMENT
        arguments: dict[str, Any] = {"limit": limit}
        if tiers is not None:
            query += " WHERE tier IN :tiers"
            arguments["tiers"] = [self.stored_tier(tier) for tier in tiers]
        rows = self.query(
            query + " ORDER BY coalesce(last_verified, 0), digest, tier LIMIT :limit", arguments
        )
        return [self._placement(row) for row in rows]

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per tier: the copies journaled there and their bytes (of known size)."""
        rows = self.query(
            "SELECT tier, count(*), coalesce(sum(size), 0) FROM placements GROUP BY tier"
        )
        return {self.shown_tier(tier): (int(count), int(size)) for tier, count, size in rows}

    def last_verified(self) -> dict[str, float]:
        """Per tier: when a copy there was last verified (tiers with none verified left out)."""
        rows = self.query(
            "SELECT tier, max(last_verified) FROM placements "
            "WHERE last_verified IS NOT NULL GROUP BY tier"
        )
        return {self.shown_tier(tier): float(when) for tier, when in rows}

    def suspected(self) -> set[str]:
        """The digests (as text) of which some copy's last journal record says it was lost or
        its rewrite failed: the only ones `damaged` can name."""
        return set(self._unrepaired())

    def _unrepaired(self) -> dict[str, dict[str, float]]:
        """Digest (as text) to the tiers (as stored) whose copy's last record is unrepaired,
        and when."""
        bad: dict[str, dict[str, float]] = {}
        rows = self.query(
            "SELECT j.digest, j.tier, j.time, j.action FROM damage_journal j JOIN "
            "(SELECT max(id) AS last FROM damage_journal GROUP BY digest, tier) l "
            "ON j.id = l.last"
        )
        for digest, tier, when, action in rows:
            if unrepaired(action):
                bad.setdefault(digest, {})[tier] = float(when)
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
            copies = self.query(
                "SELECT digest, tier, last_verified FROM placements WHERE digest IN :digests",
                {"digests": part},
            )
            for digest, tier, verified in copies:
                since = bad[digest].get(tier)
                if since is None or (verified is not None and verified > since):
                    # A copy never found bad, or verified since: it may be good.
                    cleared.add(digest)
        return {digest for digest in suspects if by_hex[digest.hex] not in cleared}

    def lost_copies(self, digest: Digest) -> set[str]:
        """The tiers whose copy of the blob the journal last recorded as lost or failed to
        rewrite: they held it, even if the copy is gone now."""
        last: dict[str, str] = {}
        for record in self.records(digest):
            last[record.tier] = record.action
        return {tier for tier, action in last.items() if unrepaired(action)}

    def placed(self, digest: Digest) -> set[str]:
        rows = self.query(
            "SELECT tier FROM placements WHERE digest = :digest", {"digest": str(digest)}
        )
        return {self.shown_tier(row[0]) for row in rows}

    def placed_digests(self, tier_prefix: str = "") -> Iterator[Digest]:
        """Every blob with a copy recorded, or with one on a tier whose name starts so."""
        rows = self.query(
            "SELECT DISTINCT digest FROM placements "
            "WHERE substr(tier, 1, CAST(:length AS INTEGER)) = :prefix",
            {"length": len(tier_prefix), "prefix": tier_prefix},
        )
        for (digest,) in rows:
            yield Digest.parse(digest)


def _statement(sql: str, params: Mapping[str, Any] | None) -> Any:
    """`sql` with its list-valued parameters expanded (`IN :name`)."""
    statement = text(sql)
    for name, value in (params or {}).items():
        if isinstance(value, list):
            statement = statement.bindparams(bindparam(name, expanding=True))
    return statement


def _shown_url(url: str) -> str:
    """A database URL without its password, for messages."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _reason(error: SQLAlchemyError) -> str:
    """The driver's own words, without SQLAlchemy's statement dump."""
    original = getattr(error, "orig", None)
    return str(original if original is not None else error).strip().splitlines()[0]
