"""The subject index on SQLite, kept as a log-structured merge (vault.ledger.subject_index),
through a real server with runs of 64 rows: look-ups, batch look-ups and the log filtered by
digest find every entry naming a digest while its rows move from the recent table into sorted
runs on several levels; a run a crash left unnamed is deleted, and a named run that is lost or
damaged is built again from the ledger's own subject rows, when the server next starts."""

from __future__ import annotations

import sqlite3
import stat
import time
from contextlib import closing
from pathlib import Path

import pytest

from tests.conftest import StartVault
from vault.errors import Unavailable
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import open_database
from vault.ledger.log import Ledger
from vault.ledger.records import LogFilter, PinSpec
from vault.wire import pinvault_pb2 as pb

FOLD = 64
ENV = {
    "PINVAULT_LEDGER_ORIGIN": "subjects.test/ledger",
    "PINVAULT_LEDGER_SUBJECT_FOLD_ROWS": str(FOLD),
}
ENTRIES = 3_000
BATCH = 100
STAGE = 500
# Named, besides its own digest, by every seventh entry: a base image every run names.
POPULAR = f"sha256:{10**12:064x}"


def _digest(n: int) -> str:
    return f"sha256:{n:064x}"


def _subjects(n: int) -> list[str]:
    return [_digest(n), POPULAR] if n % 7 == 0 else [_digest(n)]


def _append_all(server: object, db: Path) -> list[int]:
    """Every entry, in stages each folded before the next, so that runs fill several levels;
    the ledger index of each (each batch's commit also appends an `index` entry after it)."""
    where: list[int] = []
    with server.client() as client:  # type: ignore[attr-defined]
        for start in range(0, ENTRIES, BATCH):
            if start % STAGE == 0:
                _folded(db)
            pins = [
                pb.PinRequest(
                    kind="artefact", subjects=_subjects(n), external=True, author="subjects"
                )
                for n in range(start, start + BATCH)
            ]
            answer = client.ledger.PinBatch(pb.PinBatchRequest(pins=pins))
            where += [e.index for e in answer.entries]
    return where


def _index(db: Path) -> tuple[int, list[tuple[str, int, int]]]:
    """The rows in the recent table, and each named run: its name, level and rows."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (recent,) = conn.execute("SELECT count(*) FROM subject_recent").fetchone()
        runs = conn.execute("SELECT name, level, rows FROM subject_runs ORDER BY level").fetchall()
    return recent, runs


def _folded(db: Path, timeout: float = 60.0) -> tuple[int, list[tuple[str, int, int]]]:
    """The index once the recent table holds less than a run's rows."""
    deadline = time.monotonic() + timeout
    while True:
        recent, runs = _index(db)
        if recent < FOLD:
            return recent, runs
        assert time.monotonic() < deadline, f"{recent} recent rows were never folded"
        time.sleep(0.1)


def _check_lookups(server: object, where: list[int]) -> None:
    every_seventh = [where[n] for n in range(0, ENTRIES, 7)]
    with server.client() as client:  # type: ignore[attr-defined]
        assert [e.entry.index for e in client.lookup(POPULAR)] == every_seventh
        wanted = [_digest(n) for n in range(0, ENTRIES, 97)] + [_digest(ENTRIES + 5)]
        found = client.lookup_many(wanted)
        for n in range(0, ENTRIES, 97):
            assert [e.entry.index for e in found[_digest(n)]] == [where[n]]
        assert found[_digest(ENTRIES + 5)] == []
        logged = client.log(start=1_000, limit=5, digest=POPULAR)
        assert [e.index for e in logged] == [n for n in every_seventh if n >= 1_000][:5]


def test_look_ups_find_every_entry_while_the_index_folds_into_runs(
    start_vault: StartVault,
) -> None:
    server = start_vault("folds", env=ENV)
    db = server.data_dir / "vault.db"
    where = _append_all(server, db)
    recent, runs = _folded(db)
    subject_rows = ENTRIES + len(range(0, ENTRIES, 7))
    # Every row is in exactly one place, and the runs fill more than one level.
    assert recent + sum(rows for _, _, rows in runs) == subject_rows
    assert len({level for _, level, _ in runs}) >= 2, runs
    folder = server.data_dir / "vault.db.subjects"
    on_disk = sorted(p.name for p in folder.iterdir())
    assert on_disk == sorted(name for name, _, _ in runs)
    # Readable by the server's user only, as the database is.
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o600}
    _check_lookups(server, where)
    verified = server.run("verify")
    assert verified.returncode == 0, verified.describe()


def test_a_run_left_unnamed_is_deleted_and_lost_or_damaged_runs_are_built_again(
    start_vault: StartVault,
) -> None:
    server = start_vault("lost", env=ENV)
    db = server.data_dir / "vault.db"
    runs_dir = server.data_dir / "vault.db.subjects"
    where = _append_all(server, db)
    _, runs = _folded(db)
    assert server.stop() == 0

    # A fold that a crash cut short, a run lost from the disk and one that lost rows.
    (runs_dir / "run-000000999999.db").write_bytes(b"half a run")
    assert len(runs) >= 2, runs
    lost = runs[-1][0]
    (runs_dir / lost).unlink()
    damaged = runs[0][0]
    with closing(sqlite3.connect(runs_dir / damaged)) as conn, conn:
        conn.execute("DELETE FROM run WHERE idx % 2 = 0")

    again = start_vault("lost-again", data_dir=server.data_dir, env=ENV)
    deadline = time.monotonic() + 60
    while True:
        try:
            _check_lookups(again, where)
            break
        except Unavailable:
            # Look-ups say the index is being built again until it is.
            assert time.monotonic() < deadline, "the lost run was never built again"
            time.sleep(0.2)
    names = {p.name for p in runs_dir.iterdir()}
    assert "run-000000999999.db" not in names and lost not in names and damaged not in names
    assert names == {name for name, _, _ in _index(db)[1]}
    assert "building them again from the ledger's subject rows" in again.log()
    assert lost in again.log() and damaged in again.log()


def test_the_subject_rows_are_kept_in_append_order_beside_the_index(
    start_vault: StartVault,
) -> None:
    """entry_subjects, which `vault verify` checks against every entry, is keyed by index
    first: an append adds to its end however large it is."""
    server = start_vault("layout", env=ENV)
    with server.client() as client:
        client.pin("config", [_digest(2), _digest(1)], external=True)
    with closing(sqlite3.connect(f"file:{server.data_dir / 'vault.db'}?mode=ro", uri=True)) as c:
        key = [row[2] for row in c.execute("PRAGMA index_info(sqlite_autoindex_entry_subjects_1)")]
        rows = c.execute("SELECT idx, digest FROM entry_subjects").fetchall()
    assert key == ["idx", "digest"]
    assert [(i, d.hex()) for i, d in rows] == [(0, f"{1:064x}"), (0, f"{2:064x}")]


def test_rows_a_cut_short_fold_left_behind_are_read_once_and_deleted_by_the_next(
    tmp_path: Path,
) -> None:
    """A fold's recent rows leave in several transactions after its run is named; a crash
    between them leaves rows that are in a run too. Look-ups read each entry once meanwhile,
    and the next fold deletes them rather than folding them again."""
    db = open_database(f"sqlite:///{tmp_path / 'vault.db'}")
    key = SigningKey.generate("subjects.test/ledger")
    ledger = Ledger(db, key, origin="subjects.test/ledger", fold_rows=FOLD)
    try:
        ledger.append([_pin(n) for n in range(200)])
        recent, runs = _folded(tmp_path / "vault.db")
        assert runs and recent < FOLD
        with closing(sqlite3.connect(tmp_path / "vault.db")) as conn, conn:
            # As if the deletes after the last fold had not happened.
            conn.executemany(
                "INSERT INTO subject_recent (digest, idx) VALUES (?, ?)",
                conn.execute("SELECT digest, idx FROM entry_subjects WHERE idx < 100").fetchall(),
            )
        for n in (0, 99, 150):
            assert [e.index for e in ledger.entries_naming(_digest(n))] == [n]
        assert [e.index for e in ledger.log(0, 10, LogFilter(digest=_digest(5)))] == [5]

        ledger.append([_pin(n) for n in range(200, 300)])
        deadline = time.monotonic() + 60
        while _index(tmp_path / "vault.db")[0] >= FOLD:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        recent, runs = _index(tmp_path / "vault.db")
        assert recent + sum(rows for _, _, rows in runs) == 300
        assert [e.index for e in ledger.entries_naming(_digest(50))] == [50]
    finally:
        ledger.close()
        db.dispose()


def _pin(n: int) -> PinSpec:
    return PinSpec.checked(kind="config", subjects=[_digest(n)], author="tester", external=True)


def test_a_run_that_points_at_the_wrong_entries_cannot_make_them_name_a_digest(
    start_vault: StartVault,
) -> None:
    """The runs are files on the server's disk. One changed to say that entries name a digest
    they do not is not believed: a look-up returns only entries whose own subject rows name it."""
    server = start_vault("forged", env=ENV)
    db = server.data_dir / "vault.db"
    where = _append_all(server, db)
    _, runs = _folded(db)
    assert server.stop() == 0
    forged = server.data_dir / "vault.db.subjects" / runs[-1][0]
    looked_up = ",".join(str(where[n]) for n in range(0, ENTRIES, 97))
    with closing(sqlite3.connect(forged)) as conn, conn:
        # As many rows as it had (a run whose count is off is built again at the start), three
        # of them now saying that entries 1, 2 and 3 name the popular digest.
        conn.execute(
            "DELETE FROM run WHERE (digest, idx) IN (SELECT digest, idx FROM run "
            f"WHERE idx NOT IN ({looked_up}) AND digest != ? LIMIT 3)",
            (bytes.fromhex(POPULAR[7:]),),
        )
        conn.executemany(
            "INSERT INTO run (digest, idx) VALUES (?, ?)",
            [(bytes.fromhex(POPULAR[7:]), n) for n in (1, 2, 3)],
        )

    again = start_vault("forged-again", data_dir=server.data_dir, env=ENV)
    with again.client() as client:
        # What the server answers, before the client checks each entry names the digest.
        answer = client.ledger.Lookup(pb.LookupRequest(digest=POPULAR))
        assert [e.entry.index for e in answer.entries] == [where[n] for n in range(0, ENTRIES, 7)]
    _check_lookups(again, where)
    # Those look-ups read the changed run: its count was right, so it was not built again.
    assert "building them again" not in again.log()
    assert forged.exists()


def test_a_run_damaged_under_a_running_server_is_reported_not_read(
    start_vault: StartVault,
) -> None:
    """A run whose file is overwritten while the server runs: a look-up that needs it answers
    UNAVAILABLE naming the run, not a traceback or a partial answer."""
    server = start_vault("damaged", env=ENV)
    db = server.data_dir / "vault.db"
    _append_all(server, db)
    _, runs = _folded(db)
    name = runs[-1][0]
    run = server.data_dir / "vault.db.subjects" / name
    run.write_bytes(bytes(run.stat().st_size))
    unreadable = f"the subject index's run {name} cannot be read"
    with server.client() as client, pytest.raises(Unavailable, match=unreadable):
        client.lookup(POPULAR)
