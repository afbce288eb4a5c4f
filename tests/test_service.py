"""The gRPC services as any client sees them over a socket: the status code of every kind of
failure, batch calls answered in one round trip, all-or-none appends, and no unverified byte
ever sent."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.services.vault_server import VaultServer
from vault.client import read_all
from vault.errors import IntegrityError, NotFound
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

STORED = b"stored by test_service " * 1000
STORED_SHA256 = "sha256:" + hashlib.sha256(STORED).hexdigest()
ABSENT = "sha256:" + hashlib.sha256(b"never stored").hexdigest()


@pytest.fixture(scope="module")
def server(vault_server: VaultServer) -> VaultServer:
    with vault_server.client() as client:
        client.put(STORED)
    return vault_server


@pytest.fixture
def channel(server: VaultServer) -> Any:
    with grpc.insecure_channel(server.address) as channel:
        yield channel


def ledger_size(server: VaultServer) -> int:
    with server.client() as client:
        return client.checkpoint().size


def pin(kind: str = "image", subjects: tuple[str, ...] = (STORED_SHA256,), **fields: Any) -> Any:
    fields.setdefault("author", "tester@lab")
    return pb.PinRequest(kind=kind, subjects=subjects, **fields)


# Each call, the status it must end with, and what its message must name.
FAILURES: dict[str, tuple[Callable[[Any, Any], Any], grpc.StatusCode, str]] = {
    "scrub a vault of one tier": (
        lambda s, _: list(s.Scrub(pb.ScrubRequest())),
        grpc.StatusCode.FAILED_PRECONDITION,
        "`vault verify --blobs` re-hashes every pinned blob",
    ),
    "put a handed-off file with a ticket never given": (
        lambda s, _: s.Put(iter([pb.PutRequest(header=pb.PutHeader(handoff="f" * 32))])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown or expired handoff ticket",
    ),
    "get an unknown blob": (
        lambda s, _: list(s.Get(pb.GetRequest(digest=ABSENT))),
        grpc.StatusCode.NOT_FOUND,
        ABSENT,
    ),
    "get a malformed digest": (
        lambda s, _: list(s.Get(pb.GetRequest(digest="sha256:XYZ"))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "'sha256:XYZ'",
    ),
    "get beyond the end": (
        lambda s, _: list(s.Get(pb.GetRequest(digest=STORED_SHA256, offset=len(STORED) + 1))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "beyond the end",
    ),
    "stat an unknown blob": (
        lambda s, _: s.Stat(pb.StatRequest(digest=ABSENT)),
        grpc.StatusCode.NOT_FOUND,
        ABSENT,
    ),
    "find missing among malformed digests": (
        lambda s, _: s.FindMissing(pb.FindMissingRequest(digests=[STORED_SHA256, "md5:00"])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "'md5'",
    ),
    "put bytes that do not match the expected digest": (
        lambda s, _: s.Put(
            iter(
                [
                    pb.PutRequest(header=pb.PutHeader(expected_digest=STORED_SHA256)),
                    pb.PutRequest(data=b"other bytes"),
                    pb.PutRequest(commit=pb.PutCommit(size=11, digest=STORED_SHA256)),
                ]
            )
        ),
        grpc.StatusCode.DATA_LOSS,
        STORED_SHA256,
    ),
    "pin a blob not in the store": (
        lambda _, ledger: ledger.Pin(pin(subjects=(ABSENT,))),
        grpc.StatusCode.FAILED_PRECONDITION,
        "put it first",
    ),
    "pin an unknown kind": (
        lambda _, ledger: ledger.Pin(pin(kind="model")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown kind 'model'",
    ),
    "pin with no author": (
        lambda _, ledger: ledger.Pin(pin(author="")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "author",
    ),
    "pin nothing": (
        lambda _, ledger: ledger.Pin(pin(subjects=())),
        grpc.StatusCode.INVALID_ARGUMENT,
        "at least one subject",
    ),
    "pin too much metadata": (
        lambda _, ledger: ledger.Pin(pin(meta={f"k{n}": "v" * 300 for n in range(60)})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "(at most 16384)",
    ),
    "a batch with one bad pin": (
        lambda _, ledger: ledger.PinBatch(
            pb.PinBatchRequest(pins=[pin(), pin(), pin(subjects=("sha256:1234",))])
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "pin 2: wrong length",
    ),
    "a proof for an index not in the ledger": (
        lambda _, ledger: ledger.GetInclusionProof(pb.InclusionProofRequest(index=10**9)),
        grpc.StatusCode.NOT_FOUND,
        "fewer than 1000000001",
    ),
    "a consistency proof backwards": (
        lambda _, ledger: ledger.GetConsistencyProof(
            pb.ConsistencyProofRequest(old_size=2, new_size=1)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "larger than new size",
    ),
    "log filtered by a malformed digest": (
        lambda _, ledger: ledger.Log(pb.LogRequest(digest="latest")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "'latest'",
    ),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_each_failure_has_its_status_code_and_changes_nothing(
    server: VaultServer, channel: Any, case: str
) -> None:
    call, code, named = FAILURES[case]
    with server.client() as client:
        client.pin("image", STORED_SHA256)  # so that the ledger is not empty
    size, files = ledger_size(server), server.stored_files()
    with pytest.raises(grpc.RpcError) as caught:
        call(rpc.StoreStub(channel), rpc.LedgerStub(channel))
    assert caught.value.code() == code, caught.value.details()
    assert named in caught.value.details()
    assert "\n" not in caught.value.details()
    assert ledger_size(server) == size
    assert server.stored_files() == files


def test_a_lookup_of_what_no_entry_pins_is_an_answer_not_an_error(
    server: VaultServer, channel: Any
) -> None:
    """A digest never pinned is answered as one pinned is, with what proves the answer
    complete (docs/ledger-format.md §4.1), so that a client can tell it from a server that
    hides entries; nothing changes."""
    with server.client() as client:
        client.pin("image", STORED_SHA256)
    size = ledger_size(server)
    answer = rpc.LedgerStub(channel).Lookup(pb.LookupRequest(digest=ABSENT))
    assert list(answer.entries) == [] and len(answer.map.entries) >= 1
    assert ledger_size(server) == size


def test_find_missing_answers_ten_thousand_digests_in_one_call(
    server: VaultServer, channel: Any
) -> None:
    with server.client() as client:
        stored = [client.put(b"present %d" % n).blob for n in range(5)]
    present = [str(b.sha256) for b in stored] + [str(b.blake3) for b in stored]
    rng = random.Random("find missing")
    absent = [f"{rng.choice(['sha256', 'blake3'])}:{rng.randbytes(32).hex()}" for _ in range(9_980)]
    asked = present + absent + absent[:5] + present[:5]  # repeats are answered as asked
    rng.shuffle(asked)
    assert len(asked) == 10_000

    response = rpc.StoreStub(channel).FindMissing(pb.FindMissingRequest(digests=asked), timeout=30)
    assert list(response.missing) == [d for d in asked if d not in set(present)]


def test_a_corrupt_chunk_never_leaves_the_server(server: VaultServer, channel: Any) -> None:
    data = random.Random("corrupt").randbytes(3 * CHUNK_SIZE)
    with server.client() as client:
        sha256 = str(client.put(data).blob.sha256)
    path = server.blob_path(sha256)
    damaged = bytearray(path.read_bytes())
    damaged[2 * CHUNK_SIZE + 5] ^= 0x80  # the third chunk
    path.write_bytes(damaged)

    sent: list[pb.Chunk] = []
    with pytest.raises(grpc.RpcError) as caught:
        for response in rpc.StoreStub(channel).Get(pb.GetRequest(digest=sha256)):
            if response.WhichOneof("part") == "chunk":
                sent.append(response.chunk)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert sha256 in caught.value.details() and "byte offset 2097152" in caught.value.details()
    assert [c.offset for c in sent] == [0, CHUNK_SIZE]
    assert b"".join(c.data for c in sent) == data[: 2 * CHUNK_SIZE]

    with server.client() as client, pytest.raises(IntegrityError, match="byte offset 2097152"):
        client.open(sha256, offset=2 * CHUNK_SIZE, length=1).read()


def test_concurrent_puts_of_the_same_bytes_store_it_once(server: VaultServer) -> None:
    data = random.Random("concurrent").randbytes(2 * CHUNK_SIZE + 1)
    before = set(server.stored_files())
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def put() -> None:
        with server.client() as client:
            barrier.wait()
            results.append(client.put(data).created)

    threads = [threading.Thread(target=put) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 5 + [True]
    sha256 = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = server.blob_path(sha256)
    assert set(server.stored_files()) - before == {blob, blob.with_name(blob.name + ".chunks")}


def peak_memory(server: VaultServer) -> int:
    """The server process's peak resident memory so far, in bytes (Linux)."""
    assert server.process is not None
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_a_large_put_is_streamed_not_held_in_server_memory(server: VaultServer) -> None:
    size = 128 * CHUNK_SIZE
    data = random.Random("large").randbytes(size)
    server.run("put", "-", input=data[:CHUNK_SIZE]).ok()  # warm up the put path first
    before = peak_memory(server)
    line = server.run("put", "-", input=data).ok().stdout
    assert line.startswith("sha256:" + hashlib.sha256(data).hexdigest())
    grown = peak_memory(server) - before
    assert grown < size // 2, f"the server's peak memory grew by {grown >> 20} MiB"


def test_a_batch_appends_all_its_entries_at_once_in_order(server: VaultServer) -> None:
    with server.client() as client:
        blake3 = str(client.put(STORED).blob.blake3)
        size = client.checkpoint().size
        response = client.ledger.PinBatch(
            pb.PinBatchRequest(pins=[pin(kind=k) for k in ("image", "dataset", "config")])
        )
        assert [e.index for e in response.entries] == [size, size + 1, size + 2]
        found = client.lookup_many([STORED_SHA256, blake3, ABSENT])
    assert [p.entry.index for p in found[blake3]] == [p.entry.index for p in found[STORED_SHA256]]
    assert [p.entry.kind for p in found[STORED_SHA256]][-3:] == ["image", "dataset", "config"]
    assert found[ABSENT] == []


def test_the_largest_batch_is_stored_whole_and_verifies(server: VaultServer) -> None:
    # 10,000 entries of two subjects: more values than SQLite's default limit for one statement
    # (32,766), for both the entries and their subjects.
    subjects = [
        ("sha256:" + hashlib.sha256(b"a%d" % n).hexdigest(), f"sha256:{n:064x}")
        for n in range(10_000)
    ]
    with server.client() as client:
        size = client.checkpoint().size
        response = client.ledger.PinBatch(
            pb.PinBatchRequest(
                pins=[pin(kind="artefact", subjects=s, external=True) for s in subjects]
            )
        )
        assert [e.index for e in response.entries] == list(range(size, size + 10_000))
        found = client.lookup_many([subjects[0][0], subjects[-1][1], subjects[4_681][1]])
    assert [p.entry.index for p in found[subjects[0][0]]] == [size]
    assert [p.entry.index for p in found[subjects[-1][1]]] == [size + 9_999]
    assert [p.entry.subjects for p in found[subjects[4_681][1]]] == [subjects[4_681]]
    assert "ledger OK" in server.run("verify").ok().stdout


def test_no_call_changes_or_deletes_an_entry(channel: Any) -> None:
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    ledger = {m.name for m in pool.FindServiceByName("pinvault.v1.Ledger").methods}
    appends = {"Pin", "PinBatch"}
    reads = {
        "Lookup",
        "LookupBatch",
        "Log",
        "GetCheckpoint",
        "GetInclusionProof",
        "GetConsistencyProof",
        "GetVerifierKey",
        "ReadEntries",
        "ReadCheckpoints",
    }
    assert ledger == appends | reads, "a new ledger call must be reviewed: entries never change"


# -- batched puts ------------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _hot_files(server: VaultServer) -> tuple[set[str], list[str]]:
    """Every file under the hot tier's blobs/, and whatever is in its tmp/."""
    blobs = next(server.data_dir.rglob("blobs"))
    stored = {p.name for p in blobs.rglob("*") if p.is_file()}
    return stored, sorted(os.listdir(blobs.parent / "tmp"))


def test_a_batch_put_stores_every_blob_durably_and_visibly(server: VaultServer) -> None:
    blobs = [b"batch blob %d " % n * (n + 1) for n in range(300)] + [b""]
    with server.client() as client:
        results = client.put_many(blobs, expected=[_sha256(data) for data in blobs])
        assert [r.created for r in results] == [True] * len(blobs)
        assert [str(r.blob.sha256) for r in results] == [_sha256(data) for data in blobs]
        assert client.find_missing([_sha256(data) for data in blobs]) == []
        for data, result in zip(blobs[::50], results[::50], strict=True):
            assert client.stat(str(result.blob.blake3)).blob == result.blob
            assert read_all(client.open(str(result.blob.sha256))) == data
        stored, temp = _hot_files(server)
        assert temp == []

        again = client.put_many(blobs)

    assert [(r.blob, r.created) for r in again] == [(r.blob, False) for r in results]
    assert _hot_files(server) == (stored, [])


def test_a_batch_blob_not_matching_its_digest_is_refused_by_name_leaving_nothing(
    server: VaultServer,
) -> None:
    good, bad, claimed = b"good batch blob", b"bad batch blob", b"what bad claims to be"
    before, _ = _hot_files(server)
    with server.client() as client:
        with pytest.raises(IntegrityError) as raised:
            client.put_many([good, bad], expected=[_sha256(good), _sha256(claimed)])
        message = str(raised.value)
        assert "blob 1" in message and _sha256(claimed) in message and _sha256(bad) in message
        assert "\n" not in message
        assert client.find_missing([_sha256(bad), _sha256(good)]) == [_sha256(bad)]
        with pytest.raises(NotFound):
            client.stat(_sha256(bad))
    stored, temp = _hot_files(server)
    assert temp == []
    assert stored - before == {_sha256(good)[7:]}


def test_a_batch_refuses_an_oversized_blob_and_stores_nothing(channel: Any) -> None:
    small = b"stored before the oversized one"
    huge = bytes(4 * 1024 * 1024 + 1)
    requests = [
        pb.PutBatchRequest(blobs=[pb.PutBatchBlob(data=small)]),
        pb.PutBatchRequest(blobs=[pb.PutBatchBlob(data=huge)]),
    ]
    store = rpc.StoreStub(channel)
    with pytest.raises(grpc.RpcError) as raised:
        store.PutBatch(iter(requests))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "blob 1 of the batch" in (raised.value.details() or "")
    missing = store.FindMissing(pb.FindMissingRequest(digests=[_sha256(small)])).missing
    assert list(missing) == [_sha256(small)]
