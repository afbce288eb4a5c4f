"""Look-ups through HAProxy in front of three `vault serve` on one PostgreSQL (the shipped
deploy/haproxy/pinvault.cfg), beside the same look-ups sent straight to one of those servers,
in the same run, from h2load.

    uv run python -m bench.balanced [--pins 10000] [--seconds 5] [--rounds 3]

Three servers on one host share its cores: on two cores the balanced figure says what the
balancer and the servers' catch-up cost, not how far more hosts scale. Needs what the tests
need (PostgreSQL, HAProxy, h2load: scripts/test installs them)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import Load
from bench.h2load import unary_load
from bench.lookup import LOOKUP, populate
from tests.services.haproxy import HAProxy
from tests.services.postgres import PostgresServer
from tests.services.vault_server import VaultServer
from tests.test_balanced_ledger import ORIGIN, tiles_address
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

CONCURRENCY = 48


def answer_size(address: str, request: pb.LookupRequest) -> int:
    with grpc.insecure_channel(address) as channel:
        answer = rpc.LedgerStub(channel).Lookup(request)
    assert answer.entries, "the look-up found nothing"
    return answer.ByteSize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pins", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with PostgresServer() as postgres, tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        base = Path(tmp)
        tiles = ("--tiles-http", "0")
        env = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}
        vaults = [VaultServer(base / "a", database=postgres.url, env=env, serve_args=tiles)]
        vaults[0].start()
        config = base / "shared.toml"
        config.write_text(f'[ledger]\nkey_file = "{vaults[0].key_path}"\norigin = "{ORIGIN}"\n')
        try:
            for name in ("b", "c"):
                vault = VaultServer(
                    base / name,
                    database=postgres.url,
                    args=["--config", str(config)],
                    serve_args=tiles,
                )
                vaults.append(vault.start())
            with HAProxy([v.address for v in vaults], [tiles_address(v) for v in vaults]) as proxy:
                digests = populate(vaults[0].address, args.pins)
                request = pb.LookupRequest(digest=digests[len(digests) // 2])
                # Every server signs the grown tree within its checkpoint interval; then each
                # answers with the same bytes.
                time.sleep(3)
                sizes = {answer_size(v.address, request) for v in vaults}
                assert len(sizes) == 1, f"the servers answer differently: {sizes}"
                (size,) = sizes
                data = request.SerializeToString()
                one: list[Load] = []
                balanced: list[Load] = []
                for _ in range(args.rounds):
                    one.append(
                        unary_load(
                            vaults[0].address,
                            LOOKUP,
                            data,
                            size,
                            concurrency=CONCURRENCY,
                            seconds=args.seconds,
                        )
                    )
                    balanced.append(
                        unary_load(
                            proxy.grpc_address,
                            LOOKUP,
                            data,
                            size,
                            concurrency=CONCURRENCY,
                            seconds=args.seconds,
                        )
                    )
        finally:
            for vault in vaults:
                vault.stop()
    straight = statistics.median(load.rate for load in one)
    through = statistics.median(load.rate for load in balanced)
    print(f"ledger of {args.pins} pins on PostgreSQL; {args.rounds} rounds of {args.seconds:.0f} s")
    print(
        f"look-ups straight to one server:     {straight:,.0f}/s "
        f"(p99 {statistics.median(load.p99 for load in one) * 1000:.1f} ms)"
    )
    print(
        f"look-ups through HAProxy, 3 servers: {through:,.0f}/s "
        f"(p99 {statistics.median(load.p99 for load in balanced) * 1000:.1f} ms)"
    )
    print(f"ratio {through / straight:.2f}x (goal >= 2x on a host with the cores for it)")


if __name__ == "__main__":
    main()
