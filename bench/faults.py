"""The fault campaign of tests/test_faults.py at a larger size: more blobs and more faults of each
kind, through a real `vault serve` over hot + warm + three MinIO mirrors; prints each fault, what
found it, and the counts for docs/benchmarks.md. Not a timing benchmark: the figure is the counts.

    uv run python -m bench.faults [--scale 3] [--per-kind 6] [--seed 20261121] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tests.services.s3 import MinioServer
from tests.test_faults import DEFAULT_SEED, Campaign
from tests.test_mirror import NAMES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=3, help="copies of the test's blob mix")
    parser.add_argument("--per-kind", type=int, default=6, help="faults of each kind")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--json", help="also write the counts to this file")
    args = parser.parse_args()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pinvault-faults-")))
        minios = [stack.enter_context(MinioServer()) for _ in NAMES]
        campaign = Campaign(minios, base, seed=args.seed, scale=args.scale, per_kind=args.per_kind)
        try:
            counts = campaign.run()
        finally:
            campaign.server.stop()
    print(campaign.report())
    size = sum(len(data) for data in campaign.blobs.values())
    print(
        f"seed {counts.seed}, {counts.blobs} blobs ({size / (1 << 20):.1f} MiB) on hot, warm and "
        f"3 mirrors, {counts.reads} reads ({counts.bytes_served / (1 << 20):.1f} MiB served), "
        f"{time.monotonic() - started:.0f}s"
    )
    print(", ".join(f"{kind} {count}" for kind, count in sorted(counts.kinds.items())))
    print(counts.line())
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(counts), indent=2) + "\n")


if __name__ == "__main__":
    main()
