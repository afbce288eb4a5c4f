"""The database schema is versioned: a new database is created at the current version, an
older one is upgraded in place without losing rows, and a newer one is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Connection, select, text
from sqlalchemy.exc import DBAPIError

from tests.schema_3 import subjects_as_schema_3
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
        subjects_as_schema_3(conn)
        conn.execute(tables.schema_version.update().values(version=1))
    db.dispose()

    db = open_database(url)
    with db.read.connect() as conn:
        assert conn.execute(select(tables.schema_version.c.version)).scalar_one() == SCHEMA_VERSION
        assert conn.execute(select(tables.replay_leases.c.lease)).all() == []
        assert conn.execute(select(tables.tokens.c.token_id)).all() == []
        assert len(conn.execute(select(tables.entries.c.idx)).all()) == 3
    db.dispose()


def test_a_version_2_database_gains_the_rewrite_guards_and_still_verifies(tmp_path: Path) -> None:
    """Schema 3 adds the triggers that refuse REPLACE over ledger rows, a head moved by hand and
    changes to the blob catalogue; every entry's bytes, leaf hash and checkpoint stay as they
    were written."""
    url = f"sqlite:///{tmp_path / 'v.db'}"
    key = SigningKey.generate("schema.test/ledger")
    db = open_database(url)
    ledger = Ledger(db, key, origin="schema.test/ledger")
    ledger.append([_pin(n) for n in range(5)])
    note = ledger.checkpoint(5).note
    ledger.close()
    schema_3 = (
        "entries_no_insert_below_head",
        "entry_subjects_no_insert_below_head",
        "checkpoints_no_replace",
        "blobs_no_replace",
        "blobs_no_update",
        "blobs_no_delete",
        "ledger_head_no_insert",
        "ledger_head_no_delete",
        "ledger_head_forward_only",
    )
    with db.write.begin() as conn:
        for name in schema_3:
            conn.execute(text(f"DROP TRIGGER {name}"))
        subjects_as_schema_3(conn)
        conn.execute(tables.schema_version.update().values(version=2))
        before = conn.execute(text("SELECT idx, body, leaf_hash FROM entries")).all()
    db.dispose()

    db = open_database(url)
    with db.read.connect() as conn:
        assert conn.execute(select(tables.schema_version.c.version)).scalar_one() == SCHEMA_VERSION
        triggers = set(
            conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars()
        )
        assert set(schema_3) <= triggers
        assert conn.execute(text("SELECT idx, body, leaf_hash FROM entries")).all() == before
    with pytest.raises(DBAPIError, match="never changed or deleted"), db.write.begin() as conn:
        conn.execute(text("REPLACE INTO entries SELECT * FROM entries WHERE idx = 0"))
    ledger = Ledger(db, key, origin="schema.test/ledger")
    assert ledger.fault is None
    assert ledger.checkpoint(5).note == note
    ledger.append([_pin(5)])
    assert ledger.size == 6
    ledger.close()
    db.dispose()
