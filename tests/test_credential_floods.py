"""A flood of made-up tokens from the address that honest callers share (a login node, a NAT,
every Unix-socket caller), against a real `vault serve` asking for credentials: the flood is
refused, and past a few failures told to back off, while a valid token the server has never
seen is served from the same address at once, over gRPC and over the explorer's API alike. A
revoked token stops working; local mode says that tokens need credentials mode."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, run_vault
from tests.test_access import CREDENTIALS, Vault, first_admin_token
from tests.test_explorer import explorer_url, get
from vault.client import Credentials, VaultClient
from vault.errors import Unauthenticated
from vault.server.tokens import TOKEN_REFRESH_SECONDS
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc


def made_up_token() -> str:
    return f"pv_{os.urandom(6).hex()}_{os.urandom(32).hex()}"


def offline_token(server: VaultServer, name: str, role: str) -> str:
    """A token written straight into the vault's database: the running server never saw it,
    as after a restart, or when another server of the vault made it."""
    return (
        run_vault(
            "token", "create", "--offline", "--name", name, "--team", "vision", "--role", role,
            env={"PINVAULT_DATA_DIR": str(server.data_dir), **CREDENTIALS},
            state_home=server.state_home,
        )
        .ok()
        .stdout.strip()
    )  # fmt: skip


class Flood:
    """An anonymous caller sending made-up tokens as fast as the server answers, until
    stopped; the status codes it was answered."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.codes: list[grpc.StatusCode] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stat = rpc.StoreStub(channel).Stat
            while not self.stop.is_set():
                try:
                    stat(
                        pb.StatRequest(digest="sha256:" + "0" * 64),
                        metadata=(("authorization", f"Bearer {made_up_token()}"),),
                        timeout=10,
                    )
                except grpc.RpcError as exc:
                    self.codes.append(exc.code())

    def __enter__(self) -> Flood:
        self.thread.start()
        deadline = time.monotonic() + 30
        # Until the address's allowance is spent: from now on the flood is refused outright.
        while grpc.StatusCode.RESOURCE_EXHAUSTED not in self.codes:
            assert time.monotonic() < deadline, self.codes[-5:]
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


@pytest.fixture
def vault(start_vault: StartVault) -> Vault:
    return Vault(start_vault(env=CREDENTIALS))


def test_a_valid_token_is_served_while_a_flood_from_its_address_is_refused(
    vault: Vault,
) -> None:
    digest = str(vault.admin.put(b"a blob").blob.sha256)
    # Neither token has been presented to the server yet.
    made_by_server = vault.token("alice", "vision", "writer")
    made_offline = offline_token(vault.server, "bob", "reader")
    with Flood(vault.server.address) as flood:
        # A token made elsewhere is known within the refresh interval, flood or not.
        time.sleep(TOKEN_REFRESH_SECONDS + 0.2)
        for secret in (made_by_server, made_offline):
            with vault.client(secret) as client:
                assert client.stat(digest).blob.size == 6
        refused_during = len(flood.codes)
        time.sleep(0.5)
        # The flood is still being refused as this happens.
        assert len(flood.codes) > refused_during
    assert set(flood.codes) == {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
    # Past the default allowance (30, then 2 a second) every refusal says to back off.
    assert flood.codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > len(flood.codes) / 2


def test_a_token_revoked_elsewhere_is_refused_within_the_refresh_interval(vault: Vault) -> None:
    secret = vault.token("carol", "vision", "reader")
    digest = str(vault.admin.put(b"seen").blob.sha256)
    with vault.client(secret) as carol:
        assert carol.stat(digest).blob.size == 4
        # Revoked in the database by another process, as another server of the vault does.
        token_id = secret.split("_")[1]
        with sqlite3.connect(vault.server.data_dir / "vault.db") as db:
            db.execute(
                "UPDATE tokens SET revoked = '2030-01-01T00:00:00Z' WHERE token_id = ?",
                (token_id,),
            )
        time.sleep(TOKEN_REFRESH_SECONDS + 0.2)
        with pytest.raises(Unauthenticated, match=f"token pv_{token_id} is unknown or revoked"):
            carol.stat(digest)


def test_the_explorer_refuses_a_flood_of_made_up_tokens_and_serves_a_valid_one(
    tmp_path: Path,
) -> None:
    with VaultServer(
        tmp_path / "vault", env=CREDENTIALS, serve_args=("--explorer-http", "127.0.0.1:0")
    ) as server:
        admin = first_admin_token(server)
        with VaultClient(server.address, credentials=Credentials(token=admin), timeout=60) as c:
            image = str(c.put(b"an image").blob.sha256)
            c.pin("image", image)
        reader = offline_token(server, "ann", "reader")
        api = f"{explorer_url(server)}api/lookup?digest={image}"
        statuses = [
            get(api, {"Authorization": f"Bearer {made_up_token()}"}).status for _ in range(60)
        ]
        # The same allowance as the gRPC gate's: 30 failures, then 2 a second.
        assert set(statuses) == {401, 429}, statuses
        assert statuses[:30] == [401] * 30
        assert statuses.count(429) >= 20
        refused = get(api, {"Authorization": f"Bearer {made_up_token()}"})
        assert refused.status == 429
        assert "too many failed credentials" in refused.error()
        # A valid token the explorer has never seen is served from the same address.
        time.sleep(TOKEN_REFRESH_SECONDS + 0.2)
        answer = get(api, {"Authorization": f"Bearer {reader}"})
        assert answer.status == 200, answer.body


def test_in_local_mode_token_commands_say_tokens_need_credentials_mode(
    vault_server: VaultServer,
) -> None:
    shown = vault_server.run("token", "list")
    assert shown.returncode == 78
    assert shown.error_line() == (
        "vault: FAILED_PRECONDITION: this vault has no tokens: they need auth.mode = "
        "\"credentials\" in the vault's configuration (local mode serves only its host's one "
        "user)"
    )
    shown = vault_server.run("token", "create", "--name", "x", "--team", "t", "--role", "reader")
    assert shown.returncode == 78
    assert "FAILED_PRECONDITION" in shown.error_line()
