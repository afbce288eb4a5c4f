"""`vault mirror add` as docs/guide.md's "Adding mirrors" tells it, on real S3 servers: from a
config file without mirrors to three verified copies of a blob through a real `vault serve`, then
`vault mirror status` failing on a mirror that is down; and every way an add can be refused,
each in one line that leaves the config file as it was."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.s3 import MinioServer, S3Endpoint, S3Server
from tests.services.vault_server import VaultRun, run_vault
from tests.test_mirror import wait_for
from tiers.cold import ColdTier
from tiers.placements import Journal
from vault.digest import sha256_of
from vault.store.protocol import get_bytes

pytestmark = pytest.mark.s3

# A lab's config before it has mirrors: every line and comment must survive each add.
CONFIG = """\
# pinvault on the lab's vault host
data_dir = "{data}"   # blobs, the ledger and the replication queue

[server]
workers = 8           # a small host

# Policy: keep datasets hot.
[policy]
keep_hot_kinds = "dataset"
"""


def keys(name: str, server: S3Server, *, secret: str | None = None) -> dict[str, str]:
    """The variables `vault mirror add` and `vault serve` read a mirror's keys from."""
    stem = f"PVMIRROR_{name.upper().replace('-', '_')}"
    return {
        f"{stem}_ACCESS_KEY_ID": server.access_key,
        f"{stem}_SECRET_ACCESS_KEY": server.secret_key if secret is None else secret,
    }


def mirror_add(
    config: Path | None, name: str, server: S3Server, bucket: str, *args: str, **env: str
) -> VaultRun:
    where = ("--config", str(config)) if config is not None else ()
    return run_vault(
        *where,
        "mirror",
        "add",
        name,
        "--endpoint",
        server.url,
        "--bucket",
        bucket,
        *args,
        env={**keys(name, server), **env},
    )


def read_back(server: S3Server, bucket: str, prefix: str) -> ColdTier:
    """A cold tier of the test's own on a mirror's bucket, to read what the vault wrote."""
    return ColdTier(
        endpoint_url=server.url,
        bucket=bucket,
        prefix=prefix,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
    )


def bucket_exists(server: S3Server, bucket: str) -> bool:
    return bucket in {b["Name"] for b in server.client().list_buckets()["Buckets"]}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "vault.toml"
    path.parent.mkdir()
    path.write_text(CONFIG.format(data=tmp_path / "data"))
    path.chmod(0o640)
    return path


@pytest.fixture
def own_minio(clean_environment: None) -> Iterator[MinioServer]:
    """A MinIO of the test's own, to take down while the others stay up."""
    server = MinioServer().start()
    try:
        yield server
    finally:
        server.stop()


def test_from_a_config_without_mirrors_to_three_verified_copies(
    config_file: Path,
    minio_server: MinioServer,
    own_minio: MinioServer,
    start_vault: StartVault,
    tmp_path: Path,
) -> None:
    original = config_file.read_text()
    lab_a, lab_b = minio_server.create_bucket(), minio_server.create_bucket()
    new_bucket = f"pv-new-{secrets.token_hex(4)}"
    try:
        first = mirror_add(config_file, "lab-a", minio_server, lab_a.bucket, "--prefix", "pv/")
        said = first.ok().stdout
        assert said.splitlines()[0] == f"mirror lab-a: {minio_server.url}/{lab_a.bucket}/pv", said
        assert said.splitlines()[1] == (
            "  keys PVMIRROR_LAB_A_ACCESS_KEY_ID and PVMIRROR_LAB_A_SECRET_ACCESS_KEY: a test "
            "object written, read back, deleted"
        ), said
        assert "created bucket" not in said, said
        assert f"added to {config_file}: 1 mirror (lab-a), 3 copies of each blob" in said, said
        assert "refuses to start with fewer mirrors (add 2 more" in said, said
        # The second through $PINVAULT_CONFIG, as a host that sets it would.
        second = mirror_add(
            None, "lab-b", minio_server, lab_b.bucket, PINVAULT_CONFIG=str(config_file)
        )
        assert "2 mirrors (lab-a, lab-b)" in second.ok().stdout, second.stdout
        third = mirror_add(
            config_file, "lab-c", own_minio, new_bucket, "--create-bucket", "--replicas", "3"
        ).ok()
        assert f"  created bucket {new_bucket}" in third.stdout.splitlines(), third.stdout
        assert "3 mirrors (lab-a, lab-b, lab-c), 3 copies of each blob" in third.stdout
        assert "refuses to start" not in third.stdout, third.stdout
        assert "`vault serve` uses it from its next start" in third.stdout, third.stdout
        assert bucket_exists(own_minio, new_bucket)

        # The file: every line it had, in order, then the mirrors; no secret; its mode kept.
        text = config_file.read_text()
        assert text.startswith(original), text
        assert tomllib.loads(text)["mirrors"] == {
            "endpoints": f"lab-a={minio_server.url}/{lab_a.bucket}/pv "
            f"lab-b={minio_server.url}/{lab_b.bucket} "
            f"lab-c={own_minio.url}/{new_bucket}",
            "replicas": 3,
        }
        for secret in (minio_server.secret_key, own_minio.secret_key):
            assert secret not in text
        assert stat.S_IMODE(config_file.stat().st_mode) == 0o640
        assert sorted(os.listdir(config_file.parent)) == ["vault.toml"]

        every_key = {
            **keys("lab-a", minio_server),
            **keys("lab-b", minio_server),
            **keys("lab-c", own_minio),
        }
        server = start_vault(
            args=("--config", str(config_file)),
            env=every_key,
            data_dir=tmp_path / "data",
            data_dir_from_config=True,
        )
        data = os.urandom(300_000)
        (tmp_path / "blob").write_bytes(data)
        digest = sha256_of(data)
        server.run("put", str(tmp_path / "blob")).ok()

        def status(*args: str) -> VaultRun:
            return run_vault("--config", str(config_file), "mirror", "status", *args, env=every_key)

        def three_copies() -> bool:
            rows = status("--json").ok().json()
            return all(row["objects"] == 1 and row["queued"] == 0 for row in rows)

        wait_for(three_copies, "the blob has a verified copy on each mirror")
        rows = {row["name"]: row for row in status("--json").ok().json()}
        assert set(rows) == {"lab-a", "lab-b", "lab-c"}
        assert all(row["reachable"] and row["last_verified"] for row in rows.values()), rows
        table = status().ok().stdout.splitlines()
        assert table[0].split()[-2:] == ["last", "verified"], table
        assert [line.split()[:3] for line in table[1:]] == [
            [name, "yes", "1"] for name in ("lab-a", "lab-b", "lab-c")
        ], table
        assert all(line.endswith(" ago") for line in table[1:]), table
        with contextlib.closing(Journal(tmp_path / "data" / "tiers.db")) as journal:
            placed = {p.tier: p for p in journal.placements(digest)}
        for name in ("lab-a", "lab-b", "lab-c"):
            assert placed[f"mirror-{name}"].last_verified is not None, placed
        for s3, bucket, prefix in (
            (minio_server, lab_a.bucket, "pv"),
            (minio_server, lab_b.bucket, ""),
            (own_minio, new_bucket, ""),
        ):
            with read_back(s3, bucket, prefix) as tier:
                assert list(tier.digests()) == [digest]
                assert get_bytes(tier, digest) == data

        # A mirror down: status still reports every mirror, and fails naming the one down.
        own_minio.halt()
        down = status("--json")
        # With --json, the error is one JSON object on standard error (docs/cli.md).
        error = json.loads(down.stderr.splitlines()[-1])["error"]
        assert (down.returncode, error["kind"]) == (69, "unavailable"), down.describe()
        assert error["message"].startswith("mirrors down: lab-c ("), down.describe()
        rows = {row["name"]: row for row in down.json()}
        assert [rows[name]["reachable"] for name in ("lab-a", "lab-b", "lab-c")] == [
            True,
            True,
            False,
        ]
        shown = status()
        assert shown.error_line().startswith("vault: UNAVAILABLE: mirrors down: lab-c (")
        assert any(line.split()[:2] == ["lab-c", "NO"] for line in shown.stdout.splitlines())
    finally:
        minio_server.delete_bucket(lab_a.bucket)
        minio_server.delete_bucket(lab_b.bucket)


def unchanged(config_file: Path, before: str) -> None:
    """The refused add left the file, and its folder, as they were."""
    assert config_file.read_text() == before
    assert sorted(os.listdir(config_file.parent)) == ["vault.toml"]


def add_to(config_file: Path, endpoint: S3Endpoint, *args: str, **env: str) -> VaultRun:
    """`vault mirror add peer` of the endpoint's server, with the keys given in `env`."""
    return run_vault(
        "--config",
        str(config_file),
        "mirror",
        "add",
        "peer",
        "--endpoint",
        endpoint.url,
        *args,
        env=env,
    )


def endpoint_keys(endpoint: S3Endpoint, *, secret: str | None = None) -> dict[str, str]:
    return {
        "PVMIRROR_PEER_ACCESS_KEY_ID": endpoint.access_key,
        "PVMIRROR_PEER_SECRET_ACCESS_KEY": endpoint.secret_key if secret is None else secret,
    }


def test_a_wrong_secret_key_is_refused_naming_the_mirror_and_its_credentials(
    config_file: Path, s3_endpoint: S3Endpoint
) -> None:
    before = config_file.read_text()
    wrong = endpoint_keys(s3_endpoint, secret="not-" + s3_endpoint.secret_key)
    line = add_to(config_file, s3_endpoint, "--bucket", s3_endpoint.bucket, **wrong).error_line()
    assert line.startswith(
        f"vault: PERMISSION_DENIED: mirror peer: {s3_endpoint.url} refused the credentials in "
        "PVMIRROR_PEER_ACCESS_KEY_ID and PVMIRROR_PEER_SECRET_ACCESS_KEY"
    ), line
    unchanged(config_file, before)


def test_a_missing_bucket_is_refused_naming_the_flag_that_creates_it(
    config_file: Path, s3_endpoint: S3Endpoint
) -> None:
    with config_file.open("a") as file:
        file.write("\n[mirrors]\n# Peers get little time.\nconnect_timeout = 2.0  # near\n")
    before = config_file.read_text()
    client = s3_endpoint.client()
    missing = f"pv-missing-{secrets.token_hex(4)}"
    refused = add_to(config_file, s3_endpoint, "--bucket", missing, **endpoint_keys(s3_endpoint))
    assert refused.error_line() == (
        f"vault: FAILED_PRECONDITION: mirror peer: bucket {missing} does not exist on "
        f"{s3_endpoint.url}: create it, or pass --create-bucket"
    ), refused.describe()
    unchanged(config_file, before)
    assert missing not in {b["Name"] for b in client.list_buckets()["Buckets"]}

    made = add_to(
        config_file,
        s3_endpoint,
        "--bucket",
        missing,
        "--create-bucket",
        "--prefix",
        "/lab/vault/",
        "--json",
        **endpoint_keys(s3_endpoint),
    )
    try:
        report = made.ok().json()
        assert report["bucket_created"] is True, report
        assert (report["name"], report["prefix"], report["mirrors"]) == (
            "peer",
            "lab/vault",
            ["peer"],
        )
        # The probe object is gone: the bucket holds nothing the vault did not put there.
        assert client.list_objects_v2(Bucket=missing).get("KeyCount", 0) == 0
        text = config_file.read_text()
        assert text.startswith(before), text
        assert tomllib.loads(text)["mirrors"] == {
            "connect_timeout": 2.0,
            "endpoints": f"peer={s3_endpoint.url}/{missing}/lab/vault",
        }
    finally:
        client.delete_bucket(Bucket=missing)


def test_an_add_that_cannot_be_done_is_refused_in_one_line_before_any_change(
    config_file: Path, tmp_path: Path
) -> None:
    config_file.write_text(
        config_file.read_text() + '\n[mirrors]\nendpoints = "lab-a=http://127.0.0.1:1/bucket-a"\n'
    )
    before = config_file.read_text()
    dead = {"PVMIRROR_LAB_B_ACCESS_KEY_ID": "k", "PVMIRROR_LAB_B_SECRET_ACCESS_KEY": "s"}

    def refused(*args: str, config: Path | None = config_file, **env: str) -> str:
        where = ("--config", str(config)) if config is not None else ()
        result = run_vault(*where, "mirror", "add", *args, env={**dead, **env})
        unchanged(config_file, before)
        return result.error_line()

    bucket = ("--endpoint", "http://127.0.0.1:1", "--bucket", "bucket-b")
    assert refused("lab-a", *bucket) == (
        "vault: INVALID_ARGUMENT: mirror lab-a is already configured in "
        f"{config_file} (lab-a=http://127.0.0.1:1/bucket-a)"
    )
    assert refused("Lab_B", *bucket) == (
        "vault: INVALID_ARGUMENT: mirror name 'Lab_B' must be 1 to 32 lowercase letters, "
        "digits and dashes, not starting with a dash"
    )
    assert refused("lab-b", "--endpoint", "http://127.0.0.1:1/b", "--bucket", "b2").startswith(
        "vault: INVALID_ARGUMENT: endpoint 'http://127.0.0.1:1/b' is not http(s)://HOST[:PORT]"
    )
    assert refused("lab-b", "--endpoint", "http://127.0.0.1:1", "--bucket", "B_b").startswith(
        "vault: INVALID_ARGUMENT: bucket 'B_b' is not an S3 bucket name"
    )
    assert refused("lab-b", *bucket, "--replicas", "3") == (
        "vault: INVALID_ARGUMENT: replicas 3: expected 1 to the 2 mirrors configured with this "
        "one (each copy goes to a different mirror)"
    )
    assert refused("lab-b", *bucket, PVMIRROR_LAB_B_SECRET_ACCESS_KEY="") == (
        "vault: INVALID_ARGUMENT: mirror lab-b: set PVMIRROR_LAB_B_SECRET_ACCESS_KEY to its S3 "
        "credentials"
    )
    assert refused("lab-b", *bucket, PINVAULT_MIRRORS_ENDPOINTS="") == (
        "vault: INVALID_ARGUMENT: PINVAULT_MIRRORS_ENDPOINTS is set and overrides what would be "
        f"written in {config_file}: unset it first"
    )
    assert refused("lab-b", *bucket, config=None) == (
        "vault: INVALID_ARGUMENT: no config file to add the mirror to: pass --config FILE or set "
        "PINVAULT_CONFIG to the file `vault serve` reads (an empty file will do)"
    )
    down = refused("lab-b", *bucket)
    assert down.startswith(
        "vault: UNAVAILABLE: mirror lab-b: http://127.0.0.1:1 does not answer (a HEAD of bucket "
        "bucket-b): "
    ), down
