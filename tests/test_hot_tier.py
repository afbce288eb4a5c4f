"""The hot tier: the shared tier contract, with and without direct I/O, then what only a local
folder can show (its layout, crash leftovers, repairs of its chunk lists, durability order)."""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tier_contract import LARGE, TierContract, content, read_all
from tiers import hot
from tiers.hot import SLOT, SLOTS, SYNC_EVERY, HotTier, _batch, _layout
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList
from vault.store.protocol import BlobStore, get_bytes, put_bytes, put_file


def blob_file(tier: HotTier, sha256: Digest) -> Path:
    return tier.root / "blobs" / sha256.hex[:2] / sha256.hex


def chunks_file(tier: HotTier, sha256: Digest) -> Path:
    return blob_file(tier, sha256).with_suffix(".chunks")


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def temp_files(tier: HotTier) -> list[str]:
    return os.listdir(tier.root / "tmp")


def direct_io_works(folder: Path) -> bool:
    return HotTier(folder / "probe").direct_io


@pytest.fixture(params=[True, False], ids=["direct-io", "page-cache"])
def direct_io(request: pytest.FixtureRequest, tmp_path: Path) -> bool:
    if request.param and not direct_io_works(tmp_path):
        pytest.skip("this file system does not take direct I/O")
    return bool(request.param)


@pytest.fixture
def tier(tmp_path: Path, direct_io: bool) -> HotTier:
    return HotTier(tmp_path / "hot", direct_io=direct_io)


class TestHotTierContract(TierContract):
    @pytest.fixture
    def store(self, tier: HotTier) -> BlobStore:
        return tier

    def corrupt(self, store: BlobStore, sha256: Digest, offset: int) -> None:
        assert isinstance(store, HotTier)
        flip_byte(blob_file(store, sha256), offset)


# -- layout and durability ---------------------------------------------------------------------


def test_layout(tier: HotTier) -> None:
    data = content(LARGE)
    info = put_bytes(tier, data)

    assert blob_file(tier, info.sha256).read_bytes() == data
    stored = ChunkList.decode(chunks_file(tier, info.sha256).read_bytes(), info.sha256)
    assert stored.info == info
    assert temp_files(tier) == []


def test_large_put_round_trips(tier: HotTier) -> None:
    # Several times round the ring of slots, and past the page-cache sync interval.
    size = max(SLOT * SLOTS * 3, SYNC_EVERY + SLOT) + 12345
    data = content(size, seed=5)
    with tier.writer() as writer:
        for start in range(0, size, 300_001):
            writer.write(data[start : start + 300_001])
        info, created = writer.commit()
    assert created
    assert info == BlobInfo(sha256_of(data), info.blake3, size)
    assert tier.verify(info.sha256) == info
    assert get_bytes(tier, info.sha256) == data


def test_put_syncs_the_bytes_and_chunk_list_before_linking_then_the_folder(
    tier: HotTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []

    def recording(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            target = args[-1] if name in ("link", "replace") else args[0]
            if isinstance(target, int):
                target = os.readlink(f"/proc/self/fd/{target}")
            events.append((name, str(target)))
            return call(*args)

        return record

    for name in ("fdatasync", "fsync", "link", "replace"):
        monkeypatch.setattr(os, name, recording(name, getattr(os, name)))
    data = content(CHUNK_SIZE + 1)
    info = put_bytes(tier, data)
    monkeypatch.undo()

    blob = str(blob_file(tier, info.sha256))
    link = events.index(("link", blob))
    synced = [target for name, target in events[:link] if name == "fdatasync"]
    assert any(target.endswith(".blob") for target in synced)
    assert ("replace", str(chunks_file(tier, info.sha256))) in events[:link]
    assert ("fsync", str(Path(blob).parent)) in events[link:]


# -- leftovers ---------------------------------------------------------------------------------


def test_crash_leftovers_are_removed_at_open(tier: HotTier) -> None:
    info = put_bytes(tier, content(10))
    (tier.root / "tmp" / "0123.blob").write_bytes(b"half a blob")
    (tier.root / "tmp" / "4567.chunks").write_bytes(b"half a list")

    reopened = HotTier(tier.root)

    assert temp_files(reopened) == []
    assert reopened.info(info.sha256) == info


def test_a_write_in_progress_survives_another_open(tier: HotTier) -> None:
    data = content(LARGE)
    with tier.writer() as writer:
        writer.write(data)
        HotTier(tier.root)
        info, created = writer.commit()
    assert created
    assert get_bytes(tier, info.sha256) == data


def test_failed_and_aborted_writes_leave_no_temp_file_or_thread(tier: HotTier) -> None:
    threads_before = threading.active_count()
    data = content(SLOT * SLOTS * 2)

    writer = tier.writer()
    writer.write(data)
    writer.abort()
    with tier.writer() as unfinished:
        unfinished.write(data)
    with pytest.raises(IntegrityError), tier.writer() as mismatched:
        mismatched.write(data)
        mismatched.commit(sha256_of(b"other"))
    with pytest.raises(KeyboardInterrupt), tier.writer() as interrupted:
        interrupted.write(data)
        raise KeyboardInterrupt

    assert temp_files(tier) == []
    assert threading.active_count() == threads_before
    assert list(tier.digests()) == []


def test_a_batch_syncs_once_then_links_then_syncs_the_names(
    tier: HotTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_link = os.link

    def link(*args: Any, **kwargs: Any) -> None:
        events.append("link")
        real_link(*args, **kwargs)

    monkeypatch.setattr(_batch, "_syncfs", lambda fd: events.append("syncfs"))
    monkeypatch.setattr(os, "link", link)
    blobs = [content(5000 + n, seed=n) for n in range(49)] + [content(LARGE)]

    results = tier.put_batch((data, sha256_of(data)) for data in blobs)

    assert events == ["syncfs"] + ["link"] * 50 + ["syncfs"]
    assert all(isinstance(r, tuple) and r[1] for r in results)
    assert temp_files(tier) == []
    # Only a blob of several chunks needs its list kept beside it.
    assert [chunks_file(tier, sha256_of(data)).exists() for data in blobs] == [False] * 49 + [True]


def test_a_one_chunk_blob_without_a_list_is_read_verified_and_never_given_one(
    tier: HotTier,
) -> None:
    data = content(CHUNK_SIZE)
    [result] = tier.put_batch([(data, None)])
    assert isinstance(result, tuple)
    info = result[0]
    assert get_bytes(tier, info.sha256) == data
    assert tier.info(info.sha256) == info
    assert tier.verify(info.sha256) == info
    assert not chunks_file(tier, info.sha256).exists()
    flip_byte(blob_file(tier, info.sha256), 17)
    with pytest.raises(IntegrityError, match=str(info.sha256)):
        read_all(tier, info.sha256)
    with pytest.raises(IntegrityError):
        tier.verify(info.sha256)


def test_without_syncfs_a_batch_syncs_each_file_before_linking_then_each_folder(
    tier: HotTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real = {name: getattr(os, name) for name in ("fdatasync", "fsync", "link")}

    def recording(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return real[name](*args, **kwargs)

        return record

    monkeypatch.setattr(_batch, "_syncfs", None)
    for name in real:
        monkeypatch.setattr(os, name, recording(name))
    blobs = [content(100, seed=n) for n in range(5)]

    results = tier.put_batch((data, None) for data in blobs)
    monkeypatch.undo()

    assert events[:6] == ["fdatasync"] * 5 + ["link"]
    assert events[-1] == "fsync" and events.count("link") == 5
    assert [get_bytes(tier, sha256_of(data)) for data in blobs] == blobs
    assert all(isinstance(r, tuple) and r[1] for r in results)


def test_a_failed_batch_leaves_nothing(tier: HotTier) -> None:
    def blobs() -> Iterator[tuple[bytes, Digest | None]]:
        yield content(100), None
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tier.put_batch(blobs())
    assert temp_files(tier) == []
    assert list(tier.digests()) == []


def test_a_crashed_batch_is_removed_at_open_and_a_live_one_kept(tier: HotTier) -> None:
    crashed = tier.root / "tmp" / f"0123{hot.BATCH_SUFFIX}"
    crashed.mkdir()
    (crashed / ("ab" * 32)).write_bytes(b"half a blob")
    fd, live = tier._temp_folder()
    try:
        HotTier(tier.root)
        assert temp_files(tier) == [os.path.basename(live)]
    finally:
        _layout.remove_folder(fd, live)
    assert temp_files(tier) == []


def test_a_duplicate_put_leaves_no_temp_file(tier: HotTier) -> None:
    data = content(LARGE)
    put_bytes(tier, data)
    put_bytes(tier, data)
    assert temp_files(tier) == []


# -- damage and repair -------------------------------------------------------------------------


def _damage_missing(tier: HotTier, sha256: Digest) -> None:
    chunks_file(tier, sha256).unlink()


def _damage_flipped(tier: HotTier, sha256: Digest) -> None:
    flip_byte(chunks_file(tier, sha256), 40)


def _damage_truncated(tier: HotTier, sha256: Digest) -> None:
    path = chunks_file(tier, sha256)
    path.write_bytes(path.read_bytes()[:-7])


def _damage_other_blob(tier: HotTier, sha256: Digest) -> None:
    other = put_bytes(tier, b"another blob")
    chunks_file(tier, sha256).write_bytes(chunks_file(tier, other.sha256).read_bytes())


@pytest.mark.parametrize(
    "damage",
    [_damage_missing, _damage_flipped, _damage_truncated, _damage_other_blob],
    ids=["missing", "flipped", "truncated", "another-blob's"],
)
def test_a_damaged_chunk_list_is_rebuilt_from_good_bytes(
    tier: HotTier, damage: Callable[[HotTier, Digest], None]
) -> None:
    data = content(LARGE)
    info = put_bytes(tier, data)
    damage(tier, info.sha256)

    assert b"".join(chunk.data for chunk in read_all(tier, info.sha256)) == data
    assert tier.info(info.sha256) == info
    rebuilt = ChunkList.decode(chunks_file(tier, info.sha256).read_bytes(), info.sha256)
    assert rebuilt == tier.chunk_list(info.sha256)
    assert temp_files(tier) == []


def test_a_damaged_chunk_list_over_bad_bytes_is_not_rebuilt(tier: HotTier) -> None:
    info = put_bytes(tier, content(LARGE))
    chunks_file(tier, info.sha256).unlink()
    flip_byte(blob_file(tier, info.sha256), CHUNK_SIZE + 1)

    with pytest.raises(IntegrityError, match=str(info.sha256)):
        tier.read(info.sha256)
    with pytest.raises(IntegrityError):
        tier.info(info.sha256)
    assert not chunks_file(tier, info.sha256).exists()


def test_verify_rewrites_a_chunk_list_that_disagrees_with_good_bytes(tier: HotTier) -> None:
    data = content(LARGE)
    info = put_bytes(tier, data)
    good = tier.chunk_list(info.sha256)
    wrong = ChunkList(good.chunk_size, good.size, good.sha256, good.blake3, (bytes(32),) * 4)
    chunks_file(tier, info.sha256).write_bytes(wrong.encode())
    with pytest.raises(IntegrityError, match="offset 0"):
        read_all(tier, info.sha256)

    assert tier.verify(info.sha256) == info

    assert tier.chunk_list(info.sha256) == good
    assert b"".join(chunk.data for chunk in read_all(tier, info.sha256)) == data


def test_a_flipped_byte_stops_the_read_before_its_chunk(tier: HotTier) -> None:
    data = content(LARGE)
    info = put_bytes(tier, data)
    flip_byte(blob_file(tier, info.sha256), LARGE - 1)

    chunks = tier.read(info.sha256)
    for index in range(3):
        assert next(chunks).data == data[index * CHUNK_SIZE : (index + 1) * CHUNK_SIZE]
    with pytest.raises(IntegrityError, match=f"offset {3 * CHUNK_SIZE}"):
        next(chunks)
    # The chunks before the damage still read and verify on their own.
    assert read_all(tier, info.sha256, 0, CHUNK_SIZE)[0].data == data[:CHUNK_SIZE]


@pytest.mark.parametrize(
    "change", [-1, -CHUNK_SIZE, +1], ids=["byte-short", "chunk-short", "byte-long"]
)
def test_a_copy_of_the_wrong_length_is_caught(tier: HotTier, change: int) -> None:
    info = put_bytes(tier, content(LARGE))
    os.truncate(blob_file(tier, info.sha256), LARGE + change)

    with pytest.raises(IntegrityError, match=f"expected {LARGE}"):
        read_all(tier, info.sha256)
    with pytest.raises(IntegrityError, match=f"expected {LARGE}"):
        read_all(tier, info.sha256, 0, 1)
    with pytest.raises(IntegrityError):
        tier.info(info.sha256)
    with pytest.raises(IntegrityError, match=str(info.sha256)):
        tier.verify(info.sha256)


def test_a_copy_cut_short_while_being_read_yields_nothing_stale(tier: HotTier) -> None:
    size = 24 * CHUNK_SIZE
    data = content(size, seed=7)
    info = put_bytes(tier, data)
    cut = 20 * CHUNK_SIZE + 5

    yielded: list[Chunk] = []
    with pytest.raises(IntegrityError, match=str(info.sha256)):
        for chunk in tier.read(info.sha256):
            if not yielded:
                os.truncate(blob_file(tier, info.sha256), cut)
            yielded.append(chunk)

    assert 1 <= len(yielded) <= cut // CHUNK_SIZE
    for chunk in yielded:
        assert chunk.data == data[chunk.offset : chunk.offset + CHUNK_SIZE]


# -- memory ------------------------------------------------------------------------------------


@pytest.fixture
def big_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "big.bin"
    block = content(CHUNK_SIZE, seed=6)
    with path.open("wb") as f:
        for number in range(256):
            f.write(number.to_bytes(8, "big") + block[8:])
    yield path
    path.unlink()


def test_memory_stays_bounded_for_a_256_mib_put(tier: HotTier, big_file: Path) -> None:
    # tracemalloc sees every Python allocation; the ring of slots is a fixed mmap of
    # SLOTS * SLOT bytes outside it.
    tracemalloc.start()
    try:
        info = put_file(tier, big_file)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.size == 256 * CHUNK_SIZE
    assert peak < 32 * CHUNK_SIZE, f"peak {peak / CHUNK_SIZE:.1f} MiB"
    assert tier.verify(info.sha256) == info
