"""SQLAlchemy engines as every database of the vault is opened: SQLite in WAL mode with every
commit on disk before it returns, and PostgreSQL through a pool that tests a connection before
handing it out (a primary that failed over leaves every pooled connection dead)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def sqlite_engine(url: str, *, immediate: bool, pool_size: int = 8) -> Engine:
    """A SQLite engine; with `immediate`, every transaction takes the write lock when it
    begins, so a writer never fails to upgrade a read lock halfway (SQLite's busy handler does
    not retry that)."""
    pool: dict[str, Any] = (
        {"poolclass": NullPool}
        if ":memory:" in url
        else {"pool_size": pool_size, "max_overflow": 64}
    )
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's begin event issue BEGIN itself (pysqlite's own is deferred).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it returns, so what was acknowledged survives a crash.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def server_engine(url: str, *, pool_size: int, max_overflow: int) -> Engine:
    """An engine for a database server (PostgreSQL)."""
    return create_engine(url, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True)
