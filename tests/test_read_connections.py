"""The database's read connections are given back when the thread that held one ends: a server
whose threads come and go keeps reading, on both engines, however many threads have gone.

These drive `Database` directly: a server's own threads cannot be made to come and go from
outside it on demand, and what is under test is what the database does when they do."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vault.ledger.db import Database, Writer, open_database
from vault.ledger.subject_index import runs_folder

THREADS = 500
# Threads alive at once: fewer than the read pool holds, so that only connections kept by
# threads that have ended can exhaust it.
AT_ONCE = 25
# Far longer than a query of a small database takes, far shorter than the pool's wait.
PROMPT = 10.0
ENTRIES = 2_000
FOLD_ROWS = 256


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    url = (
        f"sqlite:///{tmp_path / 'ledger.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    database = open_database(url)
    try:
        yield database
    finally:
        database.dispose()


def key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest()


def write_subjects(db: Database) -> None:
    """ENTRIES entries naming a digest each, folded on SQLite into the subject index's runs."""
    writer = Writer(db, fold_rows=FOLD_ROWS)
    try:
        with writer.begin() as tx:
            tx.insert(
                "entries",
                ["idx", "body", "leaf_hash", "kind", "author", "time", "external"],
                [(i, b"entry", bytes(32), "image", "a", "t", True) for i in range(ENTRIES)],
            )
            subjects = [(i, key(i)) for i in range(ENTRIES)]
            tx.insert("entry_subjects", ["idx", "digest"], subjects)
            if tx.sqlite:
                tx.insert("subject_recent", ["idx", "digest"], subjects)
        if db.is_sqlite:
            deadline = time.monotonic() + 30
            while not db.fetch("SELECT name FROM subject_runs"):
                assert time.monotonic() < deadline, "the subject index was never folded"
                time.sleep(0.05)
    finally:
        writer.close()


def in_threads(db: Database, work: Callable[[int], None]) -> None:
    """`work(i)` on THREADS threads that each end once it returns, AT_ONCE alive at a time;
    fails naming the first thread whose work did not end promptly."""
    for first in range(0, THREADS, AT_ONCE):
        threads = [
            threading.Thread(target=work, args=(i,), daemon=True)
            for i in range(first, first + AT_ONCE)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + PROMPT
        for i, thread in enumerate(threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), (
                f"thread {first + i}'s read did not end in {PROMPT:.0f} s: the read pool has "
                f"{db.read.pool.checkedout()} connections out"  # type: ignore[attr-defined]
            )


def run_files_open(db: Database) -> int:
    """Descriptors of this process open on the subject index's runs."""
    folder = str(runs_folder(str(db.read.url.database)))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(folder)
    return count


def test_threads_that_end_give_their_read_connections_back(db: Database) -> None:
    write_subjects(db)
    before = db.read.pool.checkedout()  # type: ignore[attr-defined]
    held = db.held
    found: list[int] = [0] * THREADS
    errors: list[BaseException] = []

    def look_up(i: int) -> None:
        try:
            found[i] = len(db.naming("e.idx", [key(i % ENTRIES)]))
        except BaseException as exc:
            errors.append(exc)

    in_threads(db, look_up)
    assert not errors, errors[:3]
    assert found == [1] * THREADS
    # What an ended thread held is given back as it ends, with no collection of garbage.
    assert db.read.pool.checkedout() == before  # type: ignore[attr-defined]
    assert db.held == held
    if db.is_sqlite:
        assert run_files_open(db) == 0

    # A new thread still reads, promptly.
    answer: list[list[tuple[int]]] = []
    fresh = threading.Thread(
        target=lambda: answer.append(db.fetch("SELECT count(*) FROM entries")), daemon=True
    )
    fresh.start()
    fresh.join(PROMPT)
    assert answer == [[(ENTRIES,)]]
