"""Scrub rate on the hot tier beside `b3sum` over the same blob files, from the same run, both
from the page cache (each file read once before timing): medians of several rounds.

    uv run python -m bench.scrub [--blobs 8] [--size-mb 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.scrub import Scrubber


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blobs", type=int, default=8)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each run (root): time reading the disk, as a scrub "
        "of data nobody read lately does, rather than hashing what is already in memory",
    )
    args = parser.parse_args()
    b3sum = shutil.which("b3sum")
    if b3sum is None:
        print("b3sum is not installed", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        # Buffered reads, as b3sum's: direct I/O would time the disk, not the check.
        hot = HotTier(Path(tmp) / "hot", direct_io=False)
        with TierManager([("hot", hot)], journal=Path(tmp) / "tiers.db") as manager:
            files = []
            for _ in range(args.blobs):
                data = os.urandom(args.size_mb << 20)
                with hot.writer() as writer:
                    writer.write(data)
                    info, _ = writer.commit()
                files.append(
                    str(Path(tmp) / "hot" / "blobs" / info.sha256.hex[:2] / info.sha256.hex)
                )
                manager.journal.place(info.sha256, "hot", size=info.size)
            total = args.blobs * (args.size_mb << 20)
            subprocess.run([b3sum, *files], check=True, capture_output=True)
            scrubber = Scrubber(manager)
            ours, theirs = [], []
            for _ in range(args.rounds):
                if args.cold:
                    drop_caches()
                started = time.perf_counter()
                stats = scrubber.scrub_all()
                ours.append(total / (time.perf_counter() - started))
                assert stats.copies == args.blobs and stats.faults == 0
                if args.cold:
                    drop_caches()
                started = time.perf_counter()
                subprocess.run([b3sum, *files], check=True, capture_output=True)
                theirs.append(total / (time.perf_counter() - started))
    mine, base = statistics.median(ours), statistics.median(theirs)
    cache = "page cache dropped before each run" if args.cold else "files in the page cache"
    print(f"{args.blobs} blobs of {args.size_mb} MiB, {args.rounds} rounds, medians, {cache}")
    print(f"pinvault scrub (hot)  {mine / 1e6:8.0f} MB/s")
    print(f"b3sum                 {base / 1e6:8.0f} MB/s")
    print(f"ratio                 {mine / base:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
