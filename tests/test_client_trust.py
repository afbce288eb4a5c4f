"""A client trusts no vault blindly: it keeps the last checkpoint it verified and accepts a newer
one only with a consistency proof, so a vault that rolled back or rewrote its history, or signs
with another key, is refused by the command and by the Python client alike."""

from __future__ import annotations

import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultRun, VaultServer, run_vault
from vault.client import VaultClient
from vault.client.state import ledger_file_name
from vault.errors import RollbackError, VerificationError
from vault.ledger.checkpoint import SigningKey, Verifier

ORIGIN = "trust.test/ledger"
ENV = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}
# A checkpoint every few appends: concurrent clients then see many different sizes.
BUSY = {**ENV, "PINVAULT_LEDGER_CHECKPOINT_INTERVAL": "0.02"}


def trusted(server: VaultServer, state_home: Path | None = None) -> dict[str, Any]:
    (path,) = server.trust_files(state_home)
    assert path.name == ledger_file_name(ORIGIN, str(server.signing_key().verifier()))
    value = json.loads(path.read_text())
    assert isinstance(value, dict)
    return value


def pin_some(server: VaultServer, blob: str, count: int, history: str) -> None:
    """Append entries through a client of their own, which shares no state with the client
    under test."""
    with server.client() as client:
        for n in range(count):
            client.pin("dataset", blob, meta={"history": history, "n": str(n)})


def stored_blob(server: VaultServer, data: bytes = b"a dataset manifest") -> str:
    with server.client() as client:
        return str(client.put(data).blob.sha256)


def test_lookup_moves_the_trusted_checkpoint_forward_only_with_a_valid_proof(
    start_vault: StartVault,
) -> None:
    server = start_vault(env=ENV)
    blob = stored_blob(server)
    pin_some(server, blob, 2, "a")
    assert server.trust_files() == []
    server.run("lookup", blob).ok()
    assert trusted(server)["size"] == 2
    key = server.run("checkpoint", "--key").ok().stdout.strip()
    assert trusted(server)["verifier"] == key and trusted(server)["origin"] == ORIGIN

    pin_some(server, blob, 3, "a")
    lines = server.run("lookup", blob).ok().stdout.splitlines()
    assert lines[0] == f"5 entries pin {blob}"
    assert trusted(server)["size"] == 5

    # The Python client reads and moves the same state; a proof that does not lead to the
    # trusted root is refused, and the state stays where it was.
    (state,) = server.trust_files()
    pin_some(server, blob, 4, "a")
    with VaultClient(server.address, state=state) as client:
        genuine = client.ledger.Lookup

        def forged_proof(request: Any, **options: Any) -> Any:
            response = genuine(request, **options)
            assert response.consistency.hashes, "a proof from size 5 to 9 has hashes"
            response.consistency.hashes[0] = hashlib.sha256(b"forged").digest()
            return response

        client.ledger.Lookup = forged_proof
        with pytest.raises(VerificationError, match="did not prove that its ledger of size 9"):
            client.lookup(blob)
        assert trusted(server)["size"] == 5
        client.ledger.Lookup = genuine
        assert len(client.lookup(blob)) == 9
    assert trusted(server)["size"] == 9
    server.run("checkpoint").ok()


def test_a_vault_that_rolled_back_is_refused(start_vault: StartVault, tmp_path: Path) -> None:
    server = start_vault(env=ENV)
    blob = stored_blob(server)
    pin_some(server, blob, 2, "a")
    server.stop()
    backup = tmp_path / "backup"
    backup.mkdir()
    # The database's files and its subject index's runs, as a backup of them holds them.
    saved = [
        shutil.copytree(p, backup / p.name) if p.is_dir() else shutil.copy2(p, backup)
        for p in server.data_dir.glob("vault.db*")
    ]
    assert saved

    server.restart()
    pin_some(server, blob, 3, "a")
    server.run("lookup", blob).ok()
    assert trusted(server)["size"] == 5

    server.stop()
    for path in server.data_dir.glob("vault.db*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.copytree(backup, server.data_dir, dirs_exist_ok=True)
    server.restart()

    for command in (["lookup", blob], ["checkpoint"]):
        line = server.run(*command).error_line()
        assert "vault rolled back: it presents size 2 but size 5 was already verified" in line
    assert trusted(server)["size"] == 5

    (state,) = server.trust_files()
    with VaultClient(server.address, state=state) as client:
        with pytest.raises(RollbackError, match="rolled back"):
            client.lookup(blob)
        with pytest.raises(RollbackError, match="rolled back"):
            client.checkpoint()
    # Only the memory of size 5 gives it away: a client meeting this vault afresh accepts it.
    with server.client() as client:
        assert len(client.lookup(blob)) == 2


@pytest.mark.parametrize(
    ("rewritten_size", "error", "message"),
    [
        (4, RollbackError, "vault rewrote its history: size 4 was verified with root"),
        (7, VerificationError, "did not prove that its ledger of size 7 extends the size 4"),
    ],
)
def test_a_vault_that_rewrote_its_history_is_refused(
    start_vault: StartVault,
    tmp_path: Path,
    rewritten_size: int,
    error: type[VerificationError],
    message: str,
) -> None:
    original = start_vault("original", env=ENV)
    blob = stored_blob(original)
    pin_some(original, blob, 4, "original")
    original.run("lookup", blob).ok()
    assert trusted(original)["size"] == 4
    original.stop()

    # Another ledger under the same key and origin, served where the original was.
    data = tmp_path / "rewritten-data"
    data.mkdir()
    shutil.copy2(original.key_path, data)
    rewritten = start_vault("rewritten", data_dir=data, env=ENV, listen=original.address)
    assert rewritten.address == original.address
    assert stored_blob(rewritten) == blob
    pin_some(rewritten, blob, rewritten_size, "rewritten")

    for command in (["lookup", blob], ["checkpoint"]):
        run = run_vault(*command, server=original.address, state_home=original.state_home)
        assert message in run.error_line()
    assert trusted(original)["size"] == 4

    (state,) = original.trust_files()
    with VaultClient(rewritten.address, state=state) as client, pytest.raises(error, match=message):
        client.lookup(blob)


def test_a_vault_key_other_than_the_configured_or_trusted_one_is_refused(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(env=ENV)
    blob = stored_blob(server)
    pin_some(server, blob, 1, "a")
    real = str(server.signing_key().verifier())
    other = str(SigningKey.generate(ORIGIN).verifier())
    assert real != other

    first_use = tmp_path / "first-use"
    line = server.run(
        "lookup", blob, env={"PINVAULT_CLIENT_VERIFIER_KEY": other}, state_home=first_use
    ).error_line()
    assert f"the vault's checkpoint key is {real}, not the configured {other}" in line
    assert server.trust_files(first_use) == []

    pinned = tmp_path / "pinned"
    server.run("lookup", blob, env={"PINVAULT_CLIENT_VERIFIER_KEY": real}, state_home=pinned).ok()
    line = server.run(
        "checkpoint", env={"PINVAULT_CLIENT_VERIFIER_KEY": other}, state_home=pinned
    ).error_line()
    assert f"the client state trusts key {real}, not the configured {other}" in line

    with (
        VaultClient(server.address, verifier_key=other) as client,
        pytest.raises(VerificationError, match="not the configured"),
    ):
        client.lookup(blob)

    # The vault starts signing with a new key: the client that trusts the old one refuses it.
    server.stop()
    server.key_path.unlink()
    server.restart()
    assert str(server.signing_key().verifier()) != real
    label = Verifier.from_string(real).label
    line = server.run("lookup", blob, state_home=pinned).error_line()
    assert f"checkpoint is not signed by key {label}" in line


def test_verify_refuses_a_ledger_that_forks_from_the_checkpoint_this_client_verified(
    start_vault: StartVault, tmp_path: Path
) -> None:
    original = start_vault("original", env=ENV)
    blob = stored_blob(original)
    pin_some(original, blob, 2, "original")
    original.run("lookup", blob).ok()
    assert trusted(original)["size"] == 2
    # An audit that passes moves the trusted checkpoint to the one it audited.
    pin_some(original, blob, 2, "original")
    assert "ledger OK" in original.run("verify").ok().stdout.splitlines()
    assert trusted(original)["size"] == 4
    original.stop()

    # The ledger cut back to nothing and grown again with other entries, under the same key.
    data = tmp_path / "regrown-data"
    data.mkdir()
    shutil.copy2(original.key_path, data)
    regrown = start_vault("regrown", data_dir=data, env=ENV, listen=original.address)
    assert stored_blob(regrown) == blob
    pin_some(regrown, blob, 6, "regrown")

    # Every stored entry and signature of the regrown ledger is in order: only this client's
    # memory of size 4 gives it away.
    assert "ledger OK" in regrown.run("verify", state_home=tmp_path / "fresh").ok().stdout
    run = run_vault("verify", server=original.address, state_home=original.state_home)
    line = run.error_line(alone=False)
    assert "did not prove that its ledger of size 6 extends the size 4 already verified" in line
    assert trusted(original)["size"] == 4

    # Cut back below what was verified: a rollback, named with both sizes.
    regrown.stop()
    shutil.rmtree(data)
    data.mkdir()
    shutil.copy2(original.key_path, data)
    shorter = start_vault("shorter", data_dir=data, env=ENV, listen=original.address)
    stored_blob(shorter)
    pin_some(shorter, blob, 3, "shorter")
    run = run_vault("verify", server=original.address, state_home=original.state_home)
    assert "vault rolled back: it presents size 3 but size 4 was already verified" in (
        run.error_line(alone=False)
    )
    assert trusted(original)["size"] == 4


def test_one_ledger_at_two_addresses_has_one_trust_state_and_a_fork_at_either_is_caught(
    start_vault: StartVault, tmp_path: Path
) -> None:
    a = start_vault("a", env=ENV)
    blob = stored_blob(a)
    pin_some(a, blob, 2, "common")
    port = a.address.rsplit(":", 1)[1]
    state = tmp_path / "state"
    for address in (a.address, f"localhost:{port}"):
        run_vault("lookup", blob, server=address, state_home=state).ok()
    assert trusted(a, state)["size"] == 2

    # A second server on a copy of the ledger, each then appending entries of its own.
    a.stop()
    b = start_vault("b", data_dir=a.copy_data(tmp_path / "b-data"), env=ENV)
    a.restart()
    pin_some(a, blob, 2, "a")
    pin_some(b, blob, 3, "b")
    run_vault("lookup", blob, server=f"localhost:{port}", state_home=state).ok()
    assert trusted(a, state)["size"] == 4

    said = "did not prove that its ledger of size 5 extends the size 4 already verified"
    for command in (["lookup", blob], ["checkpoint"], ["verify"]):
        run = run_vault(*command, server=b.address, state_home=state)
        assert said in run.error_line(alone=False), command
    assert trusted(a, state)["size"] == 4
    folder = VaultClient(b.address, state_folder=state / "pinvault", timeout=60)
    with folder as client, pytest.raises(VerificationError, match=said):
        client.lookup(blob)
    # The second address is now held to the ledger it served: b restarted with another key
    # there is refused on the key, not trusted afresh.
    b.stop()
    b.key_path.unlink()
    b.restart()
    label = a.signing_key().verifier().label
    line = run_vault("checkpoint", server=b.address, state_home=state).error_line()
    assert f"checkpoint is not signed by key {label}" in line


def test_a_trust_state_kept_per_address_is_carried_over_to_the_ledgers(
    start_vault: StartVault,
) -> None:
    server = start_vault(env=ENV)
    blob = stored_blob(server)
    pin_some(server, blob, 3, "a")
    folder = server.state_home / "pinvault"
    kept_by_address = folder / f"trust-{server.address.replace(':', '_')}.json"
    with VaultClient(server.address, state=kept_by_address, timeout=60) as client:
        client.lookup(blob)
    kept = json.loads(kept_by_address.read_text())
    assert kept["size"] == 3

    pin_some(server, blob, 2, "a")
    assert len(server.run("lookup", blob).ok().stdout.splitlines()) == 7
    assert not kept_by_address.exists()
    assert trusted(server)["size"] == 5 and trusted(server)["root"] != kept["root"]
    servers = json.loads((folder / "servers.json").read_text())
    assert servers == {
        server.address: {"origin": ORIGIN, "verifier": str(server.signing_key().verifier())}
    }


def test_fifty_concurrent_pins_sharing_one_trust_state_all_succeed(
    start_vault: StartVault,
) -> None:
    server = start_vault(env=BUSY)
    blob = stored_blob(server)
    server.run("lookup", stored_blob(server, b"nothing pins this yet")).error_line()

    def pin(n: int) -> VaultRun:
        return server.run("pin", "dataset", blob, "--meta", f"n={n}", "--json")

    with ThreadPoolExecutor(50) as pool:
        runs = list(pool.map(pin, range(50)))
    failed = [run.describe() for run in runs if run.returncode != 0]
    assert failed == []
    indexes = sorted(run.json()["index"] for run in runs)
    assert indexes == list(range(50))
    with server.client() as client:
        assert sorted(p.entry.meta["n"] for p in client.lookup(blob)) == sorted(
            str(n) for n in range(50)
        )
    assert trusted(server)["size"] >= 50


@pytest.mark.parametrize("kept", ["in memory", "in a file"])
def test_one_client_shared_by_threads_pins_and_looks_up_without_false_rollbacks(
    start_vault: StartVault, tmp_path: Path, kept: str
) -> None:
    server = start_vault(env=BUSY)
    blob = stored_blob(server)
    state = tmp_path / "trust.json" if kept == "in a file" else None
    with VaultClient(server.address, state=state, timeout=60) as client:

        def pin(n: int) -> int:
            index = client.pin("dataset", blob, meta={"n": str(n)}).entry.index
            client.lookup(blob)
            return index

        with ThreadPoolExecutor(12) as pool:
            indexes = sorted(pool.map(pin, range(60)))
        assert indexes == list(range(60))
        assert client.checkpoint().size == 60
    if state is not None:
        assert json.loads(state.read_text())["size"] == 60
