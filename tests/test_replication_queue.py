"""The replication queue over the one placement record: the copies replication makes are
placements on `mirror-<name>` in the tier manager's journal, the queue keeps only the copies
still to make, in the record's own database, and a queue file of an earlier release (its
queued copies, and the verified copies the release before kept there) is carried into the
record and removed when the queue is opened."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path

from mirror.queue import ReplicationQueue
from tiers.placements import Journal
from vault.digest import Digest, sha256_of

# The files as the release before the one placement record wrote them.
PREVIOUS_QUEUE_SCHEMA = """
CREATE TABLE pending (
    digest TEXT NOT NULL,
    mirror TEXT NOT NULL,
    size INTEGER NOT NULL,
    queued REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_try REAL NOT NULL,
    last_error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (digest, mirror)
) WITHOUT ROWID;
CREATE INDEX pending_due ON pending (mirror, next_try);
CREATE TABLE copies (
    digest TEXT NOT NULL,
    mirror TEXT NOT NULL,
    size INTEGER NOT NULL,
    verified REAL NOT NULL,
    PRIMARY KEY (digest, mirror)
) WITHOUT ROWID;
"""
PREVIOUS_JOURNAL_SCHEMA = """
CREATE TABLE journal (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    digest TEXT NOT NULL,
    tier TEXT NOT NULL,
    chunk_offset INTEGER,
    found TEXT NOT NULL,
    action TEXT NOT NULL
);
CREATE TABLE placements (
    digest TEXT NOT NULL,
    tier TEXT NOT NULL,
    size INTEGER,
    stored REAL,
    last_read REAL,
    last_verified REAL,
    PRIMARY KEY (digest, tier)
) WITHOUT ROWID;
"""


def write_previous_release(
    data: Path,
    *,
    copies: Iterable[tuple[Digest, str, int, float]],
    placements: Iterable[tuple[Digest, str, int, float, float]] = (),
    pending: Iterable[tuple[Digest, str, int, float]] = (),
) -> None:
    """A data folder's mirrors.db and tiers.db as the previous release left them: mirror copies
    (digest, mirror, size, verified) in the queue's own table, copies on the local tiers
    (digest, tier, size, stored, verified) in the journal's placements, and queued copies
    (digest, mirror, size, queued)."""
    data.mkdir(parents=True, exist_ok=True)
    queue = sqlite3.connect(data / "mirrors.db")
    with queue:
        queue.executescript(PREVIOUS_QUEUE_SCHEMA)
        queue.executemany(
            "INSERT INTO copies VALUES (?, ?, ?, ?)", [(str(d), *rest) for d, *rest in copies]
        )
        queue.executemany(
            "INSERT INTO pending (digest, mirror, size, queued, next_try) VALUES (?, ?, ?, ?, ?)",
            [(str(d), mirror, size, when, when) for d, mirror, size, when in pending],
        )
    queue.close()
    journal = sqlite3.connect(data / "tiers.db")
    with journal:
        journal.executescript(PREVIOUS_JOURNAL_SCHEMA)
        journal.executemany(
            "INSERT INTO placements (digest, tier, size, stored, last_verified) "
            "VALUES (?, ?, ?, ?, ?)",
            [(str(d), *rest) for d, *rest in placements],
        )
    journal.close()


def tables(path: Path) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        db.close()


def placed(data: Path) -> dict[tuple[Digest, str], tuple[int | None, float | None, float | None]]:
    """(digest, tier) -> (size, stored, last verified), as the placement record has them."""
    journal = Journal(data / "tiers.db")
    try:
        return {
            (p.digest, p.tier): (p.size, p.stored, p.last_verified) for p in journal.placements()
        }
    finally:
        journal.close()


ONE, TWO = sha256_of(b"one"), sha256_of(b"two")


def test_a_queue_of_the_previous_release_has_its_copies_carried_into_the_placement_record(
    tmp_path: Path,
) -> None:
    stored, verified = time.time() - 10 * 86_400, time.time() - 3 * 86_400
    write_previous_release(
        tmp_path,
        copies=[(ONE, "a", 3, verified), (ONE, "b", 3, verified - 1)],
        placements=[(ONE, "hot", 3, stored, verified)],
        pending=[(TWO, "a", 3, verified), (ONE, "c", 3, verified)],
    )

    with closing(ReplicationQueue(tmp_path / "mirrors.db")) as queue:
        assert queue.copies(ONE) == {"a", "b"}
        counts = queue.counts()
        assert (counts["a"].objects, counts["a"].bytes, counts["a"].queued) == (1, 3, 1)
        assert (counts["b"].objects, counts["b"].queued) == (1, 0)
        assert (counts["c"].objects, counts["c"].queued) == (0, 1)
        assert set(queue.known_digests()) == {ONE, TWO}
        # A copy carried over is not queued again; the one it lacked still is.
        assert queue.enqueue([(ONE, 3, ["a", "b", "c"])]) == 0

    assert not (tmp_path / "mirrors.db").exists()
    assert {"placements", "damage_journal", "replication_queue"} <= tables(tmp_path / "tiers.db")
    assert placed(tmp_path) == {
        (ONE, "hot"): (3, stored, verified),
        # Each mirror copy keeps its size and the time it was verified; its blob's age is the
        # one its local copy has.
        (ONE, "mirror-a"): (3, stored, verified),
        (ONE, "mirror-b"): (3, stored, verified - 1),
    }
    # Opened again, nothing is carried twice and no second record comes back.
    with closing(ReplicationQueue(tmp_path / "mirrors.db")) as queue:
        assert queue.copies(ONE) == {"a", "b"}
    assert len(placed(tmp_path)) == 3
    assert not (tmp_path / "mirrors.db").exists()


def test_copies_carried_over_again_after_a_crash_keep_their_newer_verification(
    tmp_path: Path,
) -> None:
    old = time.time() - 3 * 86_400
    write_previous_release(tmp_path, copies=[(ONE, "a", 3, old), (ONE, "b", 3, old)])
    # As if a crash came after the copies were carried over and before their table went, and
    # a scrub checked one copy in between.
    journal = Journal(tmp_path / "tiers.db")
    journal.place_verified([(ONE, "mirror-a", 3, old + 100), (ONE, "mirror-b", 3, old)])
    journal.place(ONE, "mirror-a", verified=old + 200)
    journal.close()

    ReplicationQueue(tmp_path / "mirrors.db").close()

    found = placed(tmp_path)
    assert found[ONE, "mirror-a"][2] == old + 200
    assert found[ONE, "mirror-b"][2] == old


def test_the_queue_keeps_only_what_is_still_to_do_and_records_copies_as_placements(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path / "tiers.db")
    try:
        with closing(ReplicationQueue(tmp_path / "mirrors.db", placements=journal)) as queue:
            assert queue.enqueue([(ONE, 3, ["a", "b"]), (TWO, 5, ["a"])]) == 3
            before = time.time()
            queue.done_many([(ONE, "a", 3), (TWO, "a", 5)])

            assert {(p.digest, p.tier) for p in journal.placements()} == {
                (ONE, "mirror-a"),
                (TWO, "mirror-a"),
            }
            assert all((p.last_verified or 0) >= before for p in journal.placements())
            assert [(p.digest, p.mirror) for p in queue.due("b")] == [(ONE, "b")]
            assert queue.due("a") == []
            assert queue.counts()["a"].objects == 2 and queue.counts()["a"].bytes == 8
            # Placed copies are not queued again.
            assert queue.enqueue([(ONE, 3, ["a", "b"])]) == 0

            # A copy found bad is forgotten in the placement record, and can be queued again.
            queue.forget_copy(ONE, "a")
            assert journal.placed(ONE) == set()
            assert queue.enqueue([(ONE, 3, ["a"])]) == 1
        assert not (tmp_path / "mirrors.db").exists()
        assert "replication_queue" in tables(tmp_path / "tiers.db")
        # The record the queue was given stays open for its owner.
        assert journal.placed(TWO) == {"mirror-a"}
    finally:
        journal.close()
