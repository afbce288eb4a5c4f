"""A direct put reaches every mirror the blob is kept on: the client uploads the same bytes to
each, every store takes only bytes with the checksums the vault signed into the requests, and
the vault reads one copy back and takes the others on their stores' checksums, so its CPU does
not grow with the copies. A writer, or a network between the client and the stores, cannot
slip other bytes under the digest, have the vault take another blob's object as a copy, or
replay a plan into storing something else; uploads left unfinished are aborted."""

from __future__ import annotations

import base64
import os
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.services.postgres import PostgresServer
from tests.services.s3 import MinioServer
from tests.services.tampering_proxy import TamperingProxy
from tests.test_mirror import NAMES, PREFIX
from tests.test_shared_blobs import Pair, http_put, pair_on_new_database
from tiers.cold import ColdTier, decode_index
from vault.client import VaultClient
from vault.client import direct as direct_module
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

MIB = 1024 * 1024
PART = 5 * MIB


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    minio_server: MinioServer,
) -> Iterator[Pair]:
    with pair_on_new_database(
        tmp_path_factory.mktemp("copies"), postgres_server, minio_server
    ) as started:
        yield started


def mirror_rows(pair: Pair) -> dict[str, dict[str, Any]]:
    _, b, env = pair
    status = b.run("mirror", "status", "--json", env={**env, "PINVAULT_DATA_DIR": str(b.data_dir)})
    status.ok()
    return {row["name"]: row for row in status.json()}


@pytest.fixture(scope="module")
def buckets(pair: Pair) -> dict[str, str]:
    """The bucket each mirror keeps its blobs in."""
    return {
        name: urllib.parse.urlsplit(str(row["where"])).path.strip("/").split("/")[0]
        for name, row in mirror_rows(pair).items()
    }


def holds(minio: MinioServer, bucket: str, digest: str) -> bool:
    key = f"{PREFIX}blobs/sha256/{digest.removeprefix('sha256:')}"
    listed = minio.client().list_objects_v2(Bucket=bucket, Prefix=key)
    return any(item["Key"] == key for item in listed.get("Contents", ()))


def uploaded_object(minio: MinioServer, bucket: str, digest: str) -> str:
    """The object a mirror's copy of the blob keeps its data in (from its index)."""
    key = f"{PREFIX}blobs/sha256/{digest.removeprefix('sha256:')}"
    index = minio.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    layout = decode_index(index, Digest.parse(digest), key)
    assert not layout.inline, f"{bucket}: the copy of {digest} has no object of its own"
    return layout.data_key


def test_a_direct_put_is_on_every_mirror_when_it_returns(
    pair: Pair, buckets: dict[str, str], minio_server: MinioServer, tmp_path: Path
) -> None:
    a, b, _ = pair
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    # A record of an upload begun days ago, which the mirrors have aborted since.
    stale = uploads / f"{'0' * 64}.json"
    stale.write_text("{}")
    days_ago = time.time() - 3 * 24 * 3600
    os.utime(stale, (days_ago, days_ago))
    for size, part in ((3 * MIB + 17, None), (2 * PART + 1000, PART)):
        data = os.urandom(size)
        source = tmp_path / f"model-{size}.bin"
        source.write_bytes(data)
        digest = str(sha256_of(data))
        with a.client() as client:
            result = client.put_direct(source, part_size=part, uploads=uploads)
        assert (str(result.blob.sha256), result.created) == (digest, True)
        # Every mirror holds its copy as the put returns: none is left to the queue. Each is
        # the object the client uploaded, held with the blob's SHA-256 (a copy the vault made
        # of a blob this small would be kept whole in its index, with no object of its own).
        for name in NAMES:
            assert holds(minio_server, buckets[name], digest), name
            data_key = uploaded_object(minio_server, buckets[name], digest)
            head = minio_server.client().head_object(
                Bucket=buckets[name], Key=data_key, ChecksumMode="ENABLED"
            )
            assert head["ContentLength"] == size
            if part is None:
                assert head["ChecksumSHA256"] == base64.b64encode(sha256_of(data).raw).decode()
        rows = mirror_rows(pair)
        assert [rows[name]["queued"] for name in NAMES] == [0, 0, 0]
        with b.client() as client:
            out = tmp_path / f"out-{size}"
            client.get(digest, out, handoff=False)
            assert out.read_bytes() == data
    assert list(uploads.iterdir()) == []


@pytest.mark.parametrize(("size", "part"), [(9 * MIB, None), (2 * PART + 7, PART)])
def test_wrong_bytes_to_one_mirror_are_refused_by_its_store_and_its_copy_follows(
    pair: Pair,
    buckets: dict[str, str],
    minio_server: MinioServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    size: int,
    part: int | None,
) -> None:
    a, b, _ = pair
    data = os.urandom(size)
    source, other = tmp_path / "meant", tmp_path / "other"
    source.write_bytes(data)
    other.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    victim = buckets["c"]
    refusals: list[str] = []
    real_upload = direct_module._upload

    def network(url: str, headers: dict[str, str], path: Path, offset: int, length: int) -> None:
        # Between the client and mirror c, the last byte of the file is flipped.
        if f"/{victim}/" not in url:
            real_upload(url, headers, path, offset, length)
            return
        try:
            real_upload(url, headers, other, offset, length)
        except IntegrityError as refused:
            refusals.append(str(refused))
            raise

    monkeypatch.setattr(direct_module, "_upload", network)
    with a.client() as client:
        result = client.put_direct(source, part_size=part)
    # The store itself refused the other bytes, against the checksum the vault signed.
    assert refusals and "XAmzContentChecksumMismatch" in refusals[0], refusals
    digest = str(sha256_of(data))
    assert str(result.blob.sha256) == digest
    assert holds(minio_server, buckets["a"], digest)
    assert holds(minio_server, buckets["b"], digest)
    assert sorted(result.mirrors) == ["a", "b"]
    # Mirror c gets its copy from the queue, made by the vault from a good copy: streamed from
    # another mirror's upload as its bytes are, into an object its store took only with the
    # blob's SHA-256 (not decoded, hashed and encoded again: a copy made so has no checksum
    # of the whole, its parts being sent as they are cut).
    deadline = time.monotonic() + 30
    while not holds(minio_server, victim, digest):
        assert time.monotonic() < deadline, "mirror c never got its copy"
        time.sleep(0.2)
    head = minio_server.client().head_object(
        Bucket=victim, Key=uploaded_object(minio_server, victim, digest), ChecksumMode="ENABLED"
    )
    assert head["ContentLength"] == size
    assert head["ChecksumSHA256"] == base64.b64encode(sha256_of(data).raw).decode()
    with b.client() as client:
        out = tmp_path / "out"
        client.get_direct(digest, out)
        assert out.read_bytes() == data


def test_a_finish_naming_another_blobs_object_as_a_copy_is_refused(
    pair: Pair, buckets: dict[str, str], tmp_path: Path
) -> None:
    """A reader learns a blob's data key from a presigned read; a writer names it as a copy of
    its own upload. The finish is refused, nothing is catalogued, and the blob stays."""
    a, b, _ = pair
    stored = os.urandom(3 * MIB)
    source = tmp_path / "stored.bin"
    source.write_bytes(stored)
    with a.client() as client:
        stored_digest = str(client.put_direct(source).blob.sha256)
    mine = os.urandom(3 * MIB)
    mine_digest = str(sha256_of(mine))
    with grpc.insecure_channel(b.address) as channel:
        store = rpc.StoreStub(channel)
        read = store.DirectGet(pb.DirectGetRequest(digest=stored_digest), timeout=30)
        bucket, _, key = urllib.parse.urlsplit(read.url).path.lstrip("/").partition("/")
        (victim,) = [name for name in NAMES if buckets[name] == bucket]
        plan = store.DirectPut(
            pb.DirectPutRequest(sha256=mine_digest, size=len(mine), copies=3), timeout=30
        )
        uploads = [(plan.mirror, plan.key, plan.url, dict(plan.headers))]
        uploads += [(c.mirror, c.key, c.url, dict(c.headers)) for c in plan.copies]
        assert sorted(u[0] for u in uploads) == sorted(NAMES)
        (honest,) = [u for u in uploads if u[0] != victim][:1]
        assert http_put(honest[2], honest[3], mine)[0] == 200

        def finish(*copies: tuple[str, str]) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as refused:
                store.FinishDirectPut(
                    pb.FinishDirectPutRequest(
                        sha256=mine_digest,
                        mirror=honest[0],
                        key=honest[1],
                        copies=[pb.DirectUploadRef(mirror=m, key=k) for m, k in copies],
                    ),
                    timeout=30,
                )
            return refused.value

        refused = finish((victim, key))
        assert refused.code() == grpc.StatusCode.DATA_LOSS, refused.details()
        assert "refused" in str(refused.details())
        # Nor the same mirror twice, nor the first upload named again as its own copy.
        refused = finish((honest[0], honest[1]))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        missing = store.FindMissing(pb.FindMissingRequest(digests=[mine_digest]), timeout=30)
        assert list(missing.missing) == [mine_digest]
    with b.client() as client:
        out = tmp_path / "still-there"
        client.get_direct(stored_digest, out)
        assert out.read_bytes() == stored


def test_a_replayed_plan_stores_nothing_else(pair: Pair, tmp_path: Path) -> None:
    a, b, _ = pair
    first, second = os.urandom(MIB), os.urandom(MIB)
    paths = [tmp_path / "first", tmp_path / "second"]
    for path, data in zip(paths, (first, second), strict=True):
        path.write_bytes(data)
    old_plans: list[pb.DirectPutPlan] = []

    def keep(request: Any, plan: pb.DirectPutPlan) -> pb.DirectPutPlan:
        old_plans.append(plan)
        return plan

    with TamperingProxy(a.address) as proxy:
        proxy.tamper("Store/DirectPut", keep)
        with VaultClient(proxy.address, timeout=60) as client:
            assert client.put_direct(paths[0]).created
        (old,) = old_plans
        # A network that answers the second put with the first's plan: the client sends
        # nothing, since the plan is not one for its file.
        proxy.tamper("Store/DirectPut", lambda request, plan: old)
        with VaultClient(proxy.address, timeout=60) as client, pytest.raises(IntegrityError):
            client.put_direct(paths[1])
    # The first plan's requests, sent again: the stores take nothing but the first's bytes.
    for url, headers in [(old.url, dict(old.headers))] + [
        (c.url, dict(c.headers)) for c in old.copies
    ]:
        status, answer = http_put(url, headers, second)
        assert status == 400 and "XAmzContentChecksumMismatch" in answer, (status, answer)
    with grpc.insecure_channel(a.address) as channel:
        store = rpc.StoreStub(channel)
        # Its finish, sent again under the second blob's digest, is refused.
        with pytest.raises(grpc.RpcError) as refused:
            store.FinishDirectPut(
                pb.FinishDirectPutRequest(
                    sha256=str(sha256_of(second)),
                    mirror=old.mirror,
                    key=old.key,
                    copies=[pb.DirectUploadRef(mirror=c.mirror, key=c.key) for c in old.copies],
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS, refused.value.details()
        missing = store.FindMissing(
            pb.FindMissingRequest(digests=[str(sha256_of(second))]), timeout=30
        )
        assert len(missing.missing) == 1
    with b.client() as client:
        out = tmp_path / "out"
        client.get_direct(str(sha256_of(first)), out)
        assert out.read_bytes() == first


def test_a_plan_of_too_many_parts_is_refused_before_any_is_presigned(pair: Pair) -> None:
    a, _, _ = pair
    parts = 5000
    with grpc.insecure_channel(a.address) as channel:
        store = rpc.StoreStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            store.DirectPut(
                pb.DirectPutRequest(
                    sha256=str(sha256_of(b"large")),
                    size=parts * PART,
                    part_size=PART,
                    part_sha256=[bytes(32)] * parts,
                    copies=3,
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 1024" in str(refused.value.details())
        assert time.monotonic() - started < 5


def test_unfinished_uploads_are_aborted_once_old(minio_server: MinioServer) -> None:
    endpoint = minio_server.create_bucket()
    s3 = endpoint.client()
    try:
        tier = ColdTier(
            endpoint_url=endpoint.url,
            bucket=endpoint.bucket,
            access_key_id=endpoint.access_key,
            secret_access_key=endpoint.secret_key,
            region=endpoint.region,
            prefix=PREFIX,
        )
        try:
            data = os.urandom(PART + 1)
            digest = sha256_of(data)
            parts = [sha256_of(data[:PART]).raw, sha256_of(data[PART:]).raw]
            begun = tier.presign_parts(digest, len(data), PART, parts, 60)
            # Someone else's upload in the same bucket, outside the tier's data/.
            s3.create_multipart_upload(Bucket=endpoint.bucket, Key="theirs/file")

            def listed() -> list[str]:
                found = s3.list_multipart_uploads(Bucket=endpoint.bucket)
                return sorted(upload["Key"] for upload in found.get("Uploads", ()))

            assert listed() == sorted([begun.key, "theirs/file"])
            assert tier.abort_unfinished_uploads(3600) == 0
            assert tier.abort_unfinished_uploads(0) == 1
            assert listed() == ["theirs/file"]
        finally:
            tier.close()
    finally:
        minio_server.delete_bucket(endpoint.bucket)


def test_uploads_given_up_are_deleted_once_old_and_finished_ones_kept(
    tmp_path: Path, postgres_server: PostgresServer, minio_server: MinioServer
) -> None:
    """A client handed uploads it never finishes (it gave up, or was cut off) leaves objects,
    and uploads in parts, on every mirror; the vault deletes them once older than
    `mirrors.abandoned_uploads`, whichever server handed them out, and keeps every object a
    finished put made its copy of. A finish sent after that is refused."""
    with pair_on_new_database(
        tmp_path, postgres_server, minio_server, abandoned_uploads="3"
    ) as started:
        a, b, _ = started
        buckets = {
            name: urllib.parse.urlsplit(str(row["where"])).path.strip("/").split("/")[0]
            for name, row in mirror_rows(started).items()
        }
        s3 = minio_server.client()
        kept = tmp_path / "kept.bin"
        kept.write_bytes(os.urandom(2 * MIB))
        with a.client() as client:
            put = client.put_direct(kept)
        assert sorted(put.mirrors) == sorted(NAMES)
        kept_objects = {
            name: uploaded_object(minio_server, bucket, str(put.blob.sha256))
            for name, bucket in buckets.items()
        }
        given_up = os.urandom(MIB)
        in_parts = os.urandom(PART + 1)
        with grpc.insecure_channel(b.address) as channel:
            store = rpc.StoreStub(channel)
            plan = store.DirectPut(
                pb.DirectPutRequest(sha256=str(sha256_of(given_up)), size=len(given_up), copies=3),
                timeout=30,
            )
            objects = [(plan.mirror, plan.key, plan.url, dict(plan.headers))]
            objects += [(c.mirror, c.key, c.url, dict(c.headers)) for c in plan.copies]
            for _, _, url, headers in objects:
                assert http_put(url, headers, given_up)[0] == 200
            parts = [sha256_of(in_parts[:PART]).raw, sha256_of(in_parts[PART:]).raw]
            begun = store.DirectPut(
                pb.DirectPutRequest(
                    sha256=str(sha256_of(in_parts)),
                    size=len(in_parts),
                    part_size=PART,
                    part_sha256=parts,
                ),
                timeout=30,
            )
            part_one = base64.b64encode(parts[0]).decode()
            assert (
                http_put(begun.part_urls[0], {"x-amz-checksum-sha256": part_one}, in_parts[:PART])[
                    0
                ]
                == 200
            )

            def present(mirror: str, key: str) -> bool:
                listed = s3.list_objects_v2(Bucket=buckets[mirror], Prefix=key)
                return any(item["Key"] == key for item in listed.get("Contents", ()))

            def unfinished(mirror: str) -> list[str]:
                found = s3.list_multipart_uploads(Bucket=buckets[mirror])
                return [upload["Key"] for upload in found.get("Uploads", ())]

            assert all(present(mirror, key) for mirror, key, _, _ in objects)
            assert begun.key in unfinished(begun.mirror)
            deadline = time.monotonic() + 60
            while any(present(mirror, key) for mirror, key, _, _ in objects) or (
                begun.key in unfinished(begun.mirror)
            ):
                assert time.monotonic() < deadline, "abandoned uploads were never deleted"
                time.sleep(0.5)
            for name, key in kept_objects.items():
                assert present(name, key), f"{name}: a finished put's object was deleted"
            with pytest.raises(grpc.RpcError) as refused:
                store.FinishDirectPut(
                    pb.FinishDirectPutRequest(
                        sha256=str(sha256_of(given_up)), mirror=plan.mirror, key=plan.key
                    ),
                    timeout=30,
                )
            assert refused.value.code() == grpc.StatusCode.DATA_LOSS, refused.value.details()
            assert "not an upload the vault handed out" in str(refused.value.details())
        with b.client() as client:
            out = tmp_path / "out"
            client.get_direct(str(put.blob.sha256), out)
            assert out.read_bytes() == kept.read_bytes()


def test_an_upload_that_outlasts_its_requests_asks_for_new_ones_and_resumes(
    tmp_path: Path,
    postgres_server: PostgresServer,
    minio_server: MinioServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large file on a slow link takes longer than the vault's presigned requests stay valid:
    the stores refuse the parts started after that, and the client asks the vault for new
    requests, resuming the uploads (the parts the stores hold are not sent again), and the put
    completes on every mirror."""
    data = os.urandom(3 * PART + 11)
    source = tmp_path / "slow.bin"
    source.write_bytes(data)
    sent: list[tuple[str, int]] = []
    expired: list[str] = []
    real_upload = direct_module._upload

    def slow_link(url: str, headers: dict[str, str], path: Path, offset: int, length: int) -> None:
        if offset:
            time.sleep(4)
        try:
            real_upload(url, headers, path, offset, length)
        except Exception as refused:
            expired.append(str(refused))
            raise
        sent.append((urllib.parse.urlsplit(url).path, offset))

    monkeypatch.setattr(direct_module, "_upload", slow_link)
    with pair_on_new_database(
        tmp_path, postgres_server, minio_server, presign_seconds="6"
    ) as started:
        a, b, _ = started
        with a.client() as client:
            result = client.put_direct(source, part_size=PART)
        assert result.created and str(result.blob.sha256) == str(sha256_of(data))
        assert sorted(result.mirrors) == sorted(NAMES)
        # Some parts were refused for their time, and sent again with new requests; none that
        # a store held was sent twice.
        assert expired and all("expired" in refusal.lower() for refusal in expired), expired
        assert len(sent) == len(set(sent)) == 4 * len(NAMES)
        with b.client() as client:
            out = tmp_path / "out"
            client.get_direct(str(result.blob.sha256), out)
            assert out.read_bytes() == data
