"""Admission of a dataset whose manifest names a million files: the time of the first
admission and the server's extra peak memory, the same admission again (answered from memory),
a manifest whose files are all missing refused twice, and the p99 of look-ups another client
makes while the first admission runs. Beside it, the whole-document reader every manifest went
through before (json.loads, build, re-encode), timed in this process on the same bytes.

    uv run python -m bench.admission_manifest [--files 1000000]

Storing the files (tiny distinct blobs, put 10,000 a call) is set-up, timed but not the figure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import threading
import time
from pathlib import Path

from bench.common import row, vault_server
from vault.client import VaultClient
from vault.errors import FailedPrecondition
from vault.store.manifest import FileEntry, _decode_document, build_manifest, encode_manifest

BATCH = 10_000


def _status(pid: int, field: str) -> int:
    found = re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert found, field
    return int(found.group(1)) * 1024


def _manifest(digests: list[str]) -> bytes:
    files = [
        FileEntry(f"shard-{i // 1000:04d}/part-{i:07d}.bin", 8, 0o644, d)
        for i, d in enumerate(digests)
    ]
    return encode_manifest(build_manifest(files))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=1_000_000)
    args = parser.parse_args()
    n = args.files
    salt = os.urandom(4)
    blobs = [salt + i.to_bytes(4, "big") for i in range(n)]
    digests = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
    good = _manifest(digests)
    missing = _manifest(["sha256:" + os.urandom(32).hex() for _ in range(n)])

    with vault_server() as server, VaultClient(server.address, timeout=1800) as client:
        start = time.perf_counter()
        for at in range(0, n, BATCH):
            client.put_many(blobs[at : at + BATCH], expected=digests[at : at + BATCH])
        stored = time.perf_counter() - start
        del blobs
        image = "sha256:" + hashlib.sha256(b"bench image").hexdigest()
        client.pin("image", image, external=True)
        dataset = str(client.put(good).blob.sha256)
        client.pin("dataset", dataset)
        refused = str(client.put(missing).blob.sha256)
        client.pin("dataset", refused)

        # Look-ups from another client while the first admission runs.
        latencies: list[float] = []
        running = threading.Event()
        running.set()

        def look_up() -> None:
            with VaultClient(server.address, timeout=60) as other:
                while running.is_set():
                    begin = time.perf_counter()
                    other.lookup(dataset)
                    latencies.append(time.perf_counter() - begin)

        before = _status(server.pid, "VmRSS")
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")
        looker = threading.Thread(target=look_up)
        looker.start()
        start = time.perf_counter()
        first = client.admit(image=image, dataset=dataset, seed=1)
        admitted = time.perf_counter() - start
        running.clear()
        looker.join()
        extra = _status(server.pid, "VmHWM") - before
        assert first.new

        start = time.perf_counter()
        client.admit(image=image, dataset=dataset, seed=1)
        again = time.perf_counter() - start

        refusals = []
        for _ in range(2):
            start = time.perf_counter()
            try:
                client.admit(image=image, dataset=refused, seed=1)
            except FailedPrecondition as exc:
                message = str(exc)
            refusals.append(time.perf_counter() - start)

    start = time.perf_counter()
    _decode_document(good, len(good))
    whole = time.perf_counter() - start

    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0
    print(f"{n:,} files, manifest {len(good) / 2**20:.0f} MiB; stored the files in {stored:.0f} s")
    print(f"refused: {message[:120]}")
    print(
        row(
            "first admission (vs whole-document reader)",
            f"{admitted:.2f} s",
            f"{whole:.2f} s",
            whole / admitted,
            "goal < 5 s",
        )
    )
    print(f"{'server extra peak memory':<44} {extra / 2**20:>14.0f} MiB  goal < 512 MiB")
    print(f"{'same admission again':<44} {again * 1000:>14.1f} ms")
    print(f"{'missing files, refused first':<44} {refusals[0]:>15.2f} s")
    print(f"{'missing files, refused again':<44} {refusals[1] * 1000:>14.1f} ms")
    print(
        f"{'look-ups during the first admission':<44} {len(latencies):>10,} calls  "
        f"p99 {p99 * 1000:.1f} ms  max {latencies[-1] * 1000 if latencies else 0:.1f} ms"
        "  goal < 1 s"
    )


if __name__ == "__main__":
    main()
