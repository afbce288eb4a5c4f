"""`vault verify` catches every way a stored ledger can be altered behind the server's back and
names the first index where it broke. Each case alters a copy of one 20-entry ledger (every
size from 1 to 20 has a signed checkpoint) directly in SQLite, as an attacker with the file or
plain bit rot would, past the immutability triggers, then serves it again and audits it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultRun, VaultServer
from vault.digest import digest_key
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.entry import KINDS, Entry
from vault.wire import pinvault_pb2 as pb

ORIGIN = "tamper.test/ledger"
ENV = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}
SIZE = 20
IMMUTABLE_TABLES = ("entries", "entry_subjects", "checkpoints")


@dataclass(frozen=True)
class Ledger:
    """A stopped server's data folder holding a good ledger, and what was put in it."""

    server: VaultServer
    blobs: tuple[str, ...]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    server = VaultServer(tmp_path_factory.mktemp("ledger"), env=ENV).start()
    try:
        with server.client(author="builder@lab") as client:
            blobs = tuple(str(client.put(b"blob %d" % n * 1000).blob.sha256) for n in range(4))
            for n in range(SIZE):
                # One at a time, each proved at once: every size gets its own checkpoint.
                client.pin(KINDS[n % len(KINDS)], blobs[n % len(blobs)], meta={"n": str(n)})
    finally:
        assert server.stop() == 0
    with sqlite3.connect(server.db_path) as conn:
        sizes = {size for (size,) in conn.execute("SELECT size FROM checkpoints")}
    assert set(range(1, SIZE + 1)) <= sizes
    yield Ledger(server, blobs)


def serve_copy(ledger: Ledger, tmp_path: Path) -> Path:
    """A copy of the ledger's data folder, to alter before serving it."""
    return ledger.server.copy_data(tmp_path / "data")


@contextlib.contextmanager
def tampering(data: Path) -> Iterator[sqlite3.Connection]:
    """The vault's SQLite file opened past its immutability triggers, in one transaction."""
    conn = sqlite3.connect(data / "vault.db", isolation_level=None)
    try:
        triggers = {
            n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")
        }
        names = {f"{t}_no_{op}" for t in IMMUTABLE_TABLES for op in ("update", "delete")}
        assert names <= triggers, "the ledger tables are protected by triggers"
        for name in sorted(triggers):
            conn.execute(f"DROP TRIGGER {name}")
        conn.execute("BEGIN")
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()


def body(conn: sqlite3.Connection, index: int) -> bytes:
    (value,) = conn.execute("SELECT body FROM entries WHERE idx = ?", (index,)).fetchone()
    return bytes(value)


def verify(start_vault: StartVault, data: Path, *args: str) -> VaultRun:
    server = start_vault("served", data_dir=data, env=ENV)
    return server.run("verify", *args)


def assert_first_break(run: VaultRun, index: int, reason: str) -> None:
    assert run.returncode == 65, run.describe()
    assert f"ledger verification FAILED: first break at index {index}" in run.stdout, run.describe()
    failures = re.findall(r"FAIL index (\d+): (.*)", run.stdout)
    assert failures and int(failures[0][0]) == index, run.describe()
    assert reason in failures[0][1], run.describe()


# -- the untouched ledger --------------------------------------------------------------------


def test_the_untouched_ledger_verifies(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    run = verify(start_vault, serve_copy(ledger, tmp_path), "--blobs").ok()
    assert re.search(rf"ledger: {SIZE} entries, \d+ checkpoints checked", run.stdout)
    assert "ledger OK" in run.stdout
    assert f"blobs: {len(ledger.blobs)} pinned blobs checked, 0 failed" in run.stdout


# -- entries ---------------------------------------------------------------------------------


def test_one_changed_byte_in_an_entry_body(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        altered = bytearray(body(conn, 7))
        at = altered.index(b'"author":"') + len(b'"author":"')
        altered[at] = ord("M") if altered[at] != ord("M") else ord("N")
        conn.execute("UPDATE entries SET body = ? WHERE idx = 7", (bytes(altered),))
    assert_first_break(verify(start_vault, data), 7, "leaf hash does not match")


@pytest.mark.parametrize(("column", "index", "value"), [("kind", 9, "image"), ("author", 11, "x")])
def test_a_changed_index_column(
    ledger: Ledger,
    start_vault: StartVault,
    tmp_path: Path,
    column: str,
    index: int,
    value: str,
) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        (before,) = conn.execute(f"SELECT {column} FROM entries WHERE idx = ?", (index,)).fetchone()
        assert before != value
        conn.execute(f"UPDATE entries SET {column} = ? WHERE idx = ?", (value, index))
    assert_first_break(verify(start_vault, data), index, "disagree with the entry")


def test_a_deleted_entry(ledger: Ledger, start_vault: StartVault, tmp_path: Path) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        conn.execute("DELETE FROM entries WHERE idx = 10")
        conn.execute("DELETE FROM entry_subjects WHERE idx = 10")
    assert_first_break(verify(start_vault, data), 10, "entry 10 is missing")


def test_two_swapped_entries(ledger: Ledger, start_vault: StartVault, tmp_path: Path) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        fifth, twelfth = body(conn, 5), body(conn, 12)
        conn.execute("UPDATE entries SET body = ? WHERE idx = 5", (twelfth,))
        conn.execute("UPDATE entries SET body = ? WHERE idx = 12", (fifth,))
    assert_first_break(verify(start_vault, data), 5, "leaf hash does not match")


def test_a_truncated_ledger_with_its_head_left_as_it_was(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        conn.execute("DELETE FROM entries WHERE idx >= 15")
        conn.execute("DELETE FROM entry_subjects WHERE idx >= 15")
    assert_first_break(verify(start_vault, data), 15, "truncated")


def test_a_truncated_ledger_with_its_head_rewritten_is_caught_by_its_checkpoints(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        conn.execute("DELETE FROM entries WHERE idx >= 15")
        conn.execute("DELETE FROM entry_subjects WHERE idx >= 15")
        conn.execute(
            "UPDATE ledger_head SET size = 15, "
            "last_leaf = (SELECT leaf_hash FROM entries WHERE idx = 14)"
        )
    assert_first_break(verify(start_vault, data), 15, "checkpoint was signed for size 16")


def test_an_inserted_entry(ledger: Ledger, start_vault: StartVault, tmp_path: Path) -> None:
    data = serve_copy(ledger, tmp_path)
    with tampering(data) as conn:
        for index in range(SIZE - 1, 7, -1):
            conn.execute("UPDATE entries SET idx = idx + 1 WHERE idx = ?", (index,))
            conn.execute("UPDATE entry_subjects SET idx = idx + 1 WHERE idx = ?", (index,))
        previous = Entry.decode(body(conn, 7))
        forged = Entry(
            index=8,
            kind="image",
            subjects=("sha256:" + hashlib.sha256(b"forged").hexdigest(),),
            author=previous.author,
            time=previous.time,
            prev=hashlib.sha256(b"\x00" + body(conn, 7)).digest(),
            external=True,
        )
        encoded = forged.encode()
        conn.execute(
            "INSERT INTO entries (idx, body, leaf_hash, kind, author, time, external) "
            "VALUES (8, ?, ?, ?, ?, ?, 1)",
            (
                encoded,
                hashlib.sha256(b"\x00" + encoded).digest(),
                forged.kind,
                forged.author,
                forged.time,
            ),
        )
        conn.execute(
            "INSERT INTO entry_subjects (digest, idx) VALUES (?, 8)",
            (digest_key(forged.subjects[0]),),
        )
        conn.execute("UPDATE ledger_head SET size = size + 1")
    assert_first_break(verify(start_vault, data), 8, "does not match the root signed")


# -- checkpoints -----------------------------------------------------------------------------


def replace_checkpoint(conn: sqlite3.Connection, size: int, note: str) -> None:
    conn.execute("UPDATE checkpoints SET note = ? WHERE size = ?", (note, size))


def stored_checkpoint(data: Path, size: int) -> Checkpoint:
    key = SigningKey.load(data / "checkpoint.key")
    with sqlite3.connect(data / "vault.db") as conn:
        (note,) = conn.execute("SELECT note FROM checkpoints WHERE size = ?", (size,)).fetchone()
    return key.verifier().open(note)


def test_a_checkpoint_signed_by_another_key(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    data = serve_copy(ledger, tmp_path)
    genuine = stored_checkpoint(data, 12)
    impostor = SigningKey.generate(SigningKey.load(data / "checkpoint.key").name)
    with tampering(data) as conn:
        replace_checkpoint(conn, 12, impostor.sign(genuine))
    assert_first_break(verify(start_vault, data), 11, "not signed by key")


def test_a_checkpoint_whose_root_does_not_match(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    data = serve_copy(ledger, tmp_path)
    key = SigningKey.load(data / "checkpoint.key")
    wrong = Checkpoint(ORIGIN, 12, hashlib.sha256(b"not the root").digest())
    with tampering(data) as conn:
        replace_checkpoint(conn, 12, key.sign(wrong))
    assert_first_break(verify(start_vault, data), 11, "does not match the root signed")


# -- blobs -----------------------------------------------------------------------------------


def test_a_pinned_blob_whose_bytes_changed_on_disk(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    data = serve_copy(ledger, tmp_path)
    damaged = ledger.blobs[2]
    path = data / "hot" / "blobs" / damaged[7:9] / damaged[7:]
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01
    path.write_bytes(content)

    server = start_vault("served", data_dir=data, env=ENV)
    server.run("verify").ok()  # the ledger itself is intact; only --blobs reads the bytes
    run = server.run("verify", "--blobs")
    assert run.returncode == 65, run.describe()
    assert "ledger OK" in run.stdout
    (failure,) = re.findall(r"FAIL blob (\S+): (.*)", run.stdout)
    assert failure[0] == damaged and "damaged" in failure[1], run.describe()
    assert f"blobs: {len(ledger.blobs)} pinned blobs checked, 1 failed" in run.stdout


# -- a history rewritten consistently --------------------------------------------------------


def rewrite_history_from(conn: sqlite3.Connection, start: int) -> None:
    """Change entry `start` and re-chain every later entry, leaf hash, subject and the head
    so the database is consistent again, and delete every stored checkpoint: all that a
    server reading this database alone could check now agrees."""
    prev = bytes(
        conn.execute("SELECT leaf_hash FROM entries WHERE idx = ?", (start - 1,)).fetchone()[0]
    )
    for index in range(start, SIZE):
        entry = Entry.decode(body(conn, index))
        if index == start:
            entry = dataclasses.replace(entry, meta={**entry.meta, "n": "rewritten"})
        entry = dataclasses.replace(entry, prev=prev)
        encoded = entry.encode()
        prev = hashlib.sha256(b"\x00" + encoded).digest()
        conn.execute(
            "UPDATE entries SET body = ?, leaf_hash = ? WHERE idx = ?", (encoded, prev, index)
        )
    conn.execute("UPDATE ledger_head SET last_leaf = ?", (prev,))
    conn.execute("DELETE FROM checkpoints")


def test_a_rewritten_history_is_not_signed_over(
    ledger: Ledger, start_vault: StartVault, tmp_path: Path
) -> None:
    """The server keeps the last checkpoint it signed outside the database: started on a
    history rewritten behind its back, it appends nothing, signs nothing, and `vault verify`
    fails, naming the range the signed checkpoint no longer matches."""
    data = serve_copy(ledger, tmp_path)
    assert (data / "last-checkpoint").is_file()
    with tampering(data) as conn:
        rewrite_history_from(conn, 6)
    server = start_vault("served", data_dir=data, env=ENV)
    # `vault pin` asks for the vault's checkpoint first, which the server will not sign; a
    # caller that asks for the append straight away is refused by the server too.
    pin = server.run("pin", "config", "sha256:" + "ab" * 32, "--external")
    assert "will not sign a ledger that fails its check" in pin.error_line(alone=False)
    assert "do not match the checkpoint for 20 entries" in pin.stderr
    request = pb.PinRequest(
        kind="config", subjects=["sha256:" + "cd" * 32], external=True, author="tester"
    )
    with server.client() as client, pytest.raises(grpc.RpcError) as refused:
        client.ledger.Pin(request, timeout=30)
    assert "will not append to a ledger that fails its check" in str(refused.value.details())
    run = server.run("verify")
    assert_first_break(
        run, SIZE - 1, "does not match the root signed in the checkpoint for size 20"
    )
    assert server.stop() == 0
    with sqlite3.connect(data / "vault.db") as conn:
        assert conn.execute("SELECT count(*) FROM entries").fetchone() == (SIZE,)
        assert conn.execute("SELECT count(*) FROM checkpoints").fetchone() == (0,), "nothing signed"
    assert "do not match the checkpoint for 20 entries" in server.log()
