"""The warm tier: the shared tier contract, then what only an append-only archive can show (its
packs and their sealing, compression, tombstones, group commit, and recovery from a crash)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import sqlite3
import stat
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tier_contract import LARGE, TierContract, content, read_all
from tiers.warm import PACK_SUFFIX, WarmTier, _index
from vault.digest import Digest, sha256_of
from vault.errors import FailedPrecondition, IntegrityError, NotFound, Unavailable
from vault.store.chunks import CHUNK_SIZE, BlobInfo
from vault.store.protocol import BlobStore, get_bytes, put_bytes, put_file, read_range

# The trailer of a record: 4 bytes per chunk, then a 56-byte footer.
FOOTER = 56


def compressible(size: int, seed: int = 0) -> bytes:
    """Text like a run's metrics log: it shrinks several times over, and no two chunks match."""
    rng = random.Random(seed)
    lines = []
    total = 0
    step = 0
    while total < size:
        line = (
            f'{{"run": "r{seed}", "step": {step}, "loss": {rng.random():.6f}, '
            f'"lr": {rng.choice(["1e-3", "5e-4", "1e-4"])}}}\n'
        )
        lines.append(line)
        total += len(line)
        step += 1
    return "".join(lines).encode()[:size]


def change_byte(path: Path, offset: int, change: Callable[[int], int]) -> None:
    """Change one byte of a file behind the tier's back, read-only or not."""
    mode = stat.S_IMODE(path.stat().st_mode)
    path.chmod(mode | stat.S_IWUSR)
    try:
        with path.open("r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([change(byte)]))
    finally:
        path.chmod(mode)


def flip_byte(path: Path, offset: int) -> None:
    change_byte(path, offset, lambda byte: byte ^ 0x40)


def stored_frame(tier: WarmTier, sha256: Digest, index: int) -> bytes:
    record = tier.locate(sha256)
    with record.pack.open("rb") as f:
        f.seek(record.frames[index].offset)
        return f.read(record.frames[index].length)


def corrupt_chunk_byte(tier: WarmTier, sha256: Digest, offset: int) -> None:
    """Damage the stored byte at blob offset `offset`: in place in a raw chunk, in the middle of
    the frame in a compressed one."""
    record = tier.locate(sha256)
    frame = record.frames[offset // CHUNK_SIZE]
    if frame.compressed:
        flip_byte(record.pack, frame.offset + frame.length // 2)
    else:
        flip_byte(record.pack, frame.offset + offset % CHUNK_SIZE)


def packs(tier: WarmTier) -> list[Path]:
    return sorted((tier.root / "archive").glob(f"*{PACK_SUFFIX}"))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def snapshot(tier: WarmTier, target: Path) -> Path:
    """The folder as a power cut would leave it at this moment: every file's bytes, but not the
    index's shared-memory file, which lives only as long as the processes using it."""
    shutil.copytree(tier.root, target, ignore=shutil.ignore_patterns("*-shm", "lock"))
    return target


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[WarmTier]:
    with WarmTier(tmp_path / "warm") as opened:
        yield opened


class TestWarmTierContract(TierContract):
    @pytest.fixture
    def store(self, tier: WarmTier) -> BlobStore:
        return tier

    def corrupt(self, store: BlobStore, sha256: Digest, offset: int) -> None:
        assert isinstance(store, WarmTier)
        corrupt_chunk_byte(store, sha256, offset)


# -- packs and files ---------------------------------------------------------------------------


def test_small_blobs_are_packed_into_few_files(tier: WarmTier) -> None:
    blobs = [content(1024, seed=n) for n in range(1000)]
    infos = [put_bytes(tier, data) for data in blobs[:500]]
    infos += [info for info, _ in tier.put_many(blobs[500:])]

    assert len(packs(tier)) == 1
    assert {tier.locate(info.sha256).pack for info in infos} == set(packs(tier))
    for info, data in zip(infos, blobs, strict=True):
        assert get_bytes(tier, info.sha256) == data
    assert os.listdir(tier.root / "tmp") == []


def test_a_large_blob_gets_a_file_of_its_own(tier: WarmTier) -> None:
    small = put_bytes(tier, content(CHUNK_SIZE))
    large = put_bytes(tier, content(CHUNK_SIZE + 1))

    small_record = tier.locate(small.sha256)
    large_record = tier.locate(large.sha256)
    assert large_record.pack != small_record.pack
    assert (large_record.offset, large_record.length) == (0, large_record.pack.stat().st_size)
    assert len(packs(tier)) == 2


def test_packs_are_sealed_read_only_when_full(tmp_path: Path) -> None:
    limit = 64 << 10
    with WarmTier(tmp_path / "warm", pack_limit=limit) as tier:
        infos = [put_bytes(tier, content(4096, seed=n)) for n in range(60)]
        large = put_bytes(tier, content(2 * CHUNK_SIZE))

        *sealed, open_pack = (
            path for path in packs(tier) if path != tier.locate(large.sha256).pack
        )
        assert len(sealed) >= 3
        assert [mode(path) for path in sealed] == [0o444] * len(sealed)
        assert all(path.stat().st_size <= limit for path in sealed)
        assert mode(open_pack) & stat.S_IWUSR
        assert mode(tier.locate(large.sha256).pack) == 0o444
        sizes = {path: path.stat().st_size for path in sealed}

        more = [put_bytes(tier, content(4096, seed=100 + n)) for n in range(20)]

        # Sealed packs are never written again; new blobs go to new packs.
        assert {path: path.stat().st_size for path in sealed} == sizes
        assert not {tier.locate(info.sha256).pack for info in more} & set(sealed)
        for n, info in enumerate(infos):
            assert get_bytes(tier, info.sha256) == content(4096, seed=n)


def test_a_full_open_pack_is_sealed_at_open(tmp_path: Path) -> None:
    with WarmTier(tmp_path / "warm", pack_limit=8192) as tier:
        put_bytes(tier, content(9000))
        (path,) = packs(tier)
        assert mode(path) & stat.S_IWUSR
    with WarmTier(tmp_path / "warm", pack_limit=8192):
        assert mode(path) == 0o444


def test_a_second_open_of_the_same_folder_is_refused(tier: WarmTier) -> None:
    with pytest.raises(Unavailable, match="already open"):
        WarmTier(tier.root)
    tier.close()
    with WarmTier(tier.root) as reopened:
        assert list(reopened.digests()) == []


# -- compression -------------------------------------------------------------------------------


def test_compression_saves_space_on_compressible_data(tier: WarmTier) -> None:
    data = compressible(LARGE)
    info = put_bytes(tier, data)

    record = tier.locate(info.sha256)
    assert record.compression == "zstd"
    assert all(frame.compressed for frame in record.frames)
    assert record.length < LARGE // 3
    assert get_bytes(tier, info.sha256) == data
    assert tier.verify(info.sha256) == info


def test_compression_is_skipped_on_random_data(tier: WarmTier) -> None:
    large = put_bytes(tier, content(LARGE))
    small = put_bytes(tier, content(1024))

    for info in (large, small):
        record = tier.locate(info.sha256)
        assert record.compression == "none"
        assert not any(frame.compressed for frame in record.frames)
        assert record.length == info.size + 4 * len(record.frames) + FOOTER


def test_compression_is_decided_chunk_by_chunk(tier: WarmTier) -> None:
    data = compressible(CHUNK_SIZE) + content(CHUNK_SIZE) + compressible(CHUNK_SIZE // 2, 1)
    info = put_bytes(tier, data)

    record = tier.locate(info.sha256)
    assert [frame.compressed for frame in record.frames] == [True, False, True]
    assert get_bytes(tier, info.sha256) == data


def test_small_compressible_blobs_are_compressed_in_their_pack(tier: WarmTier) -> None:
    blobs = [compressible(4096, seed=n) for n in range(50)]
    infos = [info for info, _ in tier.put_many(blobs)]

    (pack,) = packs(tier)
    assert pack.stat().st_size < sum(map(len, blobs)) // 2
    assert {tier.locate(info.sha256).compression for info in infos} == {"zstd"}
    assert [get_bytes(tier, info.sha256) for info in infos] == blobs


def test_a_range_read_decompresses_only_the_chunks_it_covers(
    tier: WarmTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = compressible(5 * CHUNK_SIZE)
    info = put_bytes(tier, data)
    record = tier.locate(info.sha256)
    # Damage elsewhere in the blob must not matter to a range that does not cover it.
    corrupt_chunk_byte(tier, info.sha256, 0)
    corrupt_chunk_byte(tier, info.sha256, 4 * CHUNK_SIZE)
    read: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        read.append(length)
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    start = 2 * CHUNK_SIZE + 1000
    got = b"".join(read_range(tier, info.sha256, start, 5000))
    monkeypatch.undo()

    assert got == data[start : start + 5000]
    assert sum(read) == record.frames[2].length + 4 * 5 + FOOTER
    with pytest.raises(IntegrityError, match="offset 0"):
        read_all(tier, info.sha256, 0, 1)
    with pytest.raises(IntegrityError, match=f"offset {4 * CHUNK_SIZE}"):
        read_all(tier, info.sha256, 4 * CHUNK_SIZE, 1)


def test_a_damaged_compressed_chunk_stops_the_read_before_it(tier: WarmTier) -> None:
    data = compressible(LARGE)
    info = put_bytes(tier, data)
    corrupt_chunk_byte(tier, info.sha256, 2 * CHUNK_SIZE + 10)

    chunks = tier.read(info.sha256)
    assert next(chunks).data == data[:CHUNK_SIZE]
    assert next(chunks).data == data[CHUNK_SIZE : 2 * CHUNK_SIZE]
    with pytest.raises(IntegrityError, match=f"{info.sha256}.*offset {2 * CHUNK_SIZE}"):
        next(chunks)
    with pytest.raises(IntegrityError, match=str(info.sha256)):
        tier.verify(info.sha256)


def _content_size_field(frame: bytes) -> tuple[int, int]:
    """Where a zstd frame header keeps the frame's content size (RFC 8878, 3.1.1.1)."""
    descriptor = frame[4]
    single_segment = descriptor >> 5 & 1
    size_field = {0: single_segment, 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    dictionary_field = {0: 0, 1: 1, 2: 2, 3: 4}[descriptor & 3]
    return 5 + (0 if single_segment else 1) + dictionary_field, size_field


def test_a_frame_claiming_a_huge_size_is_refused_before_any_allocation(tier: WarmTier) -> None:
    data = compressible(LARGE)
    info = put_bytes(tier, data)
    record = tier.locate(info.sha256)
    start, length = _content_size_field(stored_frame(tier, info.sha256, 1))
    assert length >= 2
    # The content size is little-endian: with its top byte set the frame claims gigabytes.
    change_byte(record.pack, record.frames[1].offset + start + length - 1, lambda _: 0x7F)

    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError, match=f"offset {CHUNK_SIZE} claims"):
            read_all(tier, info.sha256, CHUNK_SIZE, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * CHUNK_SIZE


def test_verify_checks_the_record_of_an_empty_blob(tier: WarmTier) -> None:
    info = put_bytes(tier, b"")
    record = tier.locate(info.sha256)
    flip_byte(record.pack, record.offset + 20)

    with pytest.raises(IntegrityError, match=str(info.sha256)):
        tier.verify(info.sha256)


def test_a_damaged_record_trailer_is_refused(tier: WarmTier) -> None:
    info = put_bytes(tier, content(LARGE))
    record = tier.locate(info.sha256)
    flip_byte(record.pack, record.offset + record.length - FOOTER - 3)

    with pytest.raises(IntegrityError, match=f"{info.sha256}.*checksum"):
        read_all(tier, info.sha256)
    with pytest.raises(IntegrityError, match=str(info.sha256)):
        tier.verify(info.sha256)


# -- tombstones --------------------------------------------------------------------------------


def test_delete_leaves_a_tombstone_and_the_bytes(tier: WarmTier) -> None:
    kept = put_bytes(tier, content(100, seed=1))
    data = content(100, seed=2)
    gone = put_bytes(tier, data)
    record = tier.locate(gone.sha256)
    size = record.pack.stat().st_size

    assert tier.reclaimable() == {}

    tier.delete(gone.sha256)

    assert tier.reclaimable() == {record.pack: record.length}
    assert tier.info(gone.sha256) is None
    assert tier.find_missing([gone.sha256, kept.sha256]) == [gone.sha256]
    assert list(tier.digests()) == [kept.sha256]
    with pytest.raises(NotFound):
        tier.read(gone.sha256)
    with pytest.raises(NotFound):
        tier.delete(gone.sha256)
    # Append-only: the record is still where it was.
    assert record.pack.stat().st_size == size
    with record.pack.open("rb") as f:
        f.seek(record.frames[0].offset)
        assert f.read(100) == data

    tier.close()
    with WarmTier(tier.root) as reopened:
        assert reopened.info(gone.sha256) is None
        assert reopened.info(kept.sha256) == kept
        assert reopened.reclaimable() == {record.pack: record.length}
        info, created = reopened.put_many([data])[0]
        assert (info, created) == (gone, True)
        assert reopened.locate(gone.sha256).offset > record.offset
        assert get_bytes(reopened, gone.sha256) == data
        # The old record is still dead weight; the new one is live.
        assert reopened.reclaimable() == {record.pack: record.length}


def test_compaction_removes_the_packs_left_with_deleted_records_alone(
    tier: WarmTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deleted large blob's pack of its own is removed, its bytes freed; a shared pack
    holding a live blob beside a deleted one stays whole, its live blob readable. A crash after
    the index forgot a pack and before its file went leaves a file the next open removes."""
    kept = put_bytes(tier, content(100, seed=1))
    small = put_bytes(tier, content(100, seed=2))
    large_data = [content(CHUNK_SIZE + 1, seed=3), content(CHUNK_SIZE + 5, seed=4)]
    large = [put_bytes(tier, data) for data in large_data]
    large_packs = [tier.locate(info.sha256).pack for info in large]
    shared = tier.locate(kept.sha256).pack
    small_length = tier.locate(small.sha256).length
    assert tier.compact() == 0

    for info in (small, *large):
        tier.delete(info.sha256)
    sizes = [pack.stat().st_size for pack in large_packs]
    # The first removal goes as a crash would cut it: the index forgets, the file stays.
    real_unlink = os.unlink
    cut = [str(large_packs[0])]

    def crash_once(path: str | os.PathLike[str]) -> None:
        if str(path) in cut:
            cut.clear()
            raise KeyboardInterrupt("killed between the index and the file")
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", crash_once)
    with pytest.raises(KeyboardInterrupt):
        tier.compact()
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert large_packs[0].exists()
    assert tier.compact() == sizes[1]
    assert not large_packs[1].exists()
    tier.close()
    with WarmTier(tier.root) as reopened:
        # The file the index no longer knows is removed at open.
        assert not large_packs[0].exists()
        assert shared.exists()
        assert get_bytes(reopened, kept.sha256) == content(100, seed=1)
        assert reopened.reclaimable() == {shared: small_length}
        assert reopened.compact() == 0
        # A blob put again after its pack went is stored anew.
        info, created = reopened.put_many([large_data[0]])[0]
        assert (info, created) == (large[0], True)
        assert get_bytes(reopened, large[0].sha256) == large_data[0]


def test_compaction_rewrites_a_mostly_deleted_shared_pack_and_its_live_blobs_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sealed shared pack most of whose blobs are deleted has its live records copied to
    the open pack and goes; every live blob reads back whole, from its new place, after a
    reopen too. A crash after the copies and before the index moves them loses nothing: the
    old pack still serves them, and the bytes copied are cut off at open."""
    limit = 64 << 10
    with WarmTier(tmp_path / "warm", pack_limit=limit) as tier:
        blobs = [content(4096, seed=n) for n in range(40)]
        infos = [put_bytes(tier, data) for data in blobs]
        first = tier.locate(infos[0].sha256).pack
        in_first = [i for i, info in enumerate(infos) if tier.locate(info.sha256).pack == first]
        assert len(in_first) > 4 and len(packs(tier)) > 1
        live = in_first[:2]
        for i in in_first[2:]:
            tier.delete(infos[i].sha256)
        size = first.stat().st_size
        # A crash between the copies and the index transaction.
        real_move = _index.move_records

        def crash(*args: object, **kwargs: object) -> None:
            raise KeyboardInterrupt("killed before the index moved the records")

        monkeypatch.setattr(_index, "move_records", crash)
        with pytest.raises(KeyboardInterrupt):
            tier.compact()
        monkeypatch.setattr(_index, "move_records", real_move)
        assert first.exists()
        for i in live:
            assert tier.locate(infos[i].sha256).pack == first
            assert get_bytes(tier, infos[i].sha256) == blobs[i]
        freed = tier.compact()
        assert not first.exists()
        assert freed >= size - 2 * tier.locate(infos[live[0]].sha256).length
        for i in live:
            assert tier.locate(infos[i].sha256).pack != first
            assert get_bytes(tier, infos[i].sha256) == blobs[i]
        assert tier.reclaimable() == {}
    with WarmTier(tmp_path / "warm", pack_limit=limit) as reopened:
        for i, data in enumerate(blobs):
            if i in in_first[2:]:
                assert reopened.info(infos[i].sha256) is None
            else:
                assert get_bytes(reopened, infos[i].sha256) == data
                reopened.verify(infos[i].sha256)


# -- durability and group commit ---------------------------------------------------------------


def test_the_pack_is_synced_before_the_index_commit_that_acknowledges_it(
    tier: WarmTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_bytes(tier, b"the pack exists")
    (pack,) = packs(tier)
    events: list[str] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        if os.path.samefile(f"/proc/self/fd/{fd}", pack):
            events.append("pack synced")

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    tier._db.set_trace_callback(lambda sql: events.append(sql) if sql == "COMMIT" else None)
    info = put_bytes(tier, content(1000))
    events.append("acknowledged")
    tier._db.set_trace_callback(None)

    assert events == ["pack synced", "COMMIT", "acknowledged"]
    assert tier.info(info.sha256) == info


def test_concurrent_puts_share_a_sync(tier: WarmTier, monkeypatch: pytest.MonkeyPatch) -> None:
    put_bytes(tier, b"the pack exists")
    syncs = 0
    real_fdatasync = os.fdatasync

    def slow_fdatasync(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        time.sleep(0.02)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    threads_count, each = 16, 5
    barrier = threading.Barrier(threads_count)
    stored: list[BlobInfo] = []

    def put(number: int) -> None:
        barrier.wait()
        for n in range(each):
            stored.append(put_bytes(tier, content(500, seed=number * each + n)))

    threads = [threading.Thread(target=put, args=(n,)) for n in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(stored) == threads_count * each
    assert syncs <= threads_count * each // 4
    assert tier.find_missing(info.sha256 for info in stored) == []


def test_put_many_reports_each_blob_in_order(tier: WarmTier) -> None:
    before = put_bytes(tier, b"already here")
    blobs = [b"one", b"already here", content(CHUNK_SIZE * 2, seed=3), b"one", b""]

    results = tier.put_many(blobs)

    assert [info.sha256 for info, _ in results] == [sha256_of(data) for data in blobs]
    assert [created for _, created in results] == [True, False, True, False, True]
    assert results[1][0] == before
    tier.close()
    with WarmTier(tier.root) as reopened:
        for data in blobs:
            assert get_bytes(reopened, sha256_of(data)) == data


def test_a_failed_pack_write_leaves_nothing(
    tier: WarmTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = put_bytes(tier, content(100))
    (pack,) = packs(tier)
    size = pack.stat().st_size

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full)
    data = content(1000, seed=1)
    with pytest.raises(OSError, match="No space"):
        put_bytes(tier, data)
    monkeypatch.undo()

    assert tier.info(sha256_of(data)) is None
    assert pack.stat().st_size == size
    assert list(tier.digests()) == [kept.sha256]
    info = put_bytes(tier, data)
    assert get_bytes(tier, info.sha256) == data
    assert get_bytes(tier, kept.sha256) == content(100)


def test_a_failed_large_put_leaves_nothing(tier: WarmTier, monkeypatch: pytest.MonkeyPatch) -> None:
    data = content(LARGE)

    def failing_rename(source: str, target: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="Input/output"):
        put_bytes(tier, data)
    monkeypatch.undo()

    assert tier.info(sha256_of(data)) is None
    assert os.listdir(tier.root / "tmp") == []
    assert packs(tier) == []
    assert get_bytes(tier, put_bytes(tier, data).sha256) == data


# -- crashes -----------------------------------------------------------------------------------


def _acknowledged(tier: WarmTier) -> dict[Digest, bytes]:
    blobs = {}
    for n in range(20):
        data = content(3000, seed=n) if n % 2 else compressible(3000, seed=n)
        blobs[put_bytes(tier, data).sha256] = data
    large = compressible(LARGE, seed=99)
    blobs[put_bytes(tier, large).sha256] = large
    return blobs


def _open_pack(tier: WarmTier) -> Path:
    (pack,) = (path for path in packs(tier) if mode(path) & stat.S_IWUSR)
    return pack


def _check_recovered(
    root: Path, acknowledged: dict[Digest, bytes], torn: bytes, pack_size: int
) -> None:
    """Open a crashed copy: every acknowledged blob is there and intact, the torn one is not,
    its bytes are cut from the open pack, and the archive goes on taking puts."""
    with WarmTier(root) as recovered:
        assert _open_pack(recovered).stat().st_size == pack_size
        assert set(recovered.digests()) == set(acknowledged)
        for sha256, data in acknowledged.items():
            assert recovered.verify(sha256).size == len(data)
            assert get_bytes(recovered, sha256) == data
        assert recovered.info(sha256_of(torn)) is None
        assert recovered.find_missing([sha256_of(torn)]) == [sha256_of(torn)]
        # The archive takes new puts where the acknowledged records end.
        after = put_bytes(recovered, content(777, seed=5))
        again, created = recovered.put_many([torn])[0]
        assert created
    with WarmTier(root) as reopened:
        assert get_bytes(reopened, after.sha256) == content(777, seed=5)
        assert get_bytes(reopened, again.sha256) == torn


def test_a_crash_before_the_index_commit_drops_the_torn_put(tier: WarmTier, tmp_path: Path) -> None:
    acknowledged = _acknowledged(tier)
    pack = _open_pack(tier)
    acknowledged_size = pack.stat().st_size
    torn = content(2000, seed=50)
    crashed = tmp_path / "crashed"

    def crash_at_commit(sql: str) -> None:
        if sql == "COMMIT" and not crashed.exists():
            snapshot(tier, crashed)

    tier._db.set_trace_callback(crash_at_commit)
    put_bytes(tier, torn)
    tier._db.set_trace_callback(None)

    # The whole record was synced to the pack before the commit began.
    assert (crashed / "archive" / pack.name).stat().st_size == acknowledged_size + 2000 + 4 + 56
    _check_recovered(crashed, acknowledged, torn, acknowledged_size)


def test_a_pack_record_torn_midway_is_dropped_at_open(tier: WarmTier, tmp_path: Path) -> None:
    acknowledged = _acknowledged(tier)
    crashed = snapshot(tier, tmp_path / "crashed")
    torn = compressible(5000, seed=7)
    record = tier.locate(put_bytes(tier, torn).sha256)
    with record.pack.open("rb") as f:
        f.seek(record.offset)
        half = f.read(record.length // 2)
    torn_pack = crashed / "archive" / record.pack.name
    size = torn_pack.stat().st_size
    with torn_pack.open("ab") as f:
        f.write(half)

    _check_recovered(crashed, acknowledged, torn, size)


def test_a_torn_index_transaction_is_ignored(tier: WarmTier, tmp_path: Path) -> None:
    acknowledged = _acknowledged(tier)
    acknowledged_size = _open_pack(tier).stat().st_size
    wal = tier.root / "index.sqlite-wal"
    before = wal.stat().st_size
    torn = content(3000, seed=60)
    put_bytes(tier, torn)
    after = wal.stat().st_size
    assert after > before, "the put's index transaction should be at the end of the log"
    crashed = snapshot(tier, tmp_path / "crashed")
    # Power lost halfway through writing the transaction to the index's log.
    os.truncate(crashed / wal.name, before + (after - before) // 2)

    _check_recovered(crashed, acknowledged, torn, acknowledged_size)


def test_crash_leftovers_are_removed_at_open(tier: WarmTier) -> None:
    info = put_bytes(tier, content(10))
    tier.close()
    (tier.root / "tmp" / "0123.part").write_bytes(b"half a large blob")
    # A large blob renamed into the archive whose index row never landed.
    (tier.root / "archive" / f"{999:012d}{PACK_SUFFIX}").write_bytes(b"an unacknowledged blob")

    with WarmTier(tier.root) as reopened:
        assert os.listdir(reopened.root / "tmp") == []
        assert len(packs(reopened)) == 1
        assert reopened.info(info.sha256) == info


def test_a_newer_index_format_is_refused(tier: WarmTier) -> None:
    tier.close()
    with sqlite3.connect(tier.root / "index.sqlite") as db:
        db.execute("PRAGMA user_version = 2")
    db.close()
    with pytest.raises(FailedPrecondition, match="version 2"):
        WarmTier(tier.root)


# -- memory ------------------------------------------------------------------------------------


@pytest.fixture
def big_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "big.bin"
    text = compressible(CHUNK_SIZE)
    noise = content(CHUNK_SIZE, seed=6)
    with path.open("wb") as f:
        for number in range(128):
            block = text if number % 2 else noise
            f.write(number.to_bytes(8, "big") + block[8:])
    yield path
    path.unlink()


def test_memory_stays_bounded_for_a_128_mib_put_and_read(tier: WarmTier, big_file: Path) -> None:
    measure: Callable[[], tuple[int, int]] = tracemalloc.get_traced_memory
    tracemalloc.start()
    try:
        info = put_file(tier, big_file)
        _, put_peak = measure()
        tracemalloc.reset_peak()
        assert tier.verify(info.sha256) == info
        for _ in tier.read(info.sha256):
            pass
        _, read_peak = measure()
    finally:
        tracemalloc.stop()
    assert info.size == 128 * CHUNK_SIZE
    assert put_peak < 24 * CHUNK_SIZE, f"put peak {put_peak / CHUNK_SIZE:.1f} MiB"
    assert read_peak < 16 * CHUNK_SIZE, f"read peak {read_peak / CHUNK_SIZE:.1f} MiB"
