"""The scrubber over real hot and warm tiers: a flipped bit found and repaired from the good
copy, every copy's last verification journaled, and a rate that is kept to."""

from __future__ import annotations

import time
from pathlib import Path

from tests.test_tier_manager import flip_bit
from tests.tier_contract import LARGE, content
from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.scrub import Scrubber
from tiers.warm import WarmTier
from vault.storage import get_bytes, put_bytes


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
