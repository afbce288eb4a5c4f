"""The behaviour every BlobStore must show, whatever keeps the bytes. Each tier's test module
subclasses TierContract, provides a `store` fixture and implements `corrupt` for its medium."""

from __future__ import annotations

import hashlib
import itertools
import random
import threading

import blake3
import pytest

from vault.digest import Digest, blake3_of, sha256_of
from vault.errors import IntegrityError, InvalidArgument, NotFound
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList
from vault.store.protocol import BlobStore, get_bytes, put_bytes, put_many, read_range

SIZES = [0, 1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, CHUNK_SIZE * 7 // 2]
SIZE_IDS = ["empty", "one-byte", "chunk-less-1", "one-chunk", "chunk-plus-1", "3.5-chunks"]
LARGE = CHUNK_SIZE * 7 // 2
UNKNOWN = sha256_of(b"never stored")


def content(size: int, seed: int = 0) -> bytes:
    """Random bytes that differ from chunk to chunk, so a misplaced chunk cannot pass."""
    return random.Random(seed).randbytes(size)


def read_all(
    store: BlobStore, sha256: Digest, offset: int = 0, length: int | None = None
) -> list[Chunk]:
    return list(store.read(sha256, offset, length))


class TierContract:
    """Subclass as `TestSomeTier(TierContract)` and override both members below."""

    @pytest.fixture
    def store(self) -> BlobStore:
        raise NotImplementedError("a tier's test module provides the store under test")

    def corrupt(self, store: BlobStore, sha256: Digest, offset: int) -> None:
        """Change the stored copy's byte at `offset` behind the store's back."""
        raise NotImplementedError("a tier's test module knows how to damage its copies")

    # -- round trips ---------------------------------------------------------------------------

    @pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
    def test_round_trip(self, store: BlobStore, size: int) -> None:
        data = content(size)
        info = put_bytes(store, data)

        assert info.sha256 == Digest("sha256", hashlib.sha256(data).hexdigest())
        assert info.blake3 == Digest("blake3", blake3.blake3(data).hexdigest())
        assert info.size == size
        assert store.info(info.sha256) == info
        chunks = read_all(store, info.sha256)
        assert [chunk.offset for chunk in chunks] == list(range(0, size, CHUNK_SIZE))
        assert b"".join(chunk.data for chunk in chunks) == data
        assert all(chunk.hash == blake3.blake3(chunk.data).digest() for chunk in chunks)
        assert store.verify(info.sha256) == info

    @pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
    def test_chunk_list_describes_the_blob(self, store: BlobStore, size: int) -> None:
        data = content(size)
        info = put_bytes(store, data)

        chunks = store.chunk_list(info.sha256)
        assert (chunks.sha256, chunks.blake3, chunks.size) == (info.sha256, info.blake3, size)
        assert chunks.chunk_size == CHUNK_SIZE
        assert chunks.hashes == tuple(
            blake3.blake3(data[start : start + CHUNK_SIZE]).digest()
            for start in range(0, size, CHUNK_SIZE)
        )

    def test_chunk_list_encoding_is_self_checked_and_bound_to_its_blob(
        self, store: BlobStore
    ) -> None:
        info = put_bytes(store, content(LARGE))
        encoded = store.chunk_list(info.sha256).encode()

        assert ChunkList.decode(encoded, info.sha256) == store.chunk_list(info.sha256)
        with pytest.raises(IntegrityError, match="names another blob"):
            ChunkList.decode(encoded, UNKNOWN)
        for damaged in (
            encoded[:-1],
            encoded[:10],
            encoded[:100] + bytes([encoded[100] ^ 1]) + encoded[101:],
            encoded[:-32] + bytes(32),
        ):
            with pytest.raises(IntegrityError, match=str(info.sha256)):
                ChunkList.decode(damaged, info.sha256)

    def test_writes_of_any_size_and_kind_make_the_same_blob(self, store: BlobStore) -> None:
        data = content(LARGE, seed=1)
        cuts = [0, 1, 1, 4096, CHUNK_SIZE + 3, CHUNK_SIZE + 3, 2 * CHUNK_SIZE, LARGE]
        with store.writer() as writer:
            for number, (start, end) in enumerate(itertools.pairwise(cuts)):
                piece = data[start:end]
                if number % 3 == 0:
                    writer.write(piece)
                elif number % 3 == 1:
                    writer.write(memoryview(piece))
                else:
                    # A caller may reuse its buffer as soon as write returns.
                    buffer = bytearray(piece)
                    writer.write(memoryview(buffer))
                    buffer[:] = bytes(len(buffer))
            info, created = writer.commit()

        assert created
        assert info == BlobInfo(sha256_of(data), blake3_of(data), LARGE)
        assert get_bytes(store, info.sha256) == data

    # -- ranges ------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("offset", "length"),
        [
            (0, 0),
            (0, 1),
            (CHUNK_SIZE - 1, 1),
            (CHUNK_SIZE - 1, 2),
            (CHUNK_SIZE, CHUNK_SIZE),
            (CHUNK_SIZE, None),
            (CHUNK_SIZE + 1, 2 * CHUNK_SIZE),
            (3 * CHUNK_SIZE, CHUNK_SIZE // 2),
            (1, LARGE - 1),
            (LARGE - 1, None),
            (LARGE, 0),
            (LARGE, None),
        ],
    )
    def test_range_reads_yield_the_whole_chunks_covering_the_range(
        self, store: BlobStore, offset: int, length: int | None
    ) -> None:
        data = content(LARGE)
        info = put_bytes(store, data)
        end = LARGE if length is None else offset + length

        chunks = read_all(store, info.sha256, offset, length)

        covering = range(offset // CHUNK_SIZE, -(-end // CHUNK_SIZE)) if end > offset else []
        assert [chunk.offset for chunk in chunks] == [index * CHUNK_SIZE for index in covering]
        for chunk in chunks:
            assert chunk.data == data[chunk.offset : chunk.offset + CHUNK_SIZE]
        assert b"".join(read_range(store, info.sha256, offset, length)) == data[offset:end]

    @pytest.mark.parametrize(
        ("offset", "length"),
        [
            (LARGE + 1, None),
            (LARGE, 1),
            (0, LARGE + 1),
            (CHUNK_SIZE, LARGE),
        ],
    )
    def test_range_beyond_the_blob_is_refused_naming_its_size(
        self, store: BlobStore, offset: int, length: int | None
    ) -> None:
        info = put_bytes(store, content(LARGE))
        with pytest.raises(InvalidArgument, match=f"{LARGE} bytes"):
            store.read(info.sha256, offset, length)

    @pytest.mark.parametrize(("offset", "length"), [(-1, None), (0, -1)])
    def test_negative_range_is_refused(
        self, store: BlobStore, offset: int, length: int | None
    ) -> None:
        info = put_bytes(store, content(10))
        with pytest.raises(InvalidArgument):
            store.read(info.sha256, offset, length)

    # -- storing once ------------------------------------------------------------------------

    def test_same_content_twice_is_stored_once(self, store: BlobStore) -> None:
        data = content(CHUNK_SIZE + 1)
        with store.writer() as writer:
            writer.write(data)
            first, created_first = writer.commit()
        with store.writer() as writer:
            writer.write(data)
            second, created_second = writer.commit()

        assert (created_first, created_second) == (True, False)
        assert first == second
        assert list(store.digests()) == [first.sha256]
        assert get_bytes(store, first.sha256) == data

    def test_concurrent_puts_of_the_same_content_store_it_once_and_one_reports_it(
        self, store: BlobStore
    ) -> None:
        data = content(LARGE, seed=2)
        results: list[tuple[BlobInfo, bool]] = []
        errors: list[BaseException] = []

        # All four have written everything before any commits, so the commits race.
        ready = threading.Barrier(4)

        def put() -> None:
            try:
                with store.writer() as writer:
                    writer.write(data)
                    ready.wait()
                    results.append(writer.commit())
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=put) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert errors == []
        assert {info for info, _ in results} == {BlobInfo(sha256_of(data), blake3_of(data), LARGE)}
        assert sorted(created for _, created in results) == [False, False, False, True]
        assert list(store.digests()) == [sha256_of(data)]
        assert get_bytes(store, sha256_of(data)) == data

    @pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
    def test_expected_digest_is_checked(self, store: BlobStore, algorithm: str) -> None:
        data = content(CHUNK_SIZE + 1)
        expected = sha256_of(data) if algorithm == "sha256" else blake3_of(data)
        info = put_bytes(store, data, expected=expected)
        assert info.sha256 == sha256_of(data)

    @pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
    def test_expected_digest_mismatch_stores_nothing(
        self, store: BlobStore, algorithm: str
    ) -> None:
        kept = put_bytes(store, content(5, seed=9))
        data = content(CHUNK_SIZE + 1)
        other = content(CHUNK_SIZE + 1, seed=3)
        expected = sha256_of(other) if algorithm == "sha256" else blake3_of(other)
        actual = sha256_of(data) if algorithm == "sha256" else blake3_of(data)

        with pytest.raises(IntegrityError) as raised, store.writer() as writer:
            writer.write(data)
            writer.commit(expected)

        assert str(expected) in str(raised.value)
        assert str(actual) in str(raised.value)
        assert store.info(sha256_of(data)) is None
        assert list(store.digests()) == [kept.sha256]

    def test_expected_digest_mismatch_leaves_an_existing_copy_alone(self, store: BlobStore) -> None:
        data = content(CHUNK_SIZE + 1)
        info = put_bytes(store, data)
        with pytest.raises(IntegrityError):
            put_bytes(store, data, expected=sha256_of(b"something else"))
        assert store.info(info.sha256) == info
        assert get_bytes(store, info.sha256) == data

    # -- visibility and aborts ---------------------------------------------------------------

    def test_blob_is_invisible_until_committed(self, store: BlobStore) -> None:
        data = content(LARGE)
        sha256 = sha256_of(data)
        with store.writer() as writer:
            writer.write(data)
            assert store.info(sha256) is None
            assert store.find_missing([sha256]) == [sha256]
            assert list(store.digests()) == []
            writer.commit()
        assert store.find_missing([sha256]) == []

    def test_abort_stores_nothing(self, store: BlobStore) -> None:
        data = content(LARGE)
        writer = store.writer()
        writer.write(data)
        writer.abort()
        writer.abort()

        with store.writer() as unfinished:
            unfinished.write(data)

        with pytest.raises(RuntimeError, match="interrupted"), store.writer() as failing:
            failing.write(data)
            raise RuntimeError("interrupted")

        assert store.info(sha256_of(data)) is None
        assert list(store.digests()) == []

    def test_writer_refuses_use_after_commit(self, store: BlobStore) -> None:
        with store.writer() as writer:
            writer.write(b"x")
            writer.commit()
            with pytest.raises(ValueError):
                writer.write(b"y")
            with pytest.raises(ValueError):
                writer.commit()

    # -- lookups -----------------------------------------------------------------------------

    def test_find_missing(self, store: BlobStore) -> None:
        a = put_bytes(store, b"a").sha256
        b = put_bytes(store, b"b").sha256
        x, y = sha256_of(b"x"), sha256_of(b"y")
        assert store.find_missing([a, x, b, y, x]) == [x, y]
        assert store.find_missing([]) == []

    def test_unknown_blob(self, store: BlobStore) -> None:
        assert store.info(UNKNOWN) is None
        with pytest.raises(NotFound, match=UNKNOWN.hex):
            store.read(UNKNOWN)
        with pytest.raises(NotFound):
            store.chunk_list(UNKNOWN)
        with pytest.raises(NotFound):
            store.verify(UNKNOWN)
        with pytest.raises(NotFound):
            store.delete(UNKNOWN)

    def test_only_sha256_digests_address_a_tier(self, store: BlobStore) -> None:
        data = content(3)
        put_bytes(store, data)
        with pytest.raises(InvalidArgument):
            store.info(blake3_of(data))
        with pytest.raises(InvalidArgument):
            store.read(blake3_of(data))
        with pytest.raises(InvalidArgument):
            store.info(Digest("sha256", "../" + "0" * 61))

    def test_digests_lists_every_stored_blob_once(self, store: BlobStore) -> None:
        stored = {put_bytes(store, content(size, seed=size)).sha256 for size in (0, 1, 2, 4097)}
        put_bytes(store, content(1, seed=1))
        listed = list(store.digests())
        assert len(listed) == len(set(listed))
        assert set(listed) == stored

    def test_delete(self, store: BlobStore) -> None:
        kept = put_bytes(store, content(7, seed=1))
        data = content(CHUNK_SIZE + 1)
        gone = put_bytes(store, data)

        store.delete(gone.sha256)

        assert store.info(gone.sha256) is None
        assert store.find_missing([gone.sha256, kept.sha256]) == [gone.sha256]
        assert list(store.digests()) == [kept.sha256]
        with pytest.raises(NotFound):
            store.read(gone.sha256)
        with store.writer() as writer:
            writer.write(data)
            assert writer.commit() == (gone, True)

    # -- damage ------------------------------------------------------------------------------

    def test_a_corrupt_byte_is_never_yielded(self, store: BlobStore) -> None:
        data = content(LARGE)
        info = put_bytes(store, data)
        damaged_at = 2 * CHUNK_SIZE + 12345
        self.corrupt(store, info.sha256, damaged_at)

        yielded: list[Chunk] = []
        with pytest.raises(IntegrityError) as raised:
            for chunk in store.read(info.sha256):
                yielded.append(chunk)

        message = str(raised.value)
        assert str(info.sha256) in message
        assert f"offset {2 * CHUNK_SIZE}" in message
        assert [chunk.offset for chunk in yielded] == [0, CHUNK_SIZE]
        assert b"".join(chunk.data for chunk in yielded) == data[: 2 * CHUNK_SIZE]
        with pytest.raises(IntegrityError):
            read_all(store, info.sha256, damaged_at, 1)
        with pytest.raises(IntegrityError, match=str(info.sha256)):
            store.verify(info.sha256)

    def test_a_corrupt_small_blob_is_refused(self, store: BlobStore) -> None:
        info = put_bytes(store, b"z")
        self.corrupt(store, info.sha256, 0)
        with pytest.raises(IntegrityError, match="offset 0"):
            read_all(store, info.sha256)

    # -- batches (storage.put_many: a store's own batch, or one writer per blob) --------------

    def test_a_batch_stores_every_blob_and_reports_each_in_order(self, store: BlobStore) -> None:
        old = put_bytes(store, content(300, seed=1))
        sizes = [0, 1, 4096, CHUNK_SIZE, CHUNK_SIZE + 1, 300]
        blobs = [content(size, seed=size + 7) for size in sizes[:-1]] + [content(300, seed=1)]
        twice = blobs[2]

        results = put_many(store, [(data, None) for data in [*blobs, twice]])

        assert [result[1] for result in results if isinstance(result, tuple)] == [
            True, True, True, True, True, False, False
        ]  # fmt: skip
        for data, result in zip([*blobs, twice], results, strict=True):
            assert isinstance(result, tuple)
            info = result[0]
            assert info == BlobInfo(sha256_of(data), blake3_of(data), len(data))
            assert store.info(info.sha256) == info
            assert get_bytes(store, info.sha256) == data
            assert store.chunk_list(info.sha256).info == info
            assert store.verify(info.sha256) == info
        assert results[-2] == (old, False)
        assert set(store.digests()) == {sha256_of(data) for data in blobs}

    @pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
    def test_a_batch_refuses_a_mismatched_blob_alone_and_leaves_nothing_of_it(
        self, store: BlobStore, algorithm: str
    ) -> None:
        good, bad, other = content(1000, seed=1), content(2000, seed=2), content(2000, seed=3)
        of = sha256_of if algorithm == "sha256" else blake3_of

        results = put_many(store, [(good, of(good)), (bad, of(other)), (good, None)])

        assert isinstance(results[1], IntegrityError)
        assert str(of(other)) in str(results[1]) and str(of(bad)) in str(results[1])
        assert results[0] == (BlobInfo(sha256_of(good), blake3_of(good), 1000), True)
        assert results[2] == (results[0][0], False)
        assert store.info(sha256_of(bad)) is None
        assert store.find_missing([sha256_of(bad), sha256_of(good)]) == [sha256_of(bad)]
        assert list(store.digests()) == [sha256_of(good)]

    def test_a_batch_of_stored_blobs_creates_nothing(self, store: BlobStore) -> None:
        blobs = [content(100 + n, seed=n) for n in range(20)]
        first = put_many(store, [(data, sha256_of(data)) for data in blobs])
        again = put_many(store, [(data, sha256_of(data)) for data in blobs])
        assert all(isinstance(result, tuple) and result[1] for result in first)
        assert again == [(result[0], False) for result in first if isinstance(result, tuple)]
        assert set(store.digests()) == {sha256_of(data) for data in blobs}
