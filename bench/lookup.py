"""Pin look-ups over gRPC beside a bare gRPC echo service with the same server settings and the
same callers; batch look-ups; batch existence (FindMissing).

    uv run python -m bench.lookup [--pins 10000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import grpc

from bench.common import ROOT, Load, load, row, vault_server
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

CONCURRENCY = 16


def random_digest() -> str:
    return "sha256:" + os.urandom(32).hex()


def populate(address: str, count: int) -> list[str]:
    digests = [random_digest() for _ in range(count)]
    with grpc.insecure_channel(address) as channel:
        ledger = rpc.LedgerStub(channel)
        for start in range(0, count, 5000):
            ledger.PinBatch(
                pb.PinBatchRequest(
                    pins=[
                        pb.PinRequest(kind="image", subjects=[d], external=True, author="bench")
                        for d in digests[start : start + 5000]
                    ]
                )
            )
    return digests


def echo_rate(seconds: float, payload: bytes) -> Load:
    """The same callers against a bare echo service in its own process."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.echo_server"], cwd=ROOT, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    found = re.search(r"on (\S+)", process.stdout.readline().decode())
    assert found, "the echo server did not start"
    address = found.group(1)
    try:
        channel: grpc.aio.Channel | None = None

        async def call() -> None:
            nonlocal channel
            if channel is None:
                channel = grpc.aio.insecure_channel(address)
            await channel.unary_unary("/bench.Echo/Echo")(payload)

        return load(call, concurrency=CONCURRENCY, seconds=seconds)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pins", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with vault_server() as server:
        digests = populate(server.address, args.pins)
        request = pb.LookupRequest(digest=digests[0])
        echo = echo_rate(args.seconds, request.SerializeToString())

        channel = None
        counter = 0

        async def lookup() -> None:
            nonlocal channel, counter
            if channel is None:
                channel = grpc.aio.insecure_channel(server.address)
            counter += 1
            await rpc.LedgerStub(channel).Lookup(
                pb.LookupRequest(digest=digests[counter % len(digests)])
            )

        vault = load(lookup, concurrency=CONCURRENCY, seconds=args.seconds)

        with grpc.insecure_channel(
            server.address,
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
            ],
        ) as sync_channel:
            ledger = rpc.LedgerStub(sync_channel)
            store = rpc.StoreStub(sync_channel)
            batch = digests[:1000]
            ledger.LookupBatch(pb.LookupBatchRequest(digests=batch))
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                ledger.LookupBatch(pb.LookupBatchRequest(digests=batch))
                samples.append(time.perf_counter() - start)
            batch_rate = len(batch) / sorted(samples)[2]
            probe = [random_digest() for _ in range(100_000)]
            store.FindMissing(pb.FindMissingRequest(digests=probe[:1000]))
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                missing = store.FindMissing(pb.FindMissingRequest(digests=probe)).missing
                samples.append(time.perf_counter() - start)
            assert len(missing) == len(probe)
            exist = sorted(samples)[2]

    print(
        f"{CONCURRENCY} concurrent callers, {args.seconds:.0f} s each, ledger of {args.pins} pins"
    )
    print(f"  echo   {echo}")
    print(f"  lookup {vault}")
    ratio = vault.rate / echo.rate
    print(
        row(
            "pin look-ups (with inclusion proofs)",
            f"{vault.rate:,.0f}/s",
            f"{echo.rate:,.0f}/s",
            ratio,
            "goal >= 0.70x echo, p99 < 5 ms",
        )
    )
    print(f"look-up p99 {vault.p99 * 1000:.2f} ms")
    print(f"batch look-up, 1000 digests a call: {batch_rate:,.0f} digests/s (goal >= 50,000)")
    print(f"batch existence of 100,000 digests: {exist:.3f} s (goal < 1 s)")


if __name__ == "__main__":
    main()
