"""The scrubber over real hot and warm tiers: a flipped bit found and repaired from the good
copy, every copy's last verification journaled, and a rate that is kept to."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.test_tier_manager import flip_bit
from tests.tier_contract import LARGE, content
from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.maphash import MapHasher
from tiers.scrub import Scrubber
from tiers.warm import WarmTier
from vault.digest import sha256_of
from vault.store.protocol import get_bytes, put_bytes


def test_scrub_finds_a_flipped_bit_repairs_it_and_journals_every_check(tmp_path: Path) -> None:
    hot, warm = HotTier(tmp_path / "hot"), WarmTier(tmp_path / "warm")
    with TierManager(
        [("hot", hot), ("warm", warm)], journal=tmp_path / "tiers.db", owned=[warm]
    ) as manager:
        data = content(LARGE, seed=7)
        sha256 = put_bytes(manager, data).sha256
        put_bytes(warm, data)
        flip_bit(hot, sha256, 3 * 1024 * 1024 + 5)
        before = time.time()

        stats = Scrubber(manager).scrub_all()

        assert (stats.copies, stats.faults, stats.repaired, stats.unrepairable) == (2, 1, 1, 0)
        assert stats.bytes == 2 * len(data)
        assert get_bytes(hot, sha256) == data
        placements = manager.placements(sha256)
        assert {p.tier for p in placements} == {"hot", "warm"}
        assert all(p.last_verified is not None and p.last_verified >= before for p in placements)
        (record,) = manager.journal.records(sha256)
        assert (record.tier, record.offset) == ("hot", 3 * 1024 * 1024)


def test_scrub_keeps_to_its_rate(tmp_path: Path) -> None:
    hot = HotTier(tmp_path / "hot")
    with TierManager([("hot", hot)], journal=tmp_path / "tiers.db") as manager:
        for seed in range(4):
            put_bytes(manager, content(1 << 20, seed=seed))
        started = time.monotonic()
        stats = Scrubber(manager, rate=8 << 20).scrub_all()
        elapsed = time.monotonic() - started
    # 4 MiB at 8 MiB/s: half a second at least, where unpaced it takes milliseconds.
    assert stats.copies == 4 and elapsed >= 0.45


def test_a_large_copy_hashed_through_a_map_still_names_its_damaged_chunk(tmp_path: Path) -> None:
    hot, warm = HotTier(tmp_path / "hot"), WarmTier(tmp_path / "warm")
    with TierManager(
        [("hot", hot), ("warm", warm)], journal=tmp_path / "tiers.db", owned=[warm]
    ) as manager:
        data = content(9 * 1024 * 1024 + 17, seed=8)
        sha256 = put_bytes(manager, data).sha256
        put_bytes(warm, data)

        clean = Scrubber(manager).scrub_all()
        assert (clean.copies, clean.faults) == (2, 0)

        flip_bit(hot, sha256, 7 * 1024 * 1024 + 3)
        stats = Scrubber(manager).scrub_all()

        assert (stats.copies, stats.faults, stats.repaired) == (2, 1, 1)
        assert get_bytes(hot, sha256) == data
        (record,) = manager.journal.records(sha256)
        assert (record.tier, record.offset) == ("hot", 7 * 1024 * 1024)


def test_the_map_hasher_gives_b3sums_digest_and_survives_its_child_dying(
    tmp_path: Path,
) -> None:
    path = tmp_path / "blob"
    data = content(5 * 1024 * 1024 + 1, seed=9)
    path.write_bytes(data)
    b3sum = subprocess.run(["b3sum", "--no-names", path], capture_output=True, check=True)
    hasher = MapHasher()
    try:
        assert hasher.hash(path) == (bytes.fromhex(b3sum.stdout.decode().strip()), len(data))
        assert hasher.hash(tmp_path / "absent") is None
        # A fault under the map kills the child (SIGBUS) mid-request: the caller hears None,
        # and the next file gets a new child. The child is stopped first so that it dies
        # while the request waits on it.
        child = hasher._child
        assert child is not None
        child.send_signal(signal.SIGSTOP)
        answers: list[object] = []
        asking = threading.Thread(target=lambda: answers.append(hasher.hash(path)))
        asking.start()
        deadline = time.monotonic() + 10
        while not hasher._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        child.send_signal(signal.SIGBUS)
        child.send_signal(signal.SIGCONT)
        asking.join(10)
        assert answers == [None]
        assert hasher.hash(path) == (bytes.fromhex(b3sum.stdout.decode().strip()), len(data))
        assert hasher._child is not None and hasher._child.pid != child.pid
    finally:
        hasher.close()


def test_the_background_scrubber_gets_past_copies_on_tiers_it_does_not_hold(
    tmp_path: Path,
) -> None:
    # Copies recorded on a mirror no longer configured, never verified: the first in line for
    # the scrubber, which must not let them fill every batch and starve the copies it holds.
    hot = HotTier(tmp_path / "hot")
    with TierManager([("hot", hot)], journal=tmp_path / "tiers.db") as manager:
        sha256 = put_bytes(manager, content(1000, seed=3)).sha256
        manager.journal.place_verified(
            [(sha256_of(bytes([n])), "mirror-gone", 1, 0.0) for n in range(100)]
        )
        later = time.time() + 2 * 86_400
        scrubber = Scrubber(manager, window=86_400, clock=lambda: later)
        stop = threading.Event()
        worker = threading.Thread(target=scrubber.run, args=(stop,))
        worker.start()
        try:
            deadline = time.monotonic() + 10
            while manager.placements(sha256)[0].last_verified != later:
                assert time.monotonic() < deadline, "the hot copy was never checked"
                time.sleep(0.05)
        finally:
            stop.set()
            worker.join()
        assert {p.last_verified for p in manager.journal.placements() if p.tier != "hot"} == {0.0}
