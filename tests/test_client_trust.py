"""A client trusts no vault blindly: it keeps the last checkpoint it verified and accepts a newer
one only with a consistency proof, so a vault that rolled back or rewrote its history, or signs
with another key, is refused by the command and by the Python client alike."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, run_vault
from vault.client import VaultClient
from vault.errors import RollbackError, VerificationError
from vault.ledger.checkpoint import SigningKey, Verifier

ORIGIN = "trust.test/ledger"
ENV = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}


def trusted(server: VaultServer, state_home: Path | None = None) -> dict[str, Any]:
    (path,) = server.trust_files(state_home)
    assert path.name == f"trust-{server.address.replace(':', '_')}.json"
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
