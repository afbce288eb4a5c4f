"""`vault dataset add` of a folder of many small files, stored durably, beside
`cp -r DIR COPY && sync` on the same folder in the same run; then a second add of the
unchanged folder, which reads no file (the cache of file digests, as `vault dataset add`
keeps one). Each round copies the folder and adds it to a fresh vault with an empty cache;
the figures are medians over the rounds.

    uv run python -m bench.dataset [--files 100000] [--rounds 3]

Nothing is deleted until every round is done: on ext4 without a journal (this machine), a
file created within a minute or so of a mass deletion in the same block group costs a scan
past every recently deleted inode, so whichever side ran right after a deletion would pay for
it (the vault, when the copy was removed just before it).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import vault_server
from vault.client import VaultClient
from vault.runs.dataset import add_dataset
from vault.store.hashcache import HashCache


def make_tree(root: Path, files: int) -> int:
    """Files of 1 KiB to 64 KiB of random bytes, 1,000 to a folder."""
    rng = random.Random(7)
    total = 0
    for n in range(files):
        folder = root / f"part-{n // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        size = rng.randint(1 << 10, 64 << 10)
        (folder / f"file-{n:06d}.bin").write_bytes(os.urandom(size))
        total += size
    return total


def one_round(tmp: Path, tree: Path, number: int) -> tuple[float, float, float]:
    """Seconds for cp -r && sync, the first add, and the second add."""
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(tree), str(tmp / f"copy-{number}")], check=True)
    subprocess.run(["sync"], check=True)
    copy = time.perf_counter() - start
    # As `vault dataset add` does, with a cache of file digests of its own: empty at first.
    cache = HashCache(tmp / f"file-hashes-{number}.db")
    with vault_server(data_dir=tmp / f"vault-{number}") as server:
        client = VaultClient(server.address, state=tmp / f"state-{number}.json")
        start = time.perf_counter()
        first = add_dataset(client, tree, cache=cache)
        add = time.perf_counter() - start
        start = time.perf_counter()
        second = add_dataset(client, tree, cache=cache)
        again = time.perf_counter() - start
        client.close()
    cache.close()
    assert first.digest == second.digest and second.sent_files == 0
    return copy, add, again


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as name:
        tmp = Path(name)
        tree = tmp / "tree"
        size = make_tree(tree, args.files)
        subprocess.run(["sync"], check=True)
        rounds = [one_round(tmp, tree, number) for number in range(args.rounds)]
    copy, add, again = (statistics.median(column) for column in zip(*rounds, strict=True))
    files = args.files
    print(f"{files:,} files, {size / (1 << 20):,.0f} MiB; medians of {args.rounds} rounds")
    for number, (c, a, g) in enumerate(rounds):
        print(f"  round {number}: cp {c:.1f} s, add {a:.1f} s, add again {g:.1f} s")
    print(f"  cp -r && sync            {files / copy:>10,.0f} files/s  ({copy:.1f} s)")
    print(
        f"  vault dataset add        {files / add:>10,.0f} files/s  ({add:.1f} s)  "
        f"{copy / add:.2f}x of cp (goal >= 0.5x)"
    )
    print(
        f"  add again, unchanged     {files / again:>10,.0f} files/s  ({again:.1f} s)  "
        f"{add / again:.1f}x faster than the first (goal >= 5x)"
    )


if __name__ == "__main__":
    main()
