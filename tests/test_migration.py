"""Migration between real hot and warm tiers on disk: blobs move only once a verified copy
exists elsewhere, a worker SIGKILLed between any two steps leaves every blob with its copies
and finishes on the next pass, reads go on from the new copy (and promote it back), and the
`vault tier` commands say what would move and why."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from cli.tier import add_tier_commands
from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, command_env
from tests.terminal import run_on_terminal
from tests.tier_contract import LARGE, content
from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.migrate import COPIED, DELETED, RECORDED, UNPLACED, VERIFIED, Migrator
from tiers.policy import DAY
from tiers.warm import WarmTier
from vault import config as config_module
from vault.config import PolicyConfig
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound
from vault.store.chunks import CHUNK_SIZE
from vault.store.protocol import get_bytes, put_bytes

REPO = Path(__file__).resolve().parents[1]
LATER = 40 * DAY


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TierManager]:
    warm = WarmTier(tmp_path / "warm")
    with TierManager(
        [("hot", HotTier(tmp_path / "hot")), ("warm", warm)],
        journal=tmp_path / "tiers.db",
        owned=[warm],
    ) as opened:
        yield opened


def migrator(manager: TierManager, min_copies: int = 1, later: float = LATER) -> Migrator:
    return Migrator(
        manager,
        replace(PolicyConfig(), min_copies=min_copies),
        hot_capacity=lambda: 1 << 40,
        clock=lambda: time.time() + later,
    )


def verified_copies(tiers: list[tuple[str, object]], sha256: Digest) -> list[str]:
    found = []
    for name, tier in tiers:
        assert isinstance(tier, (HotTier, WarmTier))
        try:
            tier.verify(sha256)
        except (NotFound, IntegrityError):
            continue
        found.append(name)
    return found


def test_a_blob_unread_for_forty_days_moves_to_warm_and_leaves_hot(manager: TierManager) -> None:
    hot, warm = manager.tiers
    data = content(LARGE, seed=1)
    sha256 = put_bytes(manager, data).sha256

    report = migrator(manager).run_once()

    assert (report.copied, report.removed, report.failed) == (1, 1, [])
    assert hot.find_missing([sha256]) == [sha256]
    assert warm.verify(sha256).size == len(data)
    (placement,) = manager.journal.placements(sha256)
    assert placement.tier == "warm" and placement.last_verified is not None
    (record,) = manager.journal.records(sha256)
    assert record.found == "policy: stored 40 days ago, never read (warm after 30 days unread)"
    assert record.action == "removed the copy: 1 verified copies elsewhere (warm)"
    # A second pass has nothing to do.
    again = migrator(manager).run_once()
    assert (again.copied, again.removed) == (0, 0)


def test_without_enough_copies_elsewhere_the_hot_copy_stays(manager: TierManager) -> None:
    hot, warm = manager.tiers
    sha256 = put_bytes(manager, b"only two places to be").sha256
    worker = migrator(manager, min_copies=2)
    (decision,) = [d for d in worker.plan() if d.moves]
    assert worker.copies_note(decision) == (
        "hot copy kept: 1 verified copies elsewhere (warm), policy.min_copies is 2"
    )

    report = worker.run_once()

    assert report.removed == 0
    assert report.kept == [
        (sha256, "hot copy kept: 1 verified copies elsewhere (warm), policy.min_copies is 2")
    ]
    assert not hot.find_missing([sha256]) and not warm.find_missing([sha256])


def test_a_read_after_the_move_is_served_from_warm_and_promotes_the_blob(
    manager: TierManager,
) -> None:
    hot, _ = manager.tiers
    data = content(LARGE, seed=2)
    sha256 = put_bytes(manager, data).sha256
    migrator(manager).run_once()
    manager.promote = True

    assert get_bytes(manager, sha256) == data

    deadline = time.monotonic() + 30
    while hot.find_missing([sha256]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hot.verify(sha256).size == len(data)
    # The copy the migration removed was not taken for damage: nothing was "repaired".
    assert [r.action for r in manager.journal.records(sha256)] == [
        "removed the copy: 1 verified copies elsewhere (warm)"
    ]
    # Read now, so the policy keeps it hot.
    manager.journal.flush_reads()
    assert not [d for d in migrator(manager, later=0).plan() if d.moves]


_CRASHING_WORKER = """
import os, signal, sys, time
from dataclasses import replace
from pathlib import Path
from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.migrate import Migrator
from tiers.warm import WarmTier
from vault.config import PolicyConfig

base, crash_step, crash_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
seen = 0

def on_step(step, digest):
    global seen
    if step == crash_step:
        seen += 1
        if seen == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)

warm = WarmTier(base / "warm")
manager = TierManager(
    [("hot", HotTier(base / "hot")), ("warm", warm)], journal=base / "tiers.db", owned=[warm]
)
worker = Migrator(
    manager,
    replace(PolicyConfig(), min_copies=1),
    hot_capacity=lambda: 1 << 40,
    on_step=on_step,
    clock=lambda: time.time() + 40 * 86400,
)
worker.run_once()
manager.close()
"""


@pytest.mark.parametrize("step", [COPIED, VERIFIED, RECORDED, UNPLACED, DELETED])
def test_a_worker_killed_between_steps_never_leaves_a_blob_without_its_copies(
    tmp_path: Path, step: str
) -> None:
    blobs = {}
    warm = WarmTier(tmp_path / "warm")
    with TierManager(
        [("hot", HotTier(tmp_path / "hot")), ("warm", warm)],
        journal=tmp_path / "tiers.db",
        owned=[warm],
    ) as manager:
        for seed in range(3):
            data = content(LARGE if seed == 1 else 1000 + seed, seed=seed)
            blobs[put_bytes(manager, data).sha256] = data
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(_CRASHING_WORKER))

    killed = subprocess.run(
        [sys.executable, str(script), str(tmp_path), step, "2"], cwd=REPO, check=False
    )

    assert killed.returncode == -signal.SIGKILL
    hot, warm = HotTier(tmp_path / "hot"), WarmTier(tmp_path / "warm")
    try:
        tiers: list[tuple[str, object]] = [("hot", hot), ("warm", warm)]
        for sha256 in blobs:
            assert verified_copies(tiers, sha256), f"{sha256} lost every copy at {step}"
    finally:
        warm.close()
    # Restarted, the worker finishes the job and every blob reads back whole from warm.
    finished = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "never", "1"], cwd=REPO, check=False
    )
    assert finished.returncode == 0
    hot, warm = HotTier(tmp_path / "hot"), WarmTier(tmp_path / "warm")
    with TierManager(
        [("hot", hot), ("warm", warm)], journal=tmp_path / "tiers.db", owned=[warm]
    ) as manager:
        for sha256, data in blobs.items():
            assert verified_copies([("hot", hot), ("warm", warm)], sha256) == ["warm"]
            assert get_bytes(manager, sha256) == data
        assert not [r for r in manager.journal.records() if "damaged" in r.found]


# -- the commands ------------------------------------------------------------------------------


def run_tier_command(argv: list[str], environ: dict[str, str]) -> int:
    """`vault tier …` / `vault scrub` as cli/main.py would run them, in process."""
    parser = argparse.ArgumentParser(prog="vault")
    add_tier_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args, config_module.load(environ=environ)))


def test_tier_status_and_migrate_dry_run_say_what_would_move_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {
        "PINVAULT_DATA_DIR": str(tmp_path / "data"),
        "PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm"),
        # A hundredth of a second unread is enough, so that the test need not wait a month.
        "PINVAULT_POLICY_WARM_AFTER_UNREAD_DAYS": str(0.01 / DAY),
        "PINVAULT_POLICY_MIN_COPIES": "1",
        "PINVAULT_POLICY_HOT_CAPACITY_BYTES": str(1 << 30),
    }
    config = config_module.load(environ=environ)
    (tmp_path / "data").mkdir()
    warm = WarmTier(tmp_path / "warm")
    with TierManager(
        [("hot", HotTier(config.hot_path)), ("warm", warm)],
        journal=tmp_path / "data" / "tiers.db",
        owned=[warm],
    ) as manager:
        sha256 = put_bytes(manager, b"x" * 5000).sha256
    time.sleep(0.05)

    assert run_tier_command(["tier", "migrate", "--dry-run", "--json"], environ) == 0
    (move,) = json.loads(capsys.readouterr().out)["moves"]
    assert (move["digest"], move["from"], move["to"], move["note"]) == (
        str(sha256),
        "hot",
        "warm",
        "",
    )
    assert move["reason"].startswith("stored ") and "never read (warm after" in move["reason"]
    # A dry run moves nothing.
    assert run_tier_command(["tier", "status", "--json"], environ) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["tiers"] == {"hot": {"blobs": 1, "bytes": 5000}, "warm": {"blobs": 0, "bytes": 0}}

    # Run as a person at a terminal runs it: the moves on standard output, progress beside.
    done, shown = run_on_terminal(["tier", "migrate"], command_env(extra=environ))
    assert done.returncode == 0, shown
    assert re.search(r"tier migrate \[█{30}\] 100\.0% 1 blobs", shown), shown
    out = done.stdout.decode()
    assert f"{sha256}  4.9 KiB  hot -> warm: stored " in out
    assert "copied 1 (4.9 KiB), removed 1 (4.9 KiB), kept 0, failed 0" in out
    assert run_tier_command(["tier", "status", "--json"], environ) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["tiers"] == {"hot": {"blobs": 0, "bytes": 0}, "warm": {"blobs": 1, "bytes": 5000}}
    assert os.listdir(tmp_path / "data" / "hot" / "blobs" / str(sha256.hex[:2])) == []


def test_vault_serve_with_a_warm_tier_stores_reads_and_stops_cleanly(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(env={"PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm-tier")})
    (tmp_path / "a.txt").write_bytes(b"warm or hot\n")
    digest = server.run("put", str(tmp_path / "a.txt")).ok().stdout.split()[0]
    assert server.run("get", digest).ok().output == b"warm or hot\n"
    assert (tmp_path / "warm-tier" / "index.sqlite").exists()
    assert (server.data_dir / "tiers.db").exists()


@dataclass
class TwoCopies:
    """A served vault with a warm tier holding one pinned blob on hot and warm."""

    server: VaultServer
    digest: str
    data: bytes
    shown: str  # what `vault verify --blobs` said once both copies were there

    @property
    def hot_copy(self) -> Path:
        hex_ = self.digest.partition(":")[2]
        return self.server.data_dir / "hot" / "blobs" / hex_[:2] / hex_

    def damage_hot_copy(self, offset: int) -> None:
        copy = self.hot_copy
        copy.chmod(0o644)
        damaged = bytearray(copy.read_bytes())
        damaged[offset] ^= 0x10
        copy.write_bytes(damaged)


def two_copies(start_vault: StartVault, tmp_path: Path, seed: int, **env: str) -> TwoCopies:
    server = start_vault(
        env={
            "PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm-tier"),
            # Unread for a second: warm; two copies wanted, so the hot copy stays too.
            "PINVAULT_POLICY_WARM_AFTER_UNREAD_DAYS": str(1 / DAY),
            "PINVAULT_POLICY_MIN_COPIES": "2",
            "PINVAULT_POLICY_MIGRATE_INTERVAL": "0.2",
            **env,
        }
    )
    data = content(LARGE, seed=seed)
    (tmp_path / "model.bin").write_bytes(data)
    digest = server.run("put", str(tmp_path / "model.bin")).ok().stdout.split()[0]
    server.run("pin", "artefact", digest).ok()
    deadline = time.monotonic() + 60
    while True:
        shown = server.run("verify", "--blobs").ok().stdout
        if f"blob {digest}: 2 copies" in shown:
            return TwoCopies(server, digest, data, shown)
        assert time.monotonic() < deadline, shown
        time.sleep(0.3)


def test_verify_blobs_reports_each_copy_and_the_repairs_recorded(
    start_vault: StartVault, tmp_path: Path
) -> None:
    vault = two_copies(start_vault, tmp_path, seed=7)
    server, digest = vault.server, vault.digest
    line = next(x for x in vault.shown.splitlines() if x.startswith(f"  blob {digest}:"))
    assert "hot (verified 20" in line and "warm (verified 20" in line
    assert "repair" not in line

    vault.damage_hot_copy(len(vault.data) // 2)

    shown = server.run("verify", "--blobs").ok().stdout
    assert "blobs: 1 pinned blobs checked, 0 failed" in shown
    assert f"blob {digest}: 2 copies" in shown and "; 1 repair recorded" in shown
    assert server.run("get", digest).ok().output == vault.data


def test_vault_scrub_while_the_server_holds_the_tiers_scrubs_through_it(
    start_vault: StartVault, tmp_path: Path
) -> None:
    # No background scrubber: only the one asked for finds the damage.
    vault = two_copies(start_vault, tmp_path, seed=11, PINVAULT_POLICY_SCRUB_WINDOW_DAYS="0")
    server, data, copy = vault.server, vault.data, vault.hot_copy
    vault.damage_hot_copy(CHUNK_SIZE + 5)

    # As an operator on the vault's host runs it, with the server's own configuration.
    host = {
        "PINVAULT_DATA_DIR": str(server.data_dir),
        "PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm-tier"),
    }
    scrub = server.run("scrub", "--json", env=host)
    assert scrub.returncode == 0, scrub.describe()
    assert "scrubbing through it" in scrub.stderr
    totals = scrub.json()
    assert (totals["copies"], totals["faults"], totals["repaired"]) == (2, 1, 1), totals
    assert totals["bytes"] == 2 * len(data)
    assert copy.read_bytes() == data
    again = server.run("scrub", "--json", env=host).ok().json()
    assert (again["faults"], again["repaired"], again["unrepairable"]) == (0, 0, 0), again
    # Migration still needs the tiers to itself.
    refused = server.run("tier", "migrate", env=host)
    assert refused.returncode != 0 and "stop it to run this command" in refused.stderr
