"""The subject index as schema 3 laid it out, for tests that make a database of an older
release out of a new one (on SQLite or PostgreSQL)."""

from __future__ import annotations

from sqlalchemy import Connection, text

from vault.digest import digest_from_key
from vault.ledger import db as tables


def subjects_as_schema_3(conn: Connection) -> None:
    """Lay the subject index out as schema 3 had it (digest text in a rowid table), for a test
    that makes an older database out of a new one; its guards are those of schema 1."""
    rows = conn.execute(text("SELECT digest, idx FROM entry_subjects")).all()
    conn.execute(text("DROP TABLE entry_subjects"))
    # Schema 6's subject index beside it, on SQLite.
    conn.execute(text("DROP TABLE IF EXISTS subject_recent"))
    conn.execute(text("DROP TABLE IF EXISTS subject_runs"))
    conn.execute(
        text(
            "CREATE TABLE entry_subjects (digest TEXT NOT NULL, idx BIGINT NOT NULL, "
            "PRIMARY KEY (digest, idx))"
        )
    )
    conn.execute(text("CREATE INDEX ix_entry_subjects_idx ON entry_subjects (idx)"))
    for key, idx in rows:
        conn.execute(
            text("INSERT INTO entry_subjects (digest, idx) VALUES (:d, :i)"),
            {"d": digest_from_key(bytes(key)), "i": idx},
        )
    tables._refuse_change_and_delete(conn, ("entry_subjects",))
