"""A vault that keeps serving one old, cosigned checkpoint hides every entry appended since (a
freeze); a client that requires witnesses refuses a checkpoint whose newest cosignature is
older than client.max_witness_age, naming the age and the witness. The witness is the real
transparency-dev omniwitness, made to stop answering so that no fresh cosignature comes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.witness import WitnessServer
from tests.test_witness import pin_some, vault_env, vault_key, witness, witness_program
from vault.client import VaultClient
from vault.errors import VerificationError

__all__ = ["vault_key", "witness", "witness_program"]
AGE = 3.0


def test_a_frozen_vault_is_refused_once_its_newest_cosignature_is_too_old(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path, tmp_path: Path
) -> None:
    server = start_vault(env=vault_env(vault_key, witness, timeout=1.0))
    key = str(witness.key)
    with VaultClient(server.address, witnesses=[key], timeout=60) as client:
        pin_some(client, 2, "a")
        _, (cosignature,) = client.witnessed()
    # No witness answers from now on: whatever the vault serves keeps its old cosignatures.
    witness.freeze()
    try:
        time.sleep(max(0.0, cosignature.timestamp + AGE + 1.5 - time.time()))
        with (
            VaultClient(server.address, witnesses=[key], max_witness_age=AGE, timeout=60) as late,
            pytest.raises(VerificationError) as caught,
        ):
            late.checkpoint()
        said = str(caught.value)
        assert said.startswith("the checkpoint of size 2 was last cosigned ")
        assert f"(by witness {witness.key.label} at " in said
        assert "more than the 3s allowed (client.max_witness_age)" in said

        state = tmp_path / "state"
        run = server.run(
            "verify", "--witness", key, "--max-witness-age", str(AGE), state_home=state
        )
        line = run.error_line()
        assert line.startswith("vault: the checkpoint of size 2 was last cosigned ")
        assert f"by witness {witness.key.label}" in line and "more than the 3s allowed" in line
        env = {"PINVAULT_CLIENT_WITNESSES": key, "PINVAULT_CLIENT_MAX_WITNESS_AGE": str(AGE)}
        line = server.run("checkpoint", env=env, state_home=state).error_line()
        assert line.startswith("vault: the checkpoint of size 2 was last cosigned ")
        # The default allows a day: the same checkpoint is believed.
        server.run("verify", "--witness", key, state_home=tmp_path / "default").ok()
    finally:
        witness.thaw()
