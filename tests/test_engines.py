"""The vault on both of its engines: the same user-visible behaviour on SQLite and on a real
PostgreSQL, ledger rows that the database itself refuses to change, and two servers appending
concurrently to one PostgreSQL that keep one linear, valid ledger."""

from __future__ import annotations

import contextlib
import hashlib
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from tests.conftest import StartVault
from tests.services.postgres import PostgresServer
from tests.services.vault_server import VaultServer
from vault.ledger.checkpoint import Verifier
from vault.ledger.entry import INDEX
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

ORIGIN = "engines.test/ledger"
ENV = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}
ENGINES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def database_for(engine: str, request: pytest.FixtureRequest) -> str | None:
    """None for the embedded default; a fresh PostgreSQL database otherwise."""
    if engine == "sqlite":
        return None
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    url = postgres.create_database()
    request.addfinalizer(lambda: postgres.drop_database(sa.make_url(url).database or ""))
    return url


def database_url(server: VaultServer) -> str:
    return server.database or f"sqlite:///{server.db_path}"


@pytest.fixture(scope="module", params=ENGINES)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VaultServer]:
    database = database_for(request.param, request)
    base = tmp_path_factory.mktemp(request.param)
    with VaultServer(base, database=database, env=ENV) as server:
        engine = "sqlite" if database is None else "postgresql"
        assert f"ledger {engine} " in server.banner[1]
        yield server


def test_put_pin_lookup_and_verify(server: VaultServer, tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(b'{"files": 3}\n' * 5000)
    sha256sum = subprocess.run(["sha256sum", str(path)], capture_output=True, check=True)
    stored = server.run("put", "--json", str(path)).ok().json()
    assert stored["sha256"] == "sha256:" + sha256sum.stdout.decode().split()[0]

    first = server.run("pin", "dataset", stored["sha256"], "--json").ok().json()
    second = server.run("pin", "run", stored["blake3"], "--meta", "seed=7", "--json").ok().json()
    assert second["prev"] == first["leaf_hash"]
    (zeroth,) = server.run("log", "--limit", "1", "--json").ok().json_lines()
    assert (zeroth["index"], zeroth["prev"]) == (0, "0" * 64)

    found = server.run("lookup", stored["blake3"], "--json").ok().json()
    assert [e["index"] for e in found][-2:] == [first["index"], second["index"]]
    assert server.run("get", stored["sha256"]).ok().output == path.read_bytes()
    run = server.run("verify", "--blobs").ok()
    assert "ledger OK" in run.stdout and ", 0 failed" in run.stdout


def test_the_database_refuses_to_change_or_delete_ledger_rows(server: VaultServer) -> None:
    with server.client() as client:
        client.pin("artefact", "sha256:" + hashlib.sha256(b"immutable").hexdigest(), external=True)
    statements = [
        "UPDATE entries SET kind = 'image'",
        "UPDATE entries SET body = body WHERE idx = 0",
        "DELETE FROM entries WHERE idx = 0",
        "UPDATE entry_subjects SET digest = 'sha256:00'",
        "DELETE FROM entry_subjects",
        "UPDATE checkpoints SET note = ''",
        "DELETE FROM checkpoints",
    ]
    if server.database is not None:
        statements += ["TRUNCATE entries", "TRUNCATE checkpoints CASCADE"]
    engine = sa.create_engine(database_url(server))
    try:
        with engine.connect() as conn:
            count = conn.execute(sa.text("SELECT count(*) FROM entries")).scalar_one()
        for statement in statements:
            with pytest.raises(DBAPIError, match="never changed or deleted"), engine.begin() as c:
                c.execute(sa.text(statement))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM entries")).scalar_one() == count
    finally:
        engine.dispose()
    assert "ledger OK" in server.run("verify").ok().stdout


SQLITE_REWRITES = [
    "INSERT OR REPLACE INTO entries SELECT * FROM entries WHERE idx = 0",
    "REPLACE INTO entries SELECT * FROM entries WHERE idx = 0",
    "INSERT OR REPLACE INTO entry_subjects SELECT * FROM entry_subjects",
    "REPLACE INTO checkpoints SELECT * FROM checkpoints",
    "INSERT OR REPLACE INTO blobs SELECT * FROM blobs",
    "REPLACE INTO ledger_head SELECT * FROM ledger_head",
]
POSTGRES_REWRITES = [
    "INSERT INTO entries SELECT * FROM entries WHERE idx = 0 "
    "ON CONFLICT (idx) DO UPDATE SET kind = 'image'",
    "INSERT INTO checkpoints SELECT * FROM checkpoints ON CONFLICT (size) DO UPDATE SET note = ''",
    "INSERT INTO blobs SELECT * FROM blobs ON CONFLICT (sha256) DO UPDATE SET size = 0",
    "TRUNCATE blobs",
    "TRUNCATE ledger_head",
]
EVERY_ENGINE_REWRITES = [
    # A subject added to an entry already in the ledger would list it under another digest.
    "INSERT INTO entry_subjects (digest, idx) VALUES ('sha256:" + "0" * 64 + "', 0)",
    "UPDATE blobs SET size = 0",
    "UPDATE blobs SET stored_at = ''",
    "DELETE FROM blobs",
    "DELETE FROM ledger_head",
    "UPDATE ledger_head SET size = size - 1",
    "UPDATE ledger_head SET size = size + 1",
    "UPDATE ledger_head SET size = 0",
    "UPDATE ledger_head SET last_leaf = (SELECT leaf_hash FROM entries WHERE idx = 0)",
]


def test_the_database_refuses_every_write_but_an_append(
    server: VaultServer, tmp_path: Path
) -> None:
    """Each statement form that could rewrite history, the head or the blob catalogue is
    refused by the database itself, and the ledger still verifies after the attempts."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"catalogued")
    with server.client() as client:
        digest = client.put(blob).blob.sha256
        client.pin("artefact", str(digest))
        client.pin("config", "sha256:" + hashlib.sha256(b"second").hexdigest(), external=True)
    statements = EVERY_ENGINE_REWRITES + (
        SQLITE_REWRITES if server.database is None else POSTGRES_REWRITES
    )
    engine = sa.create_engine(database_url(server))
    tables = ("entries", "entry_subjects", "checkpoints", "blobs", "ledger_head")

    def snapshot() -> dict[str, list[tuple[object, ...]]]:
        with engine.connect() as conn:
            return {
                t: [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {t} ORDER BY 1, 2"))]
                if t != "ledger_head"
                else [tuple(r) for r in conn.execute(sa.text("SELECT * FROM ledger_head"))]
                for t in tables
            }

    try:
        before = snapshot()
        refused = []
        for statement in statements:
            with contextlib.suppress(DBAPIError), engine.begin() as conn:
                conn.execute(sa.text(statement))
                continue
            refused.append(statement)
        assert refused == statements, "accepted: " + repr(sorted(set(statements) - set(refused)))
        assert snapshot() == before
    finally:
        engine.dispose()
    assert "ledger OK" in server.run("verify").ok().stdout
    with server.client() as client:
        client.pin("config", "sha256:" + hashlib.sha256(b"third").hexdigest(), external=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_one_changed_byte_is_named_by_verify(
    engine: str, request: pytest.FixtureRequest, start_vault: StartVault
) -> None:
    server = start_vault(database=database_for(engine, request), env=ENV)
    with server.client() as client:
        for n in range(6):
            client.pin("config", "sha256:" + hashlib.sha256(b"%d" % n).hexdigest(), external=True)
    server.stop()

    db = sa.create_engine(database_url(server))
    try:
        with db.begin() as conn:
            if server.database is None:
                conn.execute(sa.text("DROP TRIGGER entries_no_update"))
            else:
                conn.execute(sa.text("DROP TRIGGER entries_immutable ON entries"))
            body = conn.execute(sa.text("SELECT body FROM entries WHERE idx = 3")).scalar_one()
            altered = bytes(body).replace(b'"kind":"config"', b'"kind":"conf1g"')
            assert altered != body
            conn.execute(sa.text("UPDATE entries SET body = :b WHERE idx = 3"), {"b": altered})
    finally:
        db.dispose()

    server.restart()
    run = server.run("verify")
    assert run.returncode == 65, run.describe()
    assert "first break at index 3" in run.stdout, run.describe()


@pytest.mark.postgres
def test_two_servers_on_one_postgresql_keep_one_linear_ledger(
    postgres_url: str, start_vault: StartVault, tmp_path: Path
) -> None:
    first = start_vault("first", database=postgres_url, env=ENV)
    config = tmp_path / "second.toml"
    config.write_text(f'[ledger]\nkey_file = "{first.key_path}"\norigin = "{ORIGIN}"\n')
    second = start_vault("second", database=postgres_url, args=["--config", str(config)])
    servers = (first, second)
    keys = {s.run("checkpoint", "--key").ok().stdout for s in servers}
    assert len(keys) == 1

    threads, pins_each = 8, 50
    subjects = {
        (t, n): "sha256:" + hashlib.sha256(f"{t}/{n}".encode()).hexdigest()
        for t in range(threads)
        for n in range(pins_each)
    }
    indexes: dict[str, int] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def append(t: int) -> None:
        try:
            with servers[t % 2].client(author=f"thread-{t}@lab") as client:
                barrier.wait()
                for n in range(pins_each):
                    # Each pin comes back proved against a checkpoint consistent with the last
                    # one this client saw, whichever server signed it.
                    proven = client.pin("run", subjects[t, n], external=True)
                    indexes[subjects[t, n]] = proven.entry.index
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=append, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    # Between the pins, the `index` entries either server's writer appended for the subject
    # map (one a commit that left INDEX_EVERY entries uncovered), each covering every entry
    # before it: one linear ledger of both.
    with first.client() as client:
        maps = [(e.index, int(e.meta["covers"])) for e in client.log(kind=INDEX)]
    assert maps and all(covers == index for index, covers in maps)
    total = threads * pins_each + len(maps)
    assert sorted([*indexes.values(), *(i for i, _ in maps)]) == list(range(total))

    verifier = Verifier.from_string(keys.pop().strip())
    roots = set()
    for server in servers:
        checkpoint = verifier.open(server.run("checkpoint").ok().stdout)
        assert checkpoint.size == total
        roots.add(checkpoint.root)
        run = server.run("verify").ok()
        assert re.search(rf"ledger: {total} entries", run.stdout) and "ledger OK" in run.stdout
        with server.client() as client:
            found = client.lookup_many(list(subjects.values()))
        assert {d: [p.entry.index for p in found[d]] for d in found} == {
            d: [i] for d, i in indexes.items()
        }
        line = server.run("lookup", subjects[7, 49]).ok().stdout.splitlines()[1]
        assert line.split()[0] == str(indexes[subjects[7, 49]])
    assert len(roots) == 1


def test_a_database_that_cannot_be_opened_is_one_line_from_serve(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/no-such-folder/vault.db"
    server = VaultServer(tmp_path, database=url)
    # EX_UNAVAILABLE: the database cannot be reached.
    with pytest.raises(RuntimeError, match="exited with 69"):
        server.start()
    assert "Traceback" not in server.log()
    assert server.log().splitlines()[-1] == (
        f"vault: UNAVAILABLE: cannot open the ledger database {url}: unable to open database file"
    )


@pytest.mark.parametrize(
    "verify_args", [(), ("--workers", "2", "--chunk", "2048")], ids=["one-process", "in-chunks"]
)
def test_verify_passes_while_writers_append(
    server: VaultServer, verify_args: tuple[str, ...]
) -> None:
    """`vault verify` audits one snapshot of the ledger (its head and the rows up to it), so
    an untampered ledger verifies while other writers keep appending; in chunks too, whose
    streams each read a later snapshot than the head's."""
    author = "live-writer"

    def batch(start: int, count: int) -> pb.PinBatchRequest:
        return pb.PinBatchRequest(
            pins=[
                pb.PinRequest(
                    kind="config",
                    subjects=["sha256:" + hashlib.sha256(b"live %d" % n).hexdigest()],
                    external=True,
                    author=author,
                )
                for n in range(start, start + count)
            ]
        )

    stop = threading.Event()
    appended: list[int] = []
    errors: list[BaseException] = []

    def append_until_stopped() -> None:
        with grpc.insecure_channel(server.address) as channel:
            ledger = rpc.LedgerStub(channel)
            n = 10**6
            try:
                while not stop.is_set():
                    ledger.PinBatch(batch(n, 500), timeout=30)
                    appended.append(500)
                    n += 500
            except BaseException as exc:
                errors.append(exc)

    with grpc.insecure_channel(server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        for start in range(0, 20_000, 5_000):
            ledger.PinBatch(batch(start, 5_000), timeout=60)
    writer = threading.Thread(target=append_until_stopped)
    writer.start()
    try:
        for _ in range(3):
            before = sum(appended)
            run = server.run("verify", *verify_args)
            assert run.returncode == 0 and "ledger OK" in run.stdout, run.describe()
            assert sum(appended) > before, "appends went on while the audit ran"
    finally:
        stop.set()
        writer.join()
    assert not errors, errors
