"""Three `vault serve` on one PostgreSQL with a synchronous standby and three MinIO mirrors, behind
HAProxy, as a lab runs them: clients put blobs, pin them and look them up through the balancer
while a vault server is killed outright and then the database primary crashes and its standby
is promoted. Nothing acknowledged is lost (no entry, no blob), clients carry on through the
balancer, and the ledger and its blobs verify."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.services.haproxy import HAProxy
from tests.services.postgres import PostgresServer, PostgresStandby, crash, failover_url
from tests.services.s3 import MinioServer
from tests.services.vault_server import VaultServer
from tests.test_mirror import mirror_env
from vault.client import VaultClient
from vault.errors import VaultError

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

ORIGIN = "balanced.test/ledger"
WRITERS = 4
BLOB_SIZE = 48 * 1024
# How long appends may take to resume after the primary crashed, as a lab is promised.
FAILOVER_SECONDS = 30.0


@dataclass
class Cluster:
    primary: PostgresServer
    standby: PostgresStandby
    vaults: list[VaultServer]
    proxy: HAProxy


@pytest.fixture
def cluster(tmp_path: Path, minio_server: MinioServer) -> Iterator[Cluster]:
    primary = PostgresServer(fsync=False, standby_name="standby1").start()
    standby: PostgresStandby | None = None
    vaults: list[VaultServer] = []
    proxy: HAProxy | None = None
    buckets = [minio_server.create_bucket() for _ in range(3)]
    try:
        standby = PostgresStandby(primary).start()
        url = failover_url("pinvault", primary, standby)
        env = {"PINVAULT_LEDGER_ORIGIN": ORIGIN, **mirror_env(buckets)}
        tiles = ("--tiles-http", "0")
        first = VaultServer(tmp_path / "a", database=url, env=env, serve_args=tiles).start()
        vaults.append(first)
        config = tmp_path / "shared.toml"
        config.write_text(f'[ledger]\nkey_file = "{first.key_path}"\norigin = "{ORIGIN}"\n')
        for name in ("b", "c"):
            vaults.append(
                VaultServer(
                    tmp_path / name,
                    database=url,
                    env=env,
                    args=["--config", str(config)],
                    serve_args=tiles,
                ).start()
            )
        proxy = HAProxy([v.address for v in vaults], [tiles_address(v) for v in vaults]).start()
        yield Cluster(primary, standby, vaults, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        for vault in vaults:
            if vault.process is not None and vault.process.poll() is None:
                vault.stop()
        if standby is not None:
            standby.stop()
        primary.stop()
        for bucket in buckets:
            minio_server.delete_bucket(bucket.bucket)


def tiles_address(vault: VaultServer) -> str:
    """host:port of a server's tiles endpoint, from what it printed when it started."""
    (url,) = [
        line.split(" at ", 1)[1] for line in vault.banner if "tiles (C2SP tlog-tiles)" in line
    ]
    return urlsplit(url).netloc


@dataclass
class Writer:
    """One client putting a blob and pinning it through the balancer until told to stop,
    reading each pin back at once: what it was told was stored and appended, and when each
    call failed."""

    number: int
    address: str
    acknowledged: dict[str, int] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    failures: list[tuple[float, str]] = field(default_factory=list)
    successes: list[float] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        n = 0
        with VaultClient(self.address, author=f"writer-{self.number}@lab", timeout=20) as client:
            while not stop.is_set():
                data = f"writer {self.number} blob {n}".encode() + os.urandom(BLOB_SIZE)
                n += 1
                try:
                    # Stored through one server, pinned (which needs it stored) through
                    # another, most likely.
                    digest = str(client.put(data, handoff=False).blob.sha256)
                    self.blobs[digest] = data
                    proven = client.pin("artefact", digest)
                    # Read back at once, through the balancer: most likely from another server.
                    found = [p.entry.index for p in client.lookup(digest)]
                    assert found == [proven.entry.index], (digest, found, proven.entry.index)
                    # And an older pin, whose proof must still be consistent with the larger
                    # tree this client has seen since.
                    first = next(iter(self.acknowledged.items()), (digest, proven.entry.index))
                    found = [p.entry.index for p in client.lookup(first[0])]
                    assert found == [first[1]], (first, found)
                except VaultError as exc:
                    self.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))
                    time.sleep(0.1)
                    continue
                self.acknowledged[digest] = proven.entry.index
                self.successes.append(time.monotonic())


def test_a_killed_server_and_a_failed_over_database_lose_nothing_acknowledged(
    cluster: Cluster,
) -> None:
    stop = threading.Event()
    writers = [Writer(n, cluster.proxy.grpc_address) for n in range(WRITERS)]
    threads = [threading.Thread(target=w.run, args=(stop,)) for w in writers]
    for thread in threads:
        thread.start()
    try:
        time.sleep(3)
        killed_at = time.monotonic()
        doomed = cluster.vaults[1]
        assert doomed.process is not None
        doomed.process.kill()
        doomed.process.wait()
        time.sleep(4)

        crashed_at = time.monotonic()
        crash(cluster.primary)
        cluster.standby.promote()
        time.sleep(FAILOVER_SECONDS / 2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)

    acknowledged = {d: i for w in writers for d, i in w.acknowledged.items()}
    failures = sorted(f for w in writers for f in w.failures)
    assert len(acknowledged) > 50, failures[:5]
    # Appends resumed after the failover, within the bound.
    resumed = min((t for w in writers for t in w.successes if t > crashed_at), default=None)
    assert resumed is not None, f"no append succeeded after the failover: {failures[-5:]}"
    assert resumed - crashed_at < FAILOVER_SECONDS
    # Every writer carried on after both faults.
    stuck = [w.number for w in writers if not any(t > resumed for t in w.successes)]
    assert stuck == [], [
        (round(t - crashed_at, 2), what) for t, what in failures if t > crashed_at
    ][-8:]
    # Calls failed only around the two faults.
    stray = [
        (round(t - killed_at, 2), what)
        for t, what in failures
        if not (killed_at <= t <= killed_at + 3 or crashed_at <= t <= resumed + 3)
    ]
    assert stray == [], stray

    survivors = [v for v in cluster.vaults if v.process is not None and v.process.poll() is None]
    # Nothing acknowledged was lost: every survivor finds every acknowledged pin where it was.
    for vault in survivors:
        with vault.client() as client:
            found = client.lookup_many(sorted(acknowledged))
        assert {d: [p.entry.index for p in found[d]] for d in acknowledged} == {
            d: [i] for d, i in acknowledged.items()
        }
    # Every blob acknowledged, by whichever server, is served by every survivor.
    blobs = {d: data for w in writers for d, data in w.blobs.items()}
    assert set(acknowledged) <= set(blobs)
    for vault in survivors:
        with vault.client() as client:
            for digest, data in blobs.items():
                with client.open(digest) as reader:
                    assert reader.read() == data, digest
    run = survivors[0].run("verify", "--blobs")
    assert run.returncode == 0 and "ledger OK" in run.stdout, run.describe()


def test_a_server_behind_the_others_catches_up_before_it_proves(
    postgres_url: str, tmp_path: Path
) -> None:
    """A client that saw a larger tree through one server asks another, which has not looked
    at the database since: it catches up and proves consistency with what the client saw,
    rather than answering with its older tree (which the client would take for a rollback)."""
    # The lagging server signs (and so looks at the database) only when asked.
    idle = {"PINVAULT_LEDGER_ORIGIN": ORIGIN, "PINVAULT_LEDGER_CHECKPOINT_INTERVAL": "3600"}
    ahead = VaultServer(tmp_path / "ahead", database=postgres_url, env=idle).start()
    config = tmp_path / "shared.toml"
    config.write_text(f'[ledger]\nkey_file = "{ahead.key_path}"\norigin = "{ORIGIN}"\n')
    behind = VaultServer(
        tmp_path / "behind", database=postgres_url, env=idle, args=["--config", str(config)]
    ).start()
    try:
        first = "sha256:" + "a1" * 32
        state = tmp_path / "trust.json"
        with ahead.client(state=state) as client:
            client.pin("config", first, external=True)
        with behind.client(state=state) as client:
            assert [p.entry.index for p in client.lookup(first)] == [0]
        with ahead.client(state=state) as client:
            for n in range(20):
                client.pin("config", f"sha256:{n:064x}", external=True)
        with behind.client(state=state) as client:
            # An old entry, proven against the tree of 21 this client already trusts.
            (proven,) = client.lookup(first)
            assert proven.entry.index == 0 and proven.checkpoint.size == 21
            assert [p.entry.index for p in client.lookup(f"sha256:{19:064x}")] == [20]
    finally:
        behind.stop()
        ahead.stop()
