"""Put and get of a large file through the vault server, durable and verified on both sides,
beside `openssl dgst -sha256` over the same file in the same run.

    uv run python -m bench.put_get [--size-mib 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import make_file, row, vault_server
from vault.allocator import keep_freed_buffers
from vault.client import VaultClient


def openssl(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["openssl", "dgst", "-sha256", str(path)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    size = args.size_mib << 20
    keep_freed_buffers()  # as the `vault` command does
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        source = make_file(Path(tmp) / "source.bin", size)
        out = Path(tmp) / "out.bin"
        with vault_server() as server:
            client = VaultClient(server.address, state=Path(tmp) / "state.json")
            base, puts, gets = [], [], []
            openssl(source)  # warm the page cache
            for i in range(args.repeat + 1):
                # New content each round, so every put really stores (and syncs) a new blob.
                with open(source, "r+b") as f:
                    f.write(i.to_bytes(8, "little") + os.urandom(8))
                b = openssl(source)
                start = time.perf_counter()
                result = client.put(str(source))
                p = time.perf_counter() - start
                assert result.created
                start = time.perf_counter()
                client.get(str(result.blob.sha256), out)
                g = time.perf_counter() - start
                out.unlink()
                if i:  # the first round is warm-up
                    base.append(b)
                    puts.append(p)
                    gets.append(g)
            client.close()
    o = statistics.median(base)
    p = statistics.median(puts)
    g = statistics.median(gets)
    mib = size / (1 << 20)
    print(f"{args.size_mib} MiB, median of {args.repeat}; baseline: openssl dgst -sha256 {o:.3f} s")
    print(row("put through the server, durable", f"{p:.3f} s", f"{o:.3f} s", p / o, "goal <= 1.5x"))
    print(row("get, verified on both sides", f"{g:.3f} s", f"{o:.3f} s", g / o, "goal <= 1.5x"))
    print(f"put {mib / p:,.0f} MiB/s, get {mib / g:,.0f} MiB/s, openssl {mib / o:,.0f} MiB/s")


if __name__ == "__main__":
    main()
