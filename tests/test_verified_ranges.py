"""A range of a blob verified alone, against the chunk root a signed pin records: a client that
put a blob records its chunk root in its pins, the vault refuses a pin whose root is not the
blob's, and a range read fetches the blob's chunk hashes and only the chunks the range covers.
Through a hostile proxy in front of a real `vault serve`, a changed byte with recomputed chunk
hashes is refused with a root and without one; a proof that fails is never taken for a missing
root."""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from tests.services.tampering_proxy import StreamRule, TamperingProxy
from tests.services.vault_server import VaultServer
from vault.client import ProvenEntry, VaultClient
from vault.client.ranges import CHUNK_ROOT, signed_root
from vault.digest import Digest
from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument, VerificationError
from vault.ledger.entry import Entry
from vault.ledger.merkle import items_root
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb

MiB = CHUNK_SIZE
SIZE = 24 * MiB + 12_345


def random_bytes(size: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(size)


def root_of(data: bytes) -> str:
    """The chunk root, computed here apart from the project's code paths that record it."""
    hashes = [blake3.blake3(data[at : at + MiB]).digest() for at in range(0, len(data), MiB)]
    return items_root(hashes).hex()


class Counting:
    """A Store/Get rule that counts the blob bytes (chunk data) the server sends."""

    def __init__(self) -> None:
        self.sent = 0
        self.hash_lists = 0
        self._lock = threading.Lock()

    def __call__(
        self, request: pb.GetRequest, answers: Iterator[pb.GetResponse]
    ) -> Iterator[pb.GetResponse]:
        for answer in answers:
            with self._lock:
                if answer.WhichOneof("part") == "chunk":
                    self.sent += len(answer.chunk.data)
                elif answer.WhichOneof("part") == "hashes":
                    self.hash_lists += 1
            yield answer


def changed_chunk(data: bytes, index: int, *, hashes_too: bool = True) -> StreamRule:
    """A Store/Get rule of a hostile server: one byte of chunk `index` of `data` changed, its hash
    recomputed in the chunk's message and (with `hashes_too`) in the list of chunk hashes, so
    that everything the server says agrees with the bytes it sends."""

    def changed(chunk: bytes) -> bytes:
        flipped = bytearray(chunk)
        flipped[len(flipped) // 2] ^= 0x01
        return bytes(flipped)

    lie = blake3.blake3(changed(data[index * MiB : (index + 1) * MiB])).digest()

    def rule(request: pb.GetRequest, answers: Iterator[pb.GetResponse]) -> Iterator[pb.GetResponse]:
        for answer in answers:
            part = answer.WhichOneof("part")
            if part == "chunk" and answer.chunk.offset == index * MiB:
                answer.chunk.data = changed(answer.chunk.data)
                answer.chunk.hash = blake3.blake3(answer.chunk.data).digest()
            elif part == "hashes" and hashes_too:
                first = answer.hashes.offset // MiB
                if first <= index < first + len(answer.hashes.hashes):
                    answer.hashes.hashes[index - first] = lie
            yield answer

    return rule


DATA = random_bytes(SIZE, "verified ranges")
SHA256 = "sha256:" + hashlib.sha256(DATA).hexdigest()


@pytest.fixture(scope="module")
def pinned(vault_server: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """DATA, put from a file and pinned by the client that put it: its pin records the root."""
    source = tmp_path_factory.mktemp("pinned") / "blob"
    source.write_bytes(DATA)
    with vault_server.client() as client:
        assert str(client.put(source, chunk_root=True).blob.sha256) == SHA256
        proven = client.pin("config", SHA256, meta={"name": "verified ranges"})
    assert proven.entry.meta[CHUNK_ROOT] == root_of(DATA)
    return SHA256


@pytest.fixture
def proxy(vault_server: VaultServer) -> Iterator[TamperingProxy]:
    with TamperingProxy(vault_server.address) as hostile:
        yield hostile


def unrooted(vault_server: VaultServer, seed: str) -> tuple[bytes, str]:
    """A blob pinned by a client that did not put it, as old entries are: no chunk root."""
    data = random_bytes(8 * MiB + 7, seed)
    with vault_server.client() as putter:
        digest = str(putter.put(data).blob.sha256)
    with vault_server.client() as other:
        proven = other.pin("config", digest)
    assert CHUNK_ROOT not in proven.entry.meta
    return data, digest


# ---------------------------------------------------------------------- only the range moves


def test_a_range_with_a_chunk_root_fetches_only_the_chunks_it_covers(
    pinned: str, proxy: TamperingProxy, tmp_path: Path
) -> None:
    counting = Counting()
    proxy.tamper("Store/Get", counting)
    offset, length = 10 * MiB + 100, MiB
    with VaultClient(proxy.address, timeout=60) as client:
        with client.open(pinned, offset=offset, length=length) as reader:
            assert reader.read() == DATA[offset : offset + length]
        # Two chunks cover it, and the list of chunk hashes (32 bytes a chunk) was read.
        assert counting.sent == 2 * MiB and counting.hash_lists == 1

        counting.sent = 0
        client.get(pinned, tmp_path / "range", offset=SIZE - 20, length=20)
        assert (tmp_path / "range").read_bytes() == DATA[-20:]
        assert counting.sent == SIZE - 24 * MiB

        counting.sent = 0
        out = tmp_path / "copied"
        with out.open("wb") as f:
            client.copy_to(pinned, f.fileno(), offset=3 * MiB, length=0)
            client.copy_to(pinned, f.fileno(), offset=3 * MiB - 1, length=2)
        assert out.read_bytes() == DATA[3 * MiB - 1 : 3 * MiB + 1]
        assert counting.sent == 2 * MiB


def test_vault_get_of_a_range_moves_only_its_chunks(
    pinned: str, vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    counting = Counting()
    proxy.tamper("Store/Get", counting)
    target = tmp_path / "part"
    offset = 5 * MiB
    vault_server.run(
        *("get", pinned, "--offset", str(offset), "--length", str(MiB), "-o", str(target)),
        env={"PINVAULT_CLIENT_SERVER": proxy.address},
        state_home=tmp_path / "state",
    ).ok()
    assert target.read_bytes() == DATA[offset : offset + MiB]
    assert counting.sent == MiB


def test_vault_pin_chunk_root_records_the_root_of_a_blob_another_client_put(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    data, digest = unrooted(vault_server, "pinned by the command")
    pinned = vault_server.run("pin", "artefact", digest, "--chunk-root", "--json").ok().json()
    assert pinned["meta"] == {CHUNK_ROOT: root_of(data)}
    counting = Counting()
    proxy.tamper("Store/Get", counting)
    target = tmp_path / "part"
    vault_server.run(
        *("get", digest, "--offset", str(3 * MiB), "--length", "10", "-o", str(target)),
        env={"PINVAULT_CLIENT_SERVER": proxy.address},
        state_home=tmp_path / "state",
    ).ok()
    assert target.read_bytes() == data[3 * MiB : 3 * MiB + 10]
    assert counting.sent == MiB


# ---------------------------------------------------------------------- a hostile server


def test_a_changed_byte_with_recomputed_chunk_hashes_is_refused_by_the_root(
    pinned: str, proxy: TamperingProxy, tmp_path: Path
) -> None:
    proxy.tamper("Store/Get", changed_chunk(DATA, 7))
    with VaultClient(proxy.address, timeout=60) as client:
        with pytest.raises(IntegrityError, match=f"{pinned}.*chunk root"):
            client.open(pinned, offset=7 * MiB + 5, length=10).read()
        with pytest.raises(IntegrityError, match=pinned):
            client.get(pinned, tmp_path / "range", offset=7 * MiB, length=MiB)
    assert not list(tmp_path.iterdir())


def test_a_changed_chunk_under_a_true_chunk_list_is_refused(
    pinned: str, proxy: TamperingProxy
) -> None:
    proxy.tamper("Store/Get", changed_chunk(DATA, 3, hashes_too=False))
    with VaultClient(proxy.address, timeout=60) as client:
        with pytest.raises(IntegrityError, match=f"{pinned}: the chunk at byte offset {3 * MiB}"):
            client.open(pinned, offset=3 * MiB, length=10).read()
        # A range beside it is not touched by the lie.
        assert client.open(pinned, offset=4 * MiB, length=10).read() == DATA[4 * MiB : 4 * MiB + 10]


def test_without_a_root_a_range_falls_back_to_the_whole_blob_and_refuses_the_same_lie(
    vault_server: VaultServer, proxy: TamperingProxy
) -> None:
    data, digest = unrooted(vault_server, "no root")
    counting = Counting()
    with VaultClient(proxy.address, timeout=60) as client:
        proxy.tamper("Store/Get", counting)
        assert client.open(digest, offset=MiB, length=5).read() == data[MiB : MiB + 5]
        assert counting.sent == len(data)  # the whole blob, verified against its digest

        proxy.tamper("Store/Get", changed_chunk(data, 1))
        with pytest.raises(IntegrityError, match=digest):
            client.open(digest, offset=MiB, length=5).read()


def test_a_lookup_proof_that_fails_is_refused_not_taken_for_a_missing_root(
    pinned: str, proxy: TamperingProxy
) -> None:
    def forged(request: pb.LookupRequest, answer: pb.LookupResponse) -> pb.LookupResponse:
        for proven in answer.entries:
            if proven.inclusion:
                proven.inclusion[0] = bytes(32)
            else:
                proven.entry.body = proven.entry.body.replace(b'"config"', b'"image"')
        return answer

    proxy.tamper("Ledger/Lookup", forged)
    counting = Counting()
    proxy.tamper("Store/Get", counting)
    with VaultClient(proxy.address, timeout=60) as client, pytest.raises(VerificationError):
        client.open(pinned, offset=MiB, length=10)
    assert counting.sent == 0


# ---------------------------------------------------------------------- the vault's check


def test_the_vault_refuses_a_pin_whose_chunk_root_is_not_the_blobs(
    pinned: str, vault_server: VaultServer
) -> None:
    wrong = root_of(DATA[:-1])
    with vault_server.client() as client:
        with pytest.raises(InvalidArgument) as refused:
            client.pin("config", pinned, meta={CHUNK_ROOT: wrong})
        message = str(refused.value)
        assert pinned in message and wrong in message and root_of(DATA) in message
        with pytest.raises(InvalidArgument, match="64 lowercase hex"):
            client.pin("config", pinned, meta={CHUNK_ROOT: root_of(DATA).upper()})
        # The blob's own root is taken, from a client that did not put it too.
        right = client.pin("config", pinned, meta={CHUNK_ROOT: root_of(DATA)})
        assert right.entry.meta[CHUNK_ROOT] == root_of(DATA)
    run = vault_server.run("pin", "config", pinned, "--meta", f"{CHUNK_ROOT}={wrong}")
    assert run.returncode != 0 and wrong in run.stderr and pinned in run.stderr


def test_the_vault_refuses_a_chunk_root_for_a_blob_it_does_not_hold(
    vault_server: VaultServer,
) -> None:
    absent = "sha256:" + hashlib.sha256(b"never stored").hexdigest()
    with vault_server.client() as client:
        with pytest.raises(FailedPrecondition, match=absent):
            client.pin("config", absent, meta={CHUNK_ROOT: root_of(b"never stored")})
        with pytest.raises(InvalidArgument, match=f"{absent} is external content"):
            client.pin("image", absent, meta={CHUNK_ROOT: root_of(b"never stored")}, external=True)


def test_a_clients_pins_record_the_root_of_what_it_put(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    """What a client puts with its root and then pins as the first subject carries the root;
    pins of small blobs, of blobs put without it and of blobs it did not put carry none, unless
    it is asked to compute one."""
    large = random_bytes(3 * MiB + 1, "large")
    small = b"small"
    with vault_server.client() as client:
        big = client.put(large, chunk_root=True).blob
        little = client.put(small, chunk_root=True).blob
        plain = client.put(random_bytes(2 * MiB + 3, "plain")).blob
        assert CHUNK_ROOT not in client.pin("config", str(plain.sha256)).entry.meta
        by_blake3 = client.pin("config", str(big.blake3))
        assert by_blake3.entry.subjects == (str(big.sha256),)
        assert by_blake3.entry.meta[CHUNK_ROOT] == root_of(large)
        assert CHUNK_ROOT not in client.pin("config", str(little.sha256)).entry.meta
        assert CHUNK_ROOT not in client.pin("config", str(big.sha256), chunk_root=False).entry.meta
    # A client that did not put it computes the root from the blob's verified bytes if asked.
    with vault_server.client() as other:
        assert CHUNK_ROOT not in other.pin("config", str(big.sha256)).entry.meta
        asked = other.pin("config", str(big.sha256), chunk_root=True)
        assert asked.entry.meta[CHUNK_ROOT] == root_of(large)
        assert other.open(str(big.sha256), offset=3 * MiB, length=1).read() == large[-1:]


def test_only_a_root_every_pin_of_the_blob_agrees_on_is_used() -> None:
    """Which recorded root a reader takes, from entries already proved (an honest vault never
    holds two roots for one blob; a hostile one that appended a second is seen here)."""
    digest = Digest.parse(SHA256)
    root, other = root_of(DATA), root_of(DATA[:-1])

    def pin(
        meta: dict[str, str], *, subjects: tuple[str, ...] = (SHA256,), external: bool = False
    ) -> ProvenEntry:
        entry = Entry(
            0, "config", subjects, "a@b", "2026-12-07T00:00:00Z", bytes(32), meta, external
        )
        return ProvenEntry(entry, bytes(32), [], None)  # type: ignore[arg-type]

    assert signed_root(digest, [pin({CHUNK_ROOT: root}), pin({})]) == bytes.fromhex(root)
    assert signed_root(digest, [pin({CHUNK_ROOT: root}), pin({CHUNK_ROOT: root})]) == bytes.fromhex(
        root
    )
    assert signed_root(digest, [pin({CHUNK_ROOT: root}), pin({CHUNK_ROOT: other})]) is None
    assert signed_root(digest, [pin({CHUNK_ROOT: root.upper()})]) is None
    assert signed_root(digest, [pin({})]) is None
    # Only a pin whose first subject is the blob speaks for its chunks.
    run = "sha256:" + "1" * 64
    assert signed_root(digest, [pin({CHUNK_ROOT: root}, subjects=(run, SHA256))]) is None
    assert signed_root(digest, [pin({CHUNK_ROOT: root}, external=True)]) is None
