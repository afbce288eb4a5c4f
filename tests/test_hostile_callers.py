"""What an anonymous, careless or slow caller can cost a real `vault serve`: refused calls are
refused before their request is read, so large anonymous requests do not raise the server's
memory; a flood of unknown tokens is refused at once past a few, and nothing remembers them;
stalled streams hold no thread others need, each caller may hold only so many, and look-ups
and small transfers keep answering quickly beside a hundred of them."""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer
from tests.test_access import CREDENTIALS, Vault
from vault.client import Credentials, VaultClient
from vault.client.reader import read_all
from vault.config import Config
from vault.errors import QuotaExceeded, Unauthenticated
from vault.ledger.db import Database
from vault.server.database import open_ledger_database
from vault.server.gatekeeper import Limits
from vault.server.service import max_connections
from vault.server.tokens import TokenStore
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

MiB = 1 << 20
STAT = "/pinvault.v1.Store/Stat"


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A line of /proc/PID/status, in KiB: VmRSS now, VmHWM the most it ever was."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


def reset_peak(pid: int) -> int:
    """Set the process's VmHWM back to its VmRSS (Linux's clear_refs `5`), so that a peak read
    afterwards is the peak of what came after, not of anything the server did earlier; returns
    that VmRSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return rss_kib(pid)


def server_pid(server: VaultServer) -> int:
    assert server.process is not None
    return server.process.pid


def flood(address: str, body: bytes, token: str, calls: int) -> list[grpc.StatusCode]:
    """`calls` unary Stat calls at once, each `body` long, each on a channel of its own."""

    def one(_: int) -> grpc.StatusCode:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
            try:
                ch.unary_unary(STAT)(body, metadata=metadata, timeout=120)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(calls) as pool:
        return list(pool.map(one, range(calls)))


@pytest.fixture
def vault(start_vault: StartVault) -> Vault:
    return Vault(start_vault(env=CREDENTIALS))


def test_large_requests_are_refused_before_they_are_read(vault: Vault) -> None:
    pid = server_pid(vault.server)
    reader = vault.token("bob", "vision", "reader")
    # Known to the server before the floods, as a user of the vault is.
    vault.client(reader).checkpoint()
    before = reset_peak(pid)
    body = pb.StatRequest(digest="sha256:" + "0" * (60 * MiB)).SerializeToString()

    anonymous = flood(vault.server.address, body, "", 32)
    forged = flood(vault.server.address, body, reader[:-4] + "0000", 32)
    grown = (rss_kib(pid, "VmHWM") - before) / 1024
    assert grown < 100, f"64 refused 60 MiB requests raised the server's memory by {grown:.0f} MiB"
    refused = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert set(anonymous) <= refused and set(forged) <= refused, (anonymous, forged)

    # Even a known caller's unary request is bounded: bulk bytes go in streams.
    known = flood(vault.server.address, body, reader, 32)
    assert set(known) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, known
    grown = (rss_kib(pid, "VmHWM") - before) / 1024
    assert grown < 100, f"96 refused 60 MiB requests raised the server's memory by {grown:.0f} MiB"
    # And the server is unharmed.
    digest = str(vault.admin.put(b"still here").blob.sha256)
    assert vault.client(reader).stat(digest).blob.size == 10


def unknown_token(n: int) -> str:
    return f"pv_{n:012x}_{os.urandom(32).hex()}"


def test_a_flood_of_unknown_tokens_is_refused_at_once_past_a_few(vault: Vault) -> None:
    reader = vault.token("bob", "vision", "reader")
    known = vault.client(reader)
    digest = str(vault.admin.put(b"looked at").blob.sha256)
    known.stat(digest)

    codes = []
    began = time.monotonic()
    with grpc.insecure_channel(vault.server.address) as channel:
        stat = rpc.StoreStub(channel).Stat
        for n in range(300):
            try:
                stat(
                    pb.StatRequest(digest=digest),
                    metadata=(("authorization", f"Bearer {unknown_token(n)}"),),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                codes.append(exc.code())
    took = time.monotonic() - began
    unauthenticated = codes.count(grpc.StatusCode.UNAUTHENTICATED)
    exhausted = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    # The default bucket: 30 failures, then 2 a second.
    assert 30 <= unauthenticated <= 30 + 2 * took + 2, (unauthenticated, took)
    assert unauthenticated + exhausted == 300
    # Refused at once, not slowed down: 300 calls in well under a second each.
    assert took < 30
    # A caller whose token the vault knows is still served from the same address.
    assert known.stat(digest).blob.size == 9


def test_unknown_tokens_cost_no_query_and_leave_nothing_behind(tmp_path: Path) -> None:
    db: Database = open_ledger_database(Config(data_dir=str(tmp_path)))
    store = TokenStore(db)
    try:
        secrets = [store.create(name=f"u{n}", team="t", role="reader")[1] for n in range(20)]
        assert store.authenticate(secrets[0]).name == "u0"
        queries: list[object] = []

        class Counting:
            def fetch(self, *args: Any) -> Any:
                queries.append(args)
                return db.fetch(*args)

        store.db = Counting()  # type: ignore[assignment]
        for n in range(2000):
            with pytest.raises(Unauthenticated):
                store.authenticate(unknown_token(n))
        # Only the live tokens are held, and the flood read the database at most once a
        # refresh interval (it took well under a few seconds).
        assert store.live == 20
        assert len(queries) <= 3
        # Past its failures an address is told to back off; a valid token is never counted.
        failed = Unauthenticated("token pv_x is unknown or revoked")
        answers = [type(store.refused("10.0.0.1", failed)) for _ in range(40)]
        assert answers[:30] == [Unauthenticated] * 30 and set(answers[30:]) == {QuotaExceeded}
        assert store.authenticate(secrets[-1]).name == "u19"
    finally:
        store.close()
        db.dispose()


# -- stalled streams ------------------------------------------------------------------------

STALLING_CALLERS = 10
STREAMS_EACH = 10
LIMITED = {**CREDENTIALS, "PINVAULT_SERVER_STREAMS_PER_CALLER": str(STREAMS_EACH)}


class Staller:
    """A caller that opens streams and then neither sends (puts) nor reads (gets)."""

    def __init__(self, address: str, token: str) -> None:
        # Without BDP probing a stream's window stays at 64 KiB, as a careful attacker keeps it.
        self.channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
        self.store = rpc.StoreStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.release = threading.Event()
        self.calls: list[Any] = []

    def silent_put(self) -> Any:
        def requests() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader())
            self.release.wait()

        call = self.store.Put.future(requests(), metadata=self.metadata, timeout=120)
        self.calls.append(call)
        return call

    def unread_get(self, digest: str) -> Any:
        call = self.store.Get(pb.GetRequest(digest=digest), metadata=self.metadata, timeout=120)
        self.calls.append(call)
        return call

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


def p99(seconds: list[float]) -> float:
    return statistics.quantiles(seconds, n=100)[98]


def timed(fn: Callable[[], Any], times: int) -> list[float]:
    taken = []
    for _ in range(times):
        began = time.perf_counter()
        fn()
        taken.append(time.perf_counter() - began)
    return taken


def test_stalled_streams_hold_no_one_else_up(start_vault: StartVault) -> None:
    vault = Vault(start_vault(env=LIMITED))
    big = os.urandom(32 * MiB)
    big_digest = str(vault.admin.put(big).blob.sha256)
    small = os.urandom(1024)
    small_digest = str(vault.admin.put(small).blob.sha256)
    vault.admin.pin("artefact", small_digest)

    stallers = [
        Staller(vault.server.address, vault.token(f"slow{n}", "vision", "writer"))
        for n in range(STALLING_CALLERS)
    ]
    measured = vault.as_("alice", "vision", "writer")
    try:
        for staller in stallers:
            for n in range(STREAMS_EACH):
                if n % 2:
                    staller.silent_put()
                else:
                    staller.unread_get(big_digest)
        # Let every stalled stream reach the server and fill what it can.
        time.sleep(2)

        # One stream more than a caller may hold is refused at once.
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            list(
                stallers[0].store.Get(
                    pb.GetRequest(digest=small_digest), metadata=stallers[0].metadata, timeout=30
                )
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "slow0 has 10 streams open" in (refused.value.details() or "")
        assert time.monotonic() - began < 5

        lookups = timed(lambda: measured.lookup(small_digest), 100)
        puts = timed(lambda: measured.put(os.urandom(1024)), 100)
        gets = timed(lambda: read_all(measured.open(small_digest)), 100)
        for what, taken in (("look-up", lookups), ("1 KiB put", puts), ("1 KiB get", gets)):
            assert p99(taken) < 1.0, (
                f"{what} p99 {p99(taken) * 1000:.0f} ms beside 100 stalled streams"
            )
        # None of the stalled streams was answered or ended meanwhile.
        assert all(not call.done() for s in stallers for call in s.calls)
    finally:
        for staller in stallers:
            staller.close()
    # Their slots come back when they go away.
    time.sleep(1)
    with VaultClient(
        vault.server.address,
        credentials=Credentials(token=vault.token("slow0b", "vision", "writer")),
        timeout=30,
    ) as again:
        assert hashlib.sha256(read_all(again.open(big_digest))).hexdigest() == big_digest[7:]


def test_a_stream_idle_past_its_timeout_is_ended(start_vault: StartVault) -> None:
    vault = Vault(start_vault(env={**CREDENTIALS, "PINVAULT_SERVER_STREAM_IDLE_TIMEOUT": "1.5"}))
    big_digest = str(vault.admin.put(os.urandom(16 * MiB)).blob.sha256)
    staller = Staller(vault.server.address, vault.admin_token)
    try:
        put = staller.silent_put()
        with pytest.raises(grpc.RpcError) as ended:
            put.result(timeout=30)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "sent nothing for 1.5 seconds" in (ended.value.details() or "")

        get = staller.unread_get(big_digest)
        time.sleep(4)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in get:
                pass
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "read nothing for 1.5 seconds" in (ended.value.details() or "")
    finally:
        staller.close()


def test_made_up_methods_are_unimplemented_and_remembered_by_no_interceptor() -> None:
    """A caller naming thousands of methods the vault does not have gets UNIMPLEMENTED each
    time, and neither the gatekeeper nor the metering keeps anything for them."""
    import asyncio

    from vault.server.auth import Gate
    from vault.server.edge import Metering
    from vault.server.gatekeeper import Gatekeeper

    async def unknown(details: grpc.HandlerCallDetails) -> None:
        return None

    class Details:
        def __init__(self, method: str) -> None:
            self.method = method
            self.invocation_metadata = ()

    gatekeeper, metering = Gatekeeper(Gate()), Metering()
    try:

        async def call_all() -> None:
            for n in range(5_000):
                for interceptor in (gatekeeper, metering):
                    found = await interceptor.intercept_service(unknown, Details(f"/x.Y/M{n}"))
                    assert found is None

        asyncio.run(call_all())
    finally:
        gatekeeper.close()
    assert gatekeeper._handlers == {} and metering._handlers == {}


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (reading off what it sent)."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:  # reset
            return True
    return False


def test_connections_that_do_nothing_are_bounded_then_closed(start_vault: StartVault) -> None:
    limited = {
        **CREDENTIALS,
        "PINVAULT_SERVER_MAX_CONNECTIONS": "40",
        "PINVAULT_SERVER_CONNECTION_IDLE_TIMEOUT": "3",
    }
    vault = Vault(start_vault(env=limited))
    pid = server_pid(vault.server)
    host, port = vault.server.address.rsplit(":", 1)
    writer = vault.client(vault.admin_token)
    writer.checkpoint()
    before = descriptors(pid)

    # 300 connections that never send a byte and 300 that send HTTP/2's preface and no call,
    # in turns, so that those let in are of both kinds.
    silent, preface = [], []
    for _ in range(300):
        silent.append(socket.create_connection((host, int(port))))
        sock = socket.create_connection((host, int(port)))
        sock.sendall(PREFACE)
        preface.append(sock)
    try:
        # The caller connected before them is served, and the vault still opens its own files.
        digest = str(writer.put(os.urandom(64 * 1024)).blob.sha256)
        writer.pin("dataset", [digest])
        # At most the 40 connections allowed, and the few files the put and pin opened.
        held = descriptors(pid) - before
        assert held <= 50, f"600 idle connections held {held} of the server's descriptors"

        # Each is closed: at once past the bound, else once its handshake or idleness lasts
        # past the timeout (3 seconds), and then new callers are served again.
        with ThreadPoolExecutor(32) as pool:
            closed = list(pool.map(lambda s: closed_by_server(s, 15), silent + preface))
        assert closed.count(False) == 0, f"{closed.count(False)} idle connections still open"
        reader = vault.client(vault.token("carol", "vision", "reader"))
        assert [e.entry.index for e in reader.lookup(digest)]
    finally:
        for sock in silent + preface:
            sock.close()
    assert descriptors(pid) <= before + 5


def test_the_bound_on_connections_leaves_the_server_its_own_descriptors() -> None:
    # A quarter of the open-file limit, and at least 256, stay the server's own.
    assert max_connections(Limits(max_connections=4096), 65_536) == 4096
    assert max_connections(Limits(max_connections=4096), 1024) == 768
    assert max_connections(Limits(max_connections=4096), 300) == 44
    assert max_connections(Limits(max_connections=10), 1024) == 10
