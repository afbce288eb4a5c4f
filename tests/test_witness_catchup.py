"""Two `vault serve` of one ledger on one PostgreSQL, both submitting its checkpoints to the same
real witness (omniwitness): when the witness has already cosigned a larger checkpoint that the
other server submitted (it answers 409 with its size), a server catches up from the database
and has the larger checkpoint cosigned, rather than serving one without cosignatures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services import witness as witness_service
from tests.services.vault_server import VaultServer
from tests.services.witness import WitnessServer
from vault.client import VaultClient
from vault.ledger.checkpoint import SigningKey
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

pytestmark = pytest.mark.postgres

ORIGIN = "catchup.test/ledger"


@pytest.fixture
def vault_key(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint.key"
    SigningKey.generate(ORIGIN).save(path)
    return path


@pytest.fixture
def witness(vault_key: Path) -> Iterator[WitnessServer]:
    witness_service.build()
    with WitnessServer({ORIGIN: str(SigningKey.load(vault_key).verifier())}) as server:
        yield server


def pin(server: VaultServer, data: bytes) -> str:
    """Put `data` and pin it, with plain calls: the vault signs no checkpoint for them."""
    with server.client() as client:
        digest = str(client.put(data).blob.sha256)
    with grpc.insecure_channel(server.address) as channel:
        rpc.LedgerStub(channel).Pin(
            pb.PinRequest(kind="dataset", subjects=[digest], author="catchup")
        )
    return digest


def test_a_server_behind_the_witness_catches_up_and_serves_cosigned_checkpoints(
    start_vault: StartVault, postgres_url: str, witness: WitnessServer, vault_key: Path
) -> None:
    env = {
        "PINVAULT_LEDGER_ORIGIN": ORIGIN,
        "PINVAULT_LEDGER_KEY_FILE": str(vault_key),
        "PINVAULT_WITNESSES_ENDPOINTS": witness.endpoint,
        "PINVAULT_WITNESSES_TIMEOUT": "5",
        # No periodic checkpoint: each server signs only when a caller needs it, so that the
        # order below is the order the witness sees.
        "PINVAULT_LEDGER_CHECKPOINT_INTERVAL": "3600",
    }
    a = start_vault("a", database=postgres_url, env=env)
    b = start_vault("b", database=postgres_url, env=env)
    on_a, on_b = pin(a, b"pinned through a"), pin(b, b"pinned through b")

    def requiring(address: str) -> VaultClient:
        return VaultClient(address, witnesses=[str(witness.key)], timeout=60)

    # B's look-up needs the tree of 2 entries, which the witness cosigns.
    with requiring(b.address) as client:
        assert [p.entry.index for p in client.lookup(on_b)] == [1]
        checkpoint, cosignatures = client.witnessed()
        assert checkpoint.size == 2
        assert [c.witness for c in cosignatures] == [witness.key]
    # A's look-up needs only its own entry, in the tree of 1 entry A knows of; the witness has
    # cosigned 2 since, so A signs 2 from the database and serves that, cosigned.
    with requiring(a.address) as client:
        assert [p.entry.index for p in client.lookup(on_a)] == [0]
        checkpoint, cosignatures = client.witnessed()
        assert checkpoint.size == 2
        assert [c.witness for c in cosignatures] == [witness.key]
