"""Look-ups and 1 KiB puts and gets beside stalled streams: p50 and p99 with none open, then
with 100 open (half puts that send nothing, half gets of a 32 MiB blob that are never read),
from the same server in the same run. The goal: p99 under 100 ms with them open.

    uv run python -m bench.stalled [--stalled 100] [--calls 300]

`--no-limits` leaves the [server] stream settings unset, to run against a vault that has none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from bench.common import vault_server
from vault.client import VaultClient
from vault.client.reader import read_all
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

GOAL_P99 = 0.100


def percentiles(seconds: list[float]) -> tuple[float, float]:
    return statistics.median(seconds), statistics.quantiles(seconds, n=100)[98]


def timed(fn: Callable[[], Any], calls: int, limit: float) -> list[float]:
    """Up to `calls` timings of `fn`; a call that fails or passes `limit` counts as `limit`."""
    taken = []
    for _ in range(calls):
        began = time.perf_counter()
        try:
            fn()
        except Exception:  # refused or timed out: counted at the limit
            taken.append(limit)
            continue
        taken.append(min(time.perf_counter() - began, limit))
    return taken


def measure(client: VaultClient, small: str, calls: int, limit: float) -> dict[str, list[float]]:
    return {
        "look-up": timed(lambda: client.lookup(small), calls, limit),
        "1 KiB put": timed(lambda: client.put(os.urandom(1024)), calls, limit),
        "1 KiB get": timed(lambda: read_all(client.open(small)), calls, limit),
    }


class Stalled:
    """Streams opened and then left: puts that send nothing after their header, gets never
    read (on a channel without BDP probing, so each keeps a 64 KiB window)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
        self.store = rpc.StoreStub(self.channel)
        self.release = threading.Event()
        self.calls: list[Any] = []

    def open(self, count: int, big: str) -> None:
        for n in range(count):
            if n % 2:
                self.calls.append(self.store.Put.future(self._silent(), timeout=600))
            else:
                self.calls.append(self.store.Get(pb.GetRequest(digest=big), timeout=600))

    def _silent(self) -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader())
        self.release.wait()

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stalled", type=int, default=100)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--no-limits", action="store_true")
    args = parser.parse_args()
    # Local mode: every stream is the one local user's, so let it hold them all.
    env = {} if args.no_limits else {"PINVAULT_SERVER_STREAMS_PER_CALLER": str(args.stalled + 50)}
    limit = 5.0
    with vault_server(env=env) as server, VaultClient(server.address, timeout=limit) as client:
        big = str(client.put(os.urandom(32 << 20)).blob.sha256)
        small = str(client.put(os.urandom(1024)).blob.sha256)
        client.pin("artefact", small)
        measure(client, small, 20, limit)  # warm-up
        quiet = measure(client, small, args.calls, limit)
        stalled = Stalled(server.address)
        try:
            stalled.open(args.stalled, big)
            time.sleep(2)
            busy = measure(client, small, args.calls, limit)
            still_open = sum(not call.done() for call in stalled.calls)
        finally:
            stalled.close()
    print(f"{args.calls} calls each; {still_open} of {args.stalled} stalled streams still open")
    print(f"{'':<10} {'no stalled streams':>22} {f'{args.stalled} stalled streams':>24}  goal p99")
    print(f"{'':<10} {'p50 ms':>10} {'p99 ms':>11} {'p50 ms':>12} {'p99 ms':>11}")
    for what in quiet:
        q50, q99 = percentiles(quiet[what])
        b50, b99 = percentiles(busy[what])
        verdict = "ok" if b99 < GOAL_P99 else "MISSED"
        print(
            f"{what:<10} {q50 * 1e3:>10.1f} {q99 * 1e3:>11.1f} {b50 * 1e3:>12.1f} "
            f"{b99 * 1e3:>11.1f}  < {GOAL_P99 * 1e3:.0f} ms {verdict}"
        )
    if any(t >= limit for ts in busy.values() for t in ts):
        print(f"(calls that failed or took {limit:.0f} s or more are counted at {limit:.0f} s)")


if __name__ == "__main__":
    main()
