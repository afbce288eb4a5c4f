"""Bitrot on a real MinIO: one byte flipped in the file where MinIO keeps an object (its xl.meta,
or a part file), so that MinIO's own bitrot check fails and it refuses the read or cuts it
short. That copy is damaged, not its mirror unreachable: the cold tier says so, and `vault
mirror repair`, `vault scrub` and `vault verify --blobs` rewrite it from a good copy, while a
mirror that does not answer at all is still told apart as unreachable."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.s3 import MinioServer
from tests.test_cold_tier import cold_tier
from tests.test_mirror import independent_tier, mirror_env, wait_for
from tiers.cold import ColdTier
from tiers.placements import JOURNAL_FILE_NAME, Journal
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError, Unavailable
from vault.store.protocol import get_bytes, put_bytes

pytestmark = pytest.mark.s3

# A blob MinIO keeps inside its xl.meta; one it keeps in a part file, which the cold tier keeps
# inline in its index object; and one the cold tier uploads in parts as an object of its own.
SIZES = {"in xl.meta": 3000, "in a part file": 3 << 20, "in parts": 12 << 20}


def rot(server: MinioServer, bucket: str, key: str, needle: bytes) -> None:
    """Flip one byte of `needle` where MinIO keeps it on disk, as a failing disk would."""
    hits = []
    for path in sorted((server.data_dir / bucket / key).rglob("*")):
        if path.is_file() and (at := path.read_bytes().find(needle)) >= 0:
            hits.append((path, at))
    assert len(hits) == 1, f"{needle.hex()} found in {hits}"
    path, at = hits[0]
    stored = bytearray(path.read_bytes())
    stored[at + len(needle) // 2] ^= 0x40
    path.write_bytes(stored)


def rot_blob(server: MinioServer, tier: ColdTier, digest: Digest, data: bytes) -> None:
    """Rot the stored copy of `data` on `tier`, in the last quarter of the blob: MinIO has
    then sent some of the object when its check fails, if it sends any."""
    at = len(data) * 3 // 4
    rot(server, tier.bucket, tier.layout(digest).data_key, data[at : at + 32])


def freeze(server: MinioServer) -> None:
    """SIGSTOP, and wait until every thread of the server has stopped: until then, one may
    still answer a request."""
    server.freeze()
    assert server.process is not None
    tasks = Path(f"/proc/{server.process.pid}/task")

    def stopped() -> bool:
        states = []
        for task in tasks.iterdir():
            with contextlib.suppress(FileNotFoundError):
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        return all(state in ("T", "t") for state in states)

    wait_for(stopped, "MinIO has stopped", timeout=10)


@pytest.fixture(scope="module")
def own_minio(clean_environment: None) -> Iterator[MinioServer]:
    """A MinIO of this module's own, to stop and freeze."""
    with MinioServer() as server:
        yield server


# -- the cold tier ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_a_copy_minio_finds_rotten_is_damaged_and_can_be_rewritten(
    minio_server: MinioServer, size: int
) -> None:
    endpoint = minio_server.create_bucket()
    try:
        with cold_tier(endpoint, read_timeout=5, max_attempts=1) as tier:
            data = os.urandom(size)
            digest = put_bytes(tier, data).sha256
            rot_blob(minio_server, tier, digest, data)

            with pytest.raises(IntegrityError) as raised:
                tier.verify(digest)
            message = str(raised.value)
            assert message.startswith(f"stored copy of {digest} is damaged: cold tier "), message
            assert "failed while the endpoint answers other requests" in message, message
            with pytest.raises(IntegrityError, match=f"stored copy of {digest} is damaged"):
                get_bytes(tier, digest)
            tier.probe()

            tier.delete(digest)
            assert put_bytes(tier, data).sha256 == digest
            assert tier.verify(digest).size == size
            assert get_bytes(tier, digest) == data
    finally:
        minio_server.delete_bucket(endpoint.bucket)


def test_a_rotten_copy_is_damage_but_an_endpoint_that_does_not_answer_is_unreachable(
    own_minio: MinioServer,
) -> None:
    endpoint = own_minio.create_bucket()
    with cold_tier(endpoint, connect_timeout=1, read_timeout=1, max_attempts=1) as tier:
        rotten, sound = os.urandom(SIZES["in a part file"]), os.urandom(5000)
        rotten_digest = put_bytes(tier, rotten).sha256
        sound_digest = put_bytes(tier, sound).sha256
        rot_blob(own_minio, tier, rotten_digest, rotten)
        with pytest.raises(IntegrityError, match=f"stored copy of {rotten_digest} is damaged"):
            tier.verify(rotten_digest)
        assert tier.verify(sound_digest).size == len(sound)

        # Frozen, the endpoint takes connections and answers nothing: its probe times out too.
        freeze(own_minio)
        try:
            for digest in (sound_digest, rotten_digest):
                with pytest.raises(Unavailable, match="timeout") as raised:
                    tier.verify(digest)
                assert not isinstance(raised.value, IntegrityError)
        finally:
            own_minio.thaw()
        # Stopped, it refuses connections.
        own_minio.halt()
        try:
            for digest in (sound_digest, rotten_digest):
                with pytest.raises(Unavailable) as raised:
                    tier.verify(digest)
                assert not isinstance(raised.value, IntegrityError)
        finally:
            own_minio.resume()
        assert tier.verify(sound_digest).size == len(sound)
        with pytest.raises(IntegrityError, match=f"stored copy of {rotten_digest} is damaged"):
            tier.verify(rotten_digest)


# -- through `vault serve` and the commands ----------------------------------------------------


def test_vault_repairs_a_mirror_copy_minio_finds_rotten_and_tells_an_unreachable_mirror_apart(
    minio_server: MinioServer, own_minio: MinioServer, start_vault: StartVault, tmp_path: Path
) -> None:
    # Mirrors a and b on the shared MinIO; c on this module's own, stopped for the whole test.
    endpoints = [minio_server.create_bucket(), minio_server.create_bucket()]
    endpoints.append(own_minio.create_bucket())
    own_minio.halt()
    try:
        env = mirror_env(endpoints)
        server = start_vault(env=env)
        host = {**env, "PINVAULT_DATA_DIR": str(server.data_dir)}
        data = os.urandom(SIZES["in a part file"])
        digest = sha256_of(data)
        (tmp_path / "blob").write_bytes(data)
        server.run("put", str(tmp_path / "blob")).ok()
        server.run("pin", "artefact", str(digest)).ok()

        def mirrored() -> bool:
            status = server.run("mirror", "status", "--json", env=host)
            assert status.returncode == 69, status.describe()  # c is down: unavailable
            rows = status.json()
            return all(row["objects"] == 1 for row in rows if row["name"] in ("a", "b"))

        wait_for(mirrored, "mirrors a and b hold the blob")
        with independent_tier(endpoints[0]) as tier:
            key = tier.layout(digest).data_key

        def rot_on_a() -> None:
            rot(minio_server, endpoints[0].bucket, key, data[2_500_000:2_500_032])
            with independent_tier(endpoints[0]) as tier, pytest.raises(IntegrityError):
                tier.verify(digest)

        rot_on_a()
        down = server.run("mirror", "status", "--json", env=host)
        # With --json, the error is one JSON object on standard error (docs/cli.md).
        error = json.loads(down.stderr.splitlines()[-1])["error"]
        assert (down.returncode, error["kind"]) == (69, "unavailable"), down.describe()
        assert error["message"].startswith("mirrors down: c ("), down.describe()
        status = {row["name"]: row for row in down.json()}
        assert (status["a"]["reachable"], status["c"]["reachable"]) == (True, False)

        repair = server.run("mirror", "repair", env=host)
        assert f"a: {digest}: stored copy of {digest} is damaged: " in repair.stdout, repair.stdout
        assert "; rewrote it from local\n" in repair.stdout, repair.stdout
        assert repair.stdout.splitlines()[-1].endswith("1 rewritten, 0 queued, 0 lost")
        # The copy is rewritten; only the mirror that does not answer is reported unreachable.
        error = repair.error_line(alone=False)
        assert error.startswith("vault: UNAVAILABLE: not checked, unreachable: c ("), error
        assert "a (" not in error and "b (" not in error, error
        assert_intact(endpoints[0], digest, data)

        rot_on_a()
        scrub = host_json(server, host, "scrub")
        assert (scrub["faults"], scrub["repaired"], scrub["unrepairable"]) == (1, 1, 0), scrub
        assert_intact(endpoints[0], digest, data)

        rot_on_a()
        verified = server.run("verify", "--blobs").ok().stdout
        assert "blobs: 1 pinned blobs checked, 0 failed" in verified, verified
        assert_intact(endpoints[0], digest, data)
        with contextlib.closing(Journal(server.data_dir / JOURNAL_FILE_NAME)) as journal:
            records = journal.records(digest)
        # By the scrub, then by the audit of `vault verify --blobs`.
        assert [(r.tier, r.action) for r in records] == [
            ("mirror-a", "deleted the damaged copy and rewrote it from hot")
        ] * 2
        assert all(f"stored copy of {digest} is damaged" in r.found for r in records)
        assert server.run("get", str(digest)).ok().output == data
    finally:
        own_minio.resume()


def host_json(server: Any, env: dict[str, str], *args: str) -> Any:
    return server.run(*args, "--json", env=env).ok().json()


def assert_intact(endpoint: Any, digest: Digest, data: bytes) -> None:
    with independent_tier(endpoint) as tier:
        assert tier.verify(digest).size == len(data)
        assert get_bytes(tier, digest) == data
