"""Peer mirrors on three real MinIO servers: replication of mixed blobs from the hot tier to the
three mirrors (queue, worker per mirror, every copy verified) beside boto3 uploading the same
files straight to the same servers; then a cold read through the vault's path (tier manager over
an empty hot tier and a mirror, every chunk verified) beside a boto3 download. Same run, medians.

    uv run python -m bench.mirror [--total-mib 1024] [--repeat 3]     # --total-mib 10240: 10 GiB
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]

from bench.common import row, vault_server
from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import FILE_NAME as QUEUE_FILE
from mirror.queue import ReplicationQueue
from mirror.replicate import Replicator
from mirror.store import MirrorReads
from tests.services.s3 import MinioServer, S3Endpoint
from tiers.cold import ColdTier
from tiers.hot import HotTier
from tiers.manager import TierManager
from vault.client import VaultClient
from vault.digest import Digest
from vault.storage import BlobStore, put_file

GOAL = 0.80
# Mixed blobs, by share of the total: large incompressible (model checkpoints), mid-size
# text (logs, CSV), and many small files.
_MIX = ((64 << 20, "random", 0.6), (8 << 20, "text", 0.3), (256 << 10, "random", 0.1))


def make_blobs(folder: Path, total: int) -> list[Path]:
    rng = random.Random(7)
    pool = rng.randbytes(64 << 20)
    line = b"step=000123 loss=0.123456 lr=1e-4 grad_norm=1.234 tokens=123456789\n"
    paths: list[Path] = []
    for size, kind, share in _MIX:
        for number in range(max(1, int(total * share) // size)):
            path = folder / f"{kind}-{size}-{number}"
            with path.open("wb") as out:
                left = size
                while left:
                    if kind == "random":
                        start = rng.randrange(len(pool) - min(left, 1 << 20))
                        piece = pool[start : start + min(left, 1 << 20)]
                    else:
                        piece = (f"{number:08d} ".encode() + line) * 1000
                        piece = piece[:left]
                    out.write(piece)
                    left -= len(piece)
            paths.append(path)
    return paths


def cold_tier(endpoint: S3Endpoint) -> ColdTier:
    return ColdTier(
        endpoint_url=endpoint.url,
        bucket=endpoint.bucket,
        access_key_id=endpoint.access_key,
        secret_access_key=endpoint.secret_key,
        region=endpoint.region,
    )


def replicate(
    hot: HotTier, digests: list[tuple[Digest, int]], endpoints: list[S3Endpoint]
) -> float:
    """Seconds to bring every blob to its three verified copies, as `vault serve` does."""
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-queue-") as folder:
        mirrors = MirrorSet(
            [Mirror(f"m{n}", cold_tier(e)) for n, e in enumerate(endpoints)], replicas=3
        )
        queue = ReplicationQueue(Path(folder) / "mirrors.db")
        queue.enqueue([(digest, size, mirrors.names) for digest, size in digests])
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


def vault_read(store: BlobStore, digests: list[tuple[Digest, int]]) -> float:
    started = time.perf_counter()
    for digest, size in digests:
        got = sum(len(chunk.data) for chunk in store.read(digest))
        assert got == size
    return time.perf_counter() - started


def grpc_cold_read(work: Path, server: MinioServer, paths: list[Path]) -> float:
    """The blobs put through a real `vault serve` with one mirror, their hot copies then gone
    (as after migration to cold), read back through the server over gRPC: the server checks
    each chunk it takes from the mirror, the client the whole digest."""
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
    with vault_server(data, env=env) as vault, VaultClient(vault.address) as client:
        digests = [str(client.put(path).blob.sha256) for path in paths]
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
        for digest, path in zip(digests, paths, strict=True):
            got = sum(len(piece) for piece in client.open(digest).chunks())
            assert got == path.stat().st_size
        return time.perf_counter() - started


def boto3_download(endpoint: S3Endpoint, paths: list[Path]) -> float:
    client = endpoint.client()
    config = TransferConfig()
    started = time.perf_counter()
    for path in paths:
        client.download_fileobj(endpoint.bucket, path.name, _Sink(), Config=config)
    return time.perf_counter() - started


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def _parallel(calls: list[Callable[[], None]]) -> float:
    threads = [threading.Thread(target=call) for call in calls]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    total = args.total_mib << 20

    servers = [MinioServer().start() for _ in range(3)]
    work = Path(tempfile.mkdtemp(prefix="pinvault-bench-mirror-"))
    try:
        (work / "files").mkdir()
        paths = make_blobs(work / "files", total)
        hot = HotTier(work / "hot")
        digests = [(put_file(hot, path).sha256, path.stat().st_size) for path in paths]
        size = sum(s for _, s in digests)
        print(f"{len(paths)} blobs, {size / (1 << 20):,.0f} MiB, to 3 MinIO servers")

        ours: list[float] = []
        theirs: list[float] = []
        endpoints: list[S3Endpoint] = []
        for _ in range(args.repeat):
            endpoints = [server.create_bucket() for server in servers]
            ours.append(replicate(hot, digests, endpoints))
            plain = [server.create_bucket() for server in servers]
            theirs.append(boto3_upload(paths, plain))
            for server, endpoint in zip(servers, plain, strict=True):
                server.delete_bucket(endpoint.bucket)
            if len(ours) < args.repeat:
                for server, endpoint in zip(servers, endpoints, strict=True):
                    server.delete_bucket(endpoint.bucket)
        ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
        print(
            row(
                "replicate to 3 mirrors, verified",
                f"{ours_s:.2f} s",
                f"boto3 {theirs_s:.2f} s",
                theirs_s / ours_s,
                f">= {GOAL:.2f}x",
            )
        )

        # The cold read: the last run's first mirror, behind an empty hot tier, as a blob
        # evicted from hot is read by `vault serve`.
        download = servers[0].create_bucket()
        client = download.client()
        for path in paths:
            client.upload_file(str(path), download.bucket, path.name)
        with MirrorSet([Mirror("m0", cold_tier(endpoints[0]))], replicas=1) as mirrors:
            empty = HotTier(work / "empty-hot")
            manager = TierManager(
                [("hot", empty), ("mirror-m0", MirrorReads(mirrors.mirrors[0]))],
                journal=work / "tiers.db",
            )
            reads = [vault_read(manager, digests) for _ in range(args.repeat)]
            manager.close()
        downloads = [boto3_download(download, paths) for _ in range(args.repeat)]
        ours_s, theirs_s = statistics.median(reads), statistics.median(downloads)
        print(
            row(
                "cold read through the tier manager, verified",
                f"{ours_s:.2f} s",
                f"boto3 {theirs_s:.2f} s",
                theirs_s / ours_s,
                f">= {GOAL:.2f}x",
            )
        )
        rate = size / (1 << 20)
        print(f"  ({rate / ours_s:,.0f} MiB/s read; boto3 {rate / theirs_s:,.0f} MiB/s)")

        served = [grpc_cold_read(work, servers[0], paths) for _ in range(args.repeat)]
        ours_s = statistics.median(served)
        print(
            row(
                "cold read through `vault serve` (gRPC), verified twice",
                f"{ours_s:.2f} s",
                f"boto3 {theirs_s:.2f} s",
                theirs_s / ours_s,
                f">= {GOAL:.2f}x",
            )
        )
        print(f"  ({rate / ours_s:,.0f} MiB/s read; boto3 {rate / theirs_s:,.0f} MiB/s)")
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
