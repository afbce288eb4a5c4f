"""Pin look-ups over gRPC beside a bare gRPC echo service with the same server settings and the
same callers; batch look-ups; batch existence (FindMissing).

    uv run python -m bench.lookup [--pins 10000] [--seconds 5] [--batches-only] [--batch-calls 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.common import Load, load, row, vault_server
from bench.rates import CONCURRENCY, Rates, compare, echo_server
from vault.client import VaultClient
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

LOOKUP = "/pinvault.v1.Ledger/Lookup"


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


def python_callers(address: str, echo: str, request: pb.LookupRequest, seconds: float) -> Rates:
    """The same look-up from 16 Python asyncio callers, which share the machine's two cores
    with the server, beside the message echo from the same callers."""
    data = request.SerializeToString()

    def timed(method: str, target: str) -> Load:
        call: Callable[[bytes], Awaitable[bytes]] | None = None

        async def one() -> None:
            nonlocal call
            if call is None:  # made on the load's event loop
                call = grpc.aio.insecure_channel(target).unary_unary(method)
            await call(data)

        return load(one, concurrency=CONCURRENCY, seconds=seconds)

    return Rates(
        timed("/bench.Echo/Echo", echo),
        timed("/bench.Echo/EchoMessage", echo),
        timed(LOOKUP, address),
    )


def verified_lookups(
    address: str, state: Path, digests: list[str], calls: int
) -> tuple[float, float]:
    """The Python client's look-up and batch look-up as a caller sees them, each proof checked
    (medians of `calls`, after one of each to warm up)."""
    with VaultClient(address, state_folder=state) as client:
        one = digests[len(digests) // 3]
        batch = digests[:1000]
        client.lookup(one)
        client.lookup_many(batch)
        singles, batches = [], []
        for n in range(calls):
            start = time.perf_counter()
            client.lookup(digests[n * 7 % len(digests)])
            singles.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.lookup_many(batch)
            batches.append(time.perf_counter() - start)
    return statistics.median(singles), statistics.median(batches)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pins", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--batches-only",
        action="store_true",
        help="measure only the batch look-up and batch existence, not single look-ups",
    )
    parser.add_argument(
        "--batch-calls",
        type=int,
        default=21,
        help="batch look-ups timed, of which the median is reported (default 21)",
    )
    args = parser.parse_args()
    if args.batch_calls < 1:
        parser.error(f"--batch-calls must be at least 1, not {args.batch_calls}")
    with vault_server() as server:
        digests = populate(server.address, args.pins)
        request = pb.LookupRequest(digest=digests[len(digests) // 2])
        with grpc.insecure_channel(server.address) as channel:
            answer = rpc.LedgerStub(channel).Lookup(request)
        assert answer.entries, "the look-up found nothing"
        if not args.batches_only:
            rates = compare(
                server.address, LOOKUP, request, answer.ByteSize(), seconds=args.seconds
            )
            with echo_server("LookupRequest") as echo:
                python = python_callers(server.address, echo, request, args.seconds)

        with grpc.insecure_channel(
            server.address,
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
            ],
        ) as sync_channel:
            ledger = rpc.LedgerStub(sync_channel)
            store = rpc.StoreStub(sync_channel)
            batch = pb.LookupBatchRequest(digests=digests[:1000])
            ledger.LookupBatch(batch)
            samples = []
            for _ in range(args.batch_calls):
                start = time.perf_counter()
                ledger.LookupBatch(batch)
                samples.append(time.perf_counter() - start)
            batch_rate = len(batch.digests) / statistics.median(samples)
            probe = [random_digest() for _ in range(100_000)]
            store.FindMissing(pb.FindMissingRequest(digests=probe[:1000]))
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                missing = store.FindMissing(pb.FindMissingRequest(digests=probe)).missing
                samples.append(time.perf_counter() - start)
            assert len(missing) == len(probe)
            exist = sorted(samples)[2]
        verified = verified_lookups(
            server.address, server.data_dir / "client-state", digests, args.batch_calls
        )

    print(f"ledger of {args.pins} pins; {args.seconds:.0f} s a run")
    print(
        f"batch look-up, 1000 digests a call: {batch_rate:,.0f} digests/s "
        f"(median of {args.batch_calls} calls; goal >= 50,000)"
    )
    print(f"batch existence of 100,000 digests: {exist:.3f} s (goal < 1 s)")
    single, many = verified
    print(
        f"verified by the client (every proof checked, look-ups proven complete): one look-up "
        f"p50 {single * 1000:.2f} ms, one call in flight; a batch of 1,000 "
        f"{len(digests[:1000]) / many:,.0f} digests/s (medians of {args.batch_calls})"
    )
    if args.batches_only:
        return
    print(rates.report("look-up"))
    print(python.report("look-up", "Python asyncio callers on one channel"))
    print(
        row(
            "pin look-ups (with inclusion proofs)",
            f"{rates.vault.rate:,.0f}/s",
            f"{rates.echo_message.rate:,.0f}/s",
            rates.ratio,
            "goal >= 0.70x echo, p99 < 5 ms",
        )
    )
    print(
        f"look-up p99 {rates.vault.p99 * 1000:.2f} ms "
        f"(from Python callers: {python.vault.p99 * 1000:.2f} ms)"
    )


if __name__ == "__main__":
    main()
