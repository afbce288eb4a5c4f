"""`vault verify` with worker processes, each auditing its own chunk of the ledger, names the
exact first break wherever it lies: inside a chunk other than the first, on the first entry
of a chunk (where the chain crosses from one worker to the next), at a checkpoint size that
ends a chunk. Each case alters a copy of one ledger of 8-entry chunks in SQLite, past the
immutability triggers, and audits it through the real command; the report of every failure
(`--json`) must be the one the audit in a single process gives."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultRun, VaultServer
from tests.test_verify_tamper import ENV, ORIGIN, body, tampering
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.entry import KINDS, Entry

SIZE = 70
CHUNK = 8
# Pin 63 uncovers the 64th entry, so its commit also appends the ledger's first index entry
# (at 64): the ledger holds SIZE + 1 entries and no checkpoint of size 64.
INDEX_ENTRY = 64
ENTRIES = SIZE + 1
PARALLEL = ("--workers", "2", "--chunk", str(CHUNK))


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultServer]:
    """A stopped server's data folder: SIZE pins and one index entry, a signed checkpoint at
    every size a commit ended."""
    server = VaultServer(tmp_path_factory.mktemp("ledger"), env=ENV).start()
    try:
        with server.client(author="builder@lab") as client:
            blob = str(client.put(b"a pinned blob").blob.sha256)
            for n in range(SIZE):
                client.pin(KINDS[n % len(KINDS)], blob, meta={"n": str(n)})
    finally:
        assert server.stop() == 0
    with sqlite3.connect(server.db_path) as conn:
        sizes = {size for (size,) in conn.execute("SELECT size FROM checkpoints")}
    assert set(range(1, ENTRIES + 1)) - {INDEX_ENTRY} <= sizes
    yield server


def audit(server: VaultServer) -> tuple[VaultRun, dict[str, Any]]:
    """`vault verify` with workers, checked against the same audit in one process: the same
    report, failure for failure."""
    run = server.run("verify", "--json", *PARALLEL)
    report = json.loads(run.stdout)
    alone = json.loads(server.run("verify", "--json", "--workers", "1").stdout)
    assert report["ledger"]["workers"] == 2, run.describe()
    assert alone["ledger"]["workers"] == 1
    assert {**report["ledger"], "workers": 1} == alone["ledger"], run.describe()
    return run, report


def assert_first_break(
    start_vault: StartVault, data: Path, index: int, reason: str
) -> list[dict[str, Any]]:
    server = start_vault("served", data_dir=data, env=ENV)
    run, report = audit(server)
    assert run.returncode == 65, run.describe()
    assert report["ok"] is False and report["ledger"]["first_break"] == index, run.describe()
    failures: list[dict[str, Any]] = report["ledger"]["failures"]
    assert failures[0]["index"] == index and reason in failures[0]["message"], run.describe()
    # And the lines a person reads say the same.
    lines = server.run("verify", *PARALLEL)
    assert f"ledger verification FAILED: first break at index {index}" in lines.stdout
    return failures


@pytest.fixture
def data(ledger: VaultServer, tmp_path: Path) -> Path:
    return ledger.copy_data(tmp_path / "data")


def test_the_untouched_ledger_verifies_in_chunks(start_vault: StartVault, data: Path) -> None:
    server = start_vault("served", data_dir=data, env=ENV)
    run, report = audit(server)
    assert run.returncode == 0, run.describe()
    assert report["ledger"]["entries"] == ENTRIES and report["ledger"]["failures"] == []
    assert report["ledger"]["checkpoints"] >= SIZE
    assert "ledger OK" in server.run("verify", *PARALLEL).ok().stdout


def change_author(conn: sqlite3.Connection, index: int) -> None:
    altered = bytearray(body(conn, index))
    at = altered.index(b'"author":"') + len(b'"author":"')
    altered[at] = ord("M") if altered[at] != ord("M") else ord("N")
    conn.execute("UPDATE entries SET body = ? WHERE idx = ?", (bytes(altered), index))


@pytest.mark.parametrize("index", [21, CHUNK * 3, CHUNK * 5 - 1])
def test_a_changed_entry_in_a_later_chunk(start_vault: StartVault, data: Path, index: int) -> None:
    """In the middle of the third chunk, on the first entry of the fourth, on the last of the
    fifth."""
    with tampering(data) as conn:
        change_author(conn, index)
    assert_first_break(start_vault, data, index, "leaf hash does not match")


def test_a_changed_stored_leaf_hash(start_vault: StartVault, data: Path) -> None:
    with tampering(data) as conn:
        conn.execute("UPDATE entries SET leaf_hash = ? WHERE idx = 37", (b"\x01" * 32,))
    assert_first_break(start_vault, data, 37, "leaf hash does not match")


def relink(conn: sqlite3.Connection, index: int, prev: bytes) -> None:
    """Give entry `index` another prev hash, with its stored leaf hash to match its bytes: only
    the chain (and the trees over it) can tell."""
    entry = dataclasses.replace(Entry.decode(body(conn, index)), prev=prev)
    encoded = entry.encode()
    conn.execute(
        "UPDATE entries SET body = ?, leaf_hash = ? WHERE idx = ?",
        (encoded, hashlib.sha256(b"\x00" + encoded).digest(), index),
    )


@pytest.mark.parametrize("index", [CHUNK * 4, 43])
def test_a_broken_chain_link(start_vault: StartVault, data: Path, index: int) -> None:
    """Where one worker's chunk ends and the next one's begins, and inside a chunk."""
    with tampering(data) as conn:
        relink(conn, index, hashlib.sha256(b"not the entry before").digest())
    failures = assert_first_break(start_vault, data, index, "chain broken")
    # The entry after names the hash the altered one had: its link breaks too.
    chain = [f["index"] for f in failures if "chain broken" in f["message"]]
    assert chain == [index, index + 1]


def test_a_chain_that_skips_the_entry_before_a_chunk(start_vault: StartVault, data: Path) -> None:
    """The first entry of a chunk names the hash of the entry two before it."""
    index = CHUNK * 6
    with tampering(data) as conn:
        (two_before,) = conn.execute(
            "SELECT leaf_hash FROM entries WHERE idx = ?", (index - 2,)
        ).fetchone()
        relink(conn, index, bytes(two_before))
    assert_first_break(start_vault, data, index, "chain broken")


@pytest.mark.parametrize("column", ["kind", "author"])
def test_a_changed_index_column_at_a_chunk_end(
    start_vault: StartVault, data: Path, column: str
) -> None:
    index = CHUNK * 2 - 1
    with tampering(data) as conn:
        conn.execute(f"UPDATE entries SET {column} = 'x' WHERE idx = ?", (index,))
    assert_first_break(start_vault, data, index, "disagree with the entry")


def test_entries_deleted_across_a_chunk_boundary(start_vault: StartVault, data: Path) -> None:
    """One gap over the end of one chunk, the whole of the next and the start of another is
    one failure, at its first index, naming the next entry stored."""
    with tampering(data) as conn:
        conn.execute("DELETE FROM entries WHERE idx >= 30 AND idx < 42")
        conn.execute("DELETE FROM entry_subjects WHERE idx >= 30 AND idx < 42")
    failures = assert_first_break(start_vault, data, 30, "entry 30 is missing")
    assert "the next stored entry is 42" in failures[0]["message"]
    assert not any("missing" in f["message"] for f in failures[1:])


def replace_checkpoint(
    conn: sqlite3.Connection, data: Path, size: int, sign: Callable[[Checkpoint], str]
) -> None:
    key = SigningKey.load(data / "checkpoint.key")
    (note,) = conn.execute("SELECT note FROM checkpoints WHERE size = ?", (size,)).fetchone()
    genuine = key.verifier().open(note)
    conn.execute("UPDATE checkpoints SET note = ? WHERE size = ?", (sign(genuine), size))


@pytest.mark.parametrize("size", [CHUNK * 5, 45])
def test_a_checkpoint_whose_root_does_not_match(
    start_vault: StartVault, data: Path, size: int
) -> None:
    """A checkpoint whose size ends a chunk (its root is the whole of the chunks before it)
    and one inside a chunk (the chunks before it and part of this one)."""
    key = SigningKey.load(data / "checkpoint.key")
    wrong = hashlib.sha256(b"not the root").digest()
    with tampering(data) as conn:
        replace_checkpoint(conn, data, size, lambda g: key.sign(Checkpoint(ORIGIN, size, wrong)))
    assert_first_break(start_vault, data, size - 1, "does not match the root signed")


def test_a_checkpoint_signed_by_another_key_in_a_later_chunk(
    start_vault: StartVault, data: Path
) -> None:
    impostor = SigningKey.generate(SigningKey.load(data / "checkpoint.key").name)
    with tampering(data) as conn:
        replace_checkpoint(conn, data, 51, impostor.sign)
    assert_first_break(start_vault, data, 50, "not signed by key")


def test_every_failure_of_a_ledger_altered_in_many_chunks(
    start_vault: StartVault, data: Path
) -> None:
    """Several breaks spread over the chunks: the report lists each, as one process does."""
    key = SigningKey.load(data / "checkpoint.key")
    with tampering(data) as conn:
        change_author(conn, 61)
        relink(conn, CHUNK * 7, b"\x02" * 32)
        conn.execute("UPDATE entries SET kind = 'x' WHERE idx = 11")
        replace_checkpoint(
            conn,
            data,
            20,
            lambda g: key.sign(Checkpoint(ORIGIN, 20, hashlib.sha256(b"x").digest())),
        )
    failures = assert_first_break(start_vault, data, 11, "disagree with the entry")
    indexes = [f["index"] for f in failures]
    assert {11, 19, CHUNK * 7, 61} <= set(indexes)
    assert indexes == sorted(indexes)
