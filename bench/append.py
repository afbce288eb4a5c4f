"""Durable appends over gRPC: 16 concurrent single-entry writers, and batch appends, on the
embedded default (SQLite, WAL, synchronous=FULL), beside a bare gRPC echo at the same
concurrency and a single-writer SQLite commit loop (one fsync per entry) from the same run.

    uv run python -m bench.append [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench.common import load, vault_server
from bench.lookup import echo_rate
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

CONCURRENCY = 16
BATCH = 1000
BATCH_WRITERS = 4


def pin(digest: str) -> pb.PinRequest:
    return pb.PinRequest(kind="artefact", subjects=[digest], external=True, author="bench")


def naive_sqlite_rate(seconds: float) -> float:
    """One transaction and one sync per entry: what group commit is measured against."""
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlite3.connect(f"{tmp}/naive.db", isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (i INTEGER PRIMARY KEY, body BLOB)")
        n = 0
        deadline = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < deadline:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t (body) VALUES (?)", (os.urandom(300),))
            conn.execute("COMMIT")
            n += 1
        rate = n / (time.perf_counter() - start)
        conn.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    echo = echo_rate(args.seconds, pin("sha256:" + "0" * 64).SerializeToString())
    naive = naive_sqlite_rate(min(args.seconds, 3))
    with vault_server() as server:
        channel = None

        async def single() -> None:
            nonlocal channel
            if channel is None:
                channel = grpc.aio.insecure_channel(server.address)
            await rpc.LedgerStub(channel).Pin(pin("sha256:" + os.urandom(32).hex()))

        singles = load(single, concurrency=CONCURRENCY, seconds=args.seconds)

        with grpc.insecure_channel(
            server.address, options=[("grpc.max_send_message_length", 64 << 20)]
        ) as sync_channel:
            ledger = rpc.LedgerStub(sync_channel)
            requests = [
                pb.PinBatchRequest(
                    pins=[pin("sha256:" + os.urandom(32).hex()) for _ in range(BATCH)]
                )
                for _ in range(BATCH_WRITERS * 15 + 1)
            ]
            ledger.PinBatch(requests.pop())
            start = time.perf_counter()
            with ThreadPoolExecutor(BATCH_WRITERS) as pool:
                list(pool.map(ledger.PinBatch, requests))
            batch_rate = len(requests) * BATCH / (time.perf_counter() - start)

    print(
        f"{CONCURRENCY} concurrent single-entry writers, {args.seconds:.0f} s; "
        "durable (synchronous=FULL)"
    )
    print(f"  echo            {echo}")
    print(f"  pin (append)    {singles}")
    print(f"  sqlite, 1 commit per entry, 1 writer: {naive:,.0f} entries/s")
    print(f"single-entry appends: {singles.rate:,.0f}/s (goal >= 5,000/s)")
    print(
        f"batch appends ({BATCH} a call, {BATCH_WRITERS} writers): {batch_rate:,.0f} entries/s "
        "(goal >= 50,000/s)"
    )


if __name__ == "__main__":
    main()
