"""A vault written by an earlier release is upgraded in place by this one: every entry's
canonical bytes and leaf hash, every signed checkpoint and the published tiles stay exactly as
they were written, `vault verify` passes, look-ups find what they found, and appends go on.

tests/data/ledger-schema-N.tar.gz is the data folder of a real `vault serve` of the release at
schema N, stopped cleanly: 3 blobs, 306 entries (blobs pinned alone and together, an external
image, an external BLAKE3 digest, 300 configs), a signed checkpoint of every size that a client
asked for, and the tiles of the last one. Schema 3 (pinvault 0.1.0) keyed the subject index by
digest text; schema 4 by raw digests, with the entries in a table beside an index of `idx`;
schema 5 keyed the entries by `idx` and kept the subject index as one B-tree of raw digests,
which schema 6 keeps in append order beside a log-structured index of sorted runs."""

from __future__ import annotations

import hashlib
import sqlite3
import tarfile
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import StartVault
from tests.schema_3 import subjects_as_schema_3
from tests.services.vault_server import run_vault
from tests.small_disk import fill, refused_for_room
from vault.digest import digest_from_key
from vault.errors import NotFound
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import SCHEMA_VERSION
from vault.ledger.entry import INDEX

DATA = Path(__file__).parent / "data"
ENV = {"PINVAULT_LEDGER_ORIGIN": "upgrade.test/ledger"}
SIZE = 306
# What the database's guards answer an attempt to rewrite history.
GUARDED = (
    r"pinvault (entries rows are never changed or deleted|ledger_head moves only by an append)"
)


def _unpack(schema: int, target: Path) -> Path:
    with tarfile.open(DATA / f"ledger-schema-{schema}.tar.gz") as archive:
        archive.extractall(target, filter="data")
    return target / "data"


def _rows(db: Path) -> dict[str, list[tuple[object, ...]]]:
    with closing(sqlite3.connect(db)) as conn:
        return {
            "entries": conn.execute(
                "SELECT idx, body, leaf_hash, kind, author, time, external FROM entries "
                "ORDER BY idx"
            ).fetchall(),
            "checkpoints": conn.execute(
                "SELECT size, note FROM checkpoints ORDER BY size"
            ).fetchall(),
            "head": conn.execute("SELECT size, last_leaf FROM ledger_head").fetchall(),
            "blobs": conn.execute("SELECT * FROM blobs ORDER BY sha256").fetchall(),
        }


def _subjects(db: Path) -> list[tuple[str, int]]:
    """The subject index's rows, each digest as text whichever way the schema keyed it."""
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT digest, idx FROM entry_subjects").fetchall()
    return sorted((digest_from_key(d) if isinstance(d, bytes) else d, i) for d, i in rows)


def _stored_as(db: Path) -> tuple[set[type], str]:
    """The types the subject index stores digests as, and the declared type of `entries.idx`."""
    with closing(sqlite3.connect(db)) as conn:
        digests = {type(d) for (d,) in conn.execute("SELECT digest FROM entry_subjects")}
        key = [row[2] for row in conn.execute("PRAGMA table_info(entries)") if row[5]]
    return digests, key[0]


@pytest.mark.parametrize(
    ("schema", "stored"),
    [
        (3, ({str}, "BIGINT")),
        (4, ({bytes}, "BIGINT")),
        (5, ({bytes}, "INTEGER")),
        (6, ({bytes}, "INTEGER")),
    ],
)
def test_a_vault_of_an_earlier_release_is_upgraded_and_verifies(
    start_vault: StartVault, tmp_path: Path, schema: int, stored: tuple[set[type], str]
) -> None:
    data = _unpack(schema, tmp_path)
    db = data / "vault.db"
    before = _rows(db)
    subjects = _subjects(db)
    assert len(before["entries"]) == SIZE and before["head"][0][0] == SIZE
    assert _stored_as(db) == stored
    tiles = {
        p.relative_to(data): p.read_bytes() for p in (data / "tiles").rglob("*") if p.is_file()
    }
    key = SigningKey.load(data / "checkpoint.key").verifier()
    last_note = before["checkpoints"][-1][1]
    assert key.open(str(last_note)).size == SIZE

    server = start_vault("upgraded", data_dir=data, env=ENV)
    # An operator is told what the server did before it listened.
    assert f"upgraded the ledger's database from schema {schema} to {SCHEMA_VERSION} in" in (
        server.log()
    )
    verified = server.run("verify", "--blobs")
    assert verified.returncode == 0, verified.describe()
    with server.client() as client:
        assert client.checkpoint_note() == last_note
        # Look-ups find what the old index listed: every blob, by each entry that pins it.
        for n, row in enumerate(before["blobs"]):
            digest = str(row[0])
            listed = sorted(i for d, i in subjects if d == digest)
            assert len(listed) >= 1
            assert [e.entry.index for e in client.lookup(digest)] == listed, digest
            client.get(digest, tmp_path / f"blob-{n}")
            assert hashlib.sha256((tmp_path / f"blob-{n}").read_bytes()).hexdigest() == digest[7:]
        assert [e.entry.index for e in client.lookup("blake3:" + "b3" * 32)] == [5]
        assert [e.entry.index for e in client.lookup(f"sha256:{299:064x}")] == [SIZE - 1]
        with pytest.raises(NotFound, match="no entry pins"):
            client.lookup(f"sha256:{300:064x}")
        # The release before kept no subject map: the first look-up had the writer build it
        # from the entries, and commit it in an `index` entry after them.
        (built,) = client.log(kind=INDEX)
        assert (built.index, built.meta["covers"]) == (SIZE, str(SIZE))
        client.pin("config", f"sha256:{300:064x}", external=True)
    assert server.stop() == 0

    after = _rows(db)
    assert after["entries"][:SIZE] == before["entries"]
    assert after["checkpoints"][: len(before["checkpoints"])] == before["checkpoints"]
    assert after["blobs"] == before["blobs"]
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        keyed = sorted(
            (bytes(k), i) for k, i in conn.execute("SELECT digest, idx FROM entry_subjects")
        )
    # The same rows, each digest now its raw bytes (a SHA-256 digest's 32), and the new pin's.
    assert len(keyed) == len(subjects) + 1
    assert {(digest_from_key(k), i) for k, i in keyed if i < SIZE} == set(subjects)
    assert {len(k) for k, _ in keyed} == {32, 33}
    # Each entry's index is now the entries table's own key (SQLite's rowid).
    assert _stored_as(db) == ({bytes}, "INTEGER")
    # The subject rows are kept in append order, and every one of them is in the subject
    # index (its recent rows: fewer than a sorted run's).
    with closing(sqlite3.connect(db)) as conn:
        key = [r[2] for r in conn.execute("PRAGMA index_info(sqlite_autoindex_entry_subjects_1)")]
        recent = conn.execute("SELECT digest, idx FROM subject_recent").fetchall()
    assert key == ["idx", "digest"]
    assert sorted((bytes(k), i) for k, i in recent) == keyed
    # The guards moved with the rows: history is still refused a rewrite, however asked.
    with closing(sqlite3.connect(db)) as conn:
        for statement in (
            "UPDATE entries SET kind = 'forged' WHERE idx = 3",
            "DELETE FROM entries WHERE idx = 3",
            "INSERT OR REPLACE INTO entries (idx, body, leaf_hash, kind, author, time, external)"
            " VALUES (3, x'00', x'00', 'config', 'mallory', 't', 1)",
            "UPDATE ledger_head SET size = size + 1, last_leaf = x'00'",
        ):
            with pytest.raises(sqlite3.DatabaseError, match=GUARDED):
                conn.execute(statement)
    assert _rows(db)["entries"][:SIZE] == before["entries"]
    # Full tiles are immutable: each is as the previous release wrote it.
    full = {path: body for path, body in tiles.items() if ".p" not in path.parts[-2:][0]}
    full = {path: body for path, body in full.items() if path.name != "checkpoint"}
    assert Path("tiles/tile/0/000") in full
    assert {path: (data / path).read_bytes() for path in full} == full

    again = start_vault("again", data_dir=data, env=ENV)
    verified = again.run("verify")
    assert verified.returncode == 0, verified.describe()
    assert f"{SIZE + 2} entries" in verified.stdout, verified.describe()


def test_an_upgrade_without_room_for_its_copy_changes_nothing_and_says_so(
    small_disk: Path, start_vault: StartVault, tmp_path: Path
) -> None:
    """Schema 5 copies the entries into a new table. On a disk without room for the copy, the
    server refuses to start in one line naming the folder, the database is left at schema 4 as
    written, and once room is made the same data folder upgrades and verifies."""
    data = _unpack(4, small_disk)
    db = data / "vault.db"
    before = _rows(db)
    fill(small_disk)

    refused = run_vault(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={**ENV, "PINVAULT_DATA_DIR": str(data)},
        state_home=tmp_path / "state",
        timeout=60,
    )
    # (It may log first that it gave up the room it holds back for starting on a full disk.)
    refused_for_room(refused.error_line(alone=False), data)
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(4,)]
    assert _rows(db) == before
    assert _stored_as(db) == ({bytes}, "BIGINT")

    (small_disk / "filler").unlink()
    server = start_vault("upgraded", data_dir=data, env=ENV)
    verified = server.run("verify")
    assert verified.returncode == 0, verified.describe()
    assert f"{SIZE} entries" in verified.stdout, verified.describe()
    assert _stored_as(db) == ({bytes}, "INTEGER")


def test_a_postgresql_vault_of_schema_3_is_upgraded_and_verifies(
    start_vault: StartVault, postgres_url: str
) -> None:
    server = start_vault("written", database=postgres_url, env=ENV)
    with server.client() as client:
        blob = client.put(b"kept through the upgrade\n")
        client.pin("config", str(blob.blob.sha256))
        client.pin("config", "blake3:" + "b3" * 32, external=True)
        for n in range(40):
            client.pin("config", f"sha256:{n:064x}", external=True)
        note = client.checkpoint_note()
    assert server.stop() == 0
    engine = create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        subjects_as_schema_3(conn)
        conn.execute(text("UPDATE schema_version SET version = 3"))
        entries = conn.execute(text("SELECT idx, body, leaf_hash FROM entries ORDER BY idx")).all()
        old = sorted(conn.execute(text("SELECT digest, idx FROM entry_subjects")).all())

    upgraded = start_vault("upgraded", data_dir=server.data_dir, database=postgres_url, env=ENV)
    verified = upgraded.run("verify")
    assert verified.returncode == 0, verified.describe()
    with upgraded.client() as client:
        assert client.checkpoint_note() == note
        assert [e.entry.index for e in client.lookup("blake3:" + "b3" * 32)] == [1]
        assert [e.entry.index for e in client.lookup(str(blob.blob.sha256))] == [0]
        client.pin("config", f"sha256:{40:064x}", external=True)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT version FROM schema_version")).scalar_one() == (
            SCHEMA_VERSION
        )
        assert (
            conn.execute(
                text("SELECT idx, body, leaf_hash FROM entries WHERE idx < 42 ORDER BY idx")
            ).all()
            == entries
        )
        assert conn.execute(text("SELECT count(*) FROM entry_subjects")).scalar_one() == (
            len(old) + 1
        )
    engine.dispose()
