"""The shipped HAProxy configuration (deploy/haproxy/pinvault.cfg) in front of a real `vault
serve`: one address that opens connections by the hundred is held to its share, and a caller
at another address is served beside it."""

from __future__ import annotations

import contextlib
import socket
import time

from tests.conftest import StartVault
from tests.services.haproxy import HAProxy
from tests.test_hostile_callers import PREFACE
from vault.client import VaultClient

# The connections one address may hold through the proxy (the configuration's `conn_cur`).
PER_ADDRESS = 256


def first_answer(sock: socket.socket) -> bytes | None:
    """What the proxy has sent on `sock` so far; None if it closed or reset it."""
    sock.settimeout(2)
    try:
        return sock.recv(65536) or None
    except (ConnectionResetError, BrokenPipeError):
        return None


def test_one_address_holds_at_most_its_share_of_connections_and_others_are_served(
    start_vault: StartVault,
) -> None:
    server = start_vault()
    # The tiles backends are not under test: an address where nothing listens.
    proxy = HAProxy([server.address] * 3, ["127.0.0.1:9"] * 3).start()
    held: list[socket.socket] = []
    try:
        host, port = proxy.grpc_address.rsplit(":", 1)
        # Another address of this host's loopback stands for a second machine.
        for _ in range(PER_ADDRESS + 100):
            sock = socket.create_connection((host, int(port)), source_address=("127.0.0.2", 0))
            held.append(sock)
            with contextlib.suppress(ConnectionResetError):  # refused already
                sock.sendall(PREFACE)
        # Those let in are answered with HTTP/2's settings; those past the share are reset.
        time.sleep(0.5)
        closed = [first_answer(sock) is None for sock in held]
        assert closed.count(True) == 100, f"{closed.count(True)} of {len(held)} closed"

        with VaultClient(proxy.grpc_address, timeout=60) as client:
            assert client.put(b"served beside the flood").created
    finally:
        for sock in held:
            sock.close()
        proxy.stop()
