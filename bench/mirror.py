"""Peer mirrors on three real MinIO servers, against boto3 on the same servers in the same run.

Migration: mixed blobs (1 KiB to 1 GiB) are put into the hot tier, then replicated hot to cold
to three mirrors as `vault serve` does (a queue, one worker per mirror, every copy verified);
beside it, boto3 uploads the same files straight to the same three servers. Each repeat deletes
our buckets as soon as replication is timed, before boto3's upload, and boto3's right after its
own, purged at once rather than left in MinIO's trash, so the disk holds at most the source
files, the hot tier and three copies.

Cold reads, on a subset of the blobs of at most --read-mib MiB (one of each size class that
fits, then the largest): each read writes the blob to a file, as a researcher fetching an
artefact does, and the file is deleted after each blob. boto3's `download_file` from a plain
bucket is the baseline; against it, the tier manager over an empty hot tier and one mirror
holding the subset in our layout (every chunk verified), and a real `vault serve` whose hot
copies are gone, read with `VaultClient.get` (the server checks each chunk, the client the
digest; on this host the file is handed to the server over its Unix socket). Medians.

With --encrypted, the replication and the tier manager's cold reads are timed again on
encrypted mirrors (every chunk sealed with AES-256-GCM, docs/encryption.md), alternated with the
plain ones, and reported beside them.

    uv run python -m bench.mirror [--total-mib 1024] [--read-mib 1024] [--repeat 3] [--encrypted]

The 10 GiB goal (about 50 GiB of disk at the peak):

    uv run python -m bench.mirror --total-mib 10240 --repeat 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]

from bench.common import row, vault_server
from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import FILE_NAME as QUEUE_FILE
from mirror.queue import ReplicationQueue
from mirror.replicate import Replicator
from mirror.store import MirrorReads
from tests.services.s3 import MinioServer, S3Endpoint
from tiers.cold import ColdTier, KeyRing
from tiers.hot import HotTier
from tiers.manager import TierManager
from vault.client import VaultClient
from vault.digest import Digest
from vault.store.protocol import BlobStore, put_file

GOAL = 0.80
_LABELS = (
    "replicate to 3 mirrors, verified",
    "cold read via tier manager to a file, verified",
    "cold read via `vault serve` (gRPC) to a file, verified twice",
    "replicate to 3 encrypted mirrors, verified",
    "cold read of encrypted copies via tier manager",
)
_WIDTH = max(len(label) for label in _LABELS)
# Mixed blobs, by share of the total: large incompressible (model checkpoints), mid-size
# incompressible (shards), text (logs, CSV), and many small files. A class's blobs are at most
# the bytes its share gets, so a small total still has every class.
_MIX = (
    (1 << 30, "random", 0.40),
    (64 << 20, "random", 0.30),
    (8 << 20, "text", 0.20),
    (256 << 10, "random", 0.08),
    (1 << 10, "random", 0.02),
)
# Blobs per class at most: the 1 KiB class's share of 10 GiB would be 200,000 files.
_MAX_PER_CLASS = 4096
_PIECE = 1 << 20


@dataclass(frozen=True, slots=True)
class Blob:
    path: Path
    label: str  # its size class, as in _MIX
    size: int
    digest: Digest


def _label(size: int, kind: str) -> str:
    return f"{_human(size)} {kind}"


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:g} {unit}"
        size /= 1024
    return f"{size:g} GiB"


def make_blobs(folder: Path, total: int) -> list[tuple[str, Path]]:
    """The files of the mix, with their size class."""
    rng = random.Random(7)
    pool = rng.randbytes(64 << 20)
    line = b"step=000123 loss=0.123456 lr=1e-4 grad_norm=1.234 tokens=123456789\n"
    made: list[tuple[str, Path]] = []
    for nominal, kind, share in _MIX:
        budget = max(1, int(total * share))
        size = min(nominal, budget)
        for number in range(max(1, min(_MAX_PER_CLASS, budget // size))):
            path = folder / f"{kind}-{size}-{number}"
            with path.open("wb") as out:
                left = size
                while left:
                    n = min(left, _PIECE)
                    if kind == "text":
                        piece = ((f"{number:08d} ".encode() + line) * 1000)[:n]
                    elif size < _PIECE:
                        # Fresh bytes: slices of the pool could repeat among thousands.
                        piece = rng.randbytes(n)
                    else:
                        start = rng.randrange(len(pool) - n)
                        piece = pool[start : start + n]
                    out.write(piece)
                    left -= len(piece)
            made.append((_label(nominal, kind), path))
    return made


def pick_reads(blobs: list[Blob], budget: int) -> list[Blob]:
    """At most `budget` bytes of blobs: one of each size class that fits (smallest class first,
    so a large one cannot crowd the rest out), then the largest that still fit."""
    chosen: dict[Path, Blob] = {}
    left = budget
    labels = list(dict.fromkeys(blob.label for blob in blobs))
    for label in reversed(labels):
        first = min((b for b in blobs if b.label == label), key=lambda b: b.size)
        if first.size <= left:
            chosen[first.path] = first
            left -= first.size
    for blob in sorted(blobs, key=lambda b: b.size, reverse=True):
        if blob.path not in chosen and blob.size <= left:
            chosen[blob.path] = blob
            left -= blob.size
    return sorted(chosen.values(), key=lambda b: b.size, reverse=True)


def describe(blobs: list[Blob]) -> str:
    size = sum(blob.size for blob in blobs)
    counts: dict[str, int] = {}
    for blob in blobs:
        counts[blob.label] = counts.get(blob.label, 0) + 1
    classes = ", ".join(f"{label} x{count}" for label, count in counts.items())
    return f"{len(blobs)} blobs, {size / (1 << 20):,.1f} MiB ({classes})"


def cold_tier(endpoint: S3Endpoint, keys: KeyRing | None = None) -> ColdTier:
    return ColdTier(
        endpoint_url=endpoint.url,
        bucket=endpoint.bucket,
        access_key_id=endpoint.access_key,
        secret_access_key=endpoint.secret_key,
        region=endpoint.region,
        keys=keys,
    )


def replicate(
    hot: HotTier,
    digests: list[tuple[Digest, int]],
    endpoints: list[S3Endpoint],
    replicas: int | None = None,
    keys: KeyRing | None = None,
) -> float:
    """Seconds to bring every blob to its verified copies (one on each endpoint unless
    `replicas` says fewer), as `vault serve` does; encrypted under `keys` if given."""
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-queue-") as folder:
        mirrors = MirrorSet(
            [Mirror(f"m{n}", cold_tier(e, keys)) for n, e in enumerate(endpoints)],
            replicas=replicas or len(endpoints),
        )
        queue = ReplicationQueue(Path(folder) / "mirrors.db")
        queue.enqueue(
            [(digest, size, [m.name for m in mirrors.assigned(digest)]) for digest, size in digests]
        )
        replicator = Replicator(hot, mirrors, queue)
        started = time.perf_counter()
        threads = [threading.Thread(target=replicator.drain, args=(mirror,)) for mirror in mirrors]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        if queue.pending_count():
            raise RuntimeError(f"{queue.pending_count()} copies were not made")
        queue.close()
        mirrors.close()
    return seconds


def boto3_upload(paths: list[Path], endpoints: list[S3Endpoint]) -> float:
    """Seconds for boto3 to upload every file to every server, one thread per server."""
    config = TransferConfig()

    def upload(endpoint: S3Endpoint) -> None:
        client = endpoint.client()
        for path in paths:
            client.upload_file(str(path), endpoint.bucket, path.name, Config=config)

    return _parallel([partial(upload, endpoint) for endpoint in endpoints])


def vault_read(store: BlobStore, blobs: list[Blob], scratch: Path) -> float:
    """Seconds to read every blob through `store` (each chunk verified) into a file, each file
    deleted after its blob."""
    started = time.perf_counter()
    for blob in blobs:
        target = scratch / blob.path.name
        with target.open("wb") as out:
            got = 0
            for chunk in store.read(blob.digest):
                out.write(chunk.data)
                got += len(chunk.data)
        assert got == blob.size, (blob.path.name, got, blob.size)
        target.unlink()
    return time.perf_counter() - started


def grpc_cold_read(work: Path, server: MinioServer, blobs: list[Blob], scratch: Path) -> float:
    """The blobs put through a real `vault serve` with one mirror, their hot copies then gone
    (as after migration to cold), read back through the server over gRPC into a file each
    (`VaultClient.get`): the server checks each chunk it takes from the mirror, the client the
    whole digest. The mirror's bucket and the server's data are deleted afterwards."""
    endpoint = server.create_bucket()
    data = work / f"served-{endpoint.bucket}"
    env = {
        "PINVAULT_MIRRORS_ENDPOINTS": f"m0={endpoint.url}/{endpoint.bucket}",
        "PINVAULT_MIRRORS_REPLICAS": "1",
        "PVMIRROR_M0_ACCESS_KEY_ID": endpoint.access_key,
        "PVMIRROR_M0_SECRET_ACCESS_KEY": endpoint.secret_key,
        "PINVAULT_POLICY_PROMOTE_ON_READ": "false",
        "PINVAULT_POLICY_MIGRATE_INTERVAL": "0",
        "PINVAULT_POLICY_SCRUB_WINDOW_DAYS": "0",
    }
    try:
        with vault_server(data, env=env) as vault, VaultClient(vault.address) as client:
            digests = [str(client.put(blob.path).blob.sha256) for blob in blobs]
            queue = ReplicationQueue(data / QUEUE_FILE)
            deadline = time.monotonic() + 600
            while queue.pending_count():
                if time.monotonic() > deadline:
                    raise RuntimeError("replication to the mirror did not finish in 10 minutes")
                time.sleep(0.2)
            queue.close()
        # Evicted from hot: neither the copies nor the journal of them remain.
        shutil.rmtree(data / "hot" / "blobs")
        (data / "hot" / "blobs").mkdir()
        for journal in data.glob("tiers.db*"):
            journal.unlink()
        with vault_server(data, env=env) as vault, VaultClient(vault.address) as client:
            started = time.perf_counter()
            for digest, blob in zip(digests, blobs, strict=True):
                target = scratch / blob.path.name
                info = client.get(digest, target)
                assert info.size == blob.size, (blob.path.name, info.size, blob.size)
                target.unlink()
            return time.perf_counter() - started
    finally:
        purge(server, endpoint)
        shutil.rmtree(data, ignore_errors=True)


def boto3_download(endpoint: S3Endpoint, blobs: list[Blob], scratch: Path) -> float:
    """Seconds for boto3's `download_file` to fetch every blob into a file, each file deleted
    after its blob."""
    client = endpoint.client()
    config = TransferConfig()
    started = time.perf_counter()
    for blob in blobs:
        target = scratch / blob.path.name
        client.download_file(endpoint.bucket, blob.path.name, str(target), Config=config)
        assert target.stat().st_size == blob.size, blob.path.name
        target.unlink()
    return time.perf_counter() - started


def _parallel(calls: list[Callable[[], None]]) -> float:
    threads = [threading.Thread(target=call) for call in calls]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def report(label: str, ours: float, theirs: float, baseline: str = "boto3") -> None:
    print(
        row(
            label.ljust(_WIDTH),
            f"{ours:.2f} s",
            f"{baseline} {theirs:.2f} s",
            theirs / ours,
            f">= {GOAL:.2f}x",
        )
    )


def purge(server: MinioServer, endpoint: S3Endpoint) -> None:
    """Delete a bucket with its objects and wait for the space to be freed. A plain delete
    only moves the objects into MinIO's trash (.minio.sys/tmp/.trash), emptied every few
    minutes, so the next copies would find the disk still full; `x-minio-force-delete`
    purges them at once (MinIO empties the trash entry in the background, which is waited
    for here; small entries of its own come and go there meanwhile)."""
    trash = server.data_dir / ".minio.sys" / "tmp" / ".trash"
    before = _bytes_under(trash)
    client = endpoint.client()
    client.meta.events.register("before-sign.s3.DeleteBucket", _force_delete)
    client.delete_bucket(Bucket=endpoint.bucket)
    client.close()
    deadline = time.monotonic() + 300
    while _bytes_under(trash) > before + (1 << 20):
        if time.monotonic() > deadline:
            print(f"  (warning: MinIO has not emptied {trash} in 5 minutes; going on)")
            return
        time.sleep(0.2)


def _bytes_under(folder: Path) -> int:
    """The bytes in the files under `folder`, which MinIO may be deleting meanwhile."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _force_delete(request: Any, **_: Any) -> None:
    request.headers["x-minio-force-delete"] = "true"


def _purge_all(servers: list[MinioServer], endpoints: list[S3Endpoint]) -> None:
    for server, endpoint in zip(servers, endpoints, strict=True):
        purge(server, endpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--read-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--encrypted",
        action="store_true",
        help="also time replication and cold reads on encrypted mirrors, beside plain ones",
    )
    args = parser.parse_args()
    total = args.total_mib << 20
    ring = KeyRing([("bench", secrets.token_bytes(32))], secrets.token_bytes(32), "bench")

    servers = [MinioServer().start() for _ in range(3)]
    work = Path(tempfile.mkdtemp(prefix="pinvault-bench-mirror-"))
    try:
        (work / "files").mkdir()
        (work / "scratch").mkdir()
        scratch = work / "scratch"
        made = make_blobs(work / "files", total)
        hot = HotTier(work / "hot")
        blobs = [
            Blob(path, label, path.stat().st_size, put_file(hot, path).sha256)
            for label, path in made
        ]
        paths = [blob.path for blob in blobs]
        digests = [(blob.digest, blob.size) for blob in blobs]
        size = sum(blob.size for blob in blobs)
        sizes = [blob.size for blob in blobs]
        print(
            f"{describe(blobs)}; smallest {_human(min(sizes))}, largest {_human(max(sizes))}; "
            "to 3 MinIO servers"
        )

        ours: list[float] = []
        theirs: list[float] = []
        sealed: list[float] = []
        for _ in range(args.repeat):
            endpoints = [server.create_bucket() for server in servers]
            ours.append(replicate(hot, digests, endpoints))
            _purge_all(servers, endpoints)
            if args.encrypted:
                endpoints = [server.create_bucket() for server in servers]
                sealed.append(replicate(hot, digests, endpoints, keys=ring))
                _purge_all(servers, endpoints)
            plain = [server.create_bucket() for server in servers]
            theirs.append(boto3_upload(paths, plain))
            _purge_all(servers, plain)
        ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
        report(_LABELS[0], ours_s, theirs_s)
        rate = size / (1 << 20)
        print(
            f"  ({rate / ours_s:,.0f} MiB/s of blobs, 3 copies each; "
            f"boto3 {rate / theirs_s:,.0f} MiB/s)"
        )
        if args.encrypted:
            sealed_s = statistics.median(sealed)
            report(_LABELS[3], sealed_s, ours_s, "plain")
            print(f"  ({rate / sealed_s:,.0f} MiB/s of blobs, 3 copies each)")

        # The cold reads, of a subset: a fresh mirror bucket on servers[0] holding it in our
        # layout (replicated from hot), and a plain bucket beside it for boto3.
        reading = pick_reads(blobs, args.read_mib << 20)
        rate = sum(blob.size for blob in reading) / (1 << 20)
        print(f"cold reads of {describe(reading)}")
        stored = servers[0].create_bucket()
        replicate(hot, [(blob.digest, blob.size) for blob in reading], [stored], replicas=1)
        download = servers[0].create_bucket()
        client = download.client()
        for blob in reading:
            client.upload_file(str(blob.path), download.bucket, blob.path.name)
        stored_sealed = servers[0].create_bucket() if args.encrypted else None
        if stored_sealed is not None:
            replicate(
                hot,
                [(blob.digest, blob.size) for blob in reading],
                [stored_sealed],
                replicas=1,
                keys=ring,
            )
        reads: list[float] = []
        downloads: list[float] = []
        sealed_reads: list[float] = []
        with contextlib.ExitStack() as stack:
            managers = []
            for number, (endpoint, keys) in enumerate(((stored, None), (stored_sealed, ring))):
                if endpoint is None:
                    continue
                mirrors = stack.enter_context(
                    MirrorSet([Mirror("m0", cold_tier(endpoint, keys))], replicas=1)
                )
                manager = TierManager(
                    [
                        ("hot", HotTier(work / f"empty-hot-{number}")),
                        ("mirror-m0", MirrorReads(mirrors.mirrors[0])),
                    ],
                    journal=work / f"tiers-{number}.db",
                )
                stack.callback(manager.close)
                managers.append(manager)
            # Alternated, so that all see the same machine.
            for _ in range(args.repeat):
                reads.append(vault_read(managers[0], reading, scratch))
                downloads.append(boto3_download(download, reading, scratch))
                if stored_sealed is not None:
                    sealed_reads.append(vault_read(managers[1], reading, scratch))
        purge(servers[0], stored)
        purge(servers[0], download)
        ours_s, theirs_s = statistics.median(reads), statistics.median(downloads)
        report(_LABELS[1], ours_s, theirs_s)
        print(f"  ({rate / ours_s:,.0f} MiB/s read; boto3 {rate / theirs_s:,.0f} MiB/s)")
        if stored_sealed is not None:
            purge(servers[0], stored_sealed)
            sealed_s = statistics.median(sealed_reads)
            report(_LABELS[4], sealed_s, ours_s, "plain")
            print(f"  ({rate / sealed_s:,.0f} MiB/s read)")

        served = [grpc_cold_read(work, servers[0], reading, scratch) for _ in range(args.repeat)]
        ours_s = statistics.median(served)
        report(_LABELS[2], ours_s, theirs_s)
        print(f"  ({rate / ours_s:,.0f} MiB/s read; boto3 {rate / theirs_s:,.0f} MiB/s)")
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
