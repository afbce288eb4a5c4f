"""Put and get of a large file through the vault server, durable and verified on both sides,
beside `openssl dgst -sha256` over the same file in the same run: on this host, where the
client hands its file to the server (vault/handoff.py), and streamed through gRPC, as a client
on another host does.

The hot tier reads a large blob past the page cache (direct I/O), so a get reads it from the
disk where `openssl` over a cached file does not: the run also times `dd iflag=direct` over the
same file, the disk's own share of a get.

Each timed get follows an untimed one whose output was just deleted: a get makes a new file,
and on this machine memory left idle for a couple of seconds is handed back to the host and
slow to touch again, which would time the host rather than the get.

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
from vault.client import VaultClient
from vault.store.allocator import keep_freed_buffers


def openssl(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["openssl", "dgst", "-sha256", str(path)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def disk_read(path: Path) -> float:
    """Reading the file past the page cache, in the hot tier's blocks of 2 MiB."""
    start = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=2M", "iflag=direct"],
        check=True,
        stderr=subprocess.DEVNULL,
    )
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
            base: list[float] = []
            disk: list[float] = []
            times: dict[tuple[str, bool], list[float]] = {}
            openssl(source)  # warm the page cache
            for i in range(args.repeat + 1):
                for handoff in (True, False):
                    # New content each time, so every put really stores (and syncs) a new blob.
                    with open(source, "r+b") as f:
                        f.write(i.to_bytes(8, "little") + os.urandom(8))
                    b = openssl(source)
                    start = time.perf_counter()
                    result = client.put(str(source), handoff=handoff)
                    p = time.perf_counter() - start
                    assert result.created
                    digest = str(result.blob.sha256)
                    client.get(digest, out, handoff=handoff)
                    out.unlink()
                    start = time.perf_counter()
                    client.get(digest, out, handoff=handoff)
                    g = time.perf_counter() - start
                    out.unlink()
                    d = disk_read(source)
                    if i:  # the first round is warm-up
                        base.append(b)
                        disk.append(d)
                        times.setdefault(("put", handoff), []).append(p)
                        times.setdefault(("get", handoff), []).append(g)
            client.close()
    o = statistics.median(base)
    mib = size / (1 << 20)
    print(f"{args.size_mib} MiB, median of {args.repeat}; baseline: openssl dgst -sha256 {o:.3f} s")
    print(
        f"the file read from disk (dd iflag=direct, 2 MiB blocks): {statistics.median(disk):.3f} s"
    )
    labels = {
        ("put", True): "put, this host (handoff), durable",
        ("get", True): "get, this host (handoff), verified both sides",
        ("put", False): "put, streamed, durable",
        ("get", False): "get, streamed, verified both sides",
    }
    for key, label in labels.items():
        t = statistics.median(times[key])
        print(row(label, f"{t:.3f} s", f"{o:.3f} s", t / o, f"goal <= 1.5x ({mib / t:,.0f} MiB/s)"))


if __name__ == "__main__":
    main()
