"""The cold tier on real S3 servers (MinIO and versitygw): the shared tier contract, with small
blobs kept inline and in data objects of their own, then what only an S3 copy can show (its
metadata, compression, ranged fetches, multipart uploads and their checks, outages)."""

from __future__ import annotations

import random
import secrets
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services.s3 import SERVERS, S3Endpoint, S3Server, bucket_is_empty
from tests.tier_contract import LARGE, TierContract, content, read_all
from tiers.cold import MIN_PART_SIZE, ColdLayout, ColdTier, KeyRing
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError, NotFound, Unavailable
from vault.store.chunks import CHUNK_SIZE, SHA_QUEUE_DEPTH
from vault.store.protocol import BlobStore, get_bytes, put_bytes, put_file, read_range

pytestmark = pytest.mark.s3

PREFIX = "mirror/"


def cold_tier(endpoint: S3Endpoint, **options: Any) -> ColdTier:
    options.setdefault("prefix", PREFIX)
    return ColdTier(
        endpoint_url=endpoint.url,
        bucket=endpoint.bucket,
        access_key_id=endpoint.access_key,
        secret_access_key=endpoint.secret_key,
        region=endpoint.region,
        **options,
    )


def key_ring_of(*ids: str) -> KeyRing:
    """A key ring of fresh keys (`ids`, by default one) for an encrypted tier."""
    keys = [(key_id, secrets.token_bytes(32)) for key_id in ids or ("k1",)]
    return KeyRing(keys, secrets.token_bytes(32), "test key ring")


def compressible(size: int, seed: int = 0) -> bytes:
    """Text-like bytes that zstd shrinks several times over, different in every chunk."""
    rng = random.Random(seed)
    words = [rng.randbytes(rng.randint(2, 6)).hex() for _ in range(400)]
    lines: list[bytes] = []
    total = 0
    while total < size:
        line = (" ".join(rng.choices(words, k=12)) + "\n").encode()
        lines.append(line)
        total += len(line)
    return b"".join(lines)[:size]


def flip_stored_bit(tier: ColdTier, sha256: Digest, offset: int) -> None:
    """Flip one bit of the stored chunk holding blob byte `offset`, through the S3 API (the
    very bit of that byte when the chunk is stored raw)."""
    layout = tier.layout(sha256)
    index = offset // CHUNK_SIZE
    extent = layout.extents[index]
    position = layout.data_offset + extent.start + (offset - index * CHUNK_SIZE) % extent.length
    rewrite_object(tier, layout.data_key, lambda body: flip(body, position))


def flip(body: bytes, position: int) -> bytes:
    return body[:position] + bytes([body[position] ^ 0x40]) + body[position + 1 :]


def rewrite_object(tier: ColdTier, key: str, change: Callable[[bytes], bytes]) -> None:
    """Replace an object's bytes behind the tier's back, keeping its metadata."""
    client = tier.client
    got = client.get_object(Bucket=tier.bucket, Key=key)
    body = got["Body"].read()
    client.put_object(Bucket=tier.bucket, Key=key, Body=change(body), Metadata=got["Metadata"])


def keys(tier: ColdTier, under: str = "") -> list[str]:
    response = tier.client.list_objects_v2(Bucket=tier.bucket, Prefix=PREFIX + under)
    return [item["Key"] for item in response.get("Contents", [])]


@dataclass
class Request:
    operation: str
    key: str | None
    range: str | None
    received: int | None = None


class RequestLog:
    """Every S3 call a client makes, as botocore's own events report them: the operation, its
    key and Range, and for a GET the Content-Length of the body the server sent."""

    def __init__(self, client: Any) -> None:
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        client.meta.events.register("provide-client-params.s3", self._called)
        client.meta.events.register("after-call.s3", self._answered)

    def _called(
        self, params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any
    ) -> None:
        request = Request(model.name, params.get("Key"), params.get("Range"))
        context["pinvault-test-request"] = request
        with self._lock:
            self.requests.append(request)

    def _answered(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        request = context.get("pinvault-test-request")
        if request is not None and request.operation == "GetObject":
            request.received = parsed.get("ContentLength")

    def of(self, operation: str) -> list[Request]:
        return [request for request in self.requests if request.operation == operation]

    def clear(self) -> None:
        self.requests.clear()


@pytest.fixture
def tier(s3_endpoint: S3Endpoint) -> Iterator[ColdTier]:
    with cold_tier(s3_endpoint) as tier:
        yield tier


# -- the contract ------------------------------------------------------------------------------


class TestColdTierContract(TierContract):
    """Every blob the contract stores fits in one part, so it runs twice: once with blobs kept
    inline in their index object, once with every blob's data in an object of its own."""

    @pytest.fixture(params=["inline", "data-object", "encrypted-inline", "encrypted-data-object"])
    def store(self, request: pytest.FixtureRequest, s3_endpoint: S3Endpoint) -> Iterator[BlobStore]:
        inline_limit = None if request.param.endswith("inline") else 0
        ring = key_ring_of() if request.param.startswith("encrypted") else None
        with cold_tier(s3_endpoint, inline_limit=inline_limit, keys=ring) as tier:
            yield tier

    def corrupt(self, store: BlobStore, sha256: Digest, offset: int) -> None:
        assert isinstance(store, ColdTier)
        flip_stored_bit(store, sha256, offset)


# -- how a blob is kept ------------------------------------------------------------------------


def test_the_blob_object_carries_size_and_digests_in_its_metadata(tier: ColdTier) -> None:
    info = put_bytes(tier, content(LARGE))
    layout = tier.layout(info.sha256)

    head = tier.client.head_object(Bucket=tier.bucket, Key=layout.key)

    assert layout.key == f"{PREFIX}blobs/sha256/{info.sha256.hex}"
    assert head["Metadata"] == {
        "format": "pinvault-cold-1",
        "size": str(LARGE),
        "sha256": str(info.sha256),
        "blake3": str(info.blake3),
        "stored-size": str(layout.stored_size),
    }


def test_compressible_chunks_are_stored_compressed_and_others_raw(tier: ColdTier) -> None:
    text = compressible(4 * CHUNK_SIZE)
    noise = content(2 * CHUNK_SIZE, seed=3)
    # text, noise, text, text, noise, then a short text chunk
    data = text[: 1 << 20] + noise[: 1 << 20] + text[1 << 20 : 3 << 20] + noise[1 << 20 :]
    data += text[3 << 20 : (3 << 20) + 1000]
    info = put_bytes(tier, data)
    layout = tier.layout(info.sha256)

    assert [extent.compressed for extent in layout.extents] == [
        True,
        False,
        True,
        True,
        False,
        True,
    ]
    raw = [extent.length for extent in layout.extents if not extent.compressed]
    assert raw == [CHUNK_SIZE, CHUNK_SIZE]
    assert layout.stored_size < 2 * CHUNK_SIZE + 4 * CHUNK_SIZE // 2
    assert get_bytes(tier, info.sha256) == data
    assert tier.verify(info.sha256) == info


def test_compressible_blob_takes_less_space_than_its_size(s3_endpoint: S3Endpoint) -> None:
    with cold_tier(s3_endpoint, inline_limit=0) as tier:
        data = compressible(12 * CHUNK_SIZE, seed=1)
        info = put_bytes(tier, data)
        layout = tier.layout(info.sha256)

        assert not layout.inline
        head = tier.client.head_object(Bucket=tier.bucket, Key=layout.data_key)
        assert head["ContentLength"] == layout.stored_size < len(data) // 2
        assert get_bytes(tier, info.sha256) == data


def test_small_blob_is_one_object_one_put_and_one_get(tier: ColdTier) -> None:
    log = RequestLog(tier.client)
    data = compressible(50_000)

    info = put_bytes(tier, data)
    # No look-up first: the PUT is conditional, and refuses to replace a copy already there.
    assert [request.operation for request in log.requests] == ["PutObject"]
    log.clear()
    assert put_bytes(tier, data) == info
    assert [request.operation for request in log.requests] == ["PutObject"]
    log.clear()
    assert get_bytes(tier, info.sha256) == data
    assert [request.operation for request in log.requests] == ["GetObject"]

    layout = tier.layout(info.sha256)
    assert layout.inline
    assert keys(tier) == [layout.key]


def test_a_range_read_fetches_only_the_chunks_it_covers(s3_endpoint: S3Endpoint) -> None:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE) as tier:
        data = b"".join(
            compressible(CHUNK_SIZE, seed=n) if n % 2 else content(CHUNK_SIZE, seed=n)
            for n in range(12)
        )
        info = put_bytes(tier, data)
        layout = tier.layout(info.sha256)
        log = RequestLog(tier.client)

        offset = 7 * CHUNK_SIZE + 1234
        got = b"".join(read_range(tier, info.sha256, offset, 10))

        assert got == data[offset : offset + 10]
        index_get, data_get = log.of("GetObject")
        assert len(log.requests) == 2
        assert index_get.key == layout.key
        assert index_get.received is not None and index_get.received < 4096
        extent = layout.extents[7]
        assert extent.compressed
        assert data_get.key == layout.data_key
        assert data_get.range == f"bytes={extent.start}-{extent.start + extent.length - 1}"
        assert data_get.received == extent.length < CHUNK_SIZE // 2

        log.clear()
        chunks = read_all(tier, info.sha256, 3 * CHUNK_SIZE, 2 * CHUNK_SIZE + 1)
        assert [chunk.offset for chunk in chunks] == [
            3 * CHUNK_SIZE,
            4 * CHUNK_SIZE,
            5 * CHUNK_SIZE,
        ]
        received = [request.received for request in log.of("GetObject")][1:]
        assert received == [sum(layout.extents[i].length for i in (3, 4, 5))]


# -- uploads -----------------------------------------------------------------------------------


@pytest.fixture
def big_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "big.bin"
    with path.open("wb") as f:
        for number in range(40):
            f.write(content(CHUNK_SIZE, seed=100 + number))
    yield path
    path.unlink()


def test_a_large_put_goes_up_in_parts_with_bounded_memory(
    s3_endpoint: S3Endpoint, big_file: Path
) -> None:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE, upload_threads=2) as tier:
        log = RequestLog(tier.client)
        tracemalloc.start()
        try:
            info = put_file(tier, big_file)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

        assert info.size == 40 * CHUNK_SIZE
        # Two parts in flight, one waiting for them, the one being filled, and what SHA-256's
        # thread may lag behind (its queue of 1 MiB batches, the batch it hashes, the one being
        # gathered); copying each part on its way out would go past this.
        hashing = (SHA_QUEUE_DEPTH + 2) * CHUNK_SIZE
        assert peak < 4 * MIN_PART_SIZE + hashing, f"peak {peak / CHUNK_SIZE:.1f} MiB"
        assert len(log.of("CreateMultipartUpload")) == 1
        assert len(log.of("UploadPart")) == 8
        assert len(log.of("CompleteMultipartUpload")) == 1
        # The server vouched for every part by its SHA-256: nothing was read back.
        assert log.of("GetObject") == []
        assert tier.verify(info.sha256) == info
        assert keys(tier, "data/") == [tier.layout(info.sha256).data_key]


def _strip_checksums(parsed: dict[str, Any], **_: Any) -> None:
    parsed.pop("ChecksumSHA256", None)


def test_an_upload_the_server_does_not_vouch_for_is_read_back(s3_endpoint: S3Endpoint) -> None:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE) as tier:
        # As a server that ignores x-amz-checksum-sha256 would answer.
        tier.client.meta.events.register("after-call.s3", _strip_checksums)
        log = RequestLog(tier.client)
        data = content(11 * CHUNK_SIZE, seed=8)

        info = put_bytes(tier, data)

        layout = tier.layout(info.sha256)
        whole_reads = [request.key for request in log.of("GetObject") if request.range is None]
        assert whole_reads == [layout.data_key, layout.key]
        assert get_bytes(tier, info.sha256) == data


def test_an_upload_that_reads_back_wrong_is_refused_and_removed(
    s3_endpoint: S3Endpoint,
) -> None:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE) as tier:
        meddler = s3_endpoint.client()

        def damage_on_completion(parsed: dict[str, Any], **_: Any) -> None:
            parsed.pop("ChecksumSHA256", None)
            body = meddler.get_object(Bucket=tier.bucket, Key=parsed["Key"])["Body"].read()
            meddler.put_object(Bucket=tier.bucket, Key=parsed["Key"], Body=flip(body, 12345))

        tier.client.meta.events.register(
            "after-call.s3.CompleteMultipartUpload", damage_on_completion
        )
        data = content(11 * CHUNK_SIZE, seed=8)

        with pytest.raises(IntegrityError, match="reads back differently"):
            put_bytes(tier, data)

        assert tier.info(sha256_of(data)) is None
        assert bucket_is_empty(s3_endpoint)


def test_failed_and_aborted_large_puts_leave_nothing(s3_endpoint: S3Endpoint) -> None:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE) as tier:
        data = content(12 * CHUNK_SIZE, seed=4)

        writer = tier.writer()
        writer.write(data)
        writer.abort()
        with pytest.raises(IntegrityError), tier.writer() as mismatched:
            mismatched.write(data)
            mismatched.commit(sha256_of(b"other"))
        with pytest.raises(KeyboardInterrupt), tier.writer() as interrupted:
            interrupted.write(data)
            raise KeyboardInterrupt

        assert bucket_is_empty(s3_endpoint)


def test_a_duplicate_large_put_leaves_one_copy(s3_endpoint: S3Endpoint) -> None:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE) as tier:
        data = content(12 * CHUNK_SIZE, seed=5)
        results: list[bool] = []
        barrier = threading.Barrier(3)

        def put() -> None:
            with tier.writer() as writer:
                writer.write(data)
                barrier.wait()
                results.append(writer.commit()[1])

        threads = [threading.Thread(target=put) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with tier.writer() as writer:
            writer.write(data)
            results.append(writer.commit()[1])

        assert sorted(results) == [False, False, False, True]
        layout = tier.layout(sha256_of(data))
        assert sorted(keys(tier)) == sorted([layout.key, layout.data_key])
        assert get_bytes(tier, layout.chunks.sha256) == data


# -- damage ------------------------------------------------------------------------------------


@pytest.fixture
def large_tier(s3_endpoint: S3Endpoint) -> Iterator[ColdTier]:
    with cold_tier(s3_endpoint, part_size=MIN_PART_SIZE) as tier:
        yield tier


def _large_blob(tier: ColdTier) -> tuple[bytes, ColdLayout]:
    data = content(12 * CHUNK_SIZE, seed=6)
    info = put_bytes(tier, data)
    return data, tier.layout(info.sha256)


@pytest.mark.parametrize(
    ("cut", "damaged_chunk"),
    [(-1, 11), (-CHUNK_SIZE, 11), (-5 * CHUNK_SIZE - 7, 6), (+1, 12)],
    ids=["byte-short", "chunk-short", "many-chunks-short", "byte-long"],
)
def test_a_data_object_of_the_wrong_length_is_caught(
    large_tier: ColdTier, cut: int, damaged_chunk: int
) -> None:
    _, layout = _large_blob(large_tier)
    rewrite_object(
        large_tier,
        layout.data_key,
        lambda body: body[:cut] if cut < 0 else body + bytes(cut),
    )
    sha256 = layout.chunks.sha256

    for offset, length in [(0, None), (0, 1), (11 * CHUNK_SIZE, 1)]:
        with pytest.raises(IntegrityError, match=f"offset {damaged_chunk * CHUNK_SIZE}"):
            read_all(large_tier, sha256, offset, length)
    with pytest.raises(IntegrityError, match=str(sha256)):
        large_tier.verify(sha256)


def test_a_missing_data_object_is_damage_and_a_missing_index_is_absence(
    large_tier: ColdTier,
) -> None:
    _, layout = _large_blob(large_tier)
    sha256 = layout.chunks.sha256
    large_tier.client.delete_object(Bucket=large_tier.bucket, Key=layout.data_key)

    with pytest.raises(IntegrityError, match=f"{sha256}.*data object.*missing"):
        read_all(large_tier, sha256)
    large_tier.delete(sha256)
    assert large_tier.info(sha256) is None
    with pytest.raises(NotFound):
        large_tier.read(sha256)


def test_a_damaged_index_is_refused_and_can_still_be_deleted(large_tier: ColdTier) -> None:
    data, layout = _large_blob(large_tier)
    sha256 = layout.chunks.sha256
    rewrite_object(large_tier, layout.key, lambda body: flip(body, 60))

    with pytest.raises(IntegrityError, match=str(sha256)):
        large_tier.info(sha256)
    with pytest.raises(IntegrityError, match=str(sha256)):
        large_tier.read(sha256)

    large_tier.delete(sha256)
    assert large_tier.find_missing([sha256]) == [sha256]
    assert put_bytes(large_tier, data).sha256 == sha256
    assert get_bytes(large_tier, sha256) == data


def test_a_corrupt_compressed_chunk_is_caught(tier: ColdTier) -> None:
    data = compressible(3 * CHUNK_SIZE, seed=2)
    info = put_bytes(tier, data)
    assert all(extent.compressed for extent in tier.layout(info.sha256).extents)
    flip_stored_bit(tier, info.sha256, CHUNK_SIZE + 500)

    chunks = tier.read(info.sha256)
    assert next(chunks).data == data[:CHUNK_SIZE]
    with pytest.raises(IntegrityError, match=f"{info.sha256}.*offset {CHUNK_SIZE}"):
        next(chunks)


# -- keys --------------------------------------------------------------------------------------


def test_tiers_under_different_prefixes_keep_apart(s3_endpoint: S3Endpoint) -> None:
    with (
        cold_tier(s3_endpoint, prefix="one") as one,
        cold_tier(s3_endpoint, prefix="two/") as two,
    ):
        a = put_bytes(one, b"a").sha256
        b = put_bytes(two, b"b").sha256
        # Objects that are not blobs, beside them, are not listed as blobs.
        one.client.put_object(Bucket=one.bucket, Key="one/blobs/sha256/README", Body=b"x")

        assert list(one.digests()) == [a]
        assert list(two.digests()) == [b]
        assert one.find_missing([a, b]) == [b]


# -- outages -----------------------------------------------------------------------------------


@pytest.fixture(params=sorted(SERVERS))
def own_server(request: pytest.FixtureRequest) -> Iterator[S3Server]:
    """A server of the test's own, which it may stop and start."""
    with SERVERS[request.param]() as server:
        yield server


def test_a_stopped_server_makes_operations_unavailable_until_it_returns(
    own_server: S3Server,
) -> None:
    endpoint = own_server.create_bucket()
    with cold_tier(
        endpoint, part_size=MIN_PART_SIZE, max_attempts=2, connect_timeout=2, read_timeout=5
    ) as tier:
        kept = content(LARGE, seed=1)
        info = put_bytes(tier, kept)
        large = content(12 * CHUNK_SIZE, seed=2)
        writer = tier.writer()
        writer.write(large[: 6 * CHUNK_SIZE])  # one part uploaded

        own_server.halt()

        failures: list[Unavailable] = []
        for operation in (
            lambda: tier.info(info.sha256),
            lambda: tier.read(info.sha256),
            lambda: tier.find_missing([info.sha256, sha256_of(b"x")]),
            lambda: list(tier.digests()),
            lambda: tier.verify(info.sha256),
            lambda: tier.delete(info.sha256),
            lambda: put_bytes(tier, b"new"),
            lambda: (writer.write(large[6 * CHUNK_SIZE :]), writer.commit()),
        ):
            with pytest.raises(Unavailable) as raised:
                operation()
            failures.append(raised.value)
        for failure in failures:
            message = str(failure)
            assert message.startswith(f"cold tier {endpoint.url}/{endpoint.bucket}/{PREFIX}:")
            assert "\n" not in message

        own_server.resume()

        assert get_bytes(tier, info.sha256) == kept
        assert tier.verify(info.sha256) == info
        assert put_bytes(tier, large).size == len(large)
        assert set(tier.digests()) == {info.sha256, sha256_of(large)}
