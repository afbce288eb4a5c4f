"""Retention through the real `vault serve`, `vault gc` and MinIO mirrors: the dry run and the
real run agree, a released blob is gone from hot, warm and every mirror while its pins still
verify, nothing a dataset, image, sealed run or hold names is released, a kill -9 during a
pass loses nothing no release entry records (and the next pass finishes the job), and a get
of a released blob names the entry that released it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.s3 import MinioServer, S3Endpoint
from tests.services.vault_server import VaultServer, run_vault
from tests.test_mirror import PREFIX, minios, mirror_env
from tiers.hot import HotTier
from tiers.warm import WarmTier
from vault.client import VaultClient
from vault.digest import Digest
from vault.errors import InvalidArgument, NotFound
from vault.ledger.db import open_database
from vault.runs import Run, start
from vault.runs.dataset import add_dataset
from vault.server.released import ReleasingContent
from vault.store.protocol import put_bytes

__all__ = ["minios"]  # a fixture, used by name

DAY = 86_400.0


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def unique(label: str, size: int = 3000) -> bytes:
    return label.encode() + random.randbytes(size)


@dataclass
class Lab:
    """What a test made: every checkpoint file's bytes by digest, the digests the policy must
    release, and those it must keep."""

    server: VaultServer
    files: dict[str, bytes] = field(default_factory=dict)
    releasable: set[str] = field(default_factory=set)
    protected: set[str] = field(default_factory=set)


def job(server: VaultServer, client: VaultClient, tmp_path: Path, inputs: dict[str, str]) -> Run:
    """A run admitted and started as `vault run` starts one."""
    admission = client.admit(
        image=inputs["image"], dataset=inputs["dataset"], seed=random.getrandbits(64)
    )
    folder = tmp_path / f"job-{admission.run_id[7:19]}"
    folder.mkdir()
    env = {
        "PINVAULT_RUN_ID": admission.run_id,
        "PINVAULT_SEED": str(admission.seed),
        "PINVAULT_IMAGE": admission.inputs.image,
        "PINVAULT_DATASET": admission.inputs.dataset,
        "PINVAULT_CLIENT_SERVER": server.address,
        "PINVAULT_CLIENT_STATE_FILE": str(folder / "trust.json"),
    }
    return start(environ=env, output_dir=folder / "out")


def build_lab(
    server: VaultServer, tmp_path: Path, *, steps: int = 6, files: int = 1, sealed_steps: int = 4
) -> Lab:
    """Run A, unsealed, `steps` checkpoints of `files` unique files each (and a file every
    checkpoint shares); with keep_last=2 its first steps-2 are intermediate. Among their files:
    one a dataset holds, one an image's manifest names, one held. Run B: sealed, its manifest
    naming all its checkpoints (`sealed_steps` of them: a pass while it runs may release all but
    its last 2)."""
    lab = Lab(server)
    shared = unique("in the dataset too")
    named = unique("named by an image manifest")
    held = unique("held")
    constant = unique("unchanged between checkpoints")
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "train.bin").write_bytes(shared)
    with server.client() as client:
        image_manifest = json.dumps(
            {"schemaVersion": 2, "layers": [{"digest": sha256(named), "size": len(named)}]}
        ).encode()
        client.put(named)
        image = str(client.put(image_manifest).blob.sha256)
        client.pin("image", image)
        dataset = add_dataset(client, folder, name="retention").digest
        inputs = {"image": image, "dataset": dataset}
        client.put(held)
        client.pin("hold", sha256(held), meta={"reason": "the paper's figure 3"})

        run_a = job(server, client, tmp_path, inputs)
        for step in range(steps):
            checkpoint = {f"w{n}.bin": unique(f"a{step}.{n}") for n in range(files)}
            checkpoint["constant.bin"] = constant
            if step == 1:
                checkpoint["train.bin"] = shared
                checkpoint["layer.bin"] = named
                checkpoint["held.bin"] = held
            run_a.checkpoint(step, checkpoint)
            for name, data in checkpoint.items():
                lab.files[sha256(data)] = data
                if step < steps - 2 and name.startswith("w"):
                    lab.releasable.add(sha256(data))
                else:
                    lab.protected.add(sha256(data))
        lab.protected |= {sha256(shared), sha256(named), sha256(held), sha256(constant)}

        run_b = job(server, client, tmp_path, inputs)
        for step in range(sealed_steps):
            data = unique(f"b{step}")
            run_b.checkpoint(step, {"w.bin": data})
            lab.files[sha256(data)] = data
            lab.protected.add(sha256(data))
        run_b.finish()
        run_b.close()
        run_a.close()
    return lab


def gc(server: VaultServer, *args: str, keep_last: int = 2) -> dict[str, object]:
    """`vault gc ARGS --json` on the stopped server's data folder."""
    env = {
        **server.extra_env,
        "PINVAULT_DATA_DIR": str(server.data_dir),
        "PINVAULT_RETENTION_KEEP_LAST": str(keep_last),
    }
    result = run_vault("gc", *args, "--json", env=env).ok()
    found: dict[str, object] = result.json()
    return found


def digests(items: object) -> set[str]:
    assert isinstance(items, list)
    return {item["digest"] for item in items}


def releases(client: VaultClient) -> dict[str, int]:
    return {e.subjects[0]: e.index for e in client.log(kind="release")}


def check_pins_verify(server: VaultServer) -> None:
    # Every hash, the chain, every signed root and signature re-derived: exit 0; and every
    # pinned blob present and intact, but those released.
    server.run("verify").ok()
    server.run("verify", "--blobs").ok()


def check_available(client: VaultClient, lab: Lab, wanted: set[str], tmp_path: Path) -> None:
    for digest in sorted(wanted):
        target = tmp_path / "got"
        client.get(digest, target)
        assert target.read_bytes() == lab.files[digest], digest


# ---------------------------------------------------------------------------------------------


def test_dry_run_and_gc_agree_and_a_released_blob_names_its_entry(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    lab = build_lab(server, tmp_path)
    server.stop()

    # Off by default: without a policy the gc refuses, saying what to set.
    refused = run_vault("gc", env={"PINVAULT_DATA_DIR": str(server.data_dir)})
    assert "retention.keep_last" in refused.error_line()

    planned = gc(server, "--dry-run")
    assert digests(planned["release"]) == lab.releasable
    assert planned["release_bytes"] == sum(len(lab.files[d]) for d in lab.releasable)
    assert all(p["rule"] == "keep_last=2" for p in planned["release"])  # type: ignore[attr-defined, union-attr]
    # A dry run releases nothing.
    assert digests(gc(server, "--dry-run")["release"]) == lab.releasable

    done = gc(server)
    assert digests(done["released"]) == digests(planned["release"])
    for digest in lab.releasable:
        assert not server.blob_path(digest).exists(), digest
    # Nothing is left to do, and a second pass releases nothing again.
    again = gc(server, "--dry-run")
    assert again["release"] == [] and again["finish"] == []

    server.start()
    with server.client() as client:
        released = releases(client)
        assert set(released) == lab.releasable
        check_available(client, lab, lab.protected, tmp_path)
        for digest in lab.releasable:
            with pytest.raises(NotFound) as caught:
                client.get(digest, tmp_path / "gone")
            assert f"released by ledger entry {released[digest]}" in str(caught.value)
            assert "keep_last=2" in str(caught.value)
            # Look-ups take it for missing, so that a client puts its bytes again.
            assert client.find_missing([digest]) == [digest]
    digest = sorted(lab.releasable)[0]
    line = server.run("get", digest, "-o", str(tmp_path / "out")).error_line()
    assert f"released by ledger entry {released[digest]}" in line, line
    # The entries that pinned the released blobs stay, and their proofs with them.
    check_pins_verify(server)
    assert digest in server.run("lookup", digest).ok().stdout

    # Only the vault's gc writes release entries: a caller's `release` pin is refused, so no
    # writer can have the next pass remove bytes the policy keeps.
    kept = sorted(lab.protected)[0]
    with server.client() as client, pytest.raises(InvalidArgument, match="only by the vault"):
        client.pin("release", kept)
    assert kept not in releases(server.client())

    # Its bytes put again, the blob is back, and a pin of it is taken.
    with server.client() as client:
        client.put(lab.files[digest])
        client.pin("artefact", digest)
        check_available(client, lab, {digest}, tmp_path)


def test_a_released_blob_is_gone_from_hot_warm_and_every_mirror(
    start_vault: StartVault,
    tmp_path: Path,
    minios: list[MinioServer],
) -> None:
    endpoints = [m.create_bucket() for m in minios]
    server = start_vault(
        env={
            **mirror_env(endpoints),
            "PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm"),
            "PINVAULT_POLICY_WARM_AFTER_UNREAD_DAYS": str(1 / DAY),
            "PINVAULT_POLICY_MIN_COPIES": "2",
            "PINVAULT_POLICY_MIGRATE_INTERVAL": "0.2",
            "PINVAULT_POLICY_PROMOTE_ON_READ": "false",
        }
    )
    lab = build_lab(server, tmp_path)
    every = lab.releasable | lab.protected
    # Every file has a warm copy and a copy on each mirror before the gc.
    deadline = time.monotonic() + 90
    while True:
        warm = _warm_copies(server)
        on_mirrors = [_mirror_digests(m, e) for m, e in zip(minios, endpoints, strict=True)]
        if every <= warm and all(every <= held for held in on_mirrors):
            break
        assert time.monotonic() < deadline, "copies were not made in time"
        time.sleep(0.5)

    server.extra_env.update(
        {"PINVAULT_RETENTION_KEEP_LAST": "2", "PINVAULT_RETENTION_INTERVAL": "1"}
    )
    server.restart()
    with server.client() as client:
        deadline = time.monotonic() + 60
        while set(releases(client)) != lab.releasable:
            assert time.monotonic() < deadline, releases(client)
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while lab.releasable & (
            _warm_copies(server) | _held_anywhere(lab, server, minios, endpoints)
        ):
            assert time.monotonic() < deadline, "the released bytes were not all removed"
            time.sleep(0.3)
        check_available(client, lab, lab.protected, tmp_path)
    check_pins_verify(server)
    server.stop()
    for minio, endpoint in zip(minios, endpoints, strict=True):
        assert not lab.releasable & _mirror_digests(minio, endpoint)
        assert lab.protected <= _mirror_digests(minio, endpoint)
    for digest in lab.releasable:
        assert not server.blob_path(digest).exists()
    # Gone from the warm tier's look-ups; the pass removed the packs left with released records
    # alone, so a compaction now frees nothing more (what waits is beside live blobs).
    warm = WarmTier(tmp_path / "warm")
    try:
        assert set(map(str, warm.find_missing([Digest.parse(d) for d in lab.releasable]))) == (
            lab.releasable
        )
        assert not warm.find_missing([Digest.parse(d) for d in lab.protected])
        assert warm.compact() == 0
    finally:
        warm.close()
    server.start()


def test_kill_9_during_gc_loses_nothing_unreleased_and_the_next_pass_finishes(
    start_vault: StartVault,
    tmp_path: Path,
    minios: list[MinioServer],
) -> None:
    endpoints = [m.create_bucket() for m in minios]
    server = start_vault(env=mirror_env(endpoints))
    lab = build_lab(server, tmp_path, steps=12, files=25)
    every = lab.releasable | lab.protected
    deadline = time.monotonic() + 120
    while not all(every <= _mirror_digests(m, e) for m, e in zip(minios, endpoints, strict=True)):
        assert time.monotonic() < deadline, "mirror copies were not made in time"
        time.sleep(0.5)

    server.extra_env.update(
        {"PINVAULT_RETENTION_KEEP_LAST": "2", "PINVAULT_RETENTION_INTERVAL": "3600"}
    )
    server.restart()
    # Killed as soon as the first release entries are in the ledger: their bytes are being
    # removed.
    with server.client() as client:
        deadline = time.monotonic() + 60
        while not releases(client):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert server.process is not None
    server.process.kill()
    server.process.wait()
    server.process = None

    # At the kill: every blob is whole and readable, or released by a recorded entry.
    server.extra_env.pop("PINVAULT_RETENTION_KEEP_LAST")
    server.start()
    with server.client() as client:
        released = set(releases(client))
        assert released <= lab.releasable
        check_available(client, lab, every - released, tmp_path)
    half_done = released & _held_anywhere(lab, server, minios, endpoints)
    # The kill came between a release entry and the removal of its bytes.
    assert half_done, "the kill came after the pass, not during it"
    server.stop()

    # The next pass (at start) finishes what the kill cut short, and releases the rest.
    server.extra_env["PINVAULT_RETENTION_KEEP_LAST"] = "2"
    server.start()
    with server.client() as client:
        deadline = time.monotonic() + 90
        while set(releases(client)) != lab.releasable or lab.releasable & _held_anywhere(
            lab, server, minios, endpoints
        ):
            assert time.monotonic() < deadline, (half_done, releases(client))
            time.sleep(0.3)
        check_available(client, lab, lab.protected, tmp_path)
        for digest in lab.releasable:
            with pytest.raises(NotFound, match="released by ledger entry"):
                client.get(digest, tmp_path / "gone")
    check_pins_verify(server)


def test_two_servers_on_one_postgresql_ledger_release_each_blob_once(
    start_vault: StartVault, tmp_path: Path, postgres_url: str
) -> None:
    # Servers of one ledger sign its checkpoints with one key. Both run their passes every
    # second, with the same policy, over the same ledger, while a run commits checkpoints.
    env = {
        "PINVAULT_LEDGER_KEY_FILE": str(tmp_path / "checkpoint.key"),
        "PINVAULT_RETENTION_KEEP_LAST": "2",
        "PINVAULT_RETENTION_INTERVAL": "1",
    }
    first = start_vault("first", database=postgres_url, env=env)
    second = start_vault("second", database=postgres_url, env=env)
    lab = build_lab(first, tmp_path, steps=10, files=20, sealed_steps=2)
    with first.client() as client:
        deadline = time.monotonic() + 60
        # The blobs' bytes are on the first server's disk: it removes them in its passes,
        # whichever server released them.
        while lab.releasable & {d for d in lab.files if first.blob_path(d).exists()}:
            assert time.monotonic() < deadline, "the released bytes were not all removed"
            time.sleep(0.3)
        time.sleep(2)  # a few more passes of each server
        entries = [e.subjects[0] for e in client.log(kind="release")]
        check_available(client, lab, lab.protected, tmp_path)
    assert sorted(entries) == sorted(lab.releasable), "a blob released twice, or not at all"
    # (The blobs are on the first server's disk alone: no mirrors here.)
    check_pins_verify(first)
    second.run("verify").ok()


# ---------------------------------------------------------------------------------------------


def _mirror_digests(minio: MinioServer, endpoint: S3Endpoint) -> set[str]:
    """The blobs a mirror's bucket holds an index object of."""
    s3 = minio.client()
    found: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=endpoint.bucket, Prefix=PREFIX):
        for item in page.get("Contents", []):
            folder, _, name = item["Key"].rpartition("/")
            if folder.endswith("blobs/sha256"):
                found.add("sha256:" + name)
    return found


def _warm_copies(server: VaultServer) -> set[str]:
    """The blobs the placement record has a warm copy of."""
    import sqlite3

    with sqlite3.connect(f"file:{server.data_dir / 'tiers.db'}?mode=ro", uri=True) as db:
        return {d for (d,) in db.execute("SELECT digest FROM placements WHERE tier = 'warm'")}


def _held_anywhere(
    lab: Lab, server: VaultServer, minios: list[MinioServer], endpoints: list[S3Endpoint]
) -> set[str]:
    held = {d for d in lab.files if server.blob_path(d).exists()}
    for minio, endpoint in zip(minios, endpoints, strict=True):
        held |= _mirror_digests(minio, endpoint)
    return held


def test_a_look_up_on_the_event_loop_never_waits_for_a_batch_being_released(
    tmp_path: Path,
) -> None:
    """On SQLite the server answers look-ups inline on its event loop: one that names a blob
    of the batch a gc pass is releasing (its copies on every mirror take seconds to remove)
    must not stall that loop, and so every other call. It takes the blob for released already,
    so no pin is accepted for bytes about to go; a worker thread still waits for the batch."""
    db = open_database(f"sqlite:///{tmp_path / 'vault.db'}")
    content = ReleasingContent(db, HotTier(tmp_path / "hot"), folder=tmp_path / "hot")
    try:
        data = unique("being released")
        stored = put_bytes(content.store, data)
        content.adopt(stored, "2026-01-01T00:00:00.000000Z")
        digest = str(stored.sha256)
        assert content.find_missing([digest]) == []
        inside, leave = threading.Event(), threading.Event()

        def gc_batch() -> None:
            with content.releasing([digest]):
                inside.set()
                leave.wait(30)

        batch = threading.Thread(target=gc_batch)
        batch.start()
        assert inside.wait(10)

        async def on_the_loop() -> list[str]:
            return content.find_missing([digest])

        async def get_on_the_loop() -> object:
            return content.get(Digest.parse(digest))

        began = time.monotonic()
        assert asyncio.run(on_the_loop()) == [digest]
        assert time.monotonic() - began < 1.0
        with pytest.raises(NotFound, match="is being released by the vault's gc"):
            asyncio.run(get_on_the_loop())
        # Off the loop, a look-up waits for the batch to end.
        answered: list[list[str]] = []
        waiting = threading.Thread(target=lambda: answered.append(content.find_missing([digest])))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and answered == []
        leave.set()
        batch.join(10)
        waiting.join(10)
        assert answered == [[]]
    finally:
        leave.set()
        content.close()
        db.dispose()
