"""A real full disk under a real `vault serve`: the data folder (the ledger's SQLite database and
the hot tier) on a small tmpfs filled up by a filler file. Puts and pins are refused with
RESOURCE_EXHAUSTED naming the folder whose disk is full and the room needed, reads go on, the
server restarts (and starts when the disk filled while it was down), and writes work again as
soon as the filler is deleted, without a restart."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer
from tests.small_disk import fill, refused_for_room


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def writes_are_refused(server: VaultServer, blob: Path) -> None:
    """A put handed off (the file), one streamed (standard input), a batch of small files
    (`vault dataset add`) and a pin: all refused."""
    hot = server.data_dir / "hot"
    refused_for_room(server.run("put", str(blob)).error_line(), hot)
    refused_for_room(server.run("put", "-", input=b"streamed" * 100_000).error_line(), hot)
    # Small files go in batches.
    dataset = blob.parent / "dataset"
    dataset.mkdir(exist_ok=True)
    for n in range(20):
        (dataset / f"part-{n}.txt").write_bytes(os.urandom(10_000))
    refused_for_room(server.run("dataset", "add", str(dataset)).error_line(), hot)
    pin = server.run("pin", "artefact", sha256(b"elsewhere"), "--external")
    refused_for_room(pin.error_line(), server.data_dir)
    assert server.run("lookup", sha256(b"elsewhere")).returncode != 0, "no entry was added"
    assert "Traceback" not in server.log(), server.log()


def reads_are_served(server: VaultServer, kept: bytes) -> None:
    assert server.run("get", sha256(kept)).ok().output == kept
    lookup = server.run("lookup", sha256(kept)).ok().stdout
    assert (
        "artefact" in lookup
        and "verified: inclusion and completeness in checkpoint size 1" in lookup
    )
    assert server.run("checkpoint").ok().stdout.splitlines()[1] == "1"


def test_a_full_disk_refuses_writes_by_name_and_they_work_again_once_space_is_freed(
    small_disk: Path, start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(data_dir=small_disk / "data")
    kept = b"stored before the disk filled"
    server.run("put", "-", input=kept).ok()
    server.run("pin", "artefact", sha256(kept)).ok()
    # The file to put is elsewhere: only the vault's disk is full. It is large enough to be
    # handed off to the server rather than streamed.
    blob = tmp_path / "blob.bin"
    data = os.urandom(9 << 20)
    blob.write_bytes(data)

    fill(small_disk)
    writes_are_refused(server, blob)
    reads_are_served(server, kept)

    server.restart()
    reads_are_served(server, kept)
    # Starting gave back the room held for it; the disk is full again.
    fill(small_disk)
    writes_are_refused(server, blob)

    (small_disk / "filler").unlink()
    put = server.run("put", str(blob), "--json").ok().json()
    assert put["sha256"] == sha256(data) and put["created"]
    server.run("pin", "artefact", sha256(data)).ok()
    assert server.run("get", sha256(data)).ok().output == data
    verify = server.run("verify", "--blobs").ok().stdout
    assert "ledger: 2 entries" in verify and "2 pinned blobs checked, 0 failed" in verify
    assert not list((server.data_dir / "hot" / "tmp").iterdir()), "a failed put left a file"


def test_a_vault_whose_disk_filled_while_it_was_down_starts_and_serves_reads(
    small_disk: Path, start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(data_dir=small_disk / "data")
    kept = b"stored before the disk filled"
    server.run("put", "-", input=kept).ok()
    server.run("pin", "artefact", sha256(kept)).ok()
    assert server.stop() == 0

    fill(small_disk)
    server.start()
    reads_are_served(server, kept)
    fill(small_disk)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(9 << 20))
    writes_are_refused(server, blob)
