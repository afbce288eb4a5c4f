"""Encrypted mirrors on real MinIO servers, through the real `vault serve` and `vault mirror`
commands: what the mirrors' disks hold (no clear byte of any blob, no digest in any name,
content or metadata file), reads whole and by range, damage (a flipped byte, a chunk swapped
between two copies, an index moved under another blob's name) refused and repaired, key
rotation, and direct transfers kept off encrypted mirrors."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import blake3
import pytest

from tests.conftest import StartVault
from tests.services.s3 import MinioServer, S3Endpoint
from tests.services.vault_server import VaultServer, run_vault
from tests.test_cold_tier import flip_stored_bit, rewrite_object
from tests.test_mirror import (
    NAMES,
    PREFIX,
    Buckets,
    buckets,
    independent_tier,
    minios,
    mirror_env,
    wait_for,
)
from tiers.cold import NAMES_ID, ColdTier, KeyRing, new_key
from vault.digest import Digest, sha256_of
from vault.errors import IntegrityError
from vault.store.chunks import CHUNK_SIZE
from vault.store.protocol import get_bytes

pytestmark = pytest.mark.s3

__all__ = ["buckets", "minios"]  # fixtures, used by name

# Above the default inline limit (one 8 MiB part): kept in data objects of their own.
LARGE = 10 << 20


def write_ring(path: Path, keys: Mapping[str, str], names: str) -> Path:
    """A key ring file: `keys` (id to base64 key) in order, then the names key."""
    lines = [f"{key_id} {key}" for key_id, key in keys.items()]
    path.write_text("\n".join([*lines, f"{NAMES_ID} {names}", ""]))
    return path


def blobs_to_store(seed: int) -> dict[Digest, bytes]:
    """Text (kept inline, compressed), small random bytes (inline, raw), two large random
    blobs of the same size (data objects, raw) and a large text blob (compressed)."""
    rng = random.Random(seed)
    words = [rng.randbytes(4).hex() for _ in range(2000)]
    text = " ".join(rng.choices(words, k=60_000)).encode()
    pieces = [
        b"pinvault confidential line\n" * 1000,
        rng.randbytes(3000),
        rng.randbytes(LARGE),
        rng.randbytes(LARGE),
        text,
    ]
    return {sha256_of(data): data for data in pieces}


def put_all(server: VaultServer, tmp_path: Path, blobs: Mapping[Digest, bytes]) -> None:
    for digest, data in blobs.items():
        path = tmp_path / f"in-{digest.hex}"
        path.write_bytes(data)
        out = server.run("put", str(path)).ok().stdout
        assert out.startswith(f"{digest}  "), out


def wait_replicated(server: VaultServer, env: Mapping[str, str], count: int) -> None:
    command_env = {**env, "PINVAULT_DATA_DIR": str(server.data_dir)}

    def settled() -> bool:
        rows = server.run("mirror", "status", "--json", env=command_env).ok().json()
        return all(row["queued"] == 0 and row["objects"] == count for row in rows)

    wait_for(settled, "every copy is on every mirror")


def sealed_tier(endpoint: S3Endpoint, ring: KeyRing) -> ColdTier:
    """A cold tier of the test's own on a mirror's bucket, with the vault's key ring."""
    return independent_tier(endpoint, ring)


def files_of(server: MinioServer) -> Iterator[tuple[Path, bytes]]:
    """Every file in a MinIO server's data folder (its objects, their xl.meta, its own)."""
    for path in sorted(server.data_dir.rglob("*")):
        if path.is_file():
            yield path, path.read_bytes()


def secrets_of(blobs: Mapping[Digest, bytes]) -> dict[bytes, str]:
    """What must appear nowhere on a mirror: each blob's digests (hex of SHA-256 and BLAKE3,
    the SHA-256 raw and in base64 as S3 checksums carry it) and pieces of its bytes."""
    found: dict[bytes, str] = {}
    for digest, data in blobs.items():
        b3 = blake3.blake3(data).digest()
        found[digest.hex.encode()] = f"sha256 hex of {digest}"
        found[b3.hex().encode()] = f"blake3 hex of {digest}"
        found[digest.raw] = f"raw sha256 of {digest}"
        found[base64.b64encode(digest.raw)] = f"base64 sha256 of {digest}"
        if len(data) >= 64:
            for offset in (0, len(data) // 2, len(data) - 32):
                found[data[offset : offset + 32]] = f"bytes {offset}.. of {digest}"
    return found


def test_encrypted_mirrors_hold_no_clear_byte_or_digest_and_serve_verified_reads(
    buckets: Buckets, minios: list[MinioServer], start_vault: StartVault, tmp_path: Path
) -> None:
    ring_path = write_ring(tmp_path / "ring", {"k1": new_key()}, new_key())
    endpoints = buckets()
    env = mirror_env(endpoints, encrypted="*", encryption_keys=str(ring_path))
    server = start_vault(env=env)
    blobs = blobs_to_store(1)
    put_all(server, tmp_path, blobs)
    wait_replicated(server, env, len(blobs))

    forbidden = secrets_of(blobs)
    forbidden[b"pinvault confidential"] = "clear text"
    scanned = 0
    for minio in minios:
        for path, body in files_of(minio):
            scanned += 1
            name = str(path.relative_to(minio.data_dir)).encode()
            for secret, what in forbidden.items():
                assert secret not in name, f"{what} in the name {path}"
                assert secret not in body, f"{what} in {path}"
    assert scanned > 3 * len(blobs)

    # Reads come from the mirrors once the local copies are gone, whole and by range, each
    # verified by the client.
    ring = KeyRing.load(ring_path)
    for digest, data in blobs.items():
        server.blob_path(str(digest)).unlink()
        got = server.run("get", str(digest)).ok().output
        assert got == data
        if len(data) > 2 * CHUNK_SIZE:
            server.blob_path(str(digest)).unlink()
            offset, length = CHUNK_SIZE - 5, CHUNK_SIZE + 10
            part = server.run(
                "get", str(digest), "--offset", str(offset), "--length", str(length)
            ).ok()
            assert part.output == data[offset : offset + length]
    for endpoint in endpoints:
        with sealed_tier(endpoint, ring) as tier:
            assert set(tier.digests()) == set(blobs)
            for digest, data in blobs.items():
                assert tier.layout(digest).key.startswith(f"{PREFIX}blobs/keyed/")
                assert get_bytes(tier, digest) == data

    # A direct transfer would put clear bytes on a mirror, or read its ciphertext: refused,
    # telling the client to stream through the vault.
    large = next(digest for digest, data in blobs.items() if len(data) == LARGE)
    path = tmp_path / "direct"
    path.write_bytes(blobs[large] + b"!")
    refused = server.run("put", "--direct", str(path)).error_line()
    assert "encrypted" in refused and "stream the bytes through the vault" in refused, refused
    refused = server.run("get", "--direct", str(large), "-o", str(tmp_path / "out")).error_line()
    assert "encrypted" in refused and "through the vault" in refused, refused


def assert_damaged(tier: ColdTier, digest: Digest, *words: str) -> None:
    with pytest.raises(IntegrityError) as caught:
        tier.verify(digest)
    message = str(caught.value)
    assert all(word in message for word in words), message


def test_altered_swapped_or_moved_ciphertext_is_refused_and_repaired(
    buckets: Buckets, start_vault: StartVault, tmp_path: Path
) -> None:
    ring_path = write_ring(tmp_path / "ring", {"k1": new_key()}, new_key())
    ring = KeyRing.load(ring_path)
    endpoints = buckets()
    env = mirror_env(endpoints, encrypted="*", encryption_keys=str(ring_path))
    server = start_vault(env=env)
    blobs = blobs_to_store(2)
    put_all(server, tmp_path, blobs)
    wait_replicated(server, env, len(blobs))
    x, y = [digest for digest, data in blobs.items() if len(data) == LARGE]
    z = next(digest for digest, data in blobs.items() if len(data) == 3000)

    # a: one ciphertext byte of x flipped.
    with sealed_tier(endpoints[0], ring) as tier:
        flip_stored_bit(tier, x, CHUNK_SIZE + 7)
        assert_damaged(tier, x, "chunk at byte offset 1048576", "does not open")
    # b: the second sealed chunk of x and of y swapped, same position, other copies.
    with sealed_tier(endpoints[1], ring) as tier:
        into_x, into_y = tier.layout(x), tier.layout(y)
        extent = into_x.extents[1]
        assert into_y.extents[1] == extent
        take = slice(extent.start, extent.start + extent.length)
        x_data = tier.client.get_object(Bucket=tier.bucket, Key=into_x.data_key)["Body"].read()
        y_data = tier.client.get_object(Bucket=tier.bucket, Key=into_y.data_key)["Body"].read()
        rewrite_object(
            tier, into_x.data_key, lambda b: b[: take.start] + y_data[take] + b[take.stop :]
        )
        rewrite_object(
            tier, into_y.data_key, lambda b: b[: take.start] + x_data[take] + b[take.stop :]
        )
        assert_damaged(tier, x, "chunk at byte offset 1048576", "does not open")
        assert_damaged(tier, y, "chunk at byte offset 1048576", "does not open")
    # c: y's index put under z's name.
    with sealed_tier(endpoints[2], ring) as tier:
        index_y = tier.client.get_object(Bucket=tier.bucket, Key=tier.layout(y).key)
        tier.client.put_object(
            Bucket=tier.bucket, Key=tier.layout(z).key, Body=index_y["Body"].read()
        )
        assert_damaged(tier, z, f"index of {z}", "does not open")

    # Never served: each get, with the local copy gone, is the blob's bytes (verified by the
    # client), from a copy that opens.
    for digest in (x, y, z):
        server.blob_path(str(digest)).unlink()
        assert server.run("get", str(digest)).ok().output == blobs[digest]

    command_env = {**env, "PINVAULT_DATA_DIR": str(server.data_dir)}
    report = server.run("mirror", "repair", env=command_env).ok().stdout
    assert report.splitlines()[-1].endswith(" 0 lost"), report
    for endpoint in endpoints:
        with sealed_tier(endpoint, ring) as tier:
            for digest, data in blobs.items():
                assert tier.verify(digest).size == len(data)


def test_keys_rotate_old_copies_read_rekey_seals_them_anew_and_a_dropped_key_is_repaired(
    buckets: Buckets, start_vault: StartVault, tmp_path: Path
) -> None:
    names = new_key()
    k1, k2 = new_key(), new_key()
    ring_path = write_ring(tmp_path / "ring", {"k1": k1}, names)
    endpoints = buckets()
    env = mirror_env(endpoints, encrypted="*", encryption_keys=str(ring_path))
    command_env = {**env}
    server = start_vault(env=env)
    command_env["PINVAULT_DATA_DIR"] = str(server.data_dir)
    old = blobs_to_store(3)
    put_all(server, tmp_path, old)
    wait_replicated(server, env, len(old))

    # k2 added first: new copies are sealed under it, old ones still read.
    write_ring(ring_path, {"k2": k2, "k1": k1}, names)
    server.restart()
    new = {sha256_of(b"after the rotation" * 1000): b"after the rotation" * 1000}
    put_all(server, tmp_path, new)
    both = {**old, **new}
    wait_replicated(server, env, len(both))
    ring = KeyRing.load(ring_path)
    with sealed_tier(endpoints[0], ring) as tier:
        assert {tier.layout(d).seal.key.id for d in new} == {"k2"}  # type: ignore[union-attr]
        assert {tier.layout(d).seal.key.id for d in old} == {"k1"}  # type: ignore[union-attr]
    for digest, data in old.items():
        server.blob_path(str(digest)).unlink()
        assert server.run("get", str(digest)).ok().output == data

    # Rekeyed on a and b; c keeps its k1 copies when k1 is dropped.
    for name in ("a", "b"):
        done = server.run("mirror", "rekey", "--mirror", name, "--json", env=command_env)
        assert done.ok().json() == {
            "mirrors": {name: {"rewritten": len(old), "current": len(new), "unreadable": []}}
        }
    write_ring(ring_path, {"k2": k2}, names)
    server.restart()
    ring = KeyRing.load(ring_path)
    for endpoint in endpoints[:2]:
        with sealed_tier(endpoint, ring) as tier:
            for digest, data in both.items():
                assert get_bytes(tier, digest) == data
    large = next(digest for digest, data in old.items() if len(data) == LARGE)
    with sealed_tier(endpoints[2], ring) as tier:
        assert_damaged(tier, large, "unreadable", "'k1'", "no longer holds")
    stuck = server.run("mirror", "rekey", "--mirror", "c", env=command_env)
    assert "`vault mirror repair` rewrites them" in stuck.error_line(alone=False)
    assert stuck.stdout.count("sealed under key 'k1'") == len(old), stuck.describe()

    # A copy under a key the ring no longer holds is unreadable: reads are served from
    # another copy, and repair rewrites it under the current key.
    server.blob_path(str(large)).unlink()
    assert server.run("get", str(large)).ok().output == old[large]
    report = server.run("mirror", "repair", env=command_env).ok().stdout
    assert "'k1'" in report, report
    assert report.splitlines()[-1].endswith(" 0 lost"), report
    with sealed_tier(endpoints[2], ring) as tier:
        for digest, data in both.items():
            assert tier.layout(digest).seal.key.id == "k2"  # type: ignore[union-attr]
            assert get_bytes(tier, digest) == data
    again = server.run("mirror", "rekey", "--json", env=command_env).ok().json()
    assert again == {
        "mirrors": {
            name: {"rewritten": 0, "current": len(both), "unreadable": []} for name in NAMES
        }
    }


def test_a_key_ring_missing_or_wrong_is_one_line_naming_the_file(
    buckets: Buckets, start_vault: StartVault, tmp_path: Path
) -> None:
    endpoints = buckets()
    server = start_vault()
    missing = tmp_path / "no-such-ring"
    env = mirror_env(endpoints, encrypted="*", encryption_keys=str(missing))
    line = server.run("mirror", "status", env=env).error_line()
    assert str(missing) in line and "key ring" in line, line
    serve = run_vault(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={**env, "PINVAULT_DATA_DIR": str(tmp_path / "other")},
        state_home=tmp_path / "state",
        timeout=60,
    )
    line = serve.error_line(alone=False)
    assert line == (
        f"vault: INVALID_ARGUMENT: cannot read the mirror key ring {missing}: "
        "No such file or directory"
    ), serve.describe()
    bad = tmp_path / "bad-ring"
    bad.write_text("k1 not-base64\n")
    env = mirror_env(endpoints, encrypted="*", encryption_keys=str(bad))
    line = server.run("mirror", "status", env=env).error_line()
    assert f"{bad} line 1" in line, line
    env = mirror_env(endpoints, encrypted="a,x", encryption_keys=str(bad))
    line = server.run("mirror", "status", env=env).error_line()
    assert "mirrors.encrypted names x" in line, line


def test_direct_uploads_go_to_open_mirrors_only(
    buckets: Buckets, start_vault: StartVault, tmp_path: Path
) -> None:
    ring_path = write_ring(tmp_path / "ring", {"k1": new_key()}, new_key())
    endpoints = buckets()
    env = mirror_env(endpoints, encrypted="a,b", encryption_keys=str(ring_path))
    server = start_vault(env=env)
    data = random.Random(4).randbytes(3 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)

    put: Any = server.run("put", "--direct", "--copies", "3", "--json", str(path)).ok().json()
    assert put["mirrors"] == ["c"], put
    digest = sha256_of(data)
    wait_replicated(server, env, 1)
    ring = KeyRing.load(ring_path)
    for endpoint in endpoints[:2]:
        with sealed_tier(endpoint, ring) as tier:
            assert get_bytes(tier, digest) == data
    got = server.run("get", "--direct", str(digest), "-o", str(tmp_path / "out")).ok()
    assert (tmp_path / "out").read_bytes() == data, got.describe()
