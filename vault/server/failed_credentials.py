"""Failed credentials counted per address, shared by every edge that checks a credential (the
gRPC gate and the explorer), so that a caller who keeps failing is told to back off."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from typing import Final

from vault.config import Config

# Addresses whose failed credentials are counted at once, the least recently seen forgotten
# first (a forgotten address starts again with a full bucket).
FAILURE_ADDRESSES: Final = 4096


def caller_address(peer: str) -> str:
    """Whom failed credentials are counted against: the caller's IPv4 address, its IPv6 /64
    (one host's share), or every Unix-socket caller alike. `peer` is gRPC's (`ipv4:H:P`,
    `ipv6:[H]:P`, `unix:PATH`) or a bare IP address (the explorer's)."""
    kind, sep, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and sep:
        host = rest.rpartition(":")[0].strip("[]")
    elif kind.startswith("unix") and sep:
        return "unix"
    else:
        host = peer.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host or kind
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class FailedCredentials:
    """A token bucket of failed credentials per address: `burst` at most, refilled at `rate` a
    second. It decides only how a failed credential is answered: checking a credential costs
    the vault no query, so a valid one is never held back by its address's failures."""

    def __init__(self, burst: int = 30, rate: float = 2.0, addresses: int = FAILURE_ADDRESSES):
        self.burst = float(burst)
        self.rate = rate
        self.addresses = addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # The explorer's threads and the gRPC event loop count into the same buckets.
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config) -> FailedCredentials:
        return cls(config.server.failed_auth_burst, config.server.failed_auth_rate)

    def _level(self, address: str, now: float) -> float:
        level, since = self._buckets.get(address, (self.burst, now))
        return min(self.burst, level + (now - since) * self.rate)

    def failed(self, address: str) -> bool:
        """Count one failure against `address`; whether it was within the address's bucket
        (False: the address had already failed too often)."""
        now = time.monotonic()
        with self._lock:
            level = self._level(address, now)
            self._buckets[address] = (max(0.0, level - 1.0), now)
            self._buckets.move_to_end(address)
            while len(self._buckets) > self.addresses:
                self._buckets.popitem(last=False)
        return level >= 1.0
