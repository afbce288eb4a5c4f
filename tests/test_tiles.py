"""The ledger's Merkle tree as C2SP tlog-tiles: written before each checkpoint is signed, caught
up at start, rewritable from the database, and served read-only over HTTP, where an independent
verifier written with Go's own golang.org/x/mod/sumdb code (tests/go/tilecheck) checks the
signed checkpoint, inclusion and consistency from the tiles alone."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.conftest import StartVault
from tests.services import tilecheck
from vault.errors import InvalidArgument, Unavailable
from vault.http_edge import Limits
from vault.ledger import log as ledger_log
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import Database, open_database
from vault.ledger.entry import (
    MAX_AUTHOR_LENGTH,
    MAX_META_KEYS,
    MAX_META_TOTAL_BYTES,
    MAX_SUBJECTS,
    encode_fields,
    now,
)
from vault.ledger.log import MAX_BATCH, Ledger
from vault.ledger.merkle import MerkleTree, leaf_hash
from vault.ledger.records import PinSpec, SignedCheckpoint
from vault.ledger.tiles import (
    MAX_BUNDLE_ENTRY,
    Tile,
    TileStore,
    index_path,
    new_tiles,
    parse_tile_path,
    partial_tiles,
)
from vault.server.tiles_http import IMMUTABLE, TilesServer

ORIGIN = "tiles.test/ledger"
# 13 full level 0 tiles and a partial one of 5, under a partial level 1 tile of 13.
SIZE = 13 * 256 + 5


def _pin(n: int) -> PinSpec:
    return PinSpec.checked(
        kind="config", subjects=[f"sha256:{n:064x}"], author="tester", external=True
    )


@dataclass
class Vault:
    """A ledger that writes its tiles into `data/tiles`, and the endpoint serving them."""

    data: Path
    key: SigningKey
    db: Database
    ledger: Ledger
    http: TilesServer
    verifier: Path

    @property
    def tiles(self) -> Path:
        return self.data / "tiles"

    def grow(self, size: int) -> SignedCheckpoint:
        """Append entries up to `size`, sign the checkpoint of that size and publish its tiles
        (as the checkpointer does within an interval)."""
        while self.ledger.size < size:
            count = min(size - self.ledger.size, MAX_BATCH)
            self.ledger.append([_pin(self.ledger.size + n) for n in range(count)])
        signed = self.ledger.checkpoint(size)
        self.ledger.write_tiles()
        return signed

    def get(self, target: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        """One request with `target` sent exactly as given."""
        conn = http.client.HTTPConnection("127.0.0.1", self.http.port, timeout=10)
        try:
            conn.request(method, target)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def check(self, *, leaves: Sequence[int] = (), old: Path | None = None) -> tilecheck.Outcome:
        """The Go verifier's verdict on what the endpoint serves."""
        key = str(self.key.verifier())
        return tilecheck.run(self.verifier, self.http.url, key, leaves=leaves, old=old)


@pytest.fixture(scope="module")
def verifier() -> Path:
    """The Go verifier, built once (a build that fails fails the tests that use it)."""
    return tilecheck.build()


def _open(
    data: Path, key: SigningKey, *, tiles: bool = True, url: str | None = None
) -> tuple[Database, Ledger]:
    db = open_database(url or f"sqlite:///{data / 'vault.db'}")
    ledger = Ledger(
        db,
        key,
        origin=ORIGIN,
        checkpoint_interval=3600,
        last_signed=data / "last-checkpoint",
        tiles=data / "tiles" if tiles else None,
        # No background check: these tests see how each path finds a damaged tile.
        tiles_check_interval=None,
        # A ledger of exactly the entries appended: no `index` entries among them.
        index_every=None,
    )
    return db, ledger


@contextlib.contextmanager
def _vault(data: Path, verifier: Path) -> Iterator[Vault]:
    key = SigningKey.generate(ORIGIN)
    db, ledger = _open(data, key)
    vault = Vault(data, key, db, ledger, TilesServer(data / "tiles").start(), verifier)
    try:
        yield vault
    finally:
        vault.http.stop()
        vault.ledger.close()
        vault.db.dispose()


@pytest.fixture
def vault(tmp_path: Path, verifier: Path) -> Iterator[Vault]:
    """A new ledger with tiles, for a test to grow and alter."""
    with _vault(tmp_path, verifier) as vault:
        yield vault


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, verifier: Path) -> Iterator[Vault]:
    """A ledger of SIZE entries with tiles, for tests that only read what is served."""
    with _vault(tmp_path_factory.mktemp("served"), verifier) as vault:
        vault.grow(SIZE)
        yield vault


def _save(vault: Vault, name: str) -> Path:
    """The checkpoint the endpoint serves now, kept in a file as a verifier keeps it."""
    status, _, body = vault.get("/checkpoint")
    assert status == 200
    path = vault.data / name
    path.write_bytes(body)
    return path


# -- what an independent verifier sees -----------------------------------------------------


def test_the_go_verifier_proves_inclusion_and_consistency_from_tiles_alone(vault: Vault) -> None:
    vault.grow(1000)
    old = _save(vault, "old.note")
    latest = vault.grow(SIZE)
    outcome = vault.check(leaves=[0, 255, 256, 999, 1000, 3327, 3328, SIZE - 1], old=old)
    assert outcome.status == 0, outcome.line
    assert outcome.line == (
        f"tilecheck: OK: checkpoint {ORIGIN} size {SIZE} verified; inclusion of entries "
        f"0,255,256,999,1000,3327,3328,{SIZE - 1}; consistency from size 1000"
    )
    assert _save(vault, "latest.note").read_text() == latest.note


def test_the_go_verifier_reads_every_tile_level_of_the_spec_example(vault: Vault) -> None:
    """A tree of 70,000 entries (the spec's own example): 273 full level 0 tiles and one of
    112, a full level 1 tile and one of 17, and a level 2 tile of 1."""
    vault.grow(65_536 + 100)
    old = _save(vault, "old.note")
    vault.grow(70_000)
    for tile in (
        "tile/0/272",
        "tile/0/273.p/112",
        "tile/1/000",
        "tile/1/001.p/17",
        "tile/2/000.p/1",
    ):
        assert (vault.tiles / tile).is_file(), tile
    outcome = vault.check(leaves=[0, 65_535, 65_536, 69_887, 69_999], old=old)
    assert outcome.status == 0, outcome.line
    assert "consistency from size 65636" in outcome.line


def test_a_flipped_byte_in_a_tile_on_disk_fails_the_go_verifier(vault: Vault) -> None:
    vault.grow(SIZE)
    assert vault.check(leaves=[5]).status == 0
    tile = vault.tiles / "tile/0/000"
    data = bytearray(tile.read_bytes())
    data[5 * 32 + 7] ^= 0x01
    tile.write_bytes(bytes(data))
    outcome = vault.check(leaves=[5])
    assert outcome.status == 1
    assert (
        outcome.line == "tilecheck: FAILED: entry 5: inclusion proof: downloaded inconsistent tile"
    )


def test_a_damaged_entry_bundle_fails_the_go_verifier(vault: Vault) -> None:
    vault.grow(SIZE)
    bundle = vault.tiles / "tile/entries/001"
    data = bytearray(bundle.read_bytes())
    data[100] ^= 0x20  # inside the bundle's first entry, 256
    bundle.write_bytes(bytes(data))
    assert vault.check(leaves=[255, 257]).status == 0
    outcome = vault.check(leaves=[256])
    assert outcome.status == 1
    assert outcome.line.startswith(
        f"tilecheck: FAILED: entry 256: inclusion in the tree of size {SIZE}"
    )


def test_damaged_and_missing_tiles_are_written_again_from_the_database(vault: Vault) -> None:
    vault.grow(SIZE)
    good = {path: (vault.tiles / path).read_bytes() for path in ("tile/0/000", "tile/0/013.p/5")}
    damaged = vault.tiles / "tile/0/000"
    damaged.write_bytes(bytes(8192))
    (vault.tiles / "tile/0/007").unlink()
    (vault.tiles / "tile/entries/013.p/5").unlink()
    (vault.tiles / "tile/1/000.p/13").write_bytes(b"short")
    (vault.tiles / "tile/0/013.p/5").unlink()
    assert vault.check(leaves=[1, 1800, SIZE - 1]).status == 1

    repaired = vault.ledger.repair_tiles()

    assert sorted(repaired) == [
        "tile/0/000",
        "tile/0/007",
        "tile/0/013.p/5",
        "tile/1/000.p/13",
        "tile/entries/013.p/5",
    ]
    assert {path: (vault.tiles / path).read_bytes() for path in good} == good
    outcome = vault.check(leaves=[1, 1800, SIZE - 1])
    assert outcome.status == 0, outcome.line
    assert vault.ledger.repair_tiles() == []


# -- written before signing, caught up at start --------------------------------------------


def test_a_checkpoint_is_published_only_once_its_tiles_are_on_disk(
    vault: Vault, tmp_path: Path
) -> None:
    first = vault.grow(300)
    vault.ledger.append([_pin(n) for n in range(300, 600)])
    # The folder for the next tiles cannot be made: a file is in its way.
    (vault.tiles / "tile/1").rename(vault.data / "level1")
    (vault.tiles / "tile/1").write_bytes(b"")

    # Signing writes no tile file: the size is signed, and its tiles are served all the same
    # (as `vault serve` serves them, checked), made from the tree and the stored entries as
    # they are asked for.
    latest = vault.ledger.checkpoint(600)
    held = tmp_path / "checkpoint-600"
    held.write_text(latest.note)
    served = vault.ledger.served_tiles
    assert served is not None
    with TilesServer(vault.tiles, checked=served.served_bytes) as checked:
        outcome = tilecheck.run(
            vault.verifier, checked.url, str(vault.key.verifier()), leaves=[0, 599], checkpoint=held
        )
    assert outcome.status == 0, outcome
    # The tiles cannot be written: the published checkpoint stays the one whose tiles are.
    with pytest.raises(Unavailable, match=r"cannot write the ledger's tiles in .*tiles"):
        vault.ledger.write_tiles()
    assert vault.get("/checkpoint")[2].decode() == first.note
    (vault.tiles / "tile/1").unlink()
    vault.ledger.write_tiles()
    assert vault.get("/checkpoint")[2].decode() == latest.note
    assert (vault.tiles / "tile/1/000.p/2").exists()
    assert vault.check(leaves=[0, 599]).status == 0


def test_a_tile_made_from_the_tree_is_made_once_however_often_it_is_asked_for(
    vault: Vault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller asking again and again for a tile that is not on disk (of a size signed since
    the tiles were written) makes the database read its entries once, not at every request."""
    vault.grow(300)
    vault.ledger.append([_pin(n) for n in range(300, 600)])
    vault.ledger.checkpoint(600)
    served = vault.ledger.served_tiles
    assert served is not None
    made: list[str] = []
    render = served._render

    def counted(tile: Tile) -> bytes | None:
        made.append(tile.path)
        return render(tile)

    monkeypatch.setattr(served, "_render", counted)
    paths = ["tile/0/002.p/88", "tile/entries/002.p/88", "tile/1/000.p/2"]
    assert not any((vault.tiles / path).exists() for path in paths)

    first = {path: served.served_bytes(path) for path in paths}
    for _ in range(50):
        assert {path: served.served_bytes(path) for path in paths} == first

    assert all(first.values())
    assert sorted(made) == sorted(paths)


def test_tiles_missing_for_checkpoints_signed_before_are_written_at_start(
    tmp_path: Path, verifier: Path
) -> None:
    """A ledger that kept no tiles (or lost them) gets every tile of its signed checkpoints
    at its next start, the partial tiles of older checkpoints that are still partial too."""
    _catch_up_at_start(tmp_path, verifier, url=None)


def test_tiles_are_caught_up_at_start_on_postgresql(
    tmp_path: Path, verifier: Path, postgres_url: str
) -> None:
    _catch_up_at_start(tmp_path, verifier, url=postgres_url)


def _catch_up_at_start(tmp_path: Path, verifier: Path, url: str | None) -> None:
    key = SigningKey.generate(ORIGIN)
    db, ledger = _open(tmp_path, key, tiles=False, url=url)
    for size in (600, 1300):
        ledger.append([_pin(n) for n in range(ledger.size, size)])
        ledger.checkpoint(size)
    ledger.append([_pin(n) for n in range(1300, 1400)])  # not yet in a checkpoint
    ledger.close()
    db.dispose()

    db, ledger = _open(tmp_path, key, url=url)
    ledger.write_tiles()  # what the checkpointer does first; here, to know it is done
    try:
        tiles = tmp_path / "tiles"
        for path in ("tile/0/004", "tile/0/005.p/20", "tile/entries/005.p/20", "tile/1/000.p/5"):
            assert (tiles / path).is_file(), path
        # Size 600's level 1 tile is still partial at 1300; its level 0 one is full.
        assert (tiles / "tile/1/000.p/2").is_file()
        assert not (tiles / "tile/0/002.p/88").exists()
        assert not (tiles / "tile/0/005.p/120").exists()
        with TilesServer(tiles) as server:
            outcome = tilecheck.run(verifier, server.url, str(key.verifier()), leaves=[0, 1299])
        assert outcome.status == 0, outcome.line
        assert "size 1300 verified" in outcome.line
    finally:
        ledger.close()
        db.dispose()


def test_a_long_catch_up_goes_in_steps_and_publishes_what_was_signed_meanwhile(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger with more history than one step of tiles missing catches up in the background,
    a step at a time; a checkpoint signed meanwhile is served once its tiles are all there."""
    monkeypatch.setattr(ledger_log, "TILES_STEP", 256)
    key = SigningKey.generate(ORIGIN)
    db, ledger = _open(tmp_path, key, tiles=False)
    ledger.append([_pin(n) for n in range(SIZE)])
    ledger.checkpoint(SIZE)
    ledger.close()
    db.dispose()

    db, ledger = _open(tmp_path, key)
    try:
        ledger.append([_pin(n) for n in range(SIZE, SIZE + 100)])
        latest = ledger.checkpoint(SIZE + 100)
        ledger.write_tiles()
        assert (tmp_path / "tiles/checkpoint").read_text() == latest.note
        with TilesServer(tmp_path / "tiles") as server:
            outcome = tilecheck.run(
                verifier, server.url, str(key.verifier()), leaves=[0, 2000, SIZE + 99]
            )
        assert outcome.status == 0, outcome.line
    finally:
        ledger.close()
        db.dispose()


def test_a_restart_writes_again_what_a_lost_checkpoint_file_no_longer_vouches_for(
    vault: Vault,
) -> None:
    vault.grow(SIZE)
    vault.ledger.close()
    vault.db.dispose()
    (vault.tiles / "checkpoint").unlink()
    (vault.tiles / "tile/0/003").unlink()
    stray = vault.tiles / ".tmp" / "0123456789abcdef"
    stray.write_bytes(b"half a tile")

    vault.db, vault.ledger = _open(vault.data, vault.key)
    vault.ledger.write_tiles()

    assert (vault.tiles / "tile/0/003").is_file()
    assert not stray.exists()
    assert vault.check(leaves=[800]).status == 0


def _proofs(ledger: Ledger, size: int) -> list[list[bytes]]:
    return [ledger.inclusion_proof(index, size) for index in range(0, size, 97)] + [
        ledger.consistency_proof(old, size) for old in (1, 255, 256, 1000, size - 1)
    ]


def test_a_restart_takes_the_tree_from_the_tiles_and_reads_a_damaged_one_from_the_database(
    vault: Vault, caplog: pytest.LogCaptureFixture
) -> None:
    """At start the tree comes from the published tiles (checked against their signed root)
    and the entries stored since; a leaf tile found damaged when a proof needs it is read from
    the database instead, and written again."""
    vault.grow(SIZE)
    proofs = _proofs(vault.ledger, SIZE)
    good = (vault.tiles / "tile/0/002").read_bytes()
    vault.ledger.close()
    vault.db.dispose()
    (vault.tiles / "tile/0/002").write_bytes(bytes(reversed(good)))

    with caplog.at_level(logging.WARNING, logger=ledger_log.__name__):
        vault.db, vault.ledger = _open(vault.data, vault.key)
        assert vault.ledger.fault is None
        assert _proofs(vault.ledger, SIZE) == proofs
    assert "tile/0/002 is missing or damaged" in caplog.text
    assert "loading the tree from the database" not in caplog.text

    vault.ledger.write_tiles()
    assert (vault.tiles / "tile/0/002").read_bytes() == good
    assert vault.check(leaves=[600]).status == 0


def test_tiles_that_do_not_give_the_signed_root_are_not_trusted_and_are_written_again(
    vault: Vault, caplog: pytest.LogCaptureFixture
) -> None:
    vault.grow(SIZE)
    proofs = _proofs(vault.ledger, SIZE)
    stratum = vault.tiles / "tile/1/000.p/13"
    good = stratum.read_bytes()
    vault.ledger.close()
    vault.db.dispose()
    stratum.write_bytes(good[32:] + good[:32])

    with caplog.at_level(logging.WARNING, logger=ledger_log.__name__):
        vault.db, vault.ledger = _open(vault.data, vault.key)
        assert vault.ledger.fault is None
        assert _proofs(vault.ledger, SIZE) == proofs
    assert "do not match the stored entries: loading the tree from the database" in caplog.text
    # The checkpointer checks every tile first thing.
    deadline = time.monotonic() + 30
    while stratum.read_bytes() != good and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stratum.read_bytes() == good
    assert vault.check(leaves=[1, SIZE - 1]).status == 0


def test_the_tree_lets_go_of_what_the_tiles_hold_and_still_proves_everything(
    vault: Vault, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ledger_log, "RETIRE_STEP", 256)
    vault.grow(SIZE)
    vault.ledger.append([_pin(n) for n in range(SIZE, SIZE + 300)])
    size = vault.ledger.size
    with vault.db.read.connect() as conn:
        leaves = conn.execute(text("SELECT leaf_hash FROM entries ORDER BY idx")).scalars().all()
    whole = MerkleTree(bytes(leaf) for leaf in leaves)
    for index in (0, 255, 256, 1700, SIZE - 1, size - 1):
        assert vault.ledger.leaf(index) == whole.leaf(index)
        assert vault.ledger.inclusion_proof(index, size) == whole.inclusion_proof(index, size)
    for old in (1, 300, SIZE, size - 1):
        assert vault.ledger.consistency_proof(old, size) == whole.consistency_proof(old, size)
    assert vault.ledger.checkpoint(size).checkpoint.root == whole.root()

    (vault.tiles / "tile/0/005").unlink()
    with caplog.at_level(logging.WARNING, logger=ledger_log.__name__):
        assert vault.ledger.inclusion_proof(5 * 256 + 7, size) == whole.inclusion_proof(
            5 * 256 + 7, size
        )
    assert "tile/0/005 is missing or damaged" in caplog.text
    vault.ledger.write_tiles()
    assert (vault.tiles / "tile/0/005").read_bytes() == whole.nodes(0, 5 * 256, 6 * 256)


def test_proofs_of_entries_the_tree_let_go_of_take_their_tiles_inner_nodes_never_trusted(
    vault: Vault, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger_log, "RETIRE_STEP", 256)
    vault.grow(SIZE)
    vault.ledger.append([_pin(n) for n in range(SIZE, SIZE + 300)])
    vault.ledger.checkpoint(vault.ledger.size)
    vault.ledger.write_tiles()
    size = vault.ledger.size
    with vault.db.read.connect() as conn:
        leaves = conn.execute(text("SELECT leaf_hash FROM entries ORDER BY idx")).scalars().all()
    whole = MerkleTree(bytes(leaf) for leaf in leaves)
    full = size // 256
    # Beside the tiles, not among the files served: each full tile's 16 nodes of height 4.
    inner = vault.data / "tile-nodes"
    assert inner.read_bytes() == b"".join(whole.nodes(4, t * 16, t * 16 + 16) for t in range(full))
    assert not list(vault.tiles.rglob("tile-nodes"))
    for index in (0, 7, 255, 256, 1700, 13 * 256 + 4, size - 1):
        assert vault.ledger.inclusion_proof(index, size) == whole.inclusion_proof(index, size)

    # A slot that does not check is not used (the proof is still right) and is written again.
    good = inner.read_bytes()
    damaged = bytearray(good)
    damaged[3 * 512 + 40] ^= 0x01
    inner.write_bytes(bytes(damaged))
    assert vault.ledger.inclusion_proof(3 * 256 + 9, size) == whole.inclusion_proof(
        3 * 256 + 9, size
    )
    vault.ledger.write_tiles()
    assert inner.read_bytes() == good
    # Nodes that check but a group of leaves that does not (a damaged tile): the same.
    tile = vault.tiles / "tile/0/004"
    tile.write_bytes(bytes(8192))
    assert vault.ledger.inclusion_proof(4 * 256 + 200, size) == whole.inclusion_proof(
        4 * 256 + 200, size
    )
    vault.ledger.write_tiles()
    assert tile.read_bytes() == whole.nodes(0, 4 * 256, 5 * 256)
    assert inner.read_bytes() == good
    # No file at all: proofs from whole tiles, and the file written again.
    inner.unlink()
    vault.ledger.close()
    vault.db, vault.ledger = _open(vault.data, vault.key)
    assert vault.ledger.inclusion_proof(1700, size) == whole.inclusion_proof(1700, size)
    vault.ledger.write_tiles()
    assert inner.read_bytes() == good


# -- the HTTP endpoint ---------------------------------------------------------------------


def test_responses_carry_the_spec_content_types_and_cache_headers(served: Vault) -> None:
    vault = served
    latest = vault.ledger.checkpoint()

    status, headers, body = vault.get("/checkpoint")
    assert (status, body.decode()) == (200, latest.note)
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    assert headers["Cache-Control"] == "public, max-age=5"

    status, headers, body = vault.get("/tile/0/000")
    assert status == 200
    assert body == b"".join(vault.ledger.leaf(i) for i in range(256))
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Cache-Control"] == IMMUTABLE == "public, max-age=31536000, immutable"
    assert headers["Content-Length"] == "8192"

    status, headers, body = vault.get("/tile/1/000.p/13")
    assert (status, len(body)) == (200, 13 * 32)
    assert headers["Cache-Control"] == "public, max-age=60"

    status, headers, body = vault.get("/tile/entries/013.p/5")
    assert status == 200
    assert headers["Cache-Control"] == "public, max-age=60"
    assert _split_bundle(body) == [vault.ledger.entry(i).body for i in range(3328, SIZE)]
    status, headers, body = vault.get("/tile/entries/000")
    assert headers["Cache-Control"] == IMMUTABLE
    assert len(_split_bundle(body)) == 256

    status, headers, body = vault.get("/tile/0/000", method="HEAD")
    assert (status, body, headers["Content-Length"]) == (200, b"", "8192")
    assert headers["Cache-Control"] == IMMUTABLE


def test_only_get_and_head_are_answered(served: Vault) -> None:
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
        status, headers, _ = served.get("/checkpoint", method=method)
        assert (status, headers["Allow"]) == (405, "GET, HEAD"), method


@pytest.mark.parametrize(
    "target",
    [
        "/tile/../../vault.db",
        "/tile/../vault.db",
        "/../vault.db",
        "/tile/%2e%2e/%2e%2e/vault.db",
        "/%2e%2e/vault.db",
        "/tile/0/%2e%2e/%2e%2e/%2e%2e/vault.db",
        "/tile/0/000/../../../../vault.db",
        "//checkpoint",
        "/checkpoint/",
        "/checkpoint?size=1",
        "/tile/0/000?",
        "/tile/0/x000/000",
        "/tile/0/0",
        "/tile/0/0000",
        "/tile/0/000.p/256",
        "/tile/0/000.p/0",
        "/tile/0/000.p/05",
        "/tile/00/000",
        "/tile/64/000",
        "/tile/entries/000/",
        "/tile/data/000",
        "/tile/8/0/000",
        "/tile/",
        "/tile/0/",
        "/",
        "/.tmp",
        "/last-checkpoint",
        "/vault.db",
        "http://127.0.0.1/checkpoint",
    ],
)
def test_paths_outside_the_tiles_are_not_found(served: Vault, target: str) -> None:
    status, headers, body = served.get(target)
    assert (status, body) == (404, b"not found\n")
    assert headers["Cache-Control"] == "no-store"


def test_a_link_planted_in_the_tile_folder_is_not_followed(vault: Vault) -> None:
    vault.grow(SIZE)
    (vault.tiles / "tile/0/900").symlink_to(vault.data / "vault.db")
    assert vault.get("/tile/0/900")[0] == 404
    os.symlink("000", vault.tiles / "tile/0/901")
    assert vault.get("/tile/0/901")[0] == 404


def test_entry_bundles_can_be_left_out(served: Vault) -> None:
    with TilesServer(served.tiles, entries=False) as hashes_only:
        conn = http.client.HTTPConnection("127.0.0.1", hashes_only.port, timeout=10)
        for target, status in (("/tile/entries/000", 404), ("/tile/0/000", 200)):
            conn.request("GET", target)
            response = conn.getresponse()
            response.read()
            assert response.status == status, target
        conn.close()


def test_an_idle_caller_holds_no_thread_and_is_let_go_at_the_head_deadline(
    tmp_path: Path,
) -> None:
    (tmp_path / "checkpoint").write_text("x\n")
    with TilesServer(tmp_path, limits=Limits(workers=1, head_seconds=2.0)) as server:
        idle = socket.create_connection(("127.0.0.1", server.port))
        try:
            # The one worker thread is not held by a caller who sends nothing.
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", "/checkpoint")
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, b"x\n")
            conn.close()
            idle.settimeout(10)
            started = time.monotonic()
            assert idle.recv(1) == b""
            assert time.monotonic() - started < 5
        finally:
            idle.close()


def test_the_endpoint_reports_the_port_it_was_given(tmp_path: Path) -> None:
    with TilesServer(tmp_path) as server:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/"
        with pytest.raises(Unavailable, match=rf"cannot serve tiles on 127.0.0.1:{server.port}: "):
            TilesServer(tmp_path, port=server.port).start()
        with pytest.raises(InvalidArgument, match="a tiles port is 0 to 65535, not 70000"):
            TilesServer(tmp_path, port=70000).start()
        (tmp_path / "checkpoint").write_text("x\n")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/checkpoint")
        assert conn.getresponse().read() == b"x\n"
        conn.close()


# -- tile coordinates and bundles ----------------------------------------------------------


def test_tile_paths_are_the_spec_encoding() -> None:
    assert index_path(1234067) == "x001/x234/067"
    assert index_path(0) == "000"
    assert index_path(1000) == "x001/000"
    assert Tile(4, 1234067, 1).path == "tile/4/x001/x234/067.p/1"
    assert Tile(-1, 5).path == "tile/entries/005"
    assert parse_tile_path("tile/4/x001/x234/067.p/1") == Tile(4, 1234067, 1)
    assert parse_tile_path("tile/entries/x001/000") == Tile(-1, 1000)
    assert parse_tile_path("tile/63/000") == Tile(63, 0)


def test_the_tiles_of_a_tree_are_those_the_spec_lists() -> None:
    tiles = new_tiles(0, 70_000)
    assert (
        [t for t in tiles if not t.full]
        == partial_tiles(70_000)
        == [
            Tile(0, 273, 112),
            Tile(1, 1, 17),
            Tile(2, 0, 1),
        ]
    )
    assert sum(1 for t in tiles if t.full and t.level == 0) == 273
    assert [t for t in tiles if t.full and t.level > 0] == [Tile(1, 0)]
    assert new_tiles(0, 256) == [Tile(0, 0), Tile(1, 0, 1)]


def test_the_largest_entry_an_append_accepts_fits_an_entry_bundle() -> None:
    """A bundle frames each entry with a uint16 length: the limits on an entry keep its body
    well under 65,535 bytes even with every character escaped or four bytes long."""
    keys = [f"k{n:02d}" for n in range(MAX_META_KEYS)]
    value = '"' * ((MAX_META_TOTAL_BYTES - sum(map(len, keys))) // MAX_META_KEYS)
    pin = PinSpec.checked(
        kind="checkpoint",
        subjects=[f"blake3:{n:064x}" for n in range(MAX_SUBJECTS)],
        author="\U0001f600" * MAX_AUTHOR_LENGTH,
        meta=dict.fromkeys(keys, value),
    )
    body = encode_fields(
        2**53 - 1, pin.kind, pin.subjects, pin.author, now(), bytes(32), pin.meta, pin.external
    )
    assert 34_000 < len(body) < MAX_BUNDLE_ENTRY


def test_an_entry_too_long_to_frame_leaves_its_bundle_unwritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No append makes one, but a stored entry of more than 65,535 bytes would not be cut or
    framed wrongly: its bundle is left out, said so in the log, and its hash tile written."""
    bodies = [b"entry %d" % n for n in range(300)]
    bodies[260] = b"x" * (MAX_BUNDLE_ENTRY + 1)
    tree = MerkleTree(leaf_hash(body) for body in bodies)
    store = TileStore(tmp_path)
    with caplog.at_level(logging.ERROR):
        store.write(300, tree.nodes, lambda start, end: bodies[start:end])
    assert (tmp_path / "tile/entries/000").is_file()
    assert (tmp_path / "tile/0/001.p/44").read_bytes() == tree.nodes(0, 256, 300)
    assert not (tmp_path / "tile/entries/001.p/44").exists()
    assert "ledger entry 260 is 65536 bytes" in caplog.text


def _split_bundle(data: bytes) -> list[bytes]:
    entries = []
    while data:
        size = int.from_bytes(data[:2], "big")
        entries.append(data[2 : 2 + size])
        data = data[2 + size :]
    return entries


# -- through `vault serve` -----------------------------------------------------------------


def test_vault_serve_publishes_tiles_the_go_verifier_accepts(
    start_vault: StartVault, verifier: Path
) -> None:
    vault = start_vault(serve_args=("--tiles-http", "0"))
    (url,) = [
        line.split(" at ", 1)[1] for line in vault.banner if "tiles (C2SP tlog-tiles)" in line
    ]
    with vault.client() as client:
        for n in range(600):
            client.pin("config", f"sha256:{n:064x}", external=True)
        key = str(client.verifier())
    # The checkpointer publishes the latest checkpoint's tiles within an interval.
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(url + "checkpoint", timeout=10) as response:
            size = int(response.read().decode().splitlines()[1])
        if size >= 600 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert size >= 600
    outcome = tilecheck.run(verifier, url, key, leaves=[0, 300, 599])
    assert outcome.status == 0, outcome.line


def test_a_new_vault_publishes_a_checkpoint_of_its_empty_ledger(start_vault: StartVault) -> None:
    """A readiness probe or a verifier may ask for the checkpoint before anything is pinned:
    the vault answers with a signed checkpoint of size 0 (the root of the empty tree), as
    Tessera does, rather than 404 until the first pin."""
    vault = start_vault(serve_args=("--tiles-http", "0"))
    (url,) = [
        line.split(" at ", 1)[1] for line in vault.banner if "tiles (C2SP tlog-tiles)" in line
    ]
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "checkpoint", timeout=10) as response:
                note = response.read().decode()
            break
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
            assert time.monotonic() < deadline, "no checkpoint published for the empty ledger"
            time.sleep(0.2)
    with vault.client() as client:
        checkpoint = client.verifier().open(note)
    assert checkpoint.size == 0
    assert checkpoint.root == hashlib.sha256(b"").digest()
