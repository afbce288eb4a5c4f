"""The gc releasing many blobs (docs/retention.md) while the vault serves look-ups: one run's
checkpoints of many small files, then `vault serve` restarted with retention.keep_last = 1,
whose pass at start releases every intermediate checkpoint's files (a release entry each, its
bytes removed). Beside it, from the same run: the same number of files unlinked, each with its
folder synced (what the removal alone costs the file system), and the look-up rate with no gc
running.

    uv run python -m bench.gc [--checkpoints 100] [--files 1000] [--size 256]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from bench.common import vault_server
from vault.client import VaultClient
from vault.runs import start
from vault.runs.dataset import add_dataset

LOOKUP_SECONDS = 10.0


def make_run(address: str, tmp: Path, checkpoints: int, files: int, size: int) -> list[str]:
    """One run's checkpoints; returns the digests of the last one's files (kept)."""
    folder = tmp / "dataset"
    folder.mkdir()
    (folder / "x.bin").write_bytes(os.urandom(1000))
    with VaultClient(address) as client:
        image = str(client.put(b"a bench image").blob.sha256)
        client.pin("image", image)
        dataset = add_dataset(client, folder).digest
        admission = client.admit(image=image, dataset=dataset, seed=7)
    env = {
        "PINVAULT_RUN_ID": admission.run_id,
        "PINVAULT_SEED": "7",
        "PINVAULT_IMAGE": image,
        "PINVAULT_DATASET": dataset,
        "PINVAULT_CLIENT_SERVER": address,
        "PINVAULT_CLIENT_STATE_FILE": str(tmp / "trust.json"),
    }
    kept: list[str] = []
    # Still running: a sealed run's manifest names every checkpoint, which then all stay.
    run = start(environ=env, output_dir=tmp / "out")
    try:
        for step in range(checkpoints):
            made = run.checkpoint(step, {f"f{n}": os.urandom(size) for n in range(files)})
            kept = [f.sha256 for f in made.manifest.files]
            if step % 10 == 9:
                print(f"  {step + 1} checkpoints made", flush=True)
    finally:
        run.close()
    return kept


def lookups(address: str, digests: list[str], stop: threading.Event) -> int:
    """Stats of random kept blobs until `stop`; how many were answered."""
    done = 0
    with VaultClient(address) as client:
        while not stop.is_set():
            client.stat(random.choice(digests))
            done += 1
    return done


def lookup_rate(address: str, digests: list[str], seconds: float) -> float:
    stop = threading.Event()
    counted: list[int] = []
    thread = threading.Thread(target=lambda: counted.append(lookups(address, digests, stop)))
    started = time.perf_counter()
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return counted[0] / (time.perf_counter() - started)


def hot_blobs(data: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(data / "hot" / "blobs"))


def unlink_floor(tmp: Path, count: int, size: int) -> float:
    """Seconds to unlink `count` files of `size` bytes in 256 folders, syncing the folder
    after each, as the hot tier's delete does."""
    root = tmp / "floor"
    paths = []
    for n in range(count):
        folder = root / f"{n % 256:02x}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{n:08d}"
        path.write_bytes(os.urandom(size))
        paths.append(path)
    started = time.perf_counter()
    for path in paths:
        path.unlink()
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=int, default=100)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    released = (args.checkpoints - 1) * args.files
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as name:
        tmp = Path(name)
        data = tmp / "data"
        print(f"making {args.checkpoints} checkpoints of {args.files} files", flush=True)
        with vault_server(data) as server:
            kept = make_run(server.address, tmp, args.checkpoints, args.files, args.size)
        with vault_server(data) as server:
            idle_rate = lookup_rate(server.address, kept, LOOKUP_SECONDS)
        before = hot_blobs(data)
        env = {"PINVAULT_RETENTION_KEEP_LAST": "1", "PINVAULT_RETENTION_INTERVAL": "86400"}
        stop = threading.Event()
        counted: list[int] = []
        with vault_server(data, env=env) as server:
            started = time.perf_counter()
            thread = threading.Thread(
                target=lambda: counted.append(lookups(server.address, kept, stop))
            )
            thread.start()
            while before - hot_blobs(data) < released:
                if time.perf_counter() - started > 3600:
                    raise RuntimeError(
                        f"{before - hot_blobs(data)} of {released} removed in an hour"
                    )
                time.sleep(0.2)
            seconds = time.perf_counter() - started
            stop.set()
            thread.join()
        busy_rate = counted[0] / seconds
        with sqlite3.connect(f"file:{data / 'vault.db'}?mode=ro", uri=True) as db:
            ((entries,),) = db.execute("SELECT count(*) FROM entries WHERE kind = 'release'")
        assert entries == released, (entries, released)
        floor = unlink_floor(tmp, released, args.size)
    print(f"{released} blobs of {args.size} bytes released (a release entry each, hot tier)")
    print(f"vault gc (from server start)      {seconds:8.1f} s  {released / seconds:9.0f} blobs/s")
    print(f"unlink + folder sync, same count  {floor:8.1f} s  {released / floor:9.0f} blobs/s")
    print(f"look-ups (stat) during the gc     {busy_rate:8.0f} /s")
    print(f"look-ups (stat) with no gc        {idle_rate:8.0f} /s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
