"""The vault's tables behind SQLAlchemy (SQLite in WAL mode by default, PostgreSQL for a lab),
their schema version and upgrades, and the triggers by which the database itself refuses every
write to the ledger but an append."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Engine,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Select,
    Table,
    Text,
    event,
    select,
    text,
)
from sqlalchemy.engine import Connection, ExceptionContext, make_url

from vault.digest import digest_key
from vault.errors import DiskFull, ResourceExhausted, VaultError
from vault.ledger.subject_index import (
    RECENT_TABLE,
    RUNS_TABLE,
    Folds,
    SubjectIndex,
    database_path,
)
from vault.sql import is_sqlite, server_engine, sqlite_engine

SCHEMA_VERSION: Final = 7

log = logging.getLogger(__name__)

metadata = MetaData()

schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))

# One row: the ledger's size and last leaf hash. Appends lock it, so appends are linear even
# when several vault servers share one PostgreSQL.
ledger_head = Table(
    "ledger_head",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("size", BigInteger, nullable=False),
    Column("last_leaf", LargeBinary, nullable=False),
)

# Schema 5: on SQLite `idx` is declared INTEGER, which makes it the table's rowid: a read by
# index is one B-tree search, and an append writes no separate index of its key.
entries = Table(
    "entries",
    metadata,
    Column(
        "idx",
        BigInteger().with_variant(Integer(), "sqlite"),
        primary_key=True,
        autoincrement=False,
    ),
    Column("body", LargeBinary, nullable=False),
    Column("leaf_hash", LargeBinary, nullable=False),
    # Copies of body fields, for filtering the log; `vault verify` checks they agree.
    Column("kind", Text, nullable=False, index=True),
    Column("author", Text, nullable=False, index=True),
    Column("time", Text, nullable=False, index=True),
    Column("external", Boolean, nullable=False),
)

# Schema 4: keyed by the digest's raw bytes (vault.digest.digest_key: a SHA-256 digest's 32),
# in a table that is its own key (no rowid table beside the key's index on SQLite). That is the
# table on PostgreSQL, whose own index answers look-ups. Schema 6, on SQLite: the table is keyed
# by (idx, digest), so that appends add to its end, and look-ups go through the subject index's
# sorted runs (`vault.ledger.subject_index`, `_SQLITE_SUBJECTS`).
entry_subjects = Table(
    "entry_subjects",
    metadata,
    Column("digest", LargeBinary, nullable=False),
    Column("idx", BigInteger, nullable=False, index=True),
    PrimaryKeyConstraint("digest", "idx"),
    sqlite_with_rowid=False,
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("size", BigInteger, primary_key=True, autoincrement=False),
    Column("note", Text, nullable=False),
)

blobs = Table(
    "blobs",
    metadata,
    Column("sha256", Text, primary_key=True),
    Column("blake3", Text, nullable=False, unique=True),
    Column("size", BigInteger, nullable=False),
    Column("stored_at", Text, nullable=False),
)

# Schema 2. A replay holds a slot in its team's quota from admission until it is released or
# its lease expires (a job that died without saying so must not hold the slot forever).
replay_leases = Table(
    "replay_leases",
    metadata,
    Column("lease", Text, primary_key=True),
    Column("team", Text, nullable=False, index=True),
    Column("run_id", Text, nullable=False),
    Column("manifest", Text, nullable=False),
    Column("started", Float, nullable=False),
    Column("expires", Float, nullable=False),
    Column("released", Float, nullable=True),
)

# Schema 2. Bearer tokens: only a hash of the secret is kept, so the table leaks no credential.
tokens = Table(
    "tokens",
    metadata,
    Column("token_id", Text, primary_key=True),
    Column("secret_hash", LargeBinary, nullable=False),
    Column("name", Text, nullable=False),
    Column("team", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("created", Text, nullable=False),
    Column("revoked", Text, nullable=True),
)

# Schema 7: the subject map's buckets (vault.ledger.subject_map_store). Derived from the
# entries, and rewritten as they are added to: `vault verify` rebuilds them. The roots of the
# buckets changed since an epoch (all 65,536 when a server starts) are read from the epoch's
# index alone: a bucket's row holds its records, kilobytes once the map holds millions of
# digests, and reading each row for its root took 1.5 s at 3M entries.
subject_map_buckets = Table(
    "subject_map_buckets",
    metadata,
    Column("bucket", Integer, primary_key=True, autoincrement=False),
    Column("records", LargeBinary, nullable=False),
    Column("root", LargeBinary, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Index("ix_subject_map_buckets_epoch", "epoch", "bucket", "root"),
)

_IMMUTABLE = ("entries", "entry_subjects", "checkpoints")
# Index rows an upgrade copies at once.
_COPY_BATCH: Final = 50_000
# Schema 3: the blob catalogue is never changed or deleted either.
_IMMUTABLE_3 = ("blobs",)
# A writer that leaves checkpoints of SQLite's write-ahead log to a thread (`Writer`) still
# makes one itself when the log reaches this many pages (64 MiB): the thread has fallen behind.
WAL_BACKSTOP_PAGES: Final = 16_384
# The room the ledger's writer leaves free on the database's disk (see `Writer`).
LEDGER_RESERVE: Final = 1 << 20
# The least time between two of that thread's checkpoints (each syncs the database file).
WAL_CHECKPOINT_EVERY: Final = 0.5
# SQLite's limit on the values one statement binds (SQLITE_MAX_VARIABLE_NUMBER).
_SQLITE_BOUND_VALUES: Final = 32_766 if sqlite3.sqlite_version_info >= (3, 32) else 999


class SchemaError(VaultError):
    """The database holds a schema this version of pinvault cannot use."""


# What a write that found its disk full looks like from each engine: SQLite's result codes (a
# page that could not be written; the shared-memory index that could not grow, when a database
# is opened) and PostgreSQL's SQLSTATE. SQLite writes whole pages, of the default size here.
_SQLITE_NO_ROOM: Final = {sqlite3.SQLITE_FULL: 4096, sqlite3.SQLITE_IOERR_SHMSIZE: 32 * 1024}
_POSTGRES_DISK_FULL: Final = "53100"


def disk_full(url: str, error: BaseException) -> ResourceExhausted | None:
    """`error` as ResourceExhausted naming where room is lacking, if it says the database's
    disk is full; None for any other error."""
    cause = getattr(error, "orig", None) or error
    code = getattr(cause, "sqlite_errorcode", None)
    if code is not None:
        needed = _SQLITE_NO_ROOM.get(code)
        path = make_url(url).database
        if needed is None or not path or path == ":memory:":
            return None
        return DiskFull(os.path.dirname(os.path.abspath(path)), needed=needed)
    if getattr(cause, "sqlstate", None) == _POSTGRES_DISK_FULL:
        shown = make_url(url).render_as_string(hide_password=True)
        return ResourceExhausted(
            f"the disk of the PostgreSQL server {shown} is full: free space there and retry"
        )
    return None


class _ReadConnection:
    """One thread's read connection, held in the thread's `threading.local`: when the thread
    ends its locals are dropped, and with them this holder, whose finalizer gives the
    connection back to the pool. A server whose threads come and go (one a request, say) so
    keeps no connection of a thread that is gone."""

    def __init__(self, raw: Any, held: _Held) -> None:
        self.raw = raw
        driver = raw.driver_connection
        assert driver is not None
        self.driver: Any = driver
        held.add(raw)
        self.give_back = weakref.finalize(self, held.give_back, raw)


class _Held:
    """The read connections the threads hold now, so that `Database.dispose` closes those of
    threads still running; each leaves this set when it goes back to the pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raws: set[Any] = set()

    def add(self, raw: Any) -> None:
        with self._lock:
            self._raws.add(raw)

    def give_back(self, raw: Any) -> None:
        with self._lock:
            if raw not in self._raws:
                return
            self._raws.discard(raw)
        with suppress(Exception):  # a broken connection is discarded by the pool
            raw.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._raws)

    def give_all_back(self) -> None:
        with self._lock:
            raws, self._raws = self._raws, set()
        for raw in raws:
            with suppress(Exception):
                raw.close()


@dataclass(frozen=True)
class Database:
    """Two engines on one database: `read` for queries, `write` for the single appender.

    `fetch` is the hot read path (look-ups, existence checks): plain SQL on a connection each
    thread keeps while it lives, in autocommit, without SQLAlchemy's per-statement machinery."""

    url: str
    read: Engine
    write: Engine
    _local: threading.local = field(default_factory=threading.local)
    _held: _Held = field(default_factory=_Held)
    _subjects: list[SubjectIndex] = field(default_factory=list)
    is_sqlite: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_sqlite", self.read.dialect.name == "sqlite")

    @property
    def held(self) -> int:
        """How many threads hold a read connection of `fetch` now."""
        return len(self._held)

    def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one query written with `?` placeholders and return all its rows."""
        conn = self._connection()
        try:
            if self.is_sqlite:
                rows: list[tuple[Any, ...]] = conn.driver.execute(sql, params).fetchall()
                return rows
            with conn.driver.cursor() as cursor:
                cursor.execute(sql.replace("?", "%s"), params)
                return list(cursor.fetchall())
        except Exception:
            # A broken connection must not be reused by this thread.
            self._drop(conn)
            raise

    def naming_queries(
        self,
        columns: str,
        keys: Sequence[bytes],
        *,
        where: str = "",
        params: Sequence[Any] = (),
        limit: int | None = None,
        every_subject: bool = False,
    ) -> list[tuple[str, list[Any]]]:
        """The statements `naming` runs, with their parameters (see there)."""
        if not keys:
            return []
        if not self.is_sqlite:
            sql = (
                f"SELECT {columns} FROM entry_subjects s JOIN entries e ON e.idx = s.idx "
                f"WHERE s.digest IN ({placeholders(len(keys))}){where} ORDER BY s.idx"
            )
            return [(sql + ("" if limit is None else f" LIMIT {int(limit)}"), [*keys, *params])]
        indexes = self.subjects.indexes(keys, limit)
        tested = () if every_subject else keys
        per = _SQLITE_BOUND_VALUES - len(tested) - len(params)
        return [
            (naming_by_index(columns, len(tested), where, len(part)), [*tested, *part, *params])
            for part in (indexes[start : start + per] for start in range(0, len(indexes), per))
        ]

    def naming(
        self,
        columns: str,
        keys: Sequence[bytes],
        *,
        where: str = "",
        params: Sequence[Any] = (),
        limit: int | None = None,
        every_subject: bool = False,
    ) -> list[tuple[Any, ...]]:
        """`columns` of `entry_subjects s JOIN entries e` for the entries naming any of `keys`
        (raw digest keys), in index order, the first `limit` only if given; `where` adds a
        condition (`AND ...`) with its `params`. On SQLite the subject index gives the entries'
        indexes and the join keeps only those whose rows name one of `keys`; with
        `every_subject`, it keeps every subject row of those entries, for a caller that selects
        `s.digest` and drops the rows of digests it did not ask for itself (cheaper for many
        keys, see `naming_by_index`). PostgreSQL, which searches the rows by digest, gives
        only the rows of `keys` either way."""
        found: list[tuple[Any, ...]] = []
        for sql, values in self.naming_queries(
            columns, keys, where=where, params=params, limit=limit, every_subject=every_subject
        ):
            found += self.fetch(sql, values)
        return found

    @property
    def subjects(self) -> SubjectIndex:
        """Which entries name a digest (see `vault.ledger.subject_index`); SQLite only."""
        index: SubjectIndex | None = self._subjects[0] if self._subjects else None
        if index is None:
            index = SubjectIndex(self.fetch, database_path(self.url))
            self._subjects[:] = [index]
        return index

    def _connection(self) -> _ReadConnection:
        conn: _ReadConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _ReadConnection(self.read.raw_connection(), self._held)
            if not self.is_sqlite:
                conn.driver.autocommit = True
        return conn

    def _drop(self, conn: _ReadConnection) -> None:
        self._local.conn = None
        conn.give_back()

    def dispose(self) -> None:
        self._held.give_all_back()
        self.read.dispose()
        self.write.dispose()


def listing(
    start: int,
    limit: int,
    *,
    kind: str | None = None,
    author: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> Select[int, bytes]:
    """The log (`vault log`): the first `limit` entries from index `start` that match the
    filters given (an empty one matches all), in index order."""
    e = entries
    query = select(e.c.idx, e.c.body).where(e.c.idx >= start)
    if kind:
        query = query.where(e.c.kind == kind)
    if author:
        query = query.where(e.c.author == author)
    if since:
        query = query.where(e.c.time >= since)
    if until:
        query = query.where(e.c.time < until)
    return query.order_by(e.c.idx).limit(limit)


# A look-up builds the same few statements again and again (one digest, a few entries): kept.
@functools.lru_cache(maxsize=64)
def naming_by_index(columns: str, keys: int, where: str, indexes: int) -> str:
    """On SQLite, `columns` of the entries among `indexes` (given by the subject index) whose
    subject rows name one of `keys` (bound first, then the indexes, then `where`'s values).
    Each entry's rows are found by its index alone, and the digest only tested on them (`+`:
    no index of it): keyed by (idx, digest), the rows would otherwise be probed once for every
    pair of an index and a digest. CROSS JOIN keeps the subject rows the outer loop, so that a
    condition on the entries (`where`) is tested on the entries found, never by a walk of the
    entries it matches. `keys` 0: every subject row of those entries, no digest tested (a test
    against hundreds of keys costs SQLite more a row than the whole rest of the join)."""
    tested = f"+s.digest IN ({placeholders(keys)}) AND " if keys else ""
    return (
        f"SELECT {columns} FROM entry_subjects s CROSS JOIN entries e ON e.idx = s.idx "
        f"WHERE {tested}s.idx IN ({placeholders(indexes)}){where} ORDER BY s.idx"
    )


class Transaction:
    """Statements inside one driver-level transaction (see `Writer`), `?` placeholders."""

    def __init__(self, cursor: Any, sqlite: bool) -> None:
        self._cursor = cursor
        self._sqlite = sqlite

    @property
    def sqlite(self) -> bool:
        return self._sqlite

    def _sql(self, sql: str) -> str:
        return sql if self._sqlite else sql.replace("?", "%s")

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._cursor.execute(self._sql(sql), params)
        return list(self._cursor.fetchall())

    def run(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._cursor.execute(self._sql(sql), params)

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            self._cursor.executemany(self._sql(sql), rows)

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """INSERT many rows. On SQLite, in as few statements as its limit on bound values
        allows: its driver's executemany steps once a row and hands the interpreter lock back
        and forth at every step, so a writer thread would wait for the server's busy event
        loop thread once a row rather than once a statement."""
        if not rows:
            return
        names = ", ".join(columns)
        if not self._sqlite:
            self.many(f"INSERT INTO {table} ({names}) VALUES ({placeholders(len(columns))})", rows)
            return
        group = f"({placeholders(len(columns))})"
        per = max(1, _SQLITE_BOUND_VALUES // len(columns))
        for start in range(0, len(rows), per):
            part = rows[start : start + per]
            values = ",".join([group] * len(part))
            self._cursor.execute(
                f"INSERT INTO {table} ({names}) VALUES {values}",
                [value for row in part for value in row],
            )

    def upsert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """`insert` of rows that replace the other columns of any row with the same first
        column (the table's key)."""
        if not rows:
            return
        names = ", ".join(columns)
        group = f"({placeholders(len(columns))})"
        tail = f" ON CONFLICT ({columns[0]}) DO UPDATE SET " + ", ".join(
            f"{c} = excluded.{c}" for c in columns[1:]
        )
        if not self._sqlite:
            self.many(f"INSERT INTO {table} ({names}) VALUES {group}{tail}", rows)
            return
        per = max(1, _SQLITE_BOUND_VALUES // len(columns))
        for start in range(0, len(rows), per):
            part = rows[start : start + per]
            self._cursor.execute(
                f"INSERT INTO {table} ({names}) VALUES {','.join([group] * len(part))}{tail}",
                [value for row in part for value in row],
            )


class _Checkpoints:
    """Copies SQLite's write-ahead log back into the database file on a thread of its own,
    after a writer's commits, at most once every WAL_CHECKPOINT_EVERY seconds: the work a
    writer would otherwise do inside the commit that crosses SQLite's autocheckpoint size.
    PASSIVE, so it never waits for the writer or a reader; what it cannot copy yet it copies
    the next time."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._due = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wal-checkpoints", daemon=True)
        self._thread.start()

    def due(self) -> None:
        self._due.set()

    def _run(self) -> None:
        raw = self._db.read.raw_connection()
        driver: Any = raw.driver_connection
        try:
            while not self._stopping.is_set():
                self._due.wait()
                self._due.clear()
                if self._stopping.is_set():
                    return
                try:
                    driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:  # the writer's own backstop still copies the log
                    log.warning("checkpoint of the write-ahead log failed: %s", exc)
                self._stopping.wait(WAL_CHECKPOINT_EVERY)
        finally:
            with suppress(Exception):
                raw.close()

    def stop(self) -> None:
        self._stopping.set()
        self._due.set()
        self._thread.join()


class Writer:
    """The appender's own driver connection: a transaction is a handful of C calls, not a
    trip through SQLAlchemy, because appends are the hot write path. One thread only.

    `checkpoints_aside`: on SQLite, the write-ahead log is copied back into the database file
    by a thread of its own (`_Checkpoints`) rather than inside this writer's commits, which
    are the ledger's serial path; the writer still does it itself past WAL_BACKSTOP_PAGES.

    `fold_rows`: the ledger's writer, on a SQLite file, also keeps the subject index's runs
    beside its commits (`vault.ledger.subject_index.Folds`, of runs of this many rows)."""

    def __init__(
        self,
        db: Database,
        *,
        checkpoints_aside: bool = False,
        reserve: int = 0,
        fold_rows: int | None = None,
    ) -> None:
        self._db = db
        self._raw: Any = None
        path = database_path(db.url)
        folder = os.path.dirname(path) if path is not None else None
        self._aside = checkpoints_aside and folder is not None
        self._checkpoints: _Checkpoints | None = None
        # Started with the writer, so that it tidies the runs a crash left before any append.
        self._folds = Folds(path, fold_rows) if path is not None and fold_rows else None
        # A transaction is refused, naming the folder, while its disk has less than `reserve`
        # bytes free: the write-ahead log may still have room to reuse, but whether a write
        # fits must not depend on when the log was last copied back.
        self._reserve = (folder, reserve) if folder is not None and reserve > 0 else None

    @contextmanager
    def begin(self) -> Iterator[Transaction]:
        if self._raw is None:
            self._raw = self._db.write.raw_connection()
            if not self._db.is_sqlite:
                self._raw.driver_connection.autocommit = True
            elif self._aside:
                self._raw.driver_connection.execute(
                    f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}"
                )
                if self._checkpoints is None:
                    self._checkpoints = _Checkpoints(self._db)
        if self._reserve is not None:
            folder, reserve = self._reserve
            if shutil.disk_usage(folder).free < reserve:
                raise DiskFull(folder, needed=reserve)
        cursor = self._raw.driver_connection.cursor()
        try:
            # SQLite: take the write lock up front, so the head read stays the head.
            cursor.execute("BEGIN IMMEDIATE" if self._db.is_sqlite else "BEGIN")
            yield Transaction(cursor, self._db.is_sqlite)
            cursor.execute("COMMIT")
            if self._checkpoints is not None:
                self._checkpoints.due()
            if self._folds is not None:
                self._folds.due()
        except BaseException as exc:
            try:
                cursor.execute("ROLLBACK")
            except Exception:
                self.close()  # a connection that cannot roll back is not reused
            full = disk_full(self._db.url, exc)
            if full is not None:
                raise full from exc
            raise
        finally:
            with suppress(Exception):
                cursor.close()

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.stop()
            self._checkpoints = None
        if self._folds is not None:
            self._folds.stop()
            self._folds = None
        if self._raw is not None:
            with suppress(Exception):
                self._raw.close()
            self._raw = None


def placeholders(count: int) -> str:
    return ",".join("?" * count)


def open_database(url: str, *, create: bool = True) -> Database:
    """Connect, create or upgrade the schema, and refuse a schema newer than this code."""
    if is_sqlite(url):
        # Each server thread keeps a read connection of its own (see `Database.fetch`); the
        # appender takes the write lock up front, so the head it reads stays the head.
        read = sqlite_engine(url, immediate=False)
        write = sqlite_engine(url, immediate=True)
    else:
        read = server_engine(url, pool_size=8, max_overflow=64)
        write = server_engine(url, pool_size=2, max_overflow=2)
    for engine in (read, write):
        # Every statement through SQLAlchemy: a full disk is told as such, not as a driver error.
        event.listen(engine, "handle_error", lambda context: _on_error(url, context))
    db = Database(url=url, read=read, write=write)
    try:
        migrate(db, create=create)
    except BaseException:
        db.dispose()
        raise
    return db


def _on_error(url: str, context: ExceptionContext) -> BaseException | None:
    return disk_full(url, context.original_exception)


def migrate(db: Database, *, create: bool = True) -> None:
    with db.write.begin() as conn:
        tables = set(db.write.dialect.get_table_names(conn))
        if "schema_version" not in tables:
            if tables & {t.name for t in metadata.sorted_tables}:
                raise SchemaError("database has pinvault tables but no schema version")
            if not create:
                raise SchemaError("database has no pinvault schema")
            metadata.create_all(conn)
            _install_immutability(conn)
            _sqlite_subject_layout(conn)
            conn.execute(schema_version.insert().values(version=SCHEMA_VERSION))
            conn.execute(ledger_head.insert().values(id=1, size=0, last_leaf=bytes(32)))
            return
        found = conn.execute(schema_version.select()).scalar_one()
        if found > SCHEMA_VERSION:
            raise SchemaError(
                f"database schema version {found} is newer than this pinvault "
                f"understands ({SCHEMA_VERSION}): upgrade pinvault"
            )
        begin = time.monotonic()
        if found < SCHEMA_VERSION:
            # One that rewrites the entries takes about a minute a 10 million: say so first.
            log.info("upgrading the ledger's database from schema %d to %d", found, SCHEMA_VERSION)
        for version in range(found + 1, SCHEMA_VERSION + 1):
            # An upgrade adds tables, columns, indexes and triggers, or rewrites a table in a
            # new layout; every entry's bytes and leaf hash and every checkpoint stay as written.
            UPGRADES[version](conn)
            conn.execute(schema_version.update().values(version=version))
    if found < SCHEMA_VERSION:
        log.info(
            "upgraded the ledger's database from schema %d to %d in %.1f s",
            found,
            SCHEMA_VERSION,
            time.monotonic() - begin,
        )


def _add_schema_2(conn: Connection) -> None:
    metadata.create_all(conn, tables=[replay_leases, tokens])


def _install_immutability(conn: Connection) -> None:
    """Every trigger a new database gets: schema 1's and those schema 3 added."""
    _refuse_change_and_delete(conn, _IMMUTABLE)
    _add_schema_3(conn)


def _add_schema_4(conn: Connection) -> None:
    """Schema 4: the subject index keyed by raw digests. Its rows are copied into the new table
    in key order (a SHA-256 digest's hex and raw bytes sort alike); the entries, their leaf
    hashes and the checkpoints are not touched. The guards go on the new table once it is
    filled: history is inserted below the head only here."""
    old = "entry_subjects_3"
    conn.execute(text(f"ALTER TABLE entry_subjects RENAME TO {old}"))
    conn.execute(text("DROP INDEX ix_entry_subjects_idx"))
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"ALTER TABLE {old} RENAME CONSTRAINT entry_subjects_pkey TO {old}_pkey"))
    metadata.create_all(conn, tables=[entry_subjects])
    first = text(f"SELECT digest, idx FROM {old} ORDER BY digest, idx LIMIT {_COPY_BATCH}")
    after = text(
        f"SELECT digest, idx FROM {old} WHERE digest > :digest OR (digest = :digest AND "
        f"idx > :idx) ORDER BY digest, idx LIMIT {_COPY_BATCH}"
    )
    part = conn.execute(first).all()
    while part:
        conn.execute(
            entry_subjects.insert(),
            [{"digest": digest_key(digest), "idx": idx} for digest, idx in part],
        )
        digest, idx = part[-1]
        part = conn.execute(after, {"digest": digest, "idx": idx}).all()
    conn.execute(text(f"DROP TABLE {old}"))
    _refuse_change_and_delete(conn, ("entry_subjects",))
    _refuse_insert_below_head(conn, ("entry_subjects",))


def _add_schema_5(conn: Connection) -> None:
    """Schema 5, on SQLite: the entries move into a table whose key is `idx` itself (see
    `entries`). Their rows are copied in index order, byte for byte; the indexes and guards go
    on the new table once it is filled. PostgreSQL's table is already keyed by `idx` alone."""
    if conn.dialect.name != "sqlite" or _sqlite_key_is_rowid(conn, "entries"):
        return
    old = "entries_4"
    for column in ("kind", "author", "time"):
        conn.execute(text(f"DROP INDEX ix_entries_{column}"))
    # A legacy rename leaves the other tables' triggers naming `entries` (the head's names the
    # leaf hash of its last entry), so that they name the new table once it is made.
    conn.exec_driver_sql("PRAGMA legacy_alter_table=ON")
    try:
        conn.execute(text(f"ALTER TABLE entries RENAME TO {old}"))
    finally:
        conn.exec_driver_sql("PRAGMA legacy_alter_table=OFF")
    metadata.create_all(conn, tables=[entries])
    columns = ", ".join(column.name for column in entries.columns)
    conn.execute(text(f"INSERT INTO entries ({columns}) SELECT {columns} FROM {old} ORDER BY idx"))
    # Its guards (renamed with it) go with it, so that the new table's can take their names.
    conn.execute(text(f"DROP TABLE {old}"))
    _refuse_change_and_delete(conn, ("entries",))
    _refuse_insert_below_head(conn, ("entries",))


_SQLITE_SUBJECTS: Final = (
    "CREATE TABLE entry_subjects (idx INTEGER NOT NULL, digest BLOB NOT NULL, "
    "PRIMARY KEY (idx, digest)) WITHOUT ROWID"
)


def _add_schema_6(conn: Connection) -> None:
    """Schema 6, on SQLite: `entry_subjects` keyed by (idx, digest), in append order, and the
    subject index as a log-structured merge beside it (`vault.ledger.subject_index`): its
    recent rows start as every subject row, which the writer's first fold writes out as one
    sorted run. The entries, their leaf hashes and the checkpoints are not touched."""
    _sqlite_subject_layout(conn)


def _add_schema_7(conn: Connection) -> None:
    """Schema 7: the subject map's table, empty; the writer's first commits fill it from
    `entry_subjects` and append the first `index` entry. Nothing written before is touched."""
    metadata.create_all(conn, tables=[subject_map_buckets])


def _sqlite_subject_layout(conn: Connection) -> None:
    if conn.dialect.name != "sqlite":
        return
    old = "entry_subjects_5"
    conn.execute(text("DROP INDEX ix_entry_subjects_idx"))
    conn.execute(text(f"ALTER TABLE entry_subjects RENAME TO {old}"))
    conn.execute(text(_SQLITE_SUBJECTS))
    copy = "INSERT INTO {} ({}) SELECT {} FROM {} ORDER BY 1, 2"
    conn.execute(text(copy.format("entry_subjects", "idx, digest", "idx, digest", old)))
    conn.execute(text(RECENT_TABLE))
    conn.execute(text(RUNS_TABLE))
    conn.execute(text(copy.format("subject_recent", "digest, idx", "digest, idx", old)))
    # Its guards (renamed with it) go with it, so that the new table's can take their names.
    conn.execute(text(f"DROP TABLE {old}"))
    _refuse_change_and_delete(conn, ("entry_subjects",))
    _refuse_insert_below_head(conn, ("entry_subjects",))


def _sqlite_key_is_rowid(conn: Connection, table: str) -> bool:
    """Whether the table's key is one column declared INTEGER: SQLite's alias of the rowid."""
    key = [
        str(row[2]).upper()
        for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")
        if row[5]  # its place in the primary key, 0 for a column outside it
    ]
    return key == ["INTEGER"]


def _add_schema_3(conn: Connection) -> None:
    """Schema 3: the guards schema 1 lacked. SQLite's REPLACE (and INSERT OR REPLACE) deletes
    a conflicting row without firing its DELETE trigger, so an insert over an existing ledger
    row is refused by a trigger of its own; the head moves only forward, to the leaf hash of
    the entry it names; and the blob catalogue is immutable too."""
    _refuse_change_and_delete(conn, _IMMUTABLE_3)
    if conn.dialect.name == "sqlite":
        _refuse_insert_below_head(conn, ("entries", "entry_subjects"))
        for table, key in (("checkpoints", "size"), ("blobs", "sha256")):
            _sqlite_refuse(
                conn,
                f"{table}_no_replace",
                f"BEFORE INSERT ON {table} "
                f"WHEN EXISTS (SELECT 1 FROM {table} WHERE {key} = NEW.{key})",
                f"pinvault {table} rows are never changed or deleted",
            )
        _sqlite_refuse(
            conn,
            "ledger_head_no_insert",
            "BEFORE INSERT ON ledger_head WHEN EXISTS (SELECT 1 FROM ledger_head)",
            "pinvault ledger_head moves only by an append",
        )
        _sqlite_refuse(
            conn,
            "ledger_head_no_delete",
            "BEFORE DELETE ON ledger_head",
            "pinvault ledger_head moves only by an append",
        )
        _sqlite_refuse(
            conn,
            "ledger_head_forward_only",
            f"BEFORE UPDATE ON ledger_head WHEN {_HEAD_MOVE_IS_WRONG}",
            "pinvault ledger_head moves only by an append",
        )
    elif conn.dialect.name == "postgresql":
        # PostgreSQL has no REPLACE, and INSERT ... ON CONFLICT DO UPDATE fires the UPDATE
        # triggers; what is left is a subject added to an old entry, and the head.
        _refuse_insert_below_head(conn, ("entry_subjects",))
        conn.execute(
            text(
                "CREATE OR REPLACE FUNCTION pinvault_head_moves_forward() RETURNS trigger AS $$ "
                "BEGIN "
                "IF TG_OP = 'DELETE' THEN "
                "RAISE EXCEPTION 'pinvault ledger_head moves only by an append'; END IF; "
                "IF " + _HEAD_MOVE_IS_WRONG.replace("IS NOT", "IS DISTINCT FROM") + " THEN "
                "RAISE EXCEPTION 'pinvault ledger_head moves only by an append'; END IF; "
                "RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        conn.execute(
            text(
                "CREATE OR REPLACE TRIGGER ledger_head_forward_only "
                "BEFORE UPDATE OR DELETE ON ledger_head "
                "FOR EACH ROW EXECUTE FUNCTION pinvault_head_moves_forward()"
            )
        )
        conn.execute(
            text(
                "CREATE OR REPLACE TRIGGER ledger_head_no_truncate BEFORE TRUNCATE ON ledger_head "
                "FOR EACH STATEMENT EXECUTE FUNCTION pinvault_immutable()"
            )
        )


# An append moves the head forward, to the leaf hash of the last entry it names; an empty
# commit may write it unchanged.
_HEAD_MOVE_IS_WRONG: Final = (
    "NEW.id IS NOT OLD.id OR NEW.size < OLD.size "
    "OR (NEW.size = OLD.size AND NEW.last_leaf IS NOT OLD.last_leaf) "
    "OR (NEW.size > 0 AND NEW.last_leaf IS NOT "
    "(SELECT leaf_hash FROM entries WHERE idx = NEW.size - 1))"
)


def _sqlite_refuse(conn: Connection, name: str, when: str, message: str) -> None:
    conn.execute(
        text(
            f"CREATE TRIGGER IF NOT EXISTS {name} {when} "
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )
    )


def _refuse_insert_below_head(conn: Connection, tables: Sequence[str]) -> None:
    """Triggers that refuse a row inserted into the tables below the head's size: rows there
    are history, and an insert among them is a rewrite, whatever its conflict clause (an append
    inserts at and above the size, then moves the head)."""
    if conn.dialect.name == "sqlite":
        for table in tables:
            _sqlite_refuse(
                conn,
                f"{table}_no_insert_below_head",
                f"BEFORE INSERT ON {table} "
                "WHEN NEW.idx < (SELECT size FROM ledger_head WHERE id = 1)",
                f"pinvault {table} rows are never changed or deleted",
            )
    elif conn.dialect.name == "postgresql":
        conn.execute(
            text(
                "CREATE OR REPLACE FUNCTION pinvault_no_insert_below_head() RETURNS trigger "
                "AS $$ BEGIN "
                "IF NEW.idx < (SELECT size FROM ledger_head WHERE id = 1) THEN "
                "RAISE EXCEPTION 'pinvault % rows are never changed or deleted', TG_TABLE_NAME; "
                "END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        for table in tables:
            conn.execute(
                text(
                    f"CREATE OR REPLACE TRIGGER {table}_no_insert_below_head "
                    f"BEFORE INSERT ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION pinvault_no_insert_below_head()"
                )
            )


def _refuse_change_and_delete(conn: Connection, tables: Sequence[str]) -> None:
    """Triggers that refuse UPDATE and DELETE (and on PostgreSQL TRUNCATE) of the tables'
    rows, whatever code asks."""
    if conn.dialect.name == "sqlite":
        for table in tables:
            for op in ("UPDATE", "DELETE"):
                _sqlite_refuse(
                    conn,
                    f"{table}_no_{op.lower()}",
                    f"BEFORE {op} ON {table}",
                    f"pinvault {table} rows are never changed or deleted",
                )
    elif conn.dialect.name == "postgresql":
        conn.execute(
            text(
                "CREATE OR REPLACE FUNCTION pinvault_immutable() RETURNS trigger AS $$ "
                "BEGIN RAISE EXCEPTION 'pinvault % rows are never changed or deleted', "
                "TG_TABLE_NAME; END $$ LANGUAGE plpgsql"
            )
        )
        for table in tables:
            conn.execute(
                text(
                    f"CREATE OR REPLACE TRIGGER {table}_immutable "
                    f"BEFORE UPDATE OR DELETE ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION pinvault_immutable()"
                )
            )
            conn.execute(
                text(
                    f"CREATE OR REPLACE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                    "FOR EACH STATEMENT EXECUTE FUNCTION pinvault_immutable()"
                )
            )


UPGRADES: dict[int, Callable[[Connection], None]] = {
    2: _add_schema_2,
    3: _add_schema_3,
    4: _add_schema_4,
    5: _add_schema_5,
    6: _add_schema_6,
    7: _add_schema_7,
}
