"""The subject index on SQLite: which entries name a digest, kept so that an append's inserts
stay cheap however large the ledger grows.

One B-tree keyed by random digests takes each insert on a page of its own once it outgrows the
cache: at 10 million entries every subject an append names dirties a 4 KiB page of its own. So
on SQLite the index is a log-structured merge, as LevelDB and RocksDB keep their tables:

- `subject_recent`, a small table keyed by (digest, idx) in the ledger's database, takes each
  append's subjects in the append's own transaction, so a look-up sees an entry as soon as it
  is acknowledged;
- once it holds FOLD_ROWS rows (`ledger.subject_fold_rows`), a thread beside the ledger's
  writer (`Folds`) folds them into an immutable sorted run: a SQLite file of its own in a
  folder beside the database (`<database>.subjects/`), written by one sorted merge with the
  runs of the levels it fills (each level holds up to FANOUT times the one above), without
  the ledger's write lock. One short transaction then names the new run in `subject_runs` and
  forgets the runs it replaced, and the rows it took leave `subject_recent` a few thousand a
  transaction (a look-up that meanwhile finds a row twice reads it as once). A crash before
  that transaction leaves a file no run names, which the writer deletes when it next starts;
  a named run found missing is built again from `entry_subjects`.
- a look-up (`SubjectIndex`) reads `subject_recent` and `subject_runs` in one snapshot and
  probes each named run (a handful: one a level).

The index only points at entries. What a look-up returns is read joined with `entry_subjects`,
the immutable rows keyed by (idx, digest) in append order that `vault verify` checks against
every entry, so a damaged run can hide an entry but never make one name a digest it does not.
PostgreSQL keeps its one B-tree keyed by digest: its cache is the server's to size."""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import closing, suppress
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from sqlalchemy.engine import make_url

from vault.errors import Unavailable
from vault.files import fsync_dir

log = logging.getLogger(__name__)

# Rows of `subject_recent` that make a fold: a table of about 3 MiB, which stays in the cache.
FOLD_ROWS: Final = 65_536
# Each level of runs holds up to this many times the rows of the one above.
FANOUT: Final = 8
# How often the fold thread counts `subject_recent` while appends go on.
FOLD_CHECK_EVERY: Final = 1.0
# A look-up's connection to a run maps up to this much of it, and caches this much of its own.
_RUN_MAP: Final = 1 << 32
_RUN_CACHE_KIB: Final = 64
# Recent rows a transaction deletes once they are in a run.
_FORGET_BATCH: Final = 8_192
# A look-up whose runs were replaced while it read them reads the new ones, this many times.
_ATTEMPTS: Final = 4

RECENT_TABLE: Final = (
    "CREATE TABLE subject_recent (digest BLOB NOT NULL, idx INTEGER NOT NULL, "
    "PRIMARY KEY (digest, idx)) WITHOUT ROWID"
)
RUNS_TABLE: Final = (
    "CREATE TABLE subject_runs (name TEXT PRIMARY KEY, level INTEGER NOT NULL, "
    "rows INTEGER NOT NULL, last_idx INTEGER NOT NULL)"
)
_RUN_TABLE: Final = (
    "CREATE TABLE run (digest BLOB NOT NULL, idx INTEGER NOT NULL, "
    "PRIMARY KEY (digest, idx)) WITHOUT ROWID"
)


def database_path(url: str) -> str | None:
    """The file of a SQLite database URL; None for PostgreSQL or a database in memory."""
    if not url.startswith("sqlite"):
        return None
    path = make_url(url).database
    if not path or path == ":memory:":
        return None
    return os.path.abspath(path)


def runs_folder(database: str) -> Path:
    return Path(database + ".subjects")


def _uri(path: Path | str, **options: str) -> str:
    query = "&".join(f"{key}={value}" for key, value in options.items())
    return f"file:{quote(str(path))}?{query}"


def _open_run(path: Path) -> sqlite3.Connection:
    # immutable: a run is never written once named, so no lock is taken and no change looked for.
    # Not checked for its thread: a thread's connections are closed as it ends (`_Runs`).
    conn = sqlite3.connect(_uri(path, mode="ro", immutable="1"), uri=True, check_same_thread=False)
    # Every server thread keeps a connection to each run: its pages are read through a shared
    # mapping of the file (the OS page cache), not copied into a cache of each connection's.
    conn.execute(f"PRAGMA mmap_size={_RUN_MAP}")
    conn.execute(f"PRAGMA cache_size=-{_RUN_CACHE_KIB}")
    return conn


@functools.lru_cache(maxsize=64)
def index_queries(keys: int, limit: int | None = None) -> tuple[str, str]:
    """A look-up's queries: of `subject_recent` with `subject_runs`, and of a run. The first
    gives the indexes of the entries its rows say name any of `keys` digests (the first
    `limit` only, if given), as `(idx, NULL)` rows, and the names of the runs, as `(NULL,
    name)` rows: one statement, so one moment of the database, without a transaction of its
    own around it. The second gives a run's indexes for the same digests."""
    marks = ",".join("?" * keys)
    tail = "" if limit is None else f" ORDER BY idx LIMIT {int(limit)}"
    return (
        f"SELECT idx, NULL FROM (SELECT idx FROM subject_recent WHERE digest IN ({marks}){tail}) "
        "UNION ALL SELECT NULL, name FROM subject_runs",
        f"SELECT idx FROM run WHERE digest IN ({marks}){tail}",
    )


# One query (`?` placeholders) run on a thread's read connection: its rows.
Fetch = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]


class _Gone(Exception):
    """A run named in the snapshot a look-up read is no longer there (a fold replaced it)."""


class _Runs:
    """One thread's connections to the runs, by name, held in the thread's `threading.local`:
    they are closed when the thread ends rather than when the collector finds them, so that
    threads that come and go leave no descriptor of a run open."""

    def __init__(self) -> None:
        self.open: dict[str, sqlite3.Connection] = {}
        weakref.finalize(self, _close_all, self.open)


def _close_all(runs: dict[str, sqlite3.Connection]) -> None:
    for conn in runs.values():
        with suppress(sqlite3.Error):
            conn.close()
    runs.clear()


class SubjectIndex:
    """The look-up side: the indexes of the entries that name digests. Each thread keeps its
    own connections to the runs it has read."""

    def __init__(self, fetch: Fetch, database: str | None) -> None:
        self._fetch = fetch
        self._folder = runs_folder(database) if database is not None else None
        self._local = threading.local()

    def indexes(self, keys: Sequence[bytes], limit: int | None = None) -> list[int]:
        """The indexes of the entries naming any of `keys` (raw digest keys), ascending; the
        first `limit` only, if given."""
        if not keys:
            return []
        recent_sql, run_sql = index_queries(len(keys), limit)
        for _ in range(_ATTEMPTS):
            rows = self._fetch(recent_sql, keys)
            found = [index for index, name in rows if name is None]
            names = [str(name) for index, name in rows if name is not None]
            try:
                for name in names:
                    found += [index for (index,) in self._run(name).execute(run_sql, keys)]
            except _Gone:
                continue
            except sqlite3.DatabaseError as exc:
                raise Unavailable(
                    f"the subject index's run {name} cannot be read ({exc}): the ledger's "
                    "writer builds a damaged run again when the server next starts"
                ) from None
            self._forget_others(names)
            found = sorted(set(found))
            return found if limit is None else found[:limit]
        raise Unavailable(
            "the subject index's runs are missing or changing faster than a look-up can read "
            "them: the ledger's writer rebuilds missing runs when it starts; retry"
        )

    def _runs(self) -> dict[str, sqlite3.Connection]:
        runs: _Runs | None = getattr(self._local, "runs", None)
        if runs is None:
            runs = self._local.runs = _Runs()
        return runs.open

    def _run(self, name: str) -> sqlite3.Connection:
        runs = self._runs()
        conn = runs.get(name)
        if conn is None:
            if self._folder is None:
                raise _Gone(name)
            try:
                conn = _open_run(self._folder / name)
            except sqlite3.OperationalError as exc:
                raise _Gone(name) from exc
            runs[name] = conn
        return conn

    def _forget_others(self, names: Sequence[str]) -> None:
        """Close this thread's connections to runs the index no longer names (their files are
        deleted; an open connection keeps one's space in use)."""
        runs = self._runs()
        if len(runs) > len(names):
            for name in set(runs) - set(names):
                runs.pop(name).close()


# ---------------------------------------------------------------------- the writer's side


class Folds:
    """The thread beside the ledger's writer that folds `subject_recent` into sorted runs
    (see the module's text). It counts the table at most once every FOLD_CHECK_EVERY seconds
    after the writer's commits; every fold and every failure is logged, and a failed fold
    leaves the rows where they were for the next."""

    def __init__(self, database: str, fold_rows: int = FOLD_ROWS) -> None:
        self._database = database
        self._fold_rows = fold_rows
        self._folder = runs_folder(database)
        self._due = threading.Event()
        self._stopping = threading.Event()
        self._building: sqlite3.Connection | None = None
        self._thread = threading.Thread(target=self._run, name="subject-folds", daemon=True)
        self._thread.start()

    def due(self) -> None:
        self._due.set()

    def stop(self) -> None:
        self._stopping.set()
        self._due.set()
        building = self._building
        if building is not None:
            with suppress(sqlite3.Error):
                building.interrupt()
        self._thread.join()

    def _run(self) -> None:
        conn = sqlite3.connect(self._database, timeout=30, isolation_level=None)
        try:
            self._tidy(conn)
            while not self._stopping.is_set():
                self._due.wait()
                self._due.clear()
                try:
                    while not self._stopping.is_set() and self.fold(conn):
                        pass
                except (sqlite3.Error, OSError) as exc:
                    # A full disk, say: the rows stay in the recent table for the next try.
                    if not self._stopping.is_set():
                        log.warning("a fold of the subject index failed (tried again): %s", exc)
                self._stopping.wait(FOLD_CHECK_EVERY)
        except (sqlite3.Error, OSError) as exc:
            if not self._stopping.is_set():
                log.error("the subject index's folds stopped: %s", exc)
        finally:
            conn.close()

    def _tidy(self, conn: sqlite3.Connection) -> None:
        """Delete the files no run names (a fold a crash cut short); build the index's runs
        again from `entry_subjects` if one it names is missing, unreadable or holds other than
        its number of rows."""
        self._folder.mkdir(mode=0o700, exist_ok=True)
        named = {
            str(name): (int(last), int(rows))
            for name, last, rows in conn.execute("SELECT name, last_idx, rows FROM subject_runs")
        }
        present = set(os.listdir(self._folder))
        for name in present - set(named):
            (self._folder / name).unlink()
        broken = sorted(
            name
            for name, (_, rows) in named.items()
            if name not in present or self._rows_in(name) != rows
        )
        if broken:
            log.warning(
                "the subject index's runs %s are missing or damaged: building them again from "
                "the ledger's subject rows",
                ", ".join(broken),
            )
            self.rebuild(conn, max(last for last, _ in named.values()))

    def _rows_in(self, name: str) -> int | None:
        """The rows run `name` holds; None for a file SQLite cannot read as a run."""
        try:
            with closing(_open_run(self._folder / name)) as run:
                ((count,),) = run.execute("SELECT count(*) FROM run").fetchall()
        except sqlite3.DatabaseError:
            return None
        return int(count)

    def fold(self, conn: sqlite3.Connection) -> bool:
        """Fold `subject_recent` into a run if it holds the rows of one; whether it did.

        The rows taken are those past the newest run (`floor`): rows at or below it are already
        in a run, left behind by a fold whose deletes a crash cut short, and deleted now."""
        conn.execute("BEGIN")
        try:
            runs = conn.execute("SELECT name, level, rows, last_idx FROM subject_runs").fetchall()
            floor = max((int(last) for *_, last in runs), default=-1)
            ((count, top),) = conn.execute(
                "SELECT count(*), max(idx) FROM subject_recent WHERE idx > ?", (floor,)
            )
        finally:
            conn.execute("COMMIT")
        if count < self._fold_rows:
            return False
        levels = {int(level): (str(name), int(rows)) for name, level, rows, _ in runs}
        # The first level that can take the rows above it, or a new one below the last.
        depth, rows = 1, int(count)
        while depth in levels and rows + levels[depth][1] > self._fold_rows * FANOUT**depth:
            rows += levels[depth][1]
            depth += 1
        taken = [levels[level][0] for level in range(1, depth + 1) if level in levels]
        rows += levels[depth][1] if depth in levels else 0
        name = f"run-{top + 1:012d}.db"
        sources = ["SELECT digest, idx FROM m.subject_recent WHERE idx > :floor AND idx <= :top"]
        sources += [f"SELECT digest, idx FROM t{i}.run" for i in range(len(taken))]
        began = time.monotonic()
        self._build(name, sources, taken, {"floor": floor, "top": top}, rows)
        self._install(conn, name, depth, rows, top, replaced=taken, began=began)
        self._forget_recent(conn, top)
        return True

    def rebuild(self, conn: sqlite3.Connection, top: int) -> None:
        """One run of every subject row up to entry `top`, in place of every named run."""
        conn.execute("BEGIN")
        try:
            ((rows,),) = conn.execute("SELECT count(*) FROM entry_subjects WHERE idx <= ?", (top,))
            level = conn.execute("SELECT max(level) FROM subject_runs").fetchone()[0] or 1
            replaced = [str(name) for (name,) in conn.execute("SELECT name FROM subject_runs")]
        finally:
            conn.execute("COMMIT")
        name = f"run-{top + 1:012d}-rebuilt.db"
        source = "SELECT digest, idx FROM m.entry_subjects WHERE idx <= :top"
        began = time.monotonic()
        self._build(name, [source], [], {"top": top}, int(rows))
        self._install(conn, name, int(level), int(rows), top, replaced=replaced, began=began)

    def _build(
        self,
        name: str,
        sources: Sequence[str],
        taken: Sequence[str],
        params: dict[str, Any],
        rows: int,
    ) -> None:
        """Write run `name` from the rows of `sources` (SELECTs of the ledger's database as
        `m` and the taken runs as `t0`, `t1`...) in key order, and make it durable."""
        path = self._folder / name
        with suppress(FileNotFoundError):
            path.unlink()
        built = sqlite3.connect(_uri(path, mode="rwc"), uri=True, isolation_level=None)
        self._building = built
        try:
            # Nothing is read from the file until it is whole and synced: no journal needed.
            built.execute("PRAGMA journal_mode=OFF")
            built.execute("PRAGMA synchronous=OFF")
            built.execute(_RUN_TABLE)
            built.execute("ATTACH ? AS m", (_uri(self._database, mode="ro"),))
            for i, taken_name in enumerate(taken):
                run = _uri(self._folder / taken_name, mode="ro", immutable="1")
                built.execute(f"ATTACH ? AS t{i}", (run,))
            built.execute("BEGIN")
            built.execute(
                f"INSERT INTO run (digest, idx) {' UNION ALL '.join(sources)} ORDER BY 1, 2",
                params,
            )
            ((written,),) = built.execute("SELECT count(*) FROM run")
            built.execute("COMMIT")
            if written != rows:
                raise sqlite3.DatabaseError(
                    f"run {name} holds {written} rows where {rows} were folded into it"
                )
        except BaseException:
            built.close()
            path.unlink(missing_ok=True)
            raise
        finally:
            self._building = None
        built.close()
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        fsync_dir(self._folder)

    def _install(
        self,
        conn: sqlite3.Connection,
        name: str,
        level: int,
        rows: int,
        top: int,
        *,
        replaced: Sequence[str],
        began: float,
    ) -> None:
        """Name run `name` in place of `replaced`, in one short transaction, durable before
        the replaced files are deleted (the fold `began` then, by the monotonic clock)."""
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("DELETE FROM subject_runs WHERE name = ?", [(n,) for n in replaced])
            conn.execute(
                "INSERT INTO subject_runs (name, level, rows, last_idx) VALUES (?, ?, ?, ?)",
                (name, level, rows, top),
            )
            conn.execute("COMMIT")
        except BaseException:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            (self._folder / name).unlink(missing_ok=True)
            raise
        for old in replaced:
            (self._folder / old).unlink(missing_ok=True)
        log.info(
            "subject index: %d rows in run %s at level %d (%.1f s)",
            rows,
            name,
            level,
            time.monotonic() - began,
        )

    def _forget_recent(self, conn: sqlite3.Connection, top: int) -> None:
        """Delete the recent rows up to entry `top`, now in a run, a few thousand a
        transaction, so that no append waits long for the write lock. Until they are gone a
        look-up finds them twice, which it reads as once. Not synced one by one: a crash that
        loses some leaves rows the next fold deletes."""
        conn.execute("PRAGMA synchronous=NORMAL")
        while not self._stopping.is_set():
            conn.execute("BEGIN IMMEDIATE")
            try:
                gone = conn.execute(
                    "DELETE FROM subject_recent WHERE (digest, idx) IN (SELECT digest, idx "
                    f"FROM subject_recent WHERE idx <= ? LIMIT {_FORGET_BATCH})",
                    (top,),
                ).rowcount
                conn.execute("COMMIT")
            except BaseException:
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise
            if gone < _FORGET_BATCH:
                return
