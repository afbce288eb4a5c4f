"""The vault's HTTP edges (tiles, metrics, explorer on a real `vault serve`, and the real
Kubernetes webhook over HTTPS) against slow and hostile callers: many scrapes and explorer calls
leave the server with the threads and descriptors it had and its appends working; callers that
drip a request head one byte at a time, from the same address as genuine callers, delay nobody;
a head that never completes is closed at its deadline; a full address gives way to a new caller
by closing its oldest waiting connection; callers dripping request bodies hold no worker thread
of an edge that streams them."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tests.services.drips import DRIP_SECONDS, Drips
from tests.services.vault_server import VaultServer
from tests.test_k8s_webhook import Webhook
from vault.http_edge import BodyError, Edge, Limits, Request, Response, Sink
from vault.server.metrics import LIMITS as METRICS_LIMITS

# Concurrent keep-alive clients, and the calls each endpoint gets from them: on this 2-core
# machine, shared, a scrape or an explorer call takes 4 to 9 ms, so 10,000 of each would take up
# to 3 minutes; 2,500 of each (over 30 times what exhausted the database's read connections
# before) keep the test under a minute.
CLIENTS = 8
CALLS = 2500
WARM_UP = 400
SLACK = 6
# An explorer call that reads the database.
EXPLORER_CALL = "/api/entry?index=0"
DRIPS = 100
# Well under the 10 s a drip could hold a slot for before, with room for a busy machine.
PROMPT_SECONDS = 3.0


@pytest.fixture(scope="module")
def vault(
    clean_environment: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VaultServer]:
    server = VaultServer(
        tmp_path_factory.mktemp("edges"),
        serve_args=(
            "--tiles-http",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--explorer-http",
            "0",
        ),
    )
    with server:
        with server.client() as client:
            stored = client.put(b"an artefact, pinned as the ledger's first entry")
            client.pin("artefact", str(stored.blob.sha256))
        yield server


@pytest.fixture(scope="module")
def webhook(vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    with Webhook(tmp_path_factory.mktemp("edges-webhook"), vault.address) as hook:
        yield hook


def url_of(server: VaultServer, what: str) -> str:
    (line,) = [line for line in server.banner if line.strip().startswith(what)]
    return line.rsplit(" at ", 1)[1].strip()


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def held(pid: int) -> tuple[int, int]:
    """The threads and open descriptors of process `pid`, as the kernel counts them."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def call_many(port: int, target: str, calls: int) -> list[int]:
    """`calls` GETs of `target`, from CLIENTS keep-alive connections at once; their statuses."""

    def one_client(count: int) -> list[int]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        statuses = []
        try:
            for _ in range(count):
                conn.request("GET", target)
                response = conn.getresponse()
                response.read()
                statuses.append(response.status)
                if response.will_close:
                    conn.close()
        finally:
            conn.close()
        return statuses

    shares = [calls // CLIENTS + (i < calls % CLIENTS) for i in range(CLIENTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        return [status for part in pool.map(one_client, shares) for status in part]


def test_many_scrapes_and_explorer_calls_leave_threads_descriptors_and_appends_as_they_were(
    vault: VaultServer,
) -> None:
    assert vault.process is not None
    pid = vault.process.pid
    metrics = port_of(url_of(vault, "metrics"))
    explorer = port_of(url_of(vault, "explorer"))
    # Enough calls that every worker thread has opened what it keeps (its read connection).
    assert set(call_many(metrics, "/metrics", WARM_UP)) == {200}
    assert set(call_many(explorer, EXPLORER_CALL, WARM_UP)) == {200}
    threads, descriptors = held(pid)

    started = time.monotonic()
    assert set(call_many(metrics, "/metrics", CALLS)) == {200}
    assert set(call_many(explorer, EXPLORER_CALL, CALLS)) == {200}
    elapsed = time.monotonic() - started
    time.sleep(0.5)  # the clients' connections are closed on the server's side too

    # A few descriptors come and go with the database's own files and the gRPC server; a
    # thread or a connection kept per call would add thousands.
    after = held(pid)
    assert after[0] <= threads and after[1] <= descriptors + SLACK, (
        f"before {CALLS} scrapes and explorer calls: {threads} threads, {descriptors} "
        f"descriptors; after ({elapsed:.1f} s): {after}"
    )
    # The database's connections are not held by threads gone: appends still find them.
    blobs = [os.urandom(3 * 1024 * 1024) for _ in range(24)]
    with vault.client() as client, ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda blob: client.put(blob, handoff=False), blobs))
    assert len({str(result.blob.sha256) for result in results}) == 24


def timed(ask: Callable[[], int]) -> tuple[int, float]:
    started = time.monotonic()
    status = ask()
    return status, time.monotonic() - started


def get(port: int, target: str, tls: ssl.SSLContext | None = None) -> int:
    conn: http.client.HTTPConnection
    if tls is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls)
    try:
        conn.request("GET", target)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_dripping_callers_delay_no_genuine_request_from_the_same_address(
    vault: VaultServer, webhook: Webhook
) -> None:
    tiles = port_of(url_of(vault, "tiles"))
    metrics = port_of(url_of(vault, "metrics"))
    explorer = port_of(url_of(vault, "explorer"))
    hook = port_of(webhook.url)
    tls = ssl.create_default_context(cafile=str(webhook.cert))
    asks: dict[str, Callable[[], int]] = {
        "tiles": lambda: get(tiles, "/checkpoint"),
        "metrics": lambda: get(metrics, "/metrics"),
        "explorer": lambda: get(explorer, "/api/vault"),
        "webhook health": lambda: get(hook, "/healthz", tls),
        "webhook review": lambda: webhook.post(review_of_a_tagged_image())[0],
    }
    addresses = [(tiles, None), (metrics, None), (explorer, None), (hook, tls)]
    with Drips(addresses, DRIPS) as drips:
        time.sleep(DRIP_SECONDS)  # every drip has sent a few bytes
        for name, ask in asks.items():
            for _ in range(10):
                status, seconds = timed(ask)
                assert status == 200, name
                assert seconds < PROMPT_SECONDS, f"{name}: {seconds:.2f} s"
        # The drips were let in and pushed out again, not refused at the door.
        assert drips.opened >= DRIPS * len(addresses)
    assert "Traceback" not in webhook.log(), webhook.log()


def review_of_a_tagged_image() -> bytes:
    """An AdmissionReview the webhook refuses without asking the vault."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "drip-test", "namespace": "research"},
        "spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]},
    }
    kind = {"group": "", "version": "v1", "kind": "Pod"}
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": str(uuid.uuid4()), "kind": kind, "operation": "CREATE", "object": pod},
    }
    return json.dumps(review).encode()


def test_a_head_that_never_completes_is_closed_at_its_deadline(vault: VaultServer) -> None:
    # The head's deadline is 10 s from the connection's opening, whatever arrives meanwhile.
    head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: " + b"a" * 100
    assert closed_after(port_of(url_of(vault, "metrics")), head, pause=0.5) < 15


def test_a_new_caller_at_its_address_s_cap_closes_the_oldest_waiting_connection(
    vault: VaultServer,
) -> None:
    metrics = port_of(url_of(vault, "metrics"))
    waiting = [
        socket.create_connection(("127.0.0.1", metrics)) for _ in range(METRICS_LIMITS.per_address)
    ]
    try:
        time.sleep(0.2)  # all accepted
        for connection in waiting:
            connection.sendall(b"GET /met")
        assert get(metrics, "/metrics") == 200
        waiting[0].settimeout(5)
        assert waiting[0].recv(1) == b"", "the oldest waiting connection is closed"
        # The rest still wait for the end of their heads, and are answered once it comes.
        last = waiting[-1]
        last.sendall(b"rics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        last.settimeout(5)
        assert last.recv(12) == b"HTTP/1.1 200"
    finally:
        for connection in waiting:
            connection.close()


def test_the_edges_refuse_what_they_do_not_serve_in_one_line(vault: VaultServer) -> None:
    metrics = port_of(url_of(vault, "metrics"))
    conn = http.client.HTTPConnection("127.0.0.1", metrics, timeout=10)
    try:
        conn.request("POST", "/metrics", b"x")
        response = conn.getresponse()
        assert (response.status, response.getheader("Allow")) == (405, "GET, HEAD")
        assert response.read() == b"method not allowed\n"
    finally:
        conn.close()
    with socket.create_connection(("127.0.0.1", metrics)) as raw:
        raw.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # no Host
        raw.settimeout(5)
        answer = raw.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert b"Traceback" not in answer


def test_a_tls_handshake_dripped_to_the_webhook_is_closed_at_the_head_deadline(
    webhook: Webhook,
) -> None:
    """The handshake is part of the request head: a ClientHello sent a byte a second, which no
    per-read timeout ends, is closed 10 s after the connection opened."""
    client = ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = client.wrap_bio(ssl.MemoryBIO(), outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    assert closed_after(port_of(webhook.url), outgoing.read(), pause=1.0) < 15


def closed_after(port: int, data: bytes, *, pause: float) -> float:
    """Seconds from opening a connection to `port` to the server's closing it, while `data`
    is sent a byte every `pause` seconds (20 s at most)."""
    with socket.create_connection(("127.0.0.1", port)) as drip:
        drip.settimeout(pause)
        started = time.monotonic()
        for byte in data:
            assert time.monotonic() - started < 20, "the connection was still open after 20 s"
            try:
                drip.sendall(bytes([byte]))
                if drip.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        else:
            raise AssertionError("all was sent and the connection is still open")
        seconds = time.monotonic() - started
    assert seconds > 9, f"closed after {seconds:.1f} s, before the head deadline"
    return seconds


class Kept:
    """A sink that keeps what it is told, for a test to read."""

    def __init__(self, told: list[str]) -> None:
        self.told = told

    def write(self, piece: bytes) -> Response | None:
        self.told.append(f"write {len(piece)}")
        return None

    def finish(self) -> Response:
        self.told.append("finish")
        return Response.text(201, "taken")

    def abort(self, error: BodyError) -> Response:
        self.told.append(f"abort {error.status}")
        return Response.text(error.status, str(error))


def test_slow_uploaders_hold_no_worker_thread_of_an_edge_that_streams_bodies() -> None:
    """More callers dripping bodies than the edge has worker threads: each worker still runs a
    fast request while they drip (the two fast requests below each wait for the other, so they
    pass only if both workers are free at once), and a body whose caller goes is aborted."""
    workers, slow = 2, 6
    together = threading.Barrier(workers, timeout=5)
    told: list[list[str]] = []

    def handler(request: Request) -> Response | Sink:
        if request.method == "GET":
            together.wait()
            return Response.text(200, "together")
        told.append([])
        return Kept(told[-1])

    limits = Limits(
        body_seconds=10.0,
        min_body_rate=100,
        max_body_bytes=1 << 20,
        workers=workers,
        queue=slow + workers,
        methods=frozenset({"GET", "PUT"}),
    )
    head = b"PUT /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n"
    with Edge("slow-test", handler, limits=limits) as edge:
        drips = [socket.create_connection(("127.0.0.1", edge.port)) for _ in range(slow)]
        try:
            for drip in drips:
                drip.sendall(head)
            time.sleep(0.5)  # every head has been answered with a sink
            with ThreadPoolExecutor(workers) as pool:
                for _ in range(3):
                    for drip in drips:  # 200 bytes a second each: well above the rate
                        drip.sendall(b"d" * 20)
                    asked = [
                        pool.submit(timed, lambda: get(edge.port, "/")) for _ in range(workers)
                    ]
                    for status, seconds in (ask.result() for ask in asked):
                        assert status == 200 and seconds < PROMPT_SECONDS
                    time.sleep(0.1)
            # Every slow body is still coming: none was handed on, none has ended.
            assert told == [[]] * slow
        finally:
            for drip in drips:
                drip.close()
        deadline = time.monotonic() + 5
        while told != [["abort 400"]] * slow and time.monotonic() < deadline:
            time.sleep(0.05)
        assert told == [["abort 400"]] * slow
