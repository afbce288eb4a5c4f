"""`vault dataset add` of a folder of many small files, stored durably, beside
`cp -r DIR COPY && sync` on the same folder in the same run; then a second add of the
unchanged folder.

    uv run python -m bench.dataset [--files 100000]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import vault_server
from vault.client import VaultClient
from vault.dataset import add_dataset


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        tree = Path(tmp) / "tree"
        size = make_tree(tree, args.files)
        subprocess.run(["sync"], check=True)
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(tree), str(Path(tmp) / "copy")], check=True)
        subprocess.run(["sync"], check=True)
        copy = time.perf_counter() - start
        shutil.rmtree(Path(tmp) / "copy")
        with vault_server() as server:
            client = VaultClient(server.address, state=Path(tmp) / "state.json")
            start = time.perf_counter()
            first = add_dataset(client, tree)
            add = time.perf_counter() - start
            start = time.perf_counter()
            second = add_dataset(client, tree)
            again = time.perf_counter() - start
            client.close()
    assert first.digest == second.digest and second.sent_files == 0
    print(f"{args.files:,} files, {size / (1 << 20):,.0f} MiB")
    print(f"  cp -r && sync            {args.files / copy:>10,.0f} files/s  ({copy:.1f} s)")
    print(
        f"  vault dataset add        {args.files / add:>10,.0f} files/s  ({add:.1f} s)  "
        f"{copy / add:.2f}x of cp (goal >= 0.5x)"
    )
    print(
        f"  add again, unchanged     {args.files / again:>10,.0f} files/s  ({again:.1f} s)  "
        f"{add / again:.1f}x faster than the first (goal >= 5x)"
    )


if __name__ == "__main__":
    main()
