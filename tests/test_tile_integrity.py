"""The tiles the vault publishes never drift from what it signs: every checkpoint it hands out
has its tiles on disk (an independent verifier written with Go's golang.org/x/mod/sumdb code,
tests/go/tilecheck, fetches and checks them), and a tile, entry bundle or checkpoint file that
does not match the tree is never served, but found (on a request, at start, in the
background), written again from the database, logged and counted."""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services import tilecheck
from tests.services.vault_server import VaultServer
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import Database, open_database
from vault.ledger.log import Ledger
from vault.ledger.records import PinSpec
from vault.ledger.sequencer import MAX_BATCH
from vault.ledger.subject_map_store import INDEX_EVERY
from vault.ledger.tiles import ServedTiles
from vault.server.tiles_http import TilesServer

ORIGIN = "tiles.test/integrity"
# Checkpoint sizes signed one after another, as bursts of appends make them: partial tiles at
# both levels, full tiles completed in between, and two sizes within one level 0 tile.
BURSTS = (1, 5, 255, 256, 300, 513, 3300, 3310, 3322)


def _pin(n: int) -> PinSpec:
    return PinSpec.checked(
        kind="config", subjects=[f"sha256:{n:064x}"], author="tester", external=True
    )


@dataclass
class Vault:
    data: Path
    key: SigningKey
    db: Database
    ledger: Ledger

    @property
    def tiles(self) -> Path:
        return self.data / "tiles"

    def grow(self, size: int) -> str:
        """Append up to `size` entries and take the checkpoint a caller would be handed."""
        while self.ledger.size < size:
            count = min(size - self.ledger.size, MAX_BATCH)
            self.ledger.append([_pin(self.ledger.size + n) for n in range(count)])
        return self.ledger.checkpoint(size).note


def _open(data: Path, key: SigningKey, *, check_every: float = 3600.0) -> Vault:
    db = open_database(f"sqlite:///{data / 'vault.db'}")
    ledger = Ledger(
        db,
        key,
        origin=ORIGIN,
        checkpoint_interval=3600,
        last_signed=data / "last-checkpoint",
        tiles=data / "tiles",
        tiles_check_interval=check_every,
        # A ledger of exactly the entries appended: no `index` entries among them.
        index_every=None,
    )
    # Until the checkpointer's first pass, a signing leaves its tiles to that pass.
    deadline = time.monotonic() + 10
    while not ledger._tiles_caught_up and time.monotonic() < deadline:
        time.sleep(0.01)
    return Vault(data, key, db, ledger)


@contextlib.contextmanager
def _closing(vault: Vault) -> Iterator[Vault]:
    try:
        yield vault
    finally:
        vault.ledger.close()
        vault.db.dispose()


@contextlib.contextmanager
def _serving(vault: Vault) -> Iterator[str]:
    """The vault's own tiles endpoint over the ledger's folder, serving through its check."""
    served = vault.ledger.served_tiles
    assert served is not None
    with TilesServer(vault.tiles, checked=served.served_bytes) as server:
        yield server.url


@pytest.fixture(scope="module")
def verifier() -> Path:
    return tilecheck.build()


@pytest.fixture
def vault(tmp_path: Path) -> Iterator[Vault]:
    with _closing(_open(tmp_path, SigningKey.generate(ORIGIN))) as vault:
        yield vault


def _flip(path: Path, at: int = 7) -> None:
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)
        file.seek(at)
        file.write(bytes([byte[0] ^ 0x01]))


def test_every_checkpoint_handed_out_has_tiles_the_go_verifier_accepts(
    vault: Vault, verifier: Path, tmp_path: Path
) -> None:
    notes = [vault.grow(size) for size in BURSTS]
    key = str(vault.key.verifier())
    with _serving(vault) as url:
        for size, note in zip(BURSTS, notes, strict=True):
            held = tmp_path / f"checkpoint-{size}"
            held.write_text(note)
            outcome = tilecheck.run(verifier, url, key, leaves=[0, size - 1], checkpoint=held)
            assert outcome.status == 0, f"size {size}: {outcome.line}"
            assert f"size {size} verified" in outcome.line


def test_a_damaged_tile_or_bundle_is_never_served_and_is_written_again(
    vault: Vault, verifier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vault.grow(3300)
    vault.grow(3310)
    vault.ledger.write_tiles()
    served = vault.ledger.served_tiles
    assert served is not None
    damaged = [
        "tile/0/000",  # a full hash tile
        "tile/entries/005",  # a full entry bundle
        "tile/entries/012.p/238",  # the latest checkpoint's partial bundle
        "tile/0/012.p/228",  # an older checkpoint's partial tile
        "tile/1/000.p/12",  # a level 1 partial tile
    ]
    good = {path: served.served_bytes(path) for path in damaged}
    assert all(good.values())
    for path in damaged:
        _flip(vault.tiles / path)
    caplog.set_level(logging.ERROR, "vault.ledger.tiles")
    for path in damaged:
        assert served.served_bytes(path) == good[path], path
        assert (vault.tiles / path).read_bytes() == good[path], path
        assert f"ledger tile {path} is damaged on disk" in caplog.text
    assert vault.ledger.tiles_rewritten == len(damaged)
    key = str(vault.key.verifier())
    with _serving(vault) as url:
        outcome = tilecheck.run(verifier, url, key, leaves=[0, 1300, 3309])
    assert outcome.status == 0, outcome.line


def test_a_file_past_the_tree_or_not_a_tile_is_not_served(vault: Vault) -> None:
    vault.grow(300)
    served = vault.ledger.served_tiles
    assert served is not None
    planted = vault.tiles / "tile/0/009"
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(b"\0" * 32 * 256)
    assert served.served_bytes("tile/0/009") is None
    assert served.served_bytes("tile/0/../../vault.db") is None
    assert served.served_bytes("tile/0/000") is not None


def test_damage_is_found_at_start_and_in_the_background_and_written_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = SigningKey.generate(ORIGIN)
    with _closing(_open(tmp_path, key)) as vault:
        vault.grow(1000)
        vault.ledger.write_tiles()
    bundle = tmp_path / "tiles/tile/entries/001"
    good = bundle.read_bytes()
    _flip(bundle, 100)
    missing = tmp_path / "tiles/tile/0/002"
    missing.unlink()
    caplog.set_level(logging.WARNING)
    with _closing(_open(tmp_path, key, check_every=0.3)) as vault:
        deadline = time.monotonic() + 20
        while vault.ledger.tiles_rewritten < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bundle.read_bytes() == good
        assert missing.exists()
        assert "ledger tile tile/entries/001 is damaged on disk" in caplog.text
        assert "ledger tile tile/0/002 is missing on disk" in caplog.text
        # Damage while running, found by the background pass with no request made.
        older = vault.tiles / "tile/0/003.p/232"
        good = older.read_bytes()
        _flip(older, 0)
        before = vault.ledger.tiles_rewritten
        deadline = time.monotonic() + 20
        while vault.ledger.tiles_rewritten == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert older.read_bytes() == good
        assert vault.ledger.tiles_rewritten == before + 1


# -- through `vault serve` -----------------------------------------------------------------


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


def test_vault_verify_names_a_damaged_tile_and_a_restart_writes_it_again(
    start_vault: StartVault,
) -> None:
    vault = start_vault(serve_args=("--metrics-port", "0"))
    tiles, size = _published_300(vault)
    checked = vault.run("verify", "--tiles", str(tiles)).ok().stdout.splitlines()[-1]
    assert re.fullmatch(rf"tiles OK: \d+ files of the checkpoint of size {size}", checked), checked
    bundle = tiles / "tile/entries/000"
    good = bundle.read_bytes()
    _flip(bundle, 300)
    refused = vault.run("verify", "--tiles", str(tiles))
    assert refused.returncode == 65
    assert "tiles verification FAILED: tile/entries/000: " in refused.stdout

    vault.stop()
    vault.start()
    deadline = time.monotonic() + 30
    while bundle.read_bytes() != good and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bundle.read_bytes() == good
    assert "ledger tile tile/entries/000 is damaged on disk" in vault.log()
    (url,) = [line.split(" at ", 1)[1] for line in vault.banner if "metrics (Prometheus)" in line]
    assert _metric(url, "pinvault_ledger_tiles_rewritten_total") == 1
    assert (
        vault.run("verify", "--tiles", str(tiles))
        .ok()
        .stdout.splitlines()[-1]
        .startswith("tiles OK")
    )


def test_a_tile_damaged_under_a_running_server_is_served_as_the_tree_holds_it(
    start_vault: StartVault,
) -> None:
    vault = start_vault(serve_args=("--tiles-http", "0"))
    (url,) = [
        line.split(" at ", 1)[1] for line in vault.banner if "tiles (C2SP tlog-tiles)" in line
    ]
    tiles, size = _published_300(vault)
    edge = size - 256
    paths = ["tile/0/000", "tile/entries/000", f"tile/0/001.p/{edge}", f"tile/entries/001.p/{edge}"]
    good = {}
    for path in paths:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            good[path] = response.read()
    for path in paths:
        _flip(tiles / path, 40)
    for path in paths:
        # Served as the tree holds it, never as the disk had it, and written again.
        with urllib.request.urlopen(url + path, timeout=10) as response:
            assert response.read() == good[path], path
        assert (tiles / path).read_bytes() == good[path], path
        assert f"ledger tile {path} is damaged on disk" in vault.log()


def _published_300(vault: VaultServer) -> tuple[Path, int]:
    """Pin 300 entries through `vault` and wait for the checkpoint of all of them (and of the
    `index` entries the writer appended among them: one every INDEX_EVERY) to be published
    with its tiles; the tile folder and that size."""
    with vault.client() as client:
        for n in range(300):
            last = client.pin("config", f"sha256:{n:064x}", external=True)
    size = last.entry.index + 1
    assert size == 300 + 300 // INDEX_EVERY
    tiles = vault.data_dir / "tiles"
    deadline = time.monotonic() + 30
    while f"\n{size}\n" not in _text(tiles / "checkpoint") and time.monotonic() < deadline:
        time.sleep(0.1)
    return tiles, size


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_tampered_ledger_is_logged_in_one_line_not_every_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = SigningKey.generate(ORIGIN)
    with _closing(_open(tmp_path, key)) as vault:
        vault.grow(20)
    conn = sqlite3.connect(tmp_path / "vault.db", isolation_level=None)
    try:
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type='trigger'"
        ).fetchall():
            conn.execute(f"DROP TRIGGER {name}")
        conn.execute("UPDATE entries SET leaf_hash = ? WHERE idx = 7", (b"\1" * 32,))
    finally:
        conn.close()
    caplog.set_level(logging.WARNING)
    db = open_database(f"sqlite:///{tmp_path / 'vault.db'}")
    ledger = Ledger(
        db,
        key,
        origin=ORIGIN,
        checkpoint_interval=0.02,
        last_signed=tmp_path / "last-checkpoint",
        tiles=tmp_path / "tiles",
        tiles_check_interval=0.02,
        index_every=None,
    )
    with _closing(Vault(tmp_path, key, db, ledger)):
        assert ledger.fault is not None
        time.sleep(1.5)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert all(r.exc_info is None for r in caplog.records), caplog.text
    assert len(errors) == len(set(errors)), caplog.text
    told = [e for e in errors if "run `vault verify`" in e]
    assert len(told) == 1, caplog.text
    assert "an entry at index 0 to 19 was changed" in told[0]


def test_a_ledger_closing_during_a_sweep_of_its_tiles_does_not_wait_for_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server checks its tiles in full a second after it starts: tens of seconds for a
    ledger of millions of entries (39 s at 3M), which a server stopping must not wait out.
    Each file's check is made slow here, as a large ledger's many files make the sweep."""
    key = SigningKey.generate(ORIGIN)
    with _closing(_open(tmp_path, key)) as vault:
        vault.grow(3300)
    checking = threading.Event()
    checked = 0
    serve = ServedTiles._serve

    def slow(self: ServedTiles, relative: str, *, cached: bool) -> bytes | None:
        nonlocal checked
        if not cached:  # the sweep's full check of one file
            checked += 1
            checking.set()
            time.sleep(0.5)
        return serve(self, relative, cached=cached)

    monkeypatch.setattr(ServedTiles, "_serve", slow)
    vault = _open(tmp_path, key, check_every=0.05)
    try:
        assert checking.wait(10)
    finally:
        start = time.monotonic()
        vault.ledger.close()
        took = time.monotonic() - start
        vault.db.dispose()
    # The ledger's 13 level 0 tiles, their bundles and the level 1 tile: 27 files a sweep.
    assert took < 2.0 and checked < 5, (took, checked)
