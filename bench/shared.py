"""Two `vault serve` on one PostgreSQL and three MinIO mirrors, as one vault: what a client sees
through the other server right after a put, what a server killed mid-put loses, the vault's CPU
per GiB stored with three copies (bytes streamed through the vault, and sent straight to the
object store), and four clients moving 256 MiB each through the two servers beside boto3
straight to the same MinIO, in the same run.

    uv run python -m bench.shared [--size-mib 256] [--clients 4] [--rounds 3]
        [--only all|cpu|clients] [--modes streamed,direct-one,direct]

Modes: `streamed` through the vault; `direct-one`, straight to one mirror, the vault's queue
making the other copies; `direct`, straight to every mirror the blob is kept on.

Needs what the tests need (PostgreSQL, MinIO: scripts/test builds them)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

from bench.common import make_file
from tests.services.postgres import PostgresServer
from tests.services.s3 import MinioServer, S3Endpoint
from tests.services.vault_server import VaultServer
from tests.test_mirror import NAMES
from tests.test_shared_blobs import Pair, started_pair
from vault.client import VaultClient
from vault.client.direct import put_direct
from vault.errors import VaultError

MIB = 1 << 20
MODES = ("streamed", "direct-one", "direct")


def cpu_seconds(vaults: list[VaultServer]) -> float:
    """User and system CPU of the servers and their child processes (the sequencers) so far,
    from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # After the command: state, ppid, ... utime (14th field) and stime (15th).
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    wanted = {vault.process.pid for vault in vaults if vault.process is not None}
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in stats.items() if parent in wanted} - wanted
        grew = bool(more)
        wanted |= more
    return sum(stats[pid][1] for pid in wanted if pid in stats)


def queue_empty(vault: VaultServer, env: dict[str, str], blobs: int) -> bool:
    """Every copy made: nothing queued, and `blobs` copies on each mirror's share."""
    status = vault.run(
        "mirror", "status", "--json", env={**env, "PINVAULT_DATA_DIR": str(vault.data_dir)}
    )
    rows = {row["name"]: row for row in status.json()}
    replicas = int(env.get("PINVAULT_MIRRORS_REPLICAS", "3"))
    copies = sum(rows[n]["objects"] for n in NAMES)
    return all(rows[n]["queued"] == 0 for n in NAMES) and copies >= blobs * replicas


def wait_for(condition: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise RuntimeError("timed out")
        time.sleep(0.5)
    return time.monotonic() - started


def put_then_get_elsewhere(pair: Pair, tmp: Path, count: int) -> int:
    a, b, _ = pair
    served = 0
    with a.client() as through_a, b.client() as through_b:
        for n in range(count):
            data = os.urandom(MIB)
            digest = str(through_a.put(data, handoff=False).blob.sha256)
            try:
                through_b.get(digest, tmp / f"elsewhere-{n}", handoff=False)
                served += 1
            except VaultError:
                pass
    return served


def killed_mid_put(pair: Pair, tmp: Path) -> tuple[int, int]:
    a, b, _ = pair
    acknowledged: dict[str, bytes] = {}
    stop = threading.Event()

    def writer(number: int) -> None:
        with a.client() as client:
            while not stop.is_set():
                data = os.urandom(MIB)
                try:
                    acknowledged[str(client.put(data, handoff=False).blob.sha256)] = data
                except VaultError:
                    return

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    while len(acknowledged) < 96:
        time.sleep(0.05)
    a._kill()
    stop.set()
    for thread in threads:
        thread.join()
    lost = 0
    with b.client() as client:
        for digest in list(acknowledged):
            try:
                client.get(digest, tmp / digest.replace(":", "-"), handoff=False)
            except VaultError:
                lost += 1
    return len(acknowledged), lost


def put_by(client: VaultClient, path: Path, mode: str) -> str:
    """Put a file the way `mode` says; its digest."""
    if mode == "streamed":
        return str(client.put(path, handoff=False).blob.sha256)
    copies = 1 if mode == "direct-one" else None
    return str(put_direct(client.store, client.timeout, path, copies=copies).blob.sha256)


def stored_cpu(pair: Pair, files: list[Path], *, mode: str) -> tuple[float, float]:
    """CPU seconds of both servers per GiB stored with three copies (beyond what they spend
    idle), and the wall time."""
    a, b, env = pair
    # What the two servers spend idle (their workers' polling), taken off the figure.
    idle_from = cpu_seconds([a, b])
    time.sleep(5)
    idle_rate = (cpu_seconds([a, b]) - idle_from) / 5
    before = cpu_seconds([a, b])
    started = time.monotonic()
    with a.client() as client:
        for path in files:
            put_by(client, path, mode)
    count = len(files)
    wait_for(lambda: queue_empty(b, env, count), 600)
    wall = time.monotonic() - started
    gib = sum(p.stat().st_size for p in files) / (1 << 30)
    return (cpu_seconds([a, b]) - before - idle_rate * wall) / gib, wall


def clients_through_two(pair: Pair, files: list[Path], tmp: Path, *, mode: str) -> float:
    """Seconds for each client to put its file through one of the two servers, then get it
    back through the other."""
    a, b, _ = pair

    def client(n: int) -> None:
        first, other = (a, b) if n % 2 == 0 else (b, a)
        with (
            VaultClient(first.address, timeout=600) as put_to,
            VaultClient(other.address, timeout=600) as get_from,
        ):
            path = files[n]
            out = tmp / f"got-{n}-{mode}"
            digest = put_by(put_to, path, mode)
            if mode == "streamed":
                get_from.get(digest, out, handoff=False)
            else:
                get_from.get_direct(digest, out)
            out.unlink()

    return timed_threads(client, len(files))


def boto3_straight(endpoints: list[S3Endpoint], files: list[Path], tmp: Path) -> float:
    def client(n: int) -> None:
        endpoint = endpoints[n % len(endpoints)]
        s3 = endpoint.client()
        key = f"boto3/{n}"
        s3.upload_file(str(files[n]), endpoint.bucket, key)
        s3.download_file(endpoint.bucket, key, str(tmp / f"boto3-{n}"))
        (tmp / f"boto3-{n}").unlink()

    return timed_threads(client, len(files))


def timed_threads(work: Callable[[int], None], count: int) -> float:
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            work(n)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.monotonic() - started


class Pairs:
    """A fresh pair of servers, on a database and buckets of its own, for each measure."""

    def __init__(self, base: Path, postgres: PostgresServer, minio: MinioServer) -> None:
        self.base, self.postgres, self.minio = base, postgres, minio
        self.made = 0

    def fresh(self, **mirrors: str) -> AbstractContextManager[Pair]:
        self.made += 1
        database = self.postgres.create_database()
        return started_pair(self.base / f"pair-{self.made}", database, self.minio, None, **mirrors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, of {', '.join(MODES)}",
    )
    parser.add_argument(
        "--replicas", default="3,1", help="comma-separated copies to measure the CPU for"
    )
    parser.add_argument(
        "--only",
        choices=("all", "cpu", "clients"),
        default="all",
        help="measure only the CPU per GiB, or only the clients beside boto3",
    )
    args = parser.parse_args()
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes takes some of {', '.join(MODES)}, not {args.modes!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with (
        tempfile.TemporaryDirectory(prefix="pinvault-bench-shared-") as tmp_name,
        ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        postgres = stack.enter_context(PostgresServer())
        minio = stack.enter_context(MinioServer())
        made = Pairs(tmp, postgres, minio)
        files = [make_file(tmp / f"file-{n}", args.size_mib * MIB) for n in range(args.clients)]
        if args.only == "all":
            lost_and_served(made, tmp)
        if args.only in ("all", "cpu"):
            cpu_per_gib(made, files, modes, args.replicas.split(","), args.rounds)
        if args.only in ("all", "clients"):
            beside_boto3(made, minio, files, tmp, modes, args.rounds, args.size_mib)


def lost_and_served(made: Pairs, tmp: Path) -> None:
    with made.fresh() as pair:
        served = put_then_get_elsewhere(pair, tmp, 20)
    print(f"put through a, get through b at once: {served} of 20 served")
    with made.fresh() as pair:
        acknowledged, lost = killed_mid_put(pair, tmp)
    print(f"server killed mid-put: {lost} of {acknowledged} acknowledged blobs lost")


def cpu_per_gib(
    made: Pairs, files: list[Path], modes: list[str], replicas: list[str], rounds: int
) -> None:
    for copies in replicas:
        results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        # Rounds interleave the modes, so that a load elsewhere on the host falls on each.
        for _ in range(rounds):
            for mode in modes:
                with made.fresh(replicas=copies) as pair:
                    results[mode].append(stored_cpu(pair, files, mode=mode))
                cpu, wall = results[mode][-1]
                print(f"  {mode}: {cpu:.2f} s per GiB ({wall:.1f} s wall)", flush=True)
        print(f"vault CPU per GiB stored with {copies} copies, medians of {rounds}:")
        for mode, measured in results.items():
            cpu = statistics.median(c for c, _ in measured)
            wall = statistics.median(w for _, w in measured)
            each = " ".join(f"{c:.2f}" for c, _ in measured)
            print(f"  {mode:10} {cpu:6.2f} s  ({wall:.1f} s wall; rounds: {each})")


def beside_boto3(
    made: Pairs,
    minio: MinioServer,
    files: list[Path],
    tmp: Path,
    modes: list[str],
    rounds: int,
    size_mib: int,
) -> None:
    endpoints = [minio.create_bucket() for _ in range(3)]
    gib = len(files) * size_mib / 1024
    results: dict[str, list[float]] = {"boto3": [], **{mode: [] for mode in modes}}
    for number in range(1, rounds + 1):
        results["boto3"].append(boto3_straight(endpoints, files, tmp))
        for mode in modes:
            with made.fresh() as pair:
                results[mode].append(clients_through_two(pair, files, tmp, mode=mode))
        line = ", ".join(f"{mode} {seconds[-1]:.2f} s" for mode, seconds in results.items())
        print(f"  round {number}: {line}", flush=True)
    base = statistics.median(results["boto3"])
    print(f"{len(files)} clients x {size_mib} MiB, put then get, medians of {rounds}:")
    for mode, seconds in results.items():
        took = statistics.median(seconds)
        ratios = " ".join(f"{base / s:.2f}" for s in seconds)
        print(
            f"  {mode:10} {took:6.2f} s  {2 * gib / took * 1024:7.1f} MiB/s  "
            f"{base / took:.2f}x boto3  (rounds: {ratios})"
        )


if __name__ == "__main__":
    main()
