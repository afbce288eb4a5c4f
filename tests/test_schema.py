"""The database schema is versioned: a new database is created at the current version, an
older one is upgraded in place without losing rows, and a newer one is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Connection, select, text

from vault.ledger import db as tables
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import SCHEMA_VERSION, SchemaError, open_database
from vault.ledger.log import Ledger, PinSpec


def _pin(n: int) -> PinSpec:
    return PinSpec.checked(
        kind="config", subjects=[f"sha256:{n:064x}"], author="tester", external=True
    )


def test_a_new_database_is_created_at_the_current_version(tmp_path: Path) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'v.db'}")
    with db.read.connect() as conn:
        assert conn.execute(select(tables.schema_version.c.version)).scalar_one() == SCHEMA_VERSION
    db.dispose()


def test_a_newer_schema_is_refused_with_a_message(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'v.db'}"
    open_database(url).dispose()
    db = open_database(url)
    with db.write.begin() as conn:
        conn.execute(tables.schema_version.update().values(version=SCHEMA_VERSION + 1))
    db.dispose()
    with pytest.raises(SchemaError, match=f"version {SCHEMA_VERSION + 1} is newer"):
        open_database(url)


def test_an_upgrade_keeps_every_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upgrade step runs once, in order, and the ledger still verifies after it."""
    url = f"sqlite:///{tmp_path / 'v.db'}"
    key = SigningKey.generate("schema.test/ledger")
    db = open_database(url)
    ledger = Ledger(db, key, origin="schema.test/ledger")
    ledger.append([_pin(n) for n in range(10)])
    root = ledger.checkpoint(10).checkpoint.root
    ledger.close()
    db.dispose()

    ran: list[int] = []

    def add_notes_table(conn: Connection) -> None:
        ran.append(SCHEMA_VERSION + 1)
        conn.execute(text("CREATE TABLE operator_notes (idx BIGINT, note TEXT)"))

    monkeypatch.setattr(tables, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setitem(tables.UPGRADES, SCHEMA_VERSION + 1, add_notes_table)
    db = open_database(url)
    db.dispose()
    db = open_database(url)  # a second open runs nothing again
    assert ran == [SCHEMA_VERSION + 1]
    with db.read.connect() as conn:
        assert conn.execute(select(tables.schema_version.c.version)).scalar_one() == (
            SCHEMA_VERSION + 1
        )
        assert conn.execute(text("SELECT count(*) FROM entries")).scalar_one() == 10
    ledger = Ledger(db, key, origin="schema.test/ledger")
    assert ledger.fault is None
    assert ledger.size == 10
    assert ledger.checkpoint(10).checkpoint.root == root
    ledger.close()
    db.dispose()


def test_a_version_1_database_gains_the_replay_and_token_tables(tmp_path: Path) -> None:
    """Schema 2 adds replay leases and tokens to a vault made by an older pinvault."""
    url = f"sqlite:///{tmp_path / 'v.db'}"
    key = SigningKey.generate("schema.test/ledger")
    db = open_database(url)
    ledger = Ledger(db, key, origin="schema.test/ledger")
    ledger.append([_pin(n) for n in range(3)])
    ledger.close()
    with db.write.begin() as conn:
        conn.execute(text("DROP TABLE replay_leases"))
        conn.execute(text("DROP TABLE tokens"))
        conn.execute(tables.schema_version.update().values(version=1))
    db.dispose()

    db = open_database(url)
    with db.read.connect() as conn:
        assert conn.execute(select(tables.schema_version.c.version)).scalar_one() == 2
        assert conn.execute(select(tables.replay_leases.c.lease)).all() == []
        assert conn.execute(select(tables.tokens.c.token_id)).all() == []
        assert len(conn.execute(select(tables.entries.c.idx)).all()) == 3
    db.dispose()
