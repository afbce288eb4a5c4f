"""Writes are all or nothing: a put is stored only once its client sends the commit that ends it,
so a put or a batch cut short (cancelled, past its deadline, its client killed) stores nothing;
and a put of bytes whose stored copy is damaged rewrites that copy and journals the repair."""

from __future__ import annotations

import hashlib
import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import REPO_ROOT, VAULT_COMMAND, VaultServer, command_env
from tiers.placements import JOURNAL_FILE_NAME, Journal
from vault.client import VaultClient
from vault.digest import Digest
from vault.errors import Unavailable
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

MiB = CHUNK_SIZE
WAIT = 30.0


def random_bytes(size: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(size)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def in_progress(server: VaultServer) -> list[Path]:
    """What the hot tier holds of puts not yet stored: temp files and batch folders."""
    return sorted((server.data_dir / "hot" / "tmp").rglob("*"))


def receiving(server: VaultServer, at_least: int) -> bool:
    """Whether a put's temp file on the server holds `at_least` bytes."""
    return any(p.suffix == ".blob" and p.stat().st_size >= at_least for p in in_progress(server))


def missing(server: VaultServer, *digests: str) -> list[str]:
    with server.client() as client:
        return client.find_missing(list(digests))


@pytest.fixture
def server(start_vault: StartVault) -> VaultServer:
    return start_vault()


@pytest.fixture
def store(server: VaultServer) -> Iterator[Any]:
    with grpc.insecure_channel(server.address) as channel:
        yield rpc.StoreStub(channel)


# -- a put cut short stores nothing ----------------------------------------------------------

DATA = random_bytes(10 * MiB, "ten MiB")
SENT = 4 * MiB


def test_a_put_cancelled_after_4_of_10_mib_stores_nothing(server: VaultServer, store: Any) -> None:
    more = threading.Event()

    def requests() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader())
        for at in range(0, SENT, MiB):
            yield pb.PutRequest(data=DATA[at : at + MiB])
        more.wait()

    call = store.Put.future(requests())
    try:
        wait_for("the server to take in 4 MiB", lambda: receiving(server, SENT))
        call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
    finally:
        more.set()
    wait_for("the server to drop the put", lambda: not in_progress(server))
    assert missing(server, sha256(DATA[:SENT]), sha256(DATA)) == [
        sha256(DATA[:SENT]),
        sha256(DATA),
    ]
    assert server.stored_files() == []


class StallingSource(io.BytesIO):
    """A source that gives its first `stall_at` bytes, then nothing until released, when it
    fails: a put of it can only end by its deadline."""

    def __init__(self, data: bytes, stall_at: int) -> None:
        super().__init__(data)
        self.stall_at = stall_at
        self.released = threading.Event()

    def read(self, size: int | None = -1) -> bytes:
        if self.tell() >= self.stall_at:
            self.released.wait()
            raise OSError("the source gave up")
        limit = self.stall_at - self.tell()
        return super().read(limit if size is None or size < 0 else min(size, limit))


def test_a_put_past_its_deadline_stores_nothing(server: VaultServer) -> None:
    source = StallingSource(DATA, SENT)
    try:
        with (
            VaultClient(server.address, timeout=3.0) as client,
            pytest.raises(Unavailable, match="Deadline Exceeded"),
        ):
            client.put(source)
    finally:
        source.released.set()
    wait_for("the server to drop the put", lambda: not in_progress(server))
    assert missing(server, sha256(DATA[:SENT])) == [sha256(DATA[:SENT])]
    assert server.stored_files() == []


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_vault_put_stopped_mid_stream_stores_nothing(
    server: VaultServer, stop: signal.Signals
) -> None:
    put = subprocess.Popen(
        [*VAULT_COMMAND, "put", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=command_env(
            state_home=server.state_home, extra={"PINVAULT_CLIENT_SERVER": server.address}
        ),
        cwd=REPO_ROOT,
    )
    assert put.stdin is not None
    put.stdin.write(DATA[:SENT])
    put.stdin.flush()
    wait_for("the server to take in 4 MiB", lambda: receiving(server, SENT))
    put.send_signal(stop)
    out, err = put.communicate(timeout=WAIT)
    if stop == signal.SIGTERM:
        assert put.returncode == 143 and err.decode() == "vault: terminated\n", err
    else:
        assert put.returncode == -signal.SIGKILL
    assert out == b""
    wait_for("the server to drop the put", lambda: not in_progress(server))
    assert missing(server, sha256(DATA[:SENT])) == [sha256(DATA[:SENT])]
    assert server.stored_files() == []


# A client of its own: put_many of three 3 MiB blobs, then of a FIFO that nobody writes, so
# that the batch stops after the messages carrying the first two.
BATCH_CLIENT = """
import sys
from vault.client import VaultClient
with VaultClient(sys.argv[1]) as client:
    client.put_many(sys.argv[2:])
"""


def test_a_batch_whose_client_is_killed_stores_none_of_its_blobs(
    server: VaultServer, tmp_path: Path
) -> None:
    blobs = [random_bytes(3 * MiB, ("batch", n)) for n in range(3)]
    paths = []
    for n, data in enumerate(blobs):
        paths.append(tmp_path / f"blob-{n}")
        paths[-1].write_bytes(data)
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    client = subprocess.Popen(
        [sys.executable, "-c", BATCH_CLIENT, server.address, *map(str, paths), str(fifo)],
        env=command_env(),
        cwd=REPO_ROOT,
    )
    try:
        staged = {hashlib.sha256(data).hexdigest() for data in blobs[:2]}
        wait_for(
            "the server to stage the first two blobs",
            lambda: staged <= {p.name for p in in_progress(server)},
        )
    finally:
        client.kill()
        client.wait()
    wait_for("the server to drop the batch", lambda: not in_progress(server))
    digests = [sha256(data) for data in blobs]
    assert missing(server, *digests) == digests
    assert server.stored_files() == []


# -- a client that never commits ------------------------------------------------------------


def test_a_put_without_its_commit_is_refused_and_stores_nothing(
    server: VaultServer, store: Any
) -> None:
    """What a client older than the commit message sees: a clear refusal, nothing stored."""
    data = b"sent by a client that never commits"
    with pytest.raises(grpc.RpcError) as old_put:
        store.Put(iter([pb.PutRequest(header=pb.PutHeader()), pb.PutRequest(data=data)]))
    assert old_put.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "without its commit message" in (old_put.value.details() or "")

    with pytest.raises(grpc.RpcError) as old_batch:
        store.PutBatch(iter([pb.PutBatchRequest(blobs=[pb.PutBatchBlob(data=data)])]))
    assert old_batch.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "without its commit message" in (old_batch.value.details() or "")

    assert missing(server, sha256(data)) == [sha256(data)]
    assert server.stored_files() == []


def put_request(data: bytes, commit: pb.PutCommit) -> Iterator[pb.PutRequest]:
    return iter(
        [
            pb.PutRequest(header=pb.PutHeader()),
            pb.PutRequest(data=data),
            pb.PutRequest(commit=commit),
        ]
    )


def test_a_commit_that_disagrees_with_what_came_stores_nothing(
    server: VaultServer, store: Any
) -> None:
    data = b"the bytes that came"
    other = sha256(b"other bytes")
    cases: list[tuple[Any, grpc.StatusCode, str]] = [
        (
            lambda: store.Put(put_request(data, pb.PutCommit(size=len(data) + 1, digest=other))),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"commit says {len(data) + 1} bytes, but {len(data)} came",
        ),
        (
            lambda: store.Put(put_request(data, pb.PutCommit(size=len(data), digest=other))),
            grpc.StatusCode.DATA_LOSS,
            other,
        ),
        (
            lambda: store.Put(put_request(data, pb.PutCommit(size=len(data)))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "names no digest",
        ),
        (
            lambda: store.PutBatch(
                iter(
                    [
                        pb.PutBatchRequest(
                            blobs=[pb.PutBatchBlob(data=data)],
                            commit=pb.PutBatchCommit(blobs=2, bytes=len(data)),
                        )
                    ]
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"commit says 2 blobs of {len(data)} bytes, but 1 blobs of {len(data)} bytes came",
        ),
    ]
    for call, code, named in cases:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == code, refused.value.details()
        assert named in (refused.value.details() or "")
    assert missing(server, sha256(data)) == [sha256(data)]
    assert server.stored_files() == []

    # The same bytes with a commit that says what they are are stored.
    stored = store.Put(put_request(data, pb.PutCommit(size=len(data), digest=sha256(data))))
    assert stored.blob.sha256 == sha256(data) and stored.created


# -- a put heals a damaged stored copy ------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x20]))


@pytest.mark.parametrize("tiers", ["hot only", "hot and warm"])
def test_a_put_of_the_same_bytes_rewrites_a_damaged_stored_copy(
    start_vault: StartVault, tmp_path: Path, tiers: str
) -> None:
    env = {} if tiers == "hot only" else {"PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm")}
    server = start_vault(env=env)
    large = random_bytes(3 * MiB + 5, "large")
    source = tmp_path / "large.bin"
    source.write_bytes(large)
    small = random_bytes(1000, "small")
    digest = server.run("put", "--json", str(source)).ok().json()["sha256"]
    with server.client() as client:
        client.put_many([small])
    flip_byte(server.blob_path(digest), MiB + 7)
    flip_byte(server.blob_path(sha256(small)), 10)
    assert "DATA_LOSS" in server.run("get", digest, "-o", str(tmp_path / "before")).error_line()
    assert "DATA_LOSS" in server.run("get", sha256(small)).error_line()

    again = server.run("put", "--json", str(source)).ok().json()
    assert again["sha256"] == digest and again["created"] is False
    with server.client() as client:
        (batch,) = client.put_many([small])
    assert batch.created is False

    server.run("get", digest, "-o", str(tmp_path / "after")).ok()
    assert (tmp_path / "after").read_bytes() == large
    assert server.run("get", sha256(small)).ok().output == small
    journal = Journal(server.data_dir / JOURNAL_FILE_NAME)
    try:
        repairs = {
            str(record.digest): record
            for record in journal.records()
            if record.action.startswith("rewrote the damaged copy from the bytes of a put")
        }
    finally:
        journal.close()
    assert repairs.keys() == {digest, sha256(small)}
    assert repairs[digest].tier == "hot" and repairs[digest].offset == MiB
    assert "is damaged" in repairs[digest].found
    assert repairs[sha256(small)].offset == 0
    assert Digest.parse(digest) == repairs[digest].digest
