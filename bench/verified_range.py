"""A 1 MiB range of a large blob, verified alone against the chunk root its pin records, beside
the same range read straight from the file and BLAKE3-hashed in the same run, and beside the
path a range took before chunk roots (fetch and verify the whole blob), run once for the ratio.

    uv run python -m bench.verified_range [--size-gib 4] [--repeat 15]

A "first" range is read by a client that has not read the blob before: it proves the blob's
pins, fetches the blob's chunk hashes (128 KiB for 4 GiB) and checks their root, then fetches
the range's chunks. A "next" range is another range of the same blob by the same client, which
keeps the verified chunk list. Goal: a first 1 MiB range of a 4 GiB blob in under 50 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import blake3

from bench.common import make_file, row, vault_server
from vault.client import VaultClient

MiB = 1 << 20
GOAL = 0.050


def offsets(size: int, count: int, seed: str) -> list[int]:
    """Random 1 MiB ranges, not chunk-aligned, so each covers two chunks (the worst case)."""
    rng = random.Random(seed)
    return [rng.randrange(0, size - 2 * MiB) | 1 for _ in range(count)]


def straight(path: Path, offset: int) -> float:
    """The baseline: the range read from the file and BLAKE3-hashed, nothing else."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        blake3.blake3(os.pread(fd, MiB, offset)).digest()
        return time.perf_counter() - start
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    size = int(args.size_gib * (1 << 30))

    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        source = make_file(Path(tmp) / "blob", size)
        with vault_server() as server:
            with VaultClient(server.address, timeout=600) as client:
                started = time.perf_counter()
                put = client.put(source, chunk_root=True)
                put_seconds = time.perf_counter() - started
                digest = str(put.blob.sha256)

                # Before any pin records its chunk root: the whole blob, once.
                spool = Path(tmp) / "range"
                started = time.perf_counter()
                client.get(digest, spool, offset=size // 2 + 1, length=MiB)
                whole = time.perf_counter() - started
                spool.unlink()
                pinned = client.pin("config", digest, meta={"bench": "verified-range"})
                assert "chunk-root" in pinned.entry.meta, "the pin records no chunk root"

            first: list[float] = []
            following: list[float] = []
            baseline: list[float] = []
            for number, offset in enumerate(offsets(size, args.repeat, "verified range")):
                with VaultClient(server.address, timeout=60) as reader:
                    reader.checkpoint()  # the trust state, set up once a client
                    started = time.perf_counter()
                    with reader.open(digest, offset=offset, length=MiB) as f:
                        data = f.read()
                    first.append(time.perf_counter() - started)
                    assert len(data) == MiB
                    other = offsets(size, 1, f"next {number}")[0]
                    started = time.perf_counter()
                    with reader.open(digest, offset=other, length=MiB) as f:
                        f.read()
                    following.append(time.perf_counter() - started)
                baseline.append(straight(source, offset))

    base = statistics.median(baseline)
    ms = 1000
    print(f"blob: {size / (1 << 30):.2f} GiB, put in {put_seconds:.1f} s; {args.repeat} repeats")
    print(f"{'':<44} {'vault':>16} {'file + BLAKE3':>16} {'ratio':>8}  goal")
    median_first = statistics.median(first)
    print(
        row(
            "first 1 MiB range, verified alone (median)",
            f"{median_first * ms:.1f} ms",
            f"{base * ms:.2f} ms",
            median_first / base,
            f"< {GOAL * ms:.0f} ms: {'met' if median_first < GOAL else 'MISSED'}",
        )
    )
    median_next = statistics.median(following)
    print(
        row(
            "next 1 MiB range, same client (median)",
            f"{median_next * ms:.1f} ms",
            f"{base * ms:.2f} ms",
            median_next / base,
            "",
        )
    )
    print(
        row(
            "1 MiB range, whole blob verified (once)",
            f"{whole * ms:.0f} ms",
            f"{base * ms:.2f} ms",
            whole / base,
            f"{whole / median_first:.0f}x the verified range",
        )
    )


if __name__ == "__main__":
    main()
