"""Two `vault serve` on one PostgreSQL and three MinIO mirrors are one vault: a blob acknowledged
by one server is served by the other at once, killing a server outright mid-put loses nothing
it acknowledged, and the copies it left queued are made by the other. Clients move bytes
straight to and from the object store with requests the vault signs, and cannot slip other
bytes under a digest."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy.engine import make_url

from tests.services.postgres import PostgresServer
from tests.services.s3 import MinioServer
from tests.services.tampering_proxy import TamperingProxy
from tests.services.vault_server import VaultServer
from tests.test_mirror import NAMES, mirror_env
from vault.client import VaultClient
from vault.client import direct as direct_module
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError, Unavailable, VaultError
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

ORIGIN = "shared.test/ledger"
# A server's claim on a queued copy; short, so that the survivor takes over within the test.
LEASE = "2"


Pair = tuple[VaultServer, VaultServer, dict[str, str]]


@contextlib.contextmanager
def started_pair(
    base: Path,
    database: str,
    minio: MinioServer,
    server: dict[str, str] | None = None,
    **mirrors: str,
) -> Iterator[Pair]:
    """Servers a and b on `database`, with three buckets of `minio` as their mirrors (with the
    `mirrors` settings given); the environment a host command on them needs is the third
    member."""
    buckets = [minio.create_bucket() for _ in NAMES]
    settings = {"claim_lease": LEASE, **mirrors}
    env = {**mirror_env(buckets, **settings), "PINVAULT_LEDGER_ORIGIN": ORIGIN, **(server or {})}
    vaults: list[VaultServer] = []
    try:
        a = VaultServer(base / "a", database=database, env=env).start()
        vaults.append(a)
        config = base / "shared.toml"
        config.write_text(f'[ledger]\nkey_file = "{a.key_path}"\norigin = "{ORIGIN}"\n')
        b = VaultServer(
            base / "b", database=database, env=env, args=["--config", str(config)]
        ).start()
        vaults.append(b)
        yield a, b, {**env, "PINVAULT_LEDGER_DATABASE": database}
    finally:
        for vault in vaults:
            if vault.process is not None and vault.process.poll() is None:
                vault.stop()
        for bucket in buckets:
            minio.delete_bucket(bucket.bucket)


@contextlib.contextmanager
def pair_on_new_database(
    base: Path, postgres: PostgresServer, minio: MinioServer, **mirrors: str
) -> Iterator[Pair]:
    """A started pair on a database of its own (with the `mirrors` settings given), dropped
    after."""
    database = postgres.create_database()
    try:
        with started_pair(base, database, minio, **mirrors) as started:
            yield started
    finally:
        name = make_url(database).database
        assert name is not None
        postgres.drop_database(name)


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    minio_server: MinioServer,
) -> Iterator[Pair]:
    """One pair for the tests that leave both servers running."""
    with pair_on_new_database(
        tmp_path_factory.mktemp("pair"), postgres_server, minio_server
    ) as started:
        yield started


@pytest.fixture
def own_pair(tmp_path: Path, postgres_url: str, minio_server: MinioServer) -> Iterator[Pair]:
    """A pair of the test's own, for a test that kills one."""
    with started_pair(tmp_path, postgres_url, minio_server) as started:
        yield started


def test_a_blob_acknowledged_by_one_server_is_served_by_the_other_at_once(
    pair: Pair, tmp_path: Path
) -> None:
    a, b, _ = pair
    blobs = [os.urandom(size) for size in (1, 70_000, 5 * 1024 * 1024)]
    with a.client() as through_a, b.client() as through_b:
        for n, data in enumerate(blobs):
            digest = str(sha256_of(data))
            assert str(through_a.put(data, handoff=False).blob.sha256) == digest
            # At once, through the other server, which never saw the bytes.
            assert through_b.stat(digest).blob.size == len(data)
            out = tmp_path / f"got-{n}"
            through_b.get(digest, out, handoff=False)
            assert out.read_bytes() == data


def test_killing_a_server_mid_put_loses_nothing_it_acknowledged(
    own_pair: Pair, tmp_path: Path
) -> None:
    a, b, env = own_pair
    acknowledged: dict[str, bytes] = {}
    errors: list[str] = []
    stop = threading.Event()

    def put_until_stopped(number: int) -> None:
        with a.client() as client:
            n = 0
            while not stop.is_set():
                data = f"writer {number} blob {n} ".encode() + os.urandom(256 * 1024)
                n += 1
                try:
                    result = client.put(data, handoff=False)
                except VaultError as error:
                    errors.append(str(error))
                    return
                acknowledged[str(result.blob.sha256)] = data

    writers = [threading.Thread(target=put_until_stopped, args=(n,)) for n in range(4)]
    for writer in writers:
        writer.start()
    deadline = time.monotonic() + 60
    while len(acknowledged) < 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    a._kill()  # kill -9, in the middle of puts
    stop.set()
    for writer in writers:
        writer.join()
    assert len(acknowledged) >= 24, errors
    # Only calls in flight at the kill failed.
    assert len(errors) <= len(writers)

    with b.client() as client:
        for digest, data in acknowledged.items():
            out = tmp_path / digest.replace(":", "-")
            client.get(digest, out, handoff=False)
            assert out.read_bytes() == data

    # The copies a left queued on the other mirrors are made by b once a's claims run out:
    # every blob ends with its three copies, as the shared record shows through b.
    host = {**env, "PINVAULT_DATA_DIR": str(b.data_dir)}
    deadline = time.monotonic() + 60
    while True:
        status = b.run("mirror", "status", "--json", env=host)
        status.ok()
        rows = {row["name"]: row for row in status.json()}
        if all(rows[name]["queued"] == 0 for name in NAMES) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {name: rows[name]["queued"] for name in NAMES} == dict.fromkeys(NAMES, 0)
    assert all(rows[name]["objects"] >= len(acknowledged) for name in NAMES), rows


# -- bytes straight to and from the object store ------------------------------------------------


def hot_copies(vault: VaultServer, digest: Digest) -> list[Path]:
    return list(vault.data_dir.rglob(f"{digest.hex}*"))


def test_a_direct_put_reaches_the_store_without_the_server_and_any_server_serves_it(
    pair: Pair, tmp_path: Path
) -> None:
    a, b, _ = pair
    source = tmp_path / "model.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    source.write_bytes(data)
    digest = sha256_of(data)
    with a.client() as through_a, b.client() as through_b:
        result = through_a.put_direct(source)
        assert (result.blob.sha256, result.blob.size, result.created) == (digest, len(data), True)
        # The vault computed the BLAKE3 alias itself, and it names the same blob.
        assert through_b.stat(str(result.blob.blake3)).blob.sha256 == digest
        # The bytes went to the object store, not into the accepting server's disk.
        assert hot_copies(a, digest) == []
        for n, get in enumerate((through_b.get_direct, through_a.get_direct)):
            out = tmp_path / f"direct-{n}"
            assert get(str(digest), out).sha256 == digest
            assert out.read_bytes() == data
        streamed = tmp_path / "streamed"
        through_b.get(str(digest), streamed, handoff=False)
        assert streamed.read_bytes() == data
        # Again: the vault has it, nothing is uploaded.
        assert through_b.put_direct(source).created is False

    # The same through the command.
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(2 * 1024 * 1024))
    put = a.run("put", "--direct", "--copies", "1", "--json", str(other))
    put.ok()
    assert put.json()["sha256"] == str(sha256_of(other.read_bytes()))
    # One mirror took the upload; the queue makes the other copies.
    assert len(put.json()["mirrors"]) == 1 and put.json()["mirrors"][0] in NAMES
    refused = a.run("put", "--copies", "1", str(other))
    assert refused.returncode == 64 and "--direct" in refused.stderr, refused.describe()
    b.run("get", "--direct", put.json()["sha256"], "-o", str(tmp_path / "other.out")).ok()
    assert (tmp_path / "other.out").read_bytes() == other.read_bytes()
    refused = b.run("get", "--direct", put.json()["sha256"])
    assert refused.returncode == 64 and "give -o PATH" in refused.stderr, refused.describe()


def test_a_writer_cannot_slip_other_bytes_under_a_digest(pair: Pair, tmp_path: Path) -> None:
    a, _, _ = pair
    meant, other = os.urandom(200_000), os.urandom(200_000)
    with grpc.insecure_channel(a.address) as channel:
        store = rpc.StoreStub(channel)
        plan = store.DirectPut(
            pb.DirectPutRequest(sha256=str(sha256_of(meant)), size=len(meant)), timeout=30
        )
        # The store itself refuses bytes other than the ones the request was signed for.
        status, answer = http_put(plan.url, dict(plan.headers), other)
        assert status == 400 and "Checksum" in answer, (status, answer)
        with pytest.raises(grpc.RpcError) as refused:
            store.FinishDirectPut(
                pb.FinishDirectPutRequest(
                    sha256=str(sha256_of(meant)), mirror=plan.mirror, key=plan.key
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND

        # Bytes uploaded honestly for one digest cannot be adopted under another.
        assert http_put(plan.url, dict(plan.headers), meant)[0] == 200
        with pytest.raises(grpc.RpcError) as refused:
            store.FinishDirectPut(
                pb.FinishDirectPutRequest(
                    sha256=str(sha256_of(other)), mirror=plan.mirror, key=plan.key
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS
        assert "refused" in str(refused.value.details())
        # Nor can a key outside the uploads handed out, nor an unknown mirror.
        for mirror, key in ((plan.mirror, "blobs/sha256/" + "0" * 64), ("nowhere", plan.key)):
            with pytest.raises(grpc.RpcError) as refused:
                store.FinishDirectPut(
                    pb.FinishDirectPutRequest(sha256=str(sha256_of(meant)), mirror=mirror, key=key),
                    timeout=30,
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing of it was catalogued.
        missing = store.FindMissing(
            pb.FindMissingRequest(digests=[str(sha256_of(meant)), str(sha256_of(other))]),
            timeout=30,
        )
        assert len(missing.missing) == 2


def test_a_writer_cannot_destroy_a_stored_blob_by_finishing_an_upload_on_its_data(
    pair: Pair, tmp_path: Path
) -> None:
    """A reader learns a blob's data key from a presigned read; a writer then names that key in
    a finish under another digest. It is refused, and the blob's data stays where it was."""
    a, b, env = pair
    data = os.urandom(3 * 1024 * 1024)
    source = tmp_path / "stored.bin"
    source.write_bytes(data)
    with a.client() as client:
        # Stored straight to a mirror: its data is an object under data/, as a large blob's is.
        digest = str(client.put_direct(source).blob.sha256)
    status = b.run("mirror", "status", "--json", env={**env, "PINVAULT_DATA_DIR": str(b.data_dir)})
    with grpc.insecure_channel(b.address) as channel:
        store = rpc.StoreStub(channel)
        plan = store.DirectGet(pb.DirectGetRequest(digest=digest), timeout=30)
        bucket, _, key = urllib.parse.urlsplit(plan.url).path.lstrip("/").partition("/")
        (mirror,) = [row["name"] for row in status.json() if f"/{bucket}/" in row["where"]]
        for claimed in (sha256_of(b"something else"), sha256_of(data[:-1])):
            with pytest.raises(grpc.RpcError) as refused:
                store.FinishDirectPut(
                    pb.FinishDirectPutRequest(sha256=str(claimed), mirror=mirror, key=key),
                    timeout=30,
                )
            assert refused.value.code() == grpc.StatusCode.DATA_LOSS, refused.value.details()
    with b.client() as client:
        out = tmp_path / "still-there"
        client.get_direct(digest, out)
        assert out.read_bytes() == data


def http_put(url: str, headers: dict[str, str], body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


class _LyingStore(http.server.BaseHTTPRequestHandler):
    """An object store that answers any ranged read with other bytes of the same length."""

    def do_GET(self) -> None:
        first, last = self.headers["Range"].removeprefix("bytes=").split("-")
        body = os.urandom(int(last) - int(first) + 1)
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_direct_get_refuses_what_a_hostile_store_or_vault_answers(
    pair: Pair, tmp_path: Path
) -> None:
    a, _, _ = pair
    data = os.urandom(2 * 1024 * 1024 + 5)
    store = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LyingStore)
    threading.Thread(target=store.serve_forever, daemon=True).start()
    lying_url = f"http://127.0.0.1:{store.server_address[1]}/bucket/data"

    def forged(**changes: object) -> Callable[[Any, pb.DirectGetPlan], pb.DirectGetPlan]:
        def rule(request: Any, plan: pb.DirectGetPlan) -> pb.DirectGetPlan:
            forged = pb.DirectGetPlan()
            forged.CopyFrom(plan)
            for name, value in changes.items():
                if name == "extents":
                    del forged.extents[:]
                    forged.extents.extend(value)  # type: ignore[arg-type]
                else:
                    setattr(forged, name, value)
            return forged

        return rule

    try:
        with a.client() as client:
            digest = str(client.put(data, handoff=False).blob.sha256)
        cases = {
            "other bytes from the store": forged(url=lying_url),
            "a URL that is not http": forged(url="file:///etc/passwd"),
            "a chunk too large to hold": forged(chunk_size=1 << 30),
            "a stored chunk longer than any chunk": forged(
                extents=[pb.StoredExtent(length=1 << 31), pb.StoredExtent(length=5)]
            ),
        }
        with TamperingProxy(a.address) as proxy:
            for case, rule in cases.items():
                proxy.tamper("Store/DirectGet", rule)
                out = tmp_path / "out"
                with (
                    VaultClient(proxy.address, timeout=60) as client,
                    pytest.raises(IntegrityError),
                ):
                    client.get_direct(digest, out)
                assert not out.exists(), case
                assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == [], case
    finally:
        store.shutdown()
        store.server_close()


def test_a_direct_put_in_parts_cut_short_resumes_with_the_parts_missing(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _ = pair
    part = 5 * 1024 * 1024
    data = os.urandom(3 * part + 100_000)
    source, uploads = tmp_path / "weights.bin", tmp_path / "uploads"
    source.write_bytes(data)
    sent: dict[str, list[int]] = {}
    cut = [True]
    real_upload = direct_module._upload

    def network(url: str, headers: dict[str, str], path: Path, offset: int, length: int) -> None:
        # Each mirror's link drops after its first two parts: a fault the real store cannot be
        # made to show.
        parts = sent.setdefault(urllib.parse.urlsplit(url).path.split("/")[1], [])
        if cut[0] and len(parts) == 2:
            raise Unavailable("uploading to the object store failed: connection reset")
        parts.append(offset // part + 1)
        real_upload(url, headers, path, offset, length)

    monkeypatch.setattr(direct_module, "_upload", network)
    with a.client() as client:
        with pytest.raises(Unavailable):
            client.put_direct(source, part_size=part, uploads=uploads)
        # The same bytes went to each of the three mirrors.
        assert sorted(sent.values()) == [[1, 2]] * 3
        assert len(list(uploads.iterdir())) == 1
        # Finishing an upload that lacks parts is refused, and catalogues nothing.
        (begun, *_) = json.loads(next(uploads.iterdir()).read_text())["uploads"]
        with (
            grpc.insecure_channel(a.address) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            rpc.StoreStub(channel).FinishDirectPut(
                pb.FinishDirectPutRequest(
                    sha256=str(sha256_of(data)),
                    mirror=begun["mirror"],
                    key=begun["key"],
                    upload_id=begun["upload_id"],
                    size=len(data),
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # Resumed: only the parts missing are sent, and the vault verifies the whole.
        sent.clear()
        cut[0] = False
        result = client.put_direct(source, part_size=part, uploads=uploads)
        assert sorted(sent.values()) == [[3, 4]] * 3
        assert (result.blob.sha256, result.created) == (sha256_of(data), True)
        assert list(uploads.iterdir()) == []
    with b.client() as client:
        out = tmp_path / "out"
        client.get_direct(str(sha256_of(data)), out)
        assert out.read_bytes() == data


def test_planning_and_finishing_a_direct_put_count_as_one_of_its_callers_streams(
    tmp_path: Path, postgres_url: str, minio_server: MinioServer
) -> None:
    """Adopting an upload reads the whole blob back, and planning one presigns each of its
    parts on each mirror: both run on the stream workers under the caller's stream limit, not
    on the threads that answer look-ups."""
    one = {"PINVAULT_SERVER_STREAMS_PER_CALLER": "1"}
    with started_pair(tmp_path, postgres_url, minio_server, server=one) as (a, _, _):
        data = os.urandom(8 * 1024 * 1024)
        with a.client() as client:
            digest = str(client.put(data, handoff=False).blob.sha256)
        with grpc.insecure_channel(a.address) as channel:
            store = rpc.StoreStub(channel)
            small = sha256_of(b"x" * 10)
            plan = store.DirectPut(pb.DirectPutRequest(sha256=str(small), size=10), timeout=30)
            held = store.Get(pb.GetRequest(digest=digest), timeout=60)
            next(held)  # the caller's one stream, open and not read
            try:
                with pytest.raises(grpc.RpcError) as refused:
                    store.FinishDirectPut(
                        pb.FinishDirectPutRequest(
                            sha256=str(small), mirror=plan.mirror, key=plan.key
                        ),
                        timeout=30,
                    )
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "streams open" in str(refused.value.details())
                # So is a plan, whose parts cost the server as much to presign.
                with pytest.raises(grpc.RpcError) as refused:
                    store.DirectPut(
                        pb.DirectPutRequest(sha256=str(small), size=10, copies=3), timeout=30
                    )
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                # Look-ups are answered all the while.
                found = store.FindMissing(pb.FindMissingRequest(digests=[digest]), timeout=30)
                assert list(found.missing) == []
            finally:
                held.cancel()
