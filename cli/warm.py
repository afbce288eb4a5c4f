"""One warm, trust-keeping vault client for a long-running command that answers a scheduler
(the Slurm admission agent, the Kubernetes webhook): connected once, and replaced when its vault
went away, since gRPC backs off reconnecting for up to two minutes and a restarted vault must
not be refused for that long."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final, TypeVar

import grpc

from vault.client import VaultClient
from vault.config import Config
from vault.errors import Unavailable

Connect = Callable[[Config], VaultClient]
T = TypeVar("T")

# Each vault call's deadline unless client.timeout sets one: below the callers' own (the Slurm
# plugin's 5 s, the API server's webhook timeout), so that they hear the vault's UNAVAILABLE.
VAULT_SECONDS: Final = 4.0
# Pauses before asking the vault again on a new channel after UNAVAILABLE: a vault that is
# down is told in well under a second, one that is back is asked.
RENEW_PAUSES: Final = (0.05, 0.25)

log = logging.getLogger("pinvault.warm")


class WarmClient:
    def __init__(self, config: Config, connect: Connect) -> None:
        if not config.client.timeout:
            # A vault that accepts and never answers must not hold a caller forever.
            config = replace(config, client=replace(config.client, timeout=VAULT_SECONDS))
        self._config = config
        self._timeout = config.client.timeout
        self._connect = connect
        self._lock = threading.Lock()
        self._client = connect(config)

    def close(self) -> None:
        self._client.close()

    def warm_up(self) -> None:
        """Connect now rather than at the first request; a vault that is not up yet only delays
        that, and is reported."""
        try:
            grpc.channel_ready_future(self._client.channel).result(timeout=self._timeout)
        except grpc.FutureTimeoutError:
            log.warning("vault %s cannot be reached yet", self._client.target)

    def call(self, ask: Callable[[VaultClient], T]) -> T:
        """`ask` of the client; on UNAVAILABLE, again on a new channel, a few times."""
        client = self._client
        for pause in RENEW_PAUSES:
            try:
                return ask(client)
            except Unavailable:
                # Again on a new channel: the vault may be back while this one backs off.
                client = self._renew(client, pause)
        return ask(client)

    def _renew(self, stale: VaultClient, pause: float) -> VaultClient:
        with self._lock:
            # Concurrent requests that failed together make one new client, not one each.
            if self._client is stale:
                # gRPC shares connections between channels to the same address and tears a
                # closed channel's down in the background: closed first, and a moment given,
                # so that the new channel connects anew rather than join the backing-off one.
                stale.close()
                time.sleep(pause)
                self._client = self._connect(self._config)
            return self._client
