"""The tier manager: the shared tier contract over [hot, warm], then read-time repair with real
damaged files: a flipped bit, a truncated or deleted copy, damage on every tier, scrubs, and a
run of random single-bit faults in which no corrupt byte may reach a caller."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_hot_tier import blob_file
from tests.test_warm_tier import change_byte
from tests.tier_contract import LARGE, TierContract, content
from tiers.hot import HotTier
from tiers.manager import ScrubReport, TierManager
from tiers.warm import WarmTier
from vault.digest import Digest
from vault.errors import IntegrityError
from vault.store.chunks import CHUNK_SIZE, Chunk
from vault.store.protocol import BlobStore, get_bytes, put_bytes, read_range


def flip_bit(store: BlobStore, sha256: Digest, offset: int, bit: int = 6) -> None:
    """Flip one bit of the stored byte at blob offset `offset`, behind the tier's back."""
    if isinstance(store, HotTier):
        change_byte(blob_file(store, sha256), offset, lambda byte: byte ^ (1 << bit))
        return
    assert isinstance(store, WarmTier)
    frame = store.locate(sha256).frames[offset // CHUNK_SIZE]
    # The test blobs are random bytes, which the archive keeps uncompressed.
    assert not frame.compressed
    change_byte(
        store.locate(sha256).pack, frame.offset + offset % CHUNK_SIZE, lambda b: b ^ (1 << bit)
    )


@pytest.fixture
def hot(tmp_path: Path) -> HotTier:
    return HotTier(tmp_path / "hot")


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[WarmTier]:
    with WarmTier(tmp_path / "warm") as opened:
        yield opened


@pytest.fixture
def manager(tmp_path: Path, hot: HotTier, warm: WarmTier) -> Iterator[TierManager]:
    with TierManager([("hot", hot), ("warm", warm)], journal=tmp_path / "journal.sqlite") as opened:
        yield opened


class TestTierManagerContract(TierContract):
    @pytest.fixture
    def store(self, manager: TierManager) -> BlobStore:
        return manager

    def corrupt(self, store: BlobStore, sha256: Digest, offset: int) -> None:
        assert isinstance(store, TierManager)
        flip_bit(store.tiers[0], sha256, offset)


def on_both(manager: TierManager, warm: WarmTier, data: bytes) -> Digest:
    """Store a blob through the manager (so in hot) and in warm as its second copy."""
    sha256 = put_bytes(manager, data).sha256
    assert put_bytes(warm, data).sha256 == sha256
    return sha256


def check_chunks(chunks: list[Chunk], data: bytes) -> None:
    for chunk in chunks:
        assert chunk.data == data[chunk.offset : chunk.offset + CHUNK_SIZE]


# -- one damaged copy --------------------------------------------------------------------------


def test_a_flipped_bit_in_the_hot_copy_is_served_from_warm_and_rewritten(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE)
    sha256 = on_both(manager, warm, data)
    flip_bit(hot, sha256, 12345)
    with pytest.raises(IntegrityError):
        get_bytes(hot, sha256)

    assert get_bytes(manager, sha256) == data

    assert get_bytes(hot, sha256) == data
    assert hot.verify(sha256).sha256 == sha256
    (record,) = manager.journal.records()
    assert (record.digest, record.tier, record.offset) == (sha256, "hot", 0)
    assert "damaged" in record.found
    assert "rewrote it from warm" in record.action
    assert (manager.stats.faults, manager.stats.repaired, manager.stats.unrepairable) == (1, 1, 0)
    # Repaired, so the next read finds nothing to do.
    assert get_bytes(manager, sha256) == data
    assert len(manager.journal.records()) == 1


def test_damage_in_a_middle_chunk_resumes_at_that_chunk(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=4)
    sha256 = on_both(manager, warm, data)
    flip_bit(hot, sha256, 2 * CHUNK_SIZE + 777)

    chunks = list(manager.read(sha256))

    assert [chunk.offset for chunk in chunks] == [0, CHUNK_SIZE, 2 * CHUNK_SIZE, 3 * CHUNK_SIZE]
    assert b"".join(chunk.data for chunk in chunks) == data
    (record,) = manager.journal.records()
    assert (record.tier, record.offset) == ("hot", 2 * CHUNK_SIZE)
    assert get_bytes(hot, sha256) == data


def test_a_range_read_over_the_damaged_chunk(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=5)
    sha256 = on_both(manager, warm, data)
    flip_bit(hot, sha256, 2 * CHUNK_SIZE + 100, bit=0)
    offset, length = 2 * CHUNK_SIZE - 10, CHUNK_SIZE

    chunks = list(manager.read(sha256, offset, length))

    assert [chunk.offset for chunk in chunks] == [CHUNK_SIZE, 2 * CHUNK_SIZE]
    check_chunks(chunks, data)
    assert b"".join(read_range(manager, sha256, offset, length)) == data[offset : offset + length]
    (record,) = manager.journal.records()
    assert (record.tier, record.offset) == ("hot", 2 * CHUNK_SIZE)
    assert get_bytes(hot, sha256) == data


def test_a_truncated_hot_copy_is_rewritten(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=6)
    sha256 = on_both(manager, warm, data)
    os.truncate(blob_file(hot, sha256), LARGE - 1000)

    assert get_bytes(manager, sha256) == data

    assert get_bytes(hot, sha256) == data
    (record,) = manager.journal.records()
    assert record.tier == "hot"
    assert f"{LARGE - 1000} bytes" in record.found
    assert manager.stats.repaired == 1


def test_a_hot_copy_deleted_behind_the_managers_back_is_rewritten(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=7)
    sha256 = on_both(manager, warm, data)
    blob_file(hot, sha256).unlink()

    assert get_bytes(manager, sha256) == data

    assert get_bytes(hot, sha256) == data
    (record,) = manager.journal.records()
    assert record.tier == "hot"
    assert record.found.startswith("missing")
    assert manager.stats.repaired == 1


def test_a_hot_copy_deleted_under_a_reader_is_resumed_from_warm(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=8)
    sha256 = on_both(manager, warm, data)
    reading = manager.read(sha256)
    blob_file(hot, sha256).unlink()

    chunks = list(reading)

    assert [chunk.offset for chunk in chunks] == list(range(0, LARGE, CHUNK_SIZE))
    assert b"".join(chunk.data for chunk in chunks) == data
    assert get_bytes(hot, sha256) == data
    (record,) = manager.journal.records()
    assert (record.tier, record.offset) == ("hot", 0)


def test_a_blob_only_in_warm_is_served_without_a_fault(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(CHUNK_SIZE + 5, seed=9)
    sha256 = put_bytes(warm, data).sha256

    assert get_bytes(manager, sha256) == data
    assert manager.verify(sha256).sha256 == sha256

    assert hot.info(sha256) is None
    assert manager.journal.records() == []
    assert manager.stats.faults == 0


def test_the_fault_is_journaled_before_the_damaged_copy_is_deleted(
    manager: TierManager, hot: HotTier, warm: WarmTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = content(CHUNK_SIZE + 1, seed=11)
    sha256 = on_both(manager, warm, data)
    flip_bit(hot, sha256, CHUNK_SIZE)
    journaled_at_delete: list[int] = []
    real_delete = hot.delete

    def delete(digest: Digest) -> None:
        journaled_at_delete.append(len(manager.journal.records()))
        real_delete(digest)

    monkeypatch.setattr(hot, "delete", delete)

    assert get_bytes(manager, sha256) == data
    assert journaled_at_delete == [1]


def test_concurrent_reads_of_a_damaged_copy_repair_it_once(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=12)
    sha256 = on_both(manager, warm, data)
    flip_bit(hot, sha256, 3 * CHUNK_SIZE + 9)
    readers = 6
    barrier = threading.Barrier(readers)
    results: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:
        barrier.wait()
        try:
            results.append(get_bytes(manager, sha256))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=read) for _ in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert results == [data] * readers
    assert get_bytes(hot, sha256) == data
    assert len(manager.journal.records()) == 1
    assert (manager.stats.faults, manager.stats.repaired) == (1, 1)


# -- no good copy ------------------------------------------------------------------------------


def test_damage_on_every_tier_is_data_loss_and_no_corrupt_byte_is_yielded(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    data = content(LARGE, seed=10)
    sha256 = on_both(manager, warm, data)
    flip_bit(hot, sha256, 2 * CHUNK_SIZE + 1)
    flip_bit(warm, sha256, 2 * CHUNK_SIZE + 2)

    yielded: list[Chunk] = []
    with pytest.raises(IntegrityError, match=f"no tier holds a good copy of {sha256}"):
        for chunk in manager.read(sha256):
            yielded.append(chunk)

    assert [chunk.offset for chunk in yielded] == [0, CHUNK_SIZE]
    check_chunks(yielded, data)
    records = manager.journal.records()
    assert [(record.tier, record.offset) for record in records] == [
        ("hot", 2 * CHUNK_SIZE),
        ("warm", 2 * CHUNK_SIZE),
    ]
    assert all(record.digest == sha256 for record in records)
    assert all("data loss" in record.action for record in records)
    assert (manager.stats.faults, manager.stats.repaired, manager.stats.unrepairable) == (2, 0, 2)
    # The damaged copies are kept: they are all there is.
    assert hot.find_missing([sha256]) == []
    assert warm.find_missing([sha256]) == []
    with pytest.raises(IntegrityError, match=str(sha256)):
        manager.verify(sha256)


# -- verify and scrub --------------------------------------------------------------------------


def test_scrub_finds_and_repairs_damage_on_both_tiers(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    blobs = {
        on_both(manager, warm, content(size, seed=size)): content(size, seed=size)
        for size in (1, CHUNK_SIZE, LARGE)
    }
    damaged_hot, damaged_warm, _ = list(blobs)
    flip_bit(hot, damaged_hot, 0)
    flip_bit(warm, damaged_warm, CHUNK_SIZE - 1)
    seen: list[Digest] = []

    report = manager.scrub(progress=seen.append)

    assert report == ScrubReport(checked=3, faults=2, repaired=2, unrepairable=0)
    assert sorted(seen, key=str) == sorted(blobs, key=str)
    for sha256, data in blobs.items():
        assert get_bytes(hot, sha256) == data
        assert get_bytes(warm, sha256) == data
    assert {(record.digest, record.tier) for record in manager.journal.records()} == {
        (damaged_hot, "hot"),
        (damaged_warm, "warm"),
    }
    assert manager.scrub() == ScrubReport(checked=3, faults=0, repaired=0, unrepairable=0)


def test_scrub_reports_a_placed_blob_that_every_tier_lost(
    manager: TierManager, hot: HotTier
) -> None:
    sha256 = put_bytes(manager, content(100)).sha256
    blob_file(hot, sha256).unlink()

    assert manager.scrub() == ScrubReport(checked=1, faults=1, repaired=0, unrepairable=1)
    (record,) = manager.journal.records()
    assert (record.digest, record.tier) == (sha256, "hot")
    assert "data loss" in record.action


# -- random faults -----------------------------------------------------------------------------


def test_no_corrupt_byte_is_served_across_random_single_bit_faults(
    manager: TierManager, hot: HotTier, warm: WarmTier
) -> None:
    rng = random.Random(20261121)
    blobs = {}
    for number, size in enumerate((1, 4096, CHUNK_SIZE + 1, LARGE)):
        data = content(size, seed=100 + number)
        blobs[on_both(manager, warm, data)] = data
    digests = list(blobs)
    copies: list[BlobStore] = [hot, warm]
    faults = 50
    served = corrupt_served = caught_by_read = 0

    for _ in range(faults):
        sha256 = rng.choice(digests)
        data = blobs[sha256]
        tier = rng.choice(copies)
        flip_bit(tier, sha256, rng.randrange(len(data)), bit=rng.randrange(8))
        before = manager.stats.faults
        offset = rng.randrange(len(data))
        length = rng.choice([None, rng.randrange(len(data) - offset + 1)])
        for chunk in manager.read(sha256, offset, length):
            expected = data[chunk.offset : chunk.offset + len(chunk.data)]
            served += len(chunk.data)
            if chunk.data != expected:
                corrupt_served += sum(a != b for a, b in zip(chunk.data, expected, strict=True))
        caught_by_read += manager.stats.faults - before
        # Damage the read did not pass over (a warm copy, another range) is found here.
        manager.verify(sha256)

    print(
        f"{faults} faults: {manager.stats.faults} detected ({caught_by_read} by reads), "
        f"{manager.stats.repaired} repaired, {manager.stats.unrepairable} unrepairable, "
        f"{served} bytes served, {corrupt_served} corrupt"
    )
    assert corrupt_served == 0
    assert (manager.stats.faults, manager.stats.repaired) == (faults, faults)
    assert manager.stats.unrepairable == 0
    assert len(manager.journal.records()) == faults
    for sha256, data in blobs.items():
        assert get_bytes(hot, sha256) == data
        assert get_bytes(warm, sha256) == data


def test_a_hot_chunk_list_rebuilt_from_sound_bytes_is_journaled_as_a_repair(
    manager: TierManager, hot: HotTier
) -> None:
    data = content(LARGE, seed=21)
    sha256 = put_bytes(manager, data).sha256
    chunks = blob_file(hot, sha256).with_suffix(".chunks")
    chunks.chmod(0o644)
    listed = bytearray(chunks.read_bytes())
    listed[100] ^= 0x01
    chunks.write_bytes(listed)

    assert get_bytes(manager, sha256) == data
    (damaged,) = manager.journal.records(sha256)
    assert (damaged.tier, damaged.found) == ("hot", "chunk list damaged")
    assert damaged.action == "chunk list rebuilt from the bytes, which match the digest"

    chunks.unlink()
    assert get_bytes(manager, sha256) == data
    assert [r.found for r in manager.journal.records(sha256)] == [
        "chunk list damaged",
        "chunk list lost",
    ]
    assert chunks.exists()
    assert (manager.stats.faults, manager.stats.repaired) == (2, 2)
