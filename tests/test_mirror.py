"""Peer mirrors on real S3 servers: three MinIO processes of this module's own (and versitygw),
replication through the durable queue with every copy read back here, mirrors that are down,
killed mid-upload, hanging or answering errors, and repair, through the real `vault serve` and
`vault mirror` commands as well as in process."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from mirror.queue import ReplicationQueue
from mirror.status import MirrorStatus, mirror_status
from mirror.store import ReplicatingStore
from tests.conftest import StartVault
from tests.services.s3 import MinioServer, S3Endpoint, S3Server, VersityGatewayServer
from tests.services.vault_server import command_env as vault_command_env
from tests.terminal import run_on_terminal
from tests.test_cold_tier import flip, flip_stored_bit
from tests.test_replication_queue import tables, write_previous_release
from tiers.cold import ColdTier, KeyRing
from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.scrub import Scrubber, ScrubWorker
from vault import config as config_module
from vault.config import Config
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError
from vault.server.assembly import open_mirror_set, open_replicating_store, queue_path
from vault.store.protocol import get_bytes, put_bytes

pytestmark = pytest.mark.s3

NAMES = ("a", "b", "c")
PREFIX = "pv/"
# Short enough that a test sees a mirror come back within seconds.
FAST = {
    "connect_timeout": "2",
    "read_timeout": "3",
    "attempts": "1",
    "retry_min": "0.2",
    "retry_max": "1",
}


@pytest.fixture(scope="module")
def minios(clean_environment: None) -> Iterator[list[MinioServer]]:
    """Three MinIO processes, each on its own port and folder."""
    servers: list[MinioServer] = []
    try:
        for _ in NAMES:
            servers.append(MinioServer().start())
        yield servers
    finally:
        for server in servers:
            server.stop()


Buckets = Callable[..., list[S3Endpoint]]


@pytest.fixture
def buckets(minios: list[MinioServer]) -> Iterator[Buckets]:
    """A fresh bucket on each server given (default: the three MinIOs), removed after."""
    made: list[tuple[S3Server, S3Endpoint]] = []

    def make(*servers: S3Server) -> list[S3Endpoint]:
        endpoints = []
        for server in servers or minios:
            endpoint = server.create_bucket()
            made.append((server, endpoint))
            endpoints.append(endpoint)
        return endpoints

    yield make
    for server, endpoint in made:
        if server.process is not None:
            server.delete_bucket(endpoint.bucket)


def mirror_env(endpoints: list[S3Endpoint], **settings: str) -> dict[str, str]:
    """What a vault needs to use these buckets as mirrors a, b, c: PINVAULT_MIRRORS_* and the
    credential variables."""
    env = {
        "PINVAULT_MIRRORS_ENDPOINTS": " ".join(
            f"{name}={endpoint.url}/{endpoint.bucket}/{PREFIX}"
            for name, endpoint in zip(NAMES, endpoints, strict=False)
        )
    }
    for name, endpoint in zip(NAMES, endpoints, strict=False):
        env[f"PVMIRROR_{name.upper()}_ACCESS_KEY_ID"] = endpoint.access_key
        env[f"PVMIRROR_{name.upper()}_SECRET_ACCESS_KEY"] = endpoint.secret_key
    for key, value in {**FAST, **settings}.items():
        env[f"PINVAULT_MIRRORS_{key.upper()}"] = value
    return env


@pytest.fixture
def configure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Config]:
    def make(endpoints: list[S3Endpoint], **settings: str) -> Config:
        env = mirror_env(endpoints, **settings)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return config_module.load(environ={**env, "PINVAULT_DATA_DIR": str(tmp_path / "data")})

    return make


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[[Config], ReplicatingStore]]:
    """The store `vault serve` composes, in process; closed after the test."""
    opened: list[ReplicatingStore] = []

    def make(config: Config) -> ReplicatingStore:
        config.data_path.mkdir(parents=True, exist_ok=True)
        store = open_replicating_store(config, HotTier(config.hot_path))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def independent_tier(endpoint: S3Endpoint, keys: KeyRing | None = None) -> ColdTier:
    """A cold tier of the test's own on a mirror's bucket, to read back what the vault wrote
    (with the vault's key ring, on an encrypted mirror)."""
    return ColdTier(
        endpoint_url=endpoint.url,
        bucket=endpoint.bucket,
        prefix=PREFIX,
        access_key_id=endpoint.access_key,
        secret_access_key=endpoint.secret_key,
        region=endpoint.region,
        keys=keys,
    )


def assert_copies(endpoints: list[S3Endpoint], blobs: Mapping[Digest, bytes]) -> None:
    """Every mirror holds every blob, and each copy reads back as exactly its bytes."""
    for endpoint in endpoints:
        with independent_tier(endpoint) as tier:
            assert set(tier.digests()) == set(blobs), endpoint
            for digest, data in blobs.items():
                assert tier.verify(digest).size == len(data)
                assert get_bytes(tier, digest) == data


def statuses(config: Config) -> dict[str, MirrorStatus]:
    with open_mirror_set(config, probe=True) as mirrors:
        queue = ReplicationQueue(queue_path(config))
        try:
            return {status.name: status for status in mirror_status(mirrors, queue)}
        finally:
            queue.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")
        time.sleep(0.1)


def caught_up(config: Config) -> Callable[[], bool]:
    def check() -> bool:
        queue = ReplicationQueue(queue_path(config))
        try:
            return queue.pending_count() == 0
        finally:
            queue.close()

    return check


def mixed_blobs(seed: int, large: int = 12 << 20) -> dict[Digest, bytes]:
    """An empty blob, a small one (kept inline), a compressible one and one of several parts."""
    rng = random.Random(seed)
    pieces = [
        b"",
        rng.randbytes(3000),
        b"pinvault mirror line\n" * 100_000,
        rng.randbytes(large),
    ]
    return {sha256_of(data): data for data in pieces}


def timed_put(store: ReplicatingStore, data: bytes) -> float:
    started = time.monotonic()
    put_bytes(store, data)
    return time.monotonic() - started


# -- replication ---------------------------------------------------------------------------


def test_every_put_is_copied_to_three_minio_servers_and_each_copy_reads_back(
    buckets: Buckets, configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints)
    store = open_store(config)
    blobs = mixed_blobs(1)
    for data in blobs.values():
        put_bytes(store, data)

    wait_for(caught_up(config), "every copy is made")
    assert_copies(endpoints, blobs)
    total = sum(len(data) for data in blobs.values())
    for name, status in statuses(config).items():
        assert (status.reachable, status.objects, status.bytes, status.queued) == (
            True,
            len(blobs),
            total,
            0,
        ), name


def test_mirrors_on_minio_and_versitygw_together(
    buckets: Buckets,
    minios: list[MinioServer],
    versitygw_server: VersityGatewayServer,
    configure: Callable[..., Config],
    open_store: Any,
) -> None:
    endpoints = buckets(minios[0], versitygw_server, minios[1])
    assert [endpoint.server for endpoint in endpoints] == ["minio", "versitygw", "minio"]
    config = configure(endpoints)
    store = open_store(config)
    blobs = mixed_blobs(2)
    for data in blobs.values():
        put_bytes(store, data)

    wait_for(caught_up(config), "every copy is made")
    assert_copies(endpoints, blobs)


def test_two_replicas_over_three_mirrors_spread_each_blob_over_two(
    buckets: Buckets, configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints, replicas="2")
    store = open_store(config)
    blobs = {sha256_of(data): data for data in (os.urandom(100 + n) for n in range(12))}
    for data in blobs.values():
        put_bytes(store, data)

    wait_for(caught_up(config), "every copy is made")
    held: dict[Digest, int] = dict.fromkeys(blobs, 0)
    for endpoint in endpoints:
        with independent_tier(endpoint) as tier:
            for digest in tier.digests():
                assert get_bytes(tier, digest) == blobs[digest]
                held[digest] += 1
    assert set(held.values()) == {2}
    assert sum(status.objects for status in statuses(config).values()) == 2 * len(blobs)


# -- mirrors that fail ---------------------------------------------------------------------


def test_a_mirror_that_is_down_holds_up_no_put_and_catches_up_when_back(
    buckets: Buckets, minios: list[MinioServer], configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints)
    store = open_store(config)
    minios[1].halt()
    try:
        blobs = mixed_blobs(3, large=2 << 20)
        durations = [timed_put(store, data) for data in blobs.values()]
        assert max(durations) < 2.0, durations

        wait_for(
            lambda: (
                statuses(config)["a"].objects == len(blobs)
                and statuses(config)["c"].objects == len(blobs)
            ),
            "the mirrors that are up have every copy",
        )
        time.sleep(0.5)
        down = statuses(config)["b"]
        assert not down.reachable
        assert str(minios[1].port) in down.error
        assert (down.objects, down.queued) == (0, len(blobs))
        assert down.queued_bytes == sum(len(data) for data in blobs.values())
        assert down.lag_seconds >= 0.5
    finally:
        minios[1].resume()

    wait_for(caught_up(config), "the mirror that came back has caught up")
    assert_copies(endpoints, blobs)
    back = statuses(config)["b"]
    assert (back.reachable, back.objects, back.queued, back.lag_seconds) == (
        True,
        len(blobs),
        0,
        0.0,
    )


def test_a_minio_killed_mid_upload_gets_the_copy_once_restarted(
    buckets: Buckets, minios: list[MinioServer], configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints)
    store = open_store(config)
    victim, endpoint = minios[2], endpoints[2]
    admin = endpoint.client()
    data = os.urandom(96 << 20)
    digest = sha256_of(data)

    killed = threading.Event()

    def kill_once_uploading() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            uploads = admin.list_multipart_uploads(Bucket=endpoint.bucket).get("Uploads", [])
            if uploads:
                victim.crash()
                killed.set()
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_once_uploading)
    killer.start()
    try:
        put_bytes(store, data)
        killer.join()
        assert killed.is_set(), "the upload to the third MinIO was never seen in progress"
        time.sleep(1)
        assert statuses(config)["c"].queued == 1
    finally:
        killer.join()
        if victim.process is None:
            victim.resume()

    wait_for(caught_up(config), "the restarted MinIO has its copy")
    assert_copies(endpoints, {digest: data})


def test_a_hanging_mirror_holds_up_no_put_and_is_reported(
    buckets: Buckets, minios: list[MinioServer], configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints)
    store = open_store(config)
    minios[0].freeze()
    try:
        blobs = mixed_blobs(4, large=1 << 20)
        durations = [timed_put(store, data) for data in blobs.values()]
        assert max(durations) < 2.0, durations
        wait_for(
            lambda: statuses(config)["b"].objects == len(blobs),
            "the mirrors that answer have every copy",
        )
        hanging = statuses(config)["a"]
        assert not hanging.reachable
        assert "timeout" in hanging.error.lower(), hanging.error
        assert hanging.queued == len(blobs)
    finally:
        minios[0].thaw()

    wait_for(caught_up(config), "the mirror that answers again has caught up")
    assert_copies(endpoints, blobs)


def test_a_mirror_answering_errors_is_reported_and_caught_up_once_fixed(
    buckets: Buckets, minios: list[MinioServer], configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    # The third mirror's bucket does not exist yet: every request is refused with an error.
    server = minios[2]
    server.delete_bucket(endpoints[2].bucket)
    config = configure(endpoints)
    store = open_store(config)
    blobs = mixed_blobs(5, large=1 << 20)
    for data in blobs.values():
        put_bytes(store, data)

    wait_for(
        lambda: statuses(config)["a"].objects == len(blobs), "the mirrors that work are written"
    )
    failing = statuses(config)["c"]
    assert not failing.reachable
    assert "404" in failing.error, failing.error
    assert failing.queued == len(blobs)
    wait_for(lambda: "NoSuchBucket" in statuses(config)["c"].last_error, "the error is recorded")

    server.client().create_bucket(Bucket=endpoints[2].bucket)
    wait_for(caught_up(config), "the fixed mirror has caught up")
    assert_copies(endpoints, blobs)


# -- through `vault serve` and `vault mirror` ----------------------------------------------


def test_vault_serve_replicates_survives_a_kill_and_vault_mirror_repairs(
    buckets: Buckets, minios: list[MinioServer], start_vault: StartVault, tmp_path: Path
) -> None:
    endpoints = buckets()
    env = mirror_env(endpoints)
    server = start_vault(env=env)
    command_env = {**env, "PINVAULT_DATA_DIR": str(server.data_dir)}

    def vault_mirror(*args: str) -> Any:
        return server.run("mirror", *args, env=command_env)

    files = mixed_blobs(6, large=6 << 20)
    minios[1].halt()
    try:
        for digest, data in files.items():
            path = tmp_path / digest.hex
            path.write_bytes(data)
            out = server.run("put", str(path)).ok().stdout
            assert out.startswith(f"{digest}  ")
        # Killed outright, right after the last put was acknowledged: its copies must have
        # been queued durably before the acknowledgement.
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        server.process = None
        server.restart()

        down = vault_mirror("status", "--json")
        # With --json, the error is one JSON object on standard error (docs/cli.md).
        error = json.loads(down.stderr.splitlines()[-1])["error"]
        assert (down.returncode, error["kind"]) == (69, "unavailable"), down.describe()
        assert error["message"].startswith("mirrors down: b ("), down.describe()
        status = {row["name"]: row for row in down.json()}
        assert status["b"]["reachable"] is False
        assert status["b"]["queued"] == len(files)
        table = vault_mirror("status")
        assert table.error_line().startswith("vault: UNAVAILABLE: mirrors down: b ("), (
            table.describe()
        )
        text = table.stdout
        assert any(line.split()[:2] == ["b", "NO"] for line in text.splitlines()), text
    finally:
        minios[1].resume()

    def settled() -> bool:
        rows = vault_mirror("status", "--json").ok().json()
        return all(row["queued"] == 0 and row["objects"] == len(files) for row in rows)

    wait_for(settled, "the restarted vault has made every copy")
    assert_copies(endpoints, files)

    # Damage: one copy overwritten through the S3 API, one deleted, and one byte of the
    # vault's own (hot) copy of a third blob flipped.
    damaged, deleted, local = sorted(files, key=lambda d: -len(files[d]))[:3]
    with independent_tier(endpoints[0]) as tier:
        flip_stored_bit(tier, damaged, len(files[damaged]) // 2)
    with independent_tier(endpoints[2]) as tier:
        tier.delete(deleted)
    hot_copy = server.blob_path(str(local))
    hot_copy.write_bytes(flip(hot_copy.read_bytes(), 1000))

    report = vault_mirror("repair").ok().stdout
    assert f"a: {damaged}: stored copy of {damaged} is damaged" in report, report
    assert f"c: {deleted}: missing; rewrote it from local" in report, report
    assert f"local: {local}: " in report and "; rewrote it from a" in report, report
    assert report.splitlines()[-1].endswith("3 rewritten, 0 queued, 0 lost"), report
    assert_copies(endpoints, files)
    assert hot_copy.read_bytes() == files[local]

    # A hot copy lost and a mirror's copy damaged: a get is still served intact, from a copy
    # that verifies, and the hot copy comes back.
    with independent_tier(endpoints[0]) as tier:
        flip_stored_bit(tier, damaged, 0)
    server.blob_path(str(damaged)).unlink()
    got = server.run("get", str(damaged)).ok().output
    assert got == files[damaged]
    assert server.blob_path(str(damaged)).exists()
    synced = vault_mirror("sync").ok().stdout
    assert synced.splitlines()[0] == "queued 0 copies", synced

    # On a terminal, a repair shows the blobs it has checked as it goes.
    done, shown = run_on_terminal(
        ["mirror", "repair"],
        vault_command_env(state_home=server.state_home, extra=command_env),
    )
    assert done.returncode == 0, shown
    assert f"mirror repair {len(files):,} blobs" in shown, shown
    assert done.stdout.decode().splitlines()[-1].startswith(f"{len(files)} blobs checked: ")


def test_vault_mirror_sync_copies_blobs_stored_before_mirrors_were_configured(
    buckets: Buckets, start_vault: StartVault, tmp_path: Path
) -> None:
    plain = start_vault()
    files = list(mixed_blobs(7, large=1 << 20).values())
    for number, data in enumerate(files):
        (tmp_path / f"f{number}").write_bytes(data)
        plain.run("put", str(tmp_path / f"f{number}")).ok()
    endpoints = buckets()
    env = {**mirror_env(endpoints), "PINVAULT_DATA_DIR": str(plain.data_dir)}

    synced = plain.run("mirror", "sync", "--json", env=env).ok().json()
    assert synced["queued"] == 3 * len(files)
    assert {name: row["copied"] for name, row in synced["mirrors"].items()} == dict.fromkeys(
        NAMES, len(files)
    )
    assert_copies(endpoints, {sha256_of(data): data for data in files})
    again = plain.run("mirror", "sync", "--json", env=env).ok().json()
    assert again["queued"] == 0


def test_vault_mirror_commands_say_what_is_missing_in_one_line(start_vault: StartVault) -> None:
    server = start_vault()
    none = server.run("mirror", "status").error_line()
    assert none == "vault: INVALID_ARGUMENT: no mirrors configured: set mirrors.endpoints", none
    keyless = server.run(
        "mirror",
        "status",
        env={"PINVAULT_MIRRORS_ENDPOINTS": "a=http://127.0.0.1:1/bucket"},
    ).error_line()
    assert "set PVMIRROR_A_ACCESS_KEY_ID and PVMIRROR_A_SECRET_ACCESS_KEY" in keyless, keyless


# -- one placement record: scrub finds the copies replication made -------------------------


def manager_of(store: ReplicatingStore) -> TierManager:
    assert isinstance(store.inner, TierManager)
    return store.inner


@pytest.mark.parametrize("scrubber", ["vault scrub", "background"])
def test_scrub_repairs_a_damaged_copy_that_replication_made_on_a_minio_mirror(
    scrubber: str, buckets: Buckets, configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints)
    store = open_store(config)
    manager = manager_of(store)
    data = os.urandom(3 << 20)
    digest = put_bytes(store, data).sha256
    wait_for(caught_up(config), "every copy is made")
    # Replication recorded its copies where scrub looks: as placements on the mirrors' tiers.
    assert {p.tier for p in manager.placements(digest)} == {
        "hot",
        "mirror-a",
        "mirror-b",
        "mirror-c",
    }

    # The copy on mirror b overwritten through the S3 API, one bit changed.
    with independent_tier(endpoints[1]) as tier:
        flip_stored_bit(tier, digest, len(data) // 2)
        assert_damaged(tier, digest)
    damaged = time.time()

    if scrubber == "vault scrub":
        stats = Scrubber(manager).scrub_all()
        assert (stats.copies, stats.faults, stats.repaired, stats.unrepairable) == (4, 1, 1, 0)
    else:
        worker = ScrubWorker(Scrubber(manager, window=0.0))
        worker.start()
        try:
            wait_for(lambda: bool(manager.journal.records(digest)), "the scrubber finds the fault")
        finally:
            worker.close()
    (record,) = manager.journal.records(digest)
    assert record.tier == "mirror-b"
    assert "is damaged" in record.found, record.found
    assert record.action == "deleted the damaged copy and rewrote it from hot"
    assert_copies(endpoints, {digest: data})
    (repaired,) = [p for p in manager.placements(digest) if p.tier == "mirror-b"]
    assert repaired.last_verified is not None and repaired.last_verified >= damaged


def assert_damaged(tier: ColdTier, digest: Digest) -> None:
    with pytest.raises(IntegrityError):
        tier.verify(digest)


def test_a_vault_of_the_previous_release_keeps_its_mirror_copies_and_scrubs_them(
    buckets: Buckets, configure: Callable[..., Config], open_store: Any
) -> None:
    endpoints = buckets()
    config = configure(endpoints)
    data = os.urandom(1 << 20)
    digest = sha256_of(data)
    # What the previous release left: the blob on hot and on every mirror, its hot copy in the
    # journal's placements and its mirror copies in the queue's own table of copies.
    put_bytes(HotTier(config.hot_path), data)
    for endpoint in endpoints:
        with independent_tier(endpoint) as tier:
            put_bytes(tier, data)
    stored, verified = time.time() - 20 * 86_400, time.time() - 10 * 86_400
    write_previous_release(
        config.data_path,
        copies=[(digest, name, len(data), verified) for name in NAMES],
        placements=[(digest, "hot", len(data), stored, verified)],
    )

    store = open_store(config)
    manager = manager_of(store)
    assert {(p.tier, p.last_verified) for p in manager.placements(digest)} == {
        ("hot", verified),
        *((f"mirror-{name}", verified) for name in NAMES),
    }
    assert "copies" not in tables(queue_path(config))
    for name, status in statuses(config).items():
        assert (status.objects, status.bytes, status.queued) == (1, len(data), 0), name
    # The copies carried over count for replication: the same bytes put again queue nothing.
    put_bytes(store, data)
    assert store.queue.pending_count() == 0

    with independent_tier(endpoints[2]) as tier:
        flip_stored_bit(tier, digest, 12345)
        assert_damaged(tier, digest)
    checked = time.time()
    stats = Scrubber(manager).scrub_all()

    assert (stats.copies, stats.faults, stats.repaired, stats.unrepairable) == (4, 1, 1, 0)
    (record,) = manager.journal.records(digest)
    assert (record.tier, record.action) == (
        "mirror-c",
        "deleted the damaged copy and rewrote it from hot",
    )
    assert_copies(endpoints, {digest: data})
    assert all((p.last_verified or 0) >= checked for p in manager.placements(digest))
