"""A vault that keeps one copy of each blob (the hot tier alone): `vault verify --blobs` checks
every file of every pinned dataset and names the damaged one by path and dataset, the journal
then knows it damaged (what admission asks), and `vault repair DIGEST --from PATH` rewrites it
from a file that hashes to its digest, through the real `vault serve` and commands; and the
journal's query of known damage, on its own and under a tier manager with real tiers."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer
from tests.test_dataset import sha256, write
from tests.test_tier_manager import flip_bit
from tests.tier_contract import content
from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.placements import JOURNAL_FILE_NAME, LOST, REWRITE_FAILED, Journal
from vault.digest import Digest
from vault.errors import IntegrityError
from vault.store.protocol import get_bytes, put_bytes

MEMBER = "train/part-1.bin"


def digest(text: str) -> Digest:
    return Digest.parse(text)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened = Journal(tmp_path / "tiers.db")
    yield opened
    opened.close()


# -- the query ---------------------------------------------------------------------------------


def test_a_blob_is_known_damaged_only_while_every_copy_of_it_is(journal: Journal) -> None:
    lost, shadowed, verified_since, rewritten, failed, healthy = (
        Digest("sha256", f"{n:064x}") for n in range(1, 7)
    )
    asked = [lost, shadowed, verified_since, rewritten, failed, healthy]
    assert journal.damaged(asked) == set()

    # The one copy lost: damaged.
    journal.record(lost, "hot", 0, "stored copy is damaged", LOST)
    # Lost on hot, but a mirror's copy was never found bad (it was out of reach): maybe good.
    journal.place(shadowed, "hot", size=1, verified=time.time() - 60)
    journal.place(shadowed, "mirror-a", size=1)
    journal.record(shadowed, "hot", None, "missing", LOST)
    # Lost, then found intact by a later check (a put rewrote it): no longer damaged.
    journal.record(verified_since, "hot", None, "missing", LOST)
    # Lost, then rewritten: the last record of the copy is the repair.
    journal.record(rewritten, "hot", None, "damaged", LOST)
    journal.record(rewritten, "hot", None, "damaged", "rewrote it from the file /tmp/x")
    # A rewrite that failed, on the only tier holding it.
    journal.place(failed, "warm", size=1, verified=time.time() - 60)
    journal.record(failed, "warm", None, "damaged", "deleted the damaged copy and rewrote it")
    journal.record(failed, "warm", None, "damaged", f"{REWRITE_FAILED}: disk full")
    time.sleep(0.01)
    journal.place(verified_since, "hot", size=1, verified=time.time())

    assert journal.damaged(asked) == {lost, failed}
    # Only digests asked about are answered.
    assert journal.damaged([failed, healthy]) == {failed}
    assert journal.damaged([]) == set()


def test_a_tier_manager_knows_a_blob_damaged_on_every_tier_until_one_copy_is_good(
    tmp_path: Path,
) -> None:
    first, second = HotTier(tmp_path / "first"), HotTier(tmp_path / "second")
    with TierManager([("hot", first), ("warm", second)], journal=tmp_path / "tiers.db") as manager:
        data = content(3 << 20, seed=4)
        both = put_bytes(manager, data).sha256
        put_bytes(second, data)
        one = put_bytes(manager, content(5000, seed=5)).sha256

        flip_bit(first, both, 10)
        flip_bit(second, both, 2 << 20)
        flip_bit(first, one, 100)
        for sha in (both, one):
            with pytest.raises(IntegrityError, match=f"no tier holds a good copy of {sha}"):
                manager.verify(sha)
        assert manager.damaged([both, one]) == {both, one}

        # A good copy of one of them comes back on the second tier: it is no longer damaged,
        # and a check repairs the first tier's copy from it.
        second.delete(both)
        put_bytes(second, data)
        assert manager.verify(both).size == len(data)
        assert manager.damaged([both, one]) == {one}
        assert get_bytes(first, both) == data


# -- through `vault serve` and the commands ----------------------------------------------------


def dataset_of(server: VaultServer, root: Path) -> tuple[str, dict[str, bytes]]:
    """A dataset of a few files added with `vault dataset add`: its digest and its files."""
    files = {
        "README.md": b"a dataset kept once\n",
        MEMBER: os.urandom(70_000),
        "train/part-2.bin": os.urandom(300_000),
    }
    for path, data in files.items():
        write(root, path, data)
    printed = server.run("dataset", "add", str(root)).ok().stdout
    return printed.strip(), files


def journal_of(server: VaultServer) -> contextlib.closing[Journal]:
    """The vault's tier journal, opened beside the running server as a host command opens it."""
    return contextlib.closing(Journal(server.data_dir / JOURNAL_FILE_NAME))


def host_env(server: VaultServer) -> dict[str, str]:
    """What a host command (`vault repair`) needs to find the vault's data folder."""
    return {"PINVAULT_DATA_DIR": str(server.data_dir)}


def test_verify_blobs_names_a_damaged_dataset_file_and_vault_repair_rewrites_it(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    dataset, files = dataset_of(server, tmp_path / "source")
    member = sha256(files[MEMBER])
    stored = server.blob_path(member)
    damaged = bytearray(stored.read_bytes())
    damaged[40_000] ^= 0x10
    stored.write_bytes(damaged)

    run = server.run("verify", "--blobs")
    assert run.returncode == 65, run.describe()
    assert (
        f"  FAIL blob {member}: file {MEMBER} of dataset {dataset}: stored copy of {member} "
        "is damaged"
    ) in run.stdout, run.stdout
    # Every blob the dataset pin reaches was checked: its manifest and its three files.
    assert "blobs: 4 pinned blobs checked, 1 failed" in run.stdout, run.stdout
    # The journal knows it, for admission to refuse the dataset without reading its files.
    others = [sha256(data) for path, data in files.items() if path != MEMBER]
    with journal_of(server) as journal:
        assert journal.damaged([digest(d) for d in [member, *others]]) == {digest(member)}

    wrong = tmp_path / "wrong.bin"
    wrong.write_bytes(files[MEMBER][:-1] + b"?")
    refused = server.run("repair", member, "--from", str(wrong), env=host_env(server))
    assert refused.error_line() == (
        f"vault: INVALID_ARGUMENT: {wrong} hashes to {sha256(wrong.read_bytes())}, not "
        f"{member}: it is not that blob's content, and no copy was changed"
    )
    assert stored.read_bytes() == damaged

    original = tmp_path / "source" / MEMBER
    repaired = server.run("repair", member, "--from", str(original), env=host_env(server)).ok()
    lines = repaired.stdout.splitlines()
    assert lines[0].startswith(f"hot: stored copy of {member} is damaged: "), lines
    assert lines[0].endswith(f"; rewrote it from the file {original}"), lines
    assert lines[-1] == f"{member}: 1 copies rewritten, 0 failed"
    assert stored.read_bytes() == files[MEMBER]

    run = server.run("verify", "--blobs").ok()
    assert "blobs: 4 pinned blobs checked, 0 failed" in run.stdout, run.stdout
    assert server.run("get", member).ok().output == files[MEMBER]
    with journal_of(server) as journal:
        assert journal.damaged([digest(member)]) == set()
        last = journal.records(digest(member))[-1]
    assert (last.tier, last.action) == (
        "hot",
        f"deleted the damaged copy and rewrote it from the file {original}",
    )
    again = server.run("repair", member, "--from", str(original), env=host_env(server)).ok()
    assert again.stdout.splitlines() == [
        "hot: intact, left as it is",
        f"{member}: 0 copies rewritten, 0 failed",
    ]


def test_a_missing_dataset_file_is_reported_and_restored_from_a_file(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    dataset, files = dataset_of(server, tmp_path / "source")
    member = sha256(files[MEMBER])
    for path in server.blob_path(member).parent.glob(member.removeprefix("sha256:") + "*"):
        path.unlink()

    run = server.run("verify", "--blobs")
    assert run.returncode == 65, run.describe()
    assert (
        f"  FAIL blob {member}: file {MEMBER} of dataset {dataset}: catalogued but its bytes "
        "are missing"
    ) in run.stdout, run.stdout
    with journal_of(server) as journal:
        assert journal.damaged([digest(member)]) == {digest(member)}

    copy = tmp_path / "kept-elsewhere.bin"
    copy.write_bytes(files[MEMBER])
    repaired = server.run("repair", member, "--from", str(copy), env=host_env(server)).ok()
    first = repaired.stdout.splitlines()[0]
    assert first.startswith(f"hot: missing: blob {member} is not in the hot tier"), first
    assert first.endswith(f"; rewrote it from the file {copy}"), first
    assert server.run("verify", "--blobs").ok().stdout.count("FAIL") == 0
    assert server.blob_path(member).read_bytes() == files[MEMBER]

    unknown = sha256(b"never stored")
    (tmp_path / "unknown").write_bytes(b"never stored")
    missing = server.run(
        "repair", unknown, "--from", str(tmp_path / "unknown"), env=host_env(server)
    )
    assert missing.error_line() == (
        f"vault: NOT_FOUND: blob {unknown} is not in this vault (no tier holds it and the "
        "catalogue does not name it): store it with `vault put`"
    )
    absent = server.run("repair", member, "--from", str(tmp_path / "nowhere"), env=host_env(server))
    assert absent.error_line() == (
        f"vault: INVALID_ARGUMENT: cannot read {tmp_path / 'nowhere'}: No such file or directory"
    )


def test_admission_refuses_a_dataset_with_a_known_damaged_file_until_it_is_repaired(
    start_vault: StartVault, tmp_path: Path
) -> None:
    # Admission checks an input again after a second (its refusals are kept that long).
    server = start_vault(env={"PINVAULT_ADMISSION_VERIFY_INTERVAL": "1"})
    dataset, files = dataset_of(server, tmp_path / "source")
    member = sha256(files[MEMBER])
    stored = server.blob_path(member)
    damaged = bytearray(stored.read_bytes())
    damaged[40_000] ^= 0x10
    stored.write_bytes(damaged)
    image = "sha256:" + "1f" * 32
    with server.client() as client:
        client.pin("image", image, external=True)
    # The vault's own check finds the damage; admission then knows it without a read.
    assert server.run("verify", "--blobs").returncode == 65

    admit = ("admit", "--image", image, "--dataset", dataset, "--seed", "7")
    refused = server.run(*admit).error_line()
    assert refused == (
        f"vault: FAILED_PRECONDITION: dataset {dataset} has 1 of its 3 files' content known "
        f"damaged in the store (first: {MEMBER}): repair it with `vault repair DIGEST --from "
        "PATH`"
    )
    original = tmp_path / "source" / MEMBER
    server.run("repair", member, "--from", str(original), env=host_env(server)).ok()
    time.sleep(1.5)
    assert server.run(*admit).ok().stdout.startswith("admitted  run sha256:")
