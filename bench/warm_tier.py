"""Small blobs through the warm tier: N blobs of 1 KiB stored durably, then each read back
verified, beside two baselines from the same run on the same disk: one file per blob (os.write,
one os.sync per 1,000 files) and SQLite rows (one transaction per 1,000, WAL, synchronous=FULL).

    uv run python -m bench.warm_tier [--count 1000000] [--size 1024] [--kind random|text]
                                     [--threads 16] [--threaded-count 50000]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sqlite3
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path

from bench.common import row
from tiers.warm import WarmTier
from vault.digest import Digest
from vault.store.protocol import put_bytes

GOAL = 5000
SYNC_EVERY = 1000
_POOL = 1 << 20


def payloads(kind: str, size: int) -> Callable[[int], bytes]:
    """Blob number i, made on demand so that a million of them are never all in memory: its
    number, then a slice of a pool of random bytes (incompressible) or of a metrics log."""
    rng = random.Random(1)
    if kind == "random":
        pool = rng.randbytes(_POOL + size)
    else:
        rates = ["1e-3", "1e-4"]
        lines = (
            f'{{"step": {step}, "loss": {rng.random():.6f}, "lr": {rng.choice(rates)}}}\n'
            for step in range(_POOL)
        )
        pool = b""
        while len(pool) < _POOL + size:
            pool += next(lines).encode()

    def payload(number: int) -> bytes:
        start = number * 7919 % _POOL
        return number.to_bytes(8, "big") + pool[start : start + size - 8]

    return payload


def shuffled(count: int) -> array[int]:
    order = array("I", range(count))
    random.Random(2).shuffle(order)
    return order


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f}/s"


def folder_size(path: Path) -> int:
    return sum(entry.stat().st_blocks * 512 for entry in path.rglob("*") if entry.is_file())


# -- the warm tier -----------------------------------------------------------------------------


def warm_puts(root: Path, count: int, payload: Callable[[int], bytes]) -> tuple[float, bytearray]:
    digests = bytearray()
    with WarmTier(root) as tier:
        start = time.perf_counter()
        for info, _ in tier.put_many(payload(number) for number in range(count)):
            digests += info.sha256.raw
        return time.perf_counter() - start, digests


def warm_gets(root: Path, digests: bytearray, order: array[int]) -> float:
    with WarmTier(root) as tier:
        start = time.perf_counter()
        for number in order:
            digest = Digest.sha256(bytes(digests[number * 32 : number * 32 + 32]))
            for _ in tier.read(digest):
                pass
        return time.perf_counter() - start


def warm_threaded_puts(
    root: Path, count: int, threads: int, payload: Callable[[int], bytes]
) -> float:
    """Single puts through writer() from concurrent callers, sharing syncs by group commit."""
    with WarmTier(root) as tier:
        barrier = threading.Barrier(threads + 1)

        def put(first: int) -> None:
            barrier.wait()
            for number in range(first, count, threads):
                put_bytes(tier, payload(number))

        workers = [threading.Thread(target=put, args=(n,)) for n in range(threads)]
        for worker in workers:
            worker.start()
        barrier.wait()
        start = time.perf_counter()
        for worker in workers:
            worker.join()
        return time.perf_counter() - start


# -- baselines ---------------------------------------------------------------------------------


def file_puts(root: Path, count: int, payload: Callable[[int], bytes]) -> tuple[float, list[str]]:
    for prefix in range(256):
        (root / f"{prefix:02x}").mkdir(parents=True, exist_ok=True)
    names = []
    start = time.perf_counter()
    for number in range(count):
        data = payload(number)
        name = hashlib.sha256(data).hexdigest()
        fd = os.open(root / name[:2] / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
        names.append(name)
        if (number + 1) % SYNC_EVERY == 0:
            # Nothing cheaper makes a thousand new files durable at once.
            os.sync()
    os.sync()
    return time.perf_counter() - start, names


def file_gets(root: Path, names: list[str], order: array[int]) -> float:
    start = time.perf_counter()
    for number in order:
        name = names[number]
        with open(root / name[:2] / name, "rb", buffering=0) as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != name:
            raise AssertionError(f"file {name} is damaged")
    return time.perf_counter() - start


def sqlite_connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = FULL")
    return db


def sqlite_puts(path: Path, count: int, payload: Callable[[int], bytes]) -> float:
    db = sqlite_connect(path)
    db.execute("CREATE TABLE blobs (sha256 BLOB PRIMARY KEY, data BLOB NOT NULL)")
    start = time.perf_counter()
    for first in range(0, count, SYNC_EVERY):
        rows = []
        for number in range(first, min(first + SYNC_EVERY, count)):
            data = payload(number)
            rows.append((hashlib.sha256(data).digest(), data))
        db.execute("BEGIN")
        db.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?)", rows)
        db.execute("COMMIT")
    seconds = time.perf_counter() - start
    db.close()
    return seconds


def sqlite_gets(path: Path, digests: bytearray, order: array[int]) -> float:
    db = sqlite_connect(path)
    start = time.perf_counter()
    for number in order:
        raw = bytes(digests[number * 32 : number * 32 + 32])
        ((data,),) = db.execute("SELECT data FROM blobs WHERE sha256 = ?", (raw,)).fetchall()
        if hashlib.sha256(data).digest() != raw:
            raise AssertionError(f"row {raw.hex()} is damaged")
    seconds = time.perf_counter() - start
    db.close()
    return seconds


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--kind", choices=["random", "text"], default="random")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--threaded-count", type=int, default=50_000)
    args = parser.parse_args()
    count, payload = args.count, payloads(args.kind, args.size)
    order = shuffled(count)
    threaded = min(count, args.threaded_count)

    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        base = Path(tmp)
        step("warm tier: put_many")
        warm_put, digests = warm_puts(base / "warm", count, payload)
        step("warm tier: verified gets")
        warm_get = warm_gets(base / "warm", digests, order)
        warm_bytes = folder_size(base / "warm")
        step(f"warm tier: {args.threads} threads of single puts")
        warm_threaded = warm_threaded_puts(base / "warm-threads", threaded, args.threads, payload)
        step("baseline: one file per blob")
        file_put, names = file_puts(base / "files", count, payload)
        step("baseline: file gets")
        file_get = file_gets(base / "files", names, order)
        file_bytes = folder_size(base / "files")
        del names
        step("baseline: SQLite rows")
        sqlite_put = sqlite_puts(base / "blobs.sqlite", count, payload)
        step("baseline: SQLite gets")
        sqlite_get = sqlite_gets(base / "blobs.sqlite", digests, order)
        sqlite_bytes = sum(
            path.stat().st_blocks * 512 for path in base.glob("blobs.sqlite*") if path.is_file()
        )

    print(
        f"{count:,} blobs of {args.size} bytes ({args.kind}), durable puts, gets in random "
        f"order, each checked against its digest; baseline: one file per blob, "
        f"os.sync every {SYNC_EVERY:,}"
    )
    print(row("puts, put_many (group of 4,096 per sync)", *figures(count, warm_put, file_put)))
    print(
        row(
            f"puts, {args.threads} threads of writer() ({threaded:,})",
            *figures(threaded, warm_threaded, file_put, baseline_count=count),
        )
    )
    print(row("gets, verified chunk by chunk", *figures(count, warm_get, file_get)))
    print(
        f"SQLite rows, {SYNC_EVERY:,} per transaction: puts {rate(count, sqlite_put)}, "
        f"gets {rate(count, sqlite_get)}"
    )
    mib = 1 << 20
    print(
        f"space: warm tier {warm_bytes / mib:,.0f} MiB, files {file_bytes / mib:,.0f} MiB, "
        f"SQLite {sqlite_bytes / mib:,.0f} MiB, payload {count * args.size / mib:,.0f} MiB"
    )


def figures(
    count: int, seconds: float, baseline: float, *, baseline_count: int | None = None
) -> tuple[str, str, float, str]:
    ours = count / seconds
    theirs = (baseline_count or count) / baseline
    return f"{ours:,.0f}/s", f"{theirs:,.0f}/s", ours / theirs, f"goal >= {GOAL:,}/s"


def step(name: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)


if __name__ == "__main__":
    main()
