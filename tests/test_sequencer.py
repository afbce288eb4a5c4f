"""The ledger's sequencer process: appends are acknowledged only once durable whatever dies (the
sequencer alone, or the whole server), a sequencer that stops is answered for with UNAVAILABLE
and started again, its link has no address anyone else can reach, and the in-process writer
(`ledger.sequencer = thread`) still serves."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import REPO_ROOT, VaultServer, run_vault
from vault.ledger.sequencer import LINGER_BELOW, gather
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

SEQUENCER = "vault.server.sequencer"


def processes() -> Iterator[Path]:
    """/proc's folder of each process running now."""
    return (entry for entry in Path("/proc").iterdir() if entry.name.isdigit())


def sequencers(server: VaultServer) -> list[int]:
    """The pids of the server's sequencer children."""
    assert server.process is not None
    found = []
    for entry in processes():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == server.process.pid and SEQUENCER.encode() in command:
            found.append(int(entry.name))
    return found


def wait_for(what: str, check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def subject(tag: str) -> str:
    return "sha256:" + hashlib.sha256(tag.encode()).hexdigest()


def pin(tag: str) -> pb.PinRequest:
    return pb.PinRequest(kind="artefact", subjects=[subject(tag)], external=True, author="t")


class Appenders:
    """Callers pinning in a loop, each pin a subject of its own; what each call was answered."""

    def __init__(self, server: VaultServer, callers: int = 8) -> None:
        self.acknowledged: dict[str, tuple[int, bytes]] = {}
        self.refused: list[grpc.StatusCode] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(server.address, n), daemon=True)
            for n in range(callers)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, address: str, caller: int) -> None:
        with grpc.insecure_channel(address) as channel:
            ledger = rpc.LedgerStub(channel)
            n = 0
            while not self._stop.is_set():
                tag = f"{caller}/{n}"
                n += 1
                try:
                    if n % 3:
                        answer = ledger.Pin(pin(tag), timeout=30)
                        got = {tag: (answer.entry.index, answer.entry.body)}
                    else:
                        tags = [f"{tag}/{k}" for k in range(50)]
                        batch = ledger.PinBatch(
                            pb.PinBatchRequest(pins=[pin(t) for t in tags]), timeout=30
                        )
                        got = {
                            t: (e.index, e.body) for t, e in zip(tags, batch.entries, strict=True)
                        }
                except grpc.RpcError as exc:
                    with self._lock:
                        self.refused.append(exc.code())
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        return
                    time.sleep(0.01)
                    continue
                with self._lock:
                    self.acknowledged.update(got)

    def count(self) -> int:
        with self._lock:
            return len(self.acknowledged)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def stored(data_dir: Path) -> dict[int, bytes]:
    with sqlite3.connect(data_dir / "vault.db") as conn:
        return {idx: bytes(body) for idx, body in conn.execute("SELECT idx, body FROM entries")}


def assert_kept(acknowledged: dict[str, tuple[int, bytes]], rows: dict[int, bytes]) -> None:
    lost = [tag for tag, (index, body) in acknowledged.items() if rows.get(index) != body]
    assert lost == [], f"{len(lost)} acknowledged entries lost, first {lost[:3]}"
    assert sorted(rows) == list(range(len(rows))), "the ledger is not linear"


def test_the_sequencer_killed_mid_batch_loses_no_acknowledged_entry(
    start_vault: StartVault,
) -> None:
    server = start_vault()
    (first,) = sequencers(server)
    appenders = Appenders(server)
    try:
        wait_for("appends before the kill", lambda: appenders.count() > 300)
        os.kill(first, signal.SIGKILL)
        before = appenders.count()
        # The server starts another sequencer, and appends are acknowledged again.
        wait_for("a new sequencer", lambda: sequencers(server) not in ([], [first]))
        wait_for("appends after the kill", lambda: appenders.count() > before + 300)
    finally:
        appenders.stop()
    # Whatever was in flight when the sequencer died was refused as unavailable, never lost.
    assert set(appenders.refused) <= {grpc.StatusCode.UNAVAILABLE}, appenders.refused
    assert "the ledger's sequencer started again" in server.log()
    run = server.run("verify").ok()
    assert "ledger OK" in run.stdout
    assert server.stop() == 0
    assert_kept(appenders.acknowledged, stored(server.data_dir))


def test_an_append_in_flight_when_the_sequencer_dies_is_unavailable_not_acknowledged(
    start_vault: StartVault,
) -> None:
    server = start_vault()
    (sequencer,) = sequencers(server)
    with grpc.insecure_channel(server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        ledger.Pin(pin("before"), timeout=30)
        # Stopped, the sequencer takes no append off its link: this one is surely in flight.
        os.kill(sequencer, signal.SIGSTOP)
        call = ledger.Pin.future(pin("in flight"), timeout=30)
        time.sleep(0.5)
        assert not call.done()
        os.kill(sequencer, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as refused:
            call.result()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not acknowledged" in str(refused.value.details())
        wait_for("a new sequencer", lambda: sequencers(server) not in ([], [sequencer]))
        wait_for(
            "appends again",
            lambda: _pins(ledger, "after"),
        )
        missing = ledger.Lookup(pb.LookupRequest(digest=subject("in flight")), timeout=30)
        assert list(missing.entries) == []
        found = ledger.Lookup(pb.LookupRequest(digest=subject("after")), timeout=30)
        assert [e.entry.index for e in found.entries] == [1]


def _pins(ledger: rpc.LedgerStub, tag: str) -> bool:
    try:
        ledger.Pin(pin(tag), timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    return True


def test_a_server_killed_outright_loses_no_acknowledged_entry_and_its_sequencer_exits(
    start_vault: StartVault,
) -> None:
    server = start_vault()
    (sequencer,) = sequencers(server)
    appenders = Appenders(server)
    try:
        wait_for("appends before the kill", lambda: appenders.count() > 500)
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        server.process = None
    finally:
        appenders.stop()
    # Its link closed, the sequencer exits too.
    wait_for("the sequencer to exit", lambda: not Path(f"/proc/{sequencer}/cmdline").exists())
    after = start_vault("after", data_dir=server.data_dir)
    run = after.run("verify").ok()
    assert "ledger OK" in run.stdout
    assert after.stop() == 0
    assert_kept(appenders.acknowledged, stored(server.data_dir))


def test_the_link_to_the_sequencer_has_no_address(start_vault: StartVault) -> None:
    server = start_vault()
    (sequencer,) = sequencers(server)
    inodes = set()
    for fd in Path(f"/proc/{sequencer}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    assert inodes
    # /proc/net/unix: a socket bound to a path (or an abstract name) lists it last.
    named = [
        line
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]
        if line.split()[6] in inodes and len(line.split()) > 7
    ]
    assert named == [], "the sequencer listens where another process could connect"
    sockets = [p.name for p in server.data_dir.iterdir() if p.is_socket()]
    assert sockets == ["handoff.sock"]
    # Started by anyone but the server, it refuses at once.
    alone = subprocess.run(
        [sys.executable, "-m", SEQUENCER],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert alone.returncode == 2
    assert alone.stderr == "vault.server.sequencer is started by `vault serve` only\n"


def _marked(mark: str) -> list[int]:
    """The pids of processes whose environment holds `mark`."""
    found = []
    for entry in processes():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SEQUENCER_TEST_MARK={mark}".encode() in environ:
            found.append(int(entry.name))
    return found


def test_a_server_that_cannot_start_leaves_no_sequencer_behind(
    start_vault: StartVault, tmp_path: Path
) -> None:
    # `vault serve` starts its sequencer before it imports its own code; a server that then
    # refuses to start (here: the folder has a server already) must not leave it running.
    first = start_vault()
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    second = run_vault(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={"PINVAULT_DATA_DIR": str(first.data_dir), "SEQUENCER_TEST_MARK": mark},
        state_home=tmp_path / "state",
        timeout=60,
    )
    assert second.returncode == 78, second.describe()
    assert "another vault server" in second.error_line()
    wait_for("no sequencer of the refused server", lambda: _marked(mark) == [], timeout=10)
    assert len(sequencers(first)) == 1
    # A sequencer whose server goes away before sending it anything exits quietly.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting = subprocess.Popen(
        [sys.executable, "-m", SEQUENCER, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    ours.close()
    _, errors = waiting.communicate(timeout=60)
    assert (waiting.returncode, errors) == (0, "")


def test_the_in_process_writer_serves_and_starts_no_sequencer(
    start_vault: StartVault,
) -> None:
    server = start_vault(env={"PINVAULT_LEDGER_SEQUENCER": "thread"})
    assert sequencers(server) == []
    appenders = Appenders(server, callers=4)
    try:
        wait_for("appends", lambda: appenders.count() > 300)
    finally:
        appenders.stop()
    assert appenders.refused == []
    found = server.run("lookup", subject("0/1")).ok().stdout
    assert str(appenders.acknowledged["0/1"][0]) in found
    assert "ledger OK" in server.run("verify").ok().stdout
    assert server.stop() == 0
    assert_kept(appenders.acknowledged, stored(server.data_dir))


def test_an_unknown_sequencer_is_one_line_from_serve(start_vault: StartVault) -> None:
    with pytest.raises(RuntimeError, match="exited with 2 before listening") as failed:
        start_vault(env={"PINVAULT_LEDGER_SEQUENCER": "fork"})
    assert str(failed.value).endswith(
        "\nvault: INVALID_ARGUMENT: unknown ledger.sequencer 'fork': expected process or thread\n"
    )


def _checkpointed_entries(database: Path, scratch: Path) -> int:
    """Entries in a copy of the database file alone, without its write-ahead log: those the
    log has been copied back for. A copy taken while a checkpoint writes may be torn: 0."""
    copy = scratch / "alone.db"
    copy.write_bytes(database.read_bytes())
    try:
        with sqlite3.connect(f"file:{copy}?immutable=1", uri=True) as conn:
            (count,) = conn.execute("SELECT count(*) FROM entries").fetchone()
            return int(count)
    except sqlite3.DatabaseError:
        return 0
    finally:
        copy.unlink()


@pytest.mark.parametrize("sequencer", ["process", "thread"])
def test_the_write_ahead_log_is_copied_back_while_appends_go_on(
    start_vault: StartVault, tmp_path: Path, sequencer: str
) -> None:
    # Far below the size at which the writer copies the log back itself (db.WAL_BACKSTOP_PAGES):
    # only the checkpoints beside it can put these entries in the database file.
    server = start_vault(env={"PINVAULT_LEDGER_SEQUENCER": sequencer})
    with grpc.insecure_channel(server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        for batch in range(10):
            tags = [f"{batch}/{n}" for n in range(1000)]
            answer = ledger.PinBatch(pb.PinBatchRequest(pins=[pin(t) for t in tags]), timeout=60)
        # Each batch's commit ends with the `index` entry of the subject map.
        size = answer.entries[-1].index + 2
        assert size == 10_010
        database = server.data_dir / "vault.db"
        wait_for(
            "the log copied back",
            lambda: _checkpointed_entries(database, tmp_path) == size,
            timeout=20,
        )
        # And again for what comes after: the log is reused, not only grown.
        ledger.PinBatch(pb.PinBatchRequest(pins=[pin(f"more/{n}") for n in range(1000)]))
        wait_for(
            "the log copied back again",
            lambda: _checkpointed_entries(database, tmp_path) == size + 1001,
            timeout=20,
        )
    assert server.stop() == 0
    wal = server.data_dir / "vault.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_commit_lingers_for_more_appends_only_while_it_is_small() -> None:
    stop = object()
    # A small commit waits out its window for the appends that come meanwhile.
    source: queue.SimpleQueue[object] = queue.SimpleQueue()
    later = threading.Timer(0.1, source.put, args=(["second"],))
    later.start()
    batch, stopped = gather(source, ["first"], len, stop, 5.0)
    assert batch == [["first"], ["second"]] and not stopped
    # One already large enough takes what is queued and does not wait: a window of a minute
    # would otherwise hold the writer that long.
    big = ["pin"] * LINGER_BELOW
    source.put(["queued"])
    started = time.monotonic()
    batch, stopped = gather(source, big, len, stop, 60.0)
    assert batch == [big, ["queued"]] and not stopped
    assert time.monotonic() - started < 30.0
    # The writer's stop ends the gathering.
    source.put(stop)
    assert gather(source, ["last"], len, stop, 60.0) == ([["last"]], True)
