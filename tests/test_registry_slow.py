"""The registry of a real `vault serve` against callers that drip their uploads: more slow
uploaders than the registry has worker threads delay no pull, push or token-less ping of an
honest client, and a body cut off part-way leaves nothing of itself in an upload or the store."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_registry import (
    CREDENTIALS,
    OCI_MANIFEST,
    Registry,
    Vault,
    _image,
    _vault,
    sha256,
)
from vault.server.registry import UPLOADS

# The registry's worker threads (RegistryServer's Limits.workers), and more slow uploaders than
# that, each on its own connection.
WORKERS = 8
SLOW = WORKERS + 4
# Bytes a second an upload must average, and what each slow uploader sends: a little more.
MIN_RATE = 1000
DRIP_BYTES = 250
DRIP_SECONDS = 0.2
# Far under what a held worker would cost: the slow uploads last far longer than the test.
PROMPT_SECONDS = 3.0
# More than one piece the edge hands on at a time (1 MiB), so some of a cut body was written.
PAST_ONE_PIECE = 1024 * 1024 + 300_000


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vault]:
    env = {
        **CREDENTIALS,
        "PINVAULT_REGISTRY_MIN_UPLOAD_RATE": str(MIN_RATE),
        "PINVAULT_REGISTRY_UPLOADS_PER_CALLER": "64",
    }
    with _vault(tmp_path_factory.mktemp("registry-slow"), env) as vault:
        yield vault


class SlowUpload(threading.Thread):
    """One connection that sends `data` to the registry as `method` `target`, DRIP_BYTES every
    DRIP_SECONDS, until it has all gone or the test is done with it."""

    def __init__(self, registry: Registry, method: str, target: str, data: bytes) -> None:
        super().__init__(daemon=True)
        self.registry = registry
        self.head = (
            f"{method} {target} HTTP/1.1\r\nHost: {registry.address}\r\n"
            f"Authorization: {registry.authorization}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        self.data = data
        self.sent = 0
        self.answer = b""
        self.done = threading.Event()
        self.connected = threading.Event()

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.registry.port), timeout=60) as conn:
            conn.sendall(self.head)
            self.connected.set()
            try:
                while self.sent < len(self.data) and not self.done.wait(DRIP_SECONDS):
                    conn.sendall(self.data[self.sent : self.sent + DRIP_BYTES])
                    self.sent += DRIP_BYTES
                if self.sent >= len(self.data):
                    while chunk := conn.recv(65536):
                        self.answer += chunk
            except OSError:
                pass


@contextlib.contextmanager
def slow_uploads(uploads: list[SlowUpload]) -> Iterator[list[SlowUpload]]:
    for upload in uploads:
        upload.start()
    for upload in uploads:
        assert upload.connected.wait(10)
    try:
        yield uploads
    finally:
        for upload in uploads:
            upload.done.set()
        for upload in uploads:
            upload.join(30)


def timed(registry: Registry, method: str, path: str, body: bytes | None = None) -> int:
    """The status of one request, which must come within PROMPT_SECONDS."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(registry.host, registry.port, timeout=PROMPT_SECONDS * 3)
    try:
        conn.request(method, path, body=body, headers={"Authorization": registry.authorization})
        response = conn.getresponse()
        response.read()
    finally:
        conn.close()
    seconds = time.monotonic() - started
    assert seconds < PROMPT_SECONDS, f"{method} {path}: {seconds:.2f} s"
    return response.status


def test_more_slow_uploaders_than_workers_delay_no_honest_request(vault: Vault) -> None:
    registry = vault.registry
    layer = b"a layer pulled while others drip theirs " * 2000
    manifest = registry.push_manifest(
        "lab/honest", "v1", _image(registry, "lab/honest", layer, b"{}"), OCI_MANIFEST
    )
    dripped = [b"%d dripped at about the minimum rate " % n * 2000 for n in range(SLOW)]
    opened = [registry.request("POST", "/v2/lab/slow/blobs/uploads/") for _ in range(SLOW // 2)]
    uploads = [
        # Half push whole blobs, half a chunk of an upload session.
        SlowUpload(registry, "POST", f"/v2/lab/slow/blobs/uploads/?digest={sha256(data)}", data)
        if n % 2
        else SlowUpload(registry, "PATCH", opened[n // 2].headers["location"], data)
        for n, data in enumerate(dripped)
    ]
    # One that sends its blob whole, at the rate, in a few seconds.
    short = b"a short blob, dripped whole " * 100
    finishing = SlowUpload(
        registry, "POST", f"/v2/lab/slow/blobs/uploads/?digest={sha256(short)}", short
    )
    with slow_uploads([*uploads, finishing]):
        time.sleep(1.0)  # every slow uploader has its body under way
        for round_ in range(3):
            assert timed(registry, "GET", "/v2/") == 200
            assert timed(registry, "GET", "/v2/lab/honest/manifests/v1") == 200
            assert timed(registry, "GET", f"/v2/lab/honest/blobs/{manifest}") == 200
            assert timed(registry, "GET", f"/v2/lab/honest/blobs/{sha256(layer)}") == 200
            small = b"a small blob pushed past the drips, round %d" % round_
            pushed = f"/v2/lab/honest/blobs/uploads/?digest={sha256(small)}"
            assert timed(registry, "POST", pushed, small) == 201
        # The slow uploaders kept the rate, so they are still sending, and the short one is in.
        assert all(u.is_alive() and u.sent < len(u.data) for u in uploads)
        finishing.join(10)
    assert finishing.answer.startswith(b"HTTP/1.1 201 "), finishing.answer
    assert registry.request("HEAD", f"/v2/lab/slow/blobs/{sha256(short)}").status == 200
    # The ones cut short by the test left nothing behind.
    for data in dripped:
        assert registry.request("HEAD", f"/v2/lab/slow/blobs/{sha256(data)}").status == 404
    for answer in opened:
        registry.request("DELETE", answer.headers["location"])


def _send_and_hang_up(registry: Registry, method: str, target: str, data: bytes) -> None:
    """Announce twice `data`'s length, send `data`, and close the connection."""
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: {registry.address}\r\n"
        f"Authorization: {registry.authorization}\r\nContent-Length: {2 * len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", registry.port), timeout=10) as conn:
        conn.sendall(head + data)
        time.sleep(0.5)  # the server has read it all (and handed on what it could)


def _upload_range(registry: Registry, location: str) -> str:
    answer = registry.request("GET", location)
    assert answer.status == 204, answer
    return answer.headers["range"]


def _leftovers(vault: Vault) -> list[Path]:
    return sorted((vault.server.data_dir / UPLOADS).iterdir())


def test_a_body_cut_off_part_way_leaves_no_half_chunk_or_blob(vault: Vault) -> None:
    registry = vault.registry
    data = bytes(range(256)) * (PAST_ONE_PIECE // 256)
    # A chunk of an upload session, cut off past its first piece: the session keeps none of it.
    opened = registry.request("POST", "/v2/lab/cut/blobs/uploads/")
    location = opened.headers["location"]
    _send_and_hang_up(registry, "PATCH", location, data)
    deadline = time.monotonic() + 5
    while _upload_range(registry, location) != "0-0" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _upload_range(registry, location) == "0-0"
    # A whole blob cut off: not in the store, and its bytes not kept.
    digest = sha256(data + data)
    _send_and_hang_up(registry, "POST", f"/v2/lab/cut/blobs/uploads/?digest={digest}", data)
    assert registry.request("HEAD", f"/v2/lab/cut/blobs/{digest}").status == 404
    deadline = time.monotonic() + 5
    while len(_leftovers(vault)) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p.name for p in _leftovers(vault)] == [location.rsplit("/", 1)[1]]
    # The session takes the same chunk again, whole, and closes into the blob; every worker was
    # given back.
    answer = registry.request("PATCH", location, data, {"Content-Range": f"0-{len(data) - 1}"})
    assert answer.status == 202 and answer.headers["range"] == f"0-{len(data) - 1}", answer
    closed = registry.request("PUT", f"{location}?digest={sha256(data)}")
    assert closed.status == 201, closed
    pulled = registry.request("GET", f"/v2/lab/cut/blobs/{sha256(data)}")
    assert pulled.status == 200 and pulled.body == data
    for _ in range(WORKERS * 2):
        assert timed(registry, "GET", "/v2/") == 200
