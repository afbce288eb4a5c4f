"""Durable appends over gRPC on the embedded default (SQLite, WAL, synchronous=FULL): batch
appends, then 16 concurrent single-entry writers, each with the ledger's writer in a sequencer
process (the default) and in a thread of the server's process (ledger.sequencer = thread).
Beside them, from the same rounds:

- for batches, SQLite alone writing the same rows into the ledger's own tables, 1,000 a commit
  with the head moved and the write-ahead log copied back beside the writer, as the vault
  does, over the same range of ledger sizes: the storage engine's ceiling;
- for single entries, a bare gRPC echo at the same concurrency (bench/rates.py), and a
  single-writer SQLite loop with one commit (one sync) per entry.

Each figure is the median of `--rounds` rounds, and each round measures every contender one
after another, so that the noise of a shared machine falls on all of them alike.

    uv run python -m bench.append [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.common import Load, vault_server
from bench.h2load import unary_load
from bench.rates import echo_server
from vault.digest import digest_key
from vault.ledger.db import WAL_BACKSTOP_PAGES, WAL_CHECKPOINT_EVERY, open_database
from vault.ledger.entry import Entry, now
from vault.ledger.merkle import leaf_hash
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

PIN = "/pinvault.v1.Ledger/Pin"
BATCH = 1000
BATCH_CALLS = 60
BATCH_WRITERS = 4
SEQUENCERS = ("process", "thread")
# Past 100,000 entries every single append's answer has the same size (six-digit indices), as
# bench/h2load.py's check of the answers needs.
FILL = 100_000


def pin(digest: str) -> pb.PinRequest:
    return pb.PinRequest(kind="artefact", subjects=[digest], external=True, author="bench")


def random_digest() -> str:
    return "sha256:" + os.urandom(32).hex()


def sqlite_connection(path: str | Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


@contextmanager
def log_copied_back(path: Path) -> Iterator[None]:
    """SQLite's write-ahead log copied back into the database by a second connection at most
    every WAL_CHECKPOINT_EVERY seconds, as beside the vault's writer."""
    stop = threading.Event()

    def copy_back() -> None:
        conn = sqlite_connection(path)
        try:
            while not stop.wait(WAL_CHECKPOINT_EVERY):
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            conn.close()

    thread = threading.Thread(target=copy_back, name="copy-back")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


INSERT_SUBJECTS = "INSERT INTO entry_subjects (digest, idx) VALUES (?, ?)"
INSERT_RECENT = "INSERT INTO subject_recent (digest, idx) VALUES (?, ?)"


@dataclass
class Batch:
    """BATCH entries' rows as the ledger stores them, their subject index rows (raw digest,
    index) and the head after them."""

    rows: Sequence[tuple[object, ...]]
    subjects: list[tuple[bytes, int]]
    head: tuple[int, bytes]


def ledger_batches(conn: sqlite3.Connection, entries: int) -> Iterator[Batch]:
    """`entries` new pins (one random digest each) after the head of the ledger in `conn`,
    chained to it, BATCH at a time."""
    first, prev = conn.execute("SELECT size, last_leaf FROM ledger_head").fetchone()
    stamp = now()
    for start in range(first, first + entries, BATCH):
        rows, subjects = [], []
        for index in range(start, start + BATCH):
            digest = random_digest()
            body = Entry(index, "artefact", (digest,), "bench", stamp, prev, {}, True).encode()
            prev = leaf_hash(body)
            rows.append((index, body, prev, "artefact", "bench", stamp, True))
            subjects.append((digest_key(digest), index))
        yield Batch(rows, subjects, (start + BATCH, prev))


def write_batch(
    conn: sqlite3.Connection,
    batch: Batch,
    index_subjects: Callable[[list[tuple[bytes, int]]], object] | None = None,
) -> None:
    """One commit of the batch: its entries, its subject rows (into entry_subjects, in append
    order, and into the subject index's recent rows, or by `index_subjects`), and the head moved
    past them, as an append writes them."""
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO entries (idx, body, leaf_hash, kind, author, time, external) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        batch.rows,
    )
    conn.executemany(INSERT_SUBJECTS, batch.subjects)
    if index_subjects is None:
        conn.executemany(INSERT_RECENT, batch.subjects)
    else:
        index_subjects(batch.subjects)
    conn.execute("UPDATE ledger_head SET size = ?, last_leaf = ? WHERE id = 1", batch.head)
    conn.execute("COMMIT")


def bare_sqlite_batch_rate(entries: int, ledger: Path | None = None) -> float:
    """Entries as the ledger stores them, written by SQLite alone into the ledger's schema,
    BATCH to a commit with the head moved as an append moves it, and the log copied back beside
    the writer: into a new ledger, or appended to `ledger` (a copy of a vault's database). The
    rows are made before the clock starts."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        path = ledger if ledger is not None else Path(tmp) / "ledger.db"
        if ledger is None:
            open_database(f"sqlite:///{path}").dispose()
        conn = sqlite_connection(path)
        conn.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
        batches = list(ledger_batches(conn, entries))
        with log_copied_back(path):
            begin = time.perf_counter()
            for batch in batches:
                write_batch(conn, batch)
            rate = entries / (time.perf_counter() - begin)
        conn.close()
    return rate


def naive_sqlite_rate(seconds: float) -> float:
    """One transaction and one sync per entry: what group commit is measured against."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        conn = sqlite_connection(f"{tmp}/naive.db")
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


def _sequencer(kind: str) -> dict[str, str]:
    return {"PINVAULT_LEDGER_SEQUENCER": kind}


def vault_batch_rate(sequencer: str) -> float:
    """Batch appends into a new vault: BATCH_CALLS calls of BATCH pins from BATCH_WRITERS."""
    with (
        vault_server(env=_sequencer(sequencer)) as server,
        grpc.insecure_channel(
            server.address, options=[("grpc.max_send_message_length", 64 << 20)]
        ) as channel,
    ):
        ledger = rpc.LedgerStub(channel)
        requests = [
            pb.PinBatchRequest(pins=[pin(random_digest()) for _ in range(BATCH)])
            for _ in range(BATCH_CALLS)
        ]
        start = time.perf_counter()
        with ThreadPoolExecutor(BATCH_WRITERS) as pool:
            list(pool.map(ledger.PinBatch, requests))
        return BATCH * BATCH_CALLS / (time.perf_counter() - start)


def vault_single_rate(sequencer: str, seconds: float) -> Load:
    """16 single-entry appends in flight from h2load, into a ledger past FILL entries."""
    with vault_server(env=_sequencer(sequencer)) as server:
        with grpc.insecure_channel(server.address) as channel:
            ledger = rpc.LedgerStub(channel)
            for _ in range(FILL // 5000):
                fill = [pin(random_digest()) for _ in range(5000)]
                ledger.PinBatch(pb.PinBatchRequest(pins=fill))
            request = pin(random_digest())
            answer = ledger.Pin(request).ByteSize()
        return unary_load(server.address, PIN, request.SerializeToString(), answer, seconds=seconds)


def echo_rate(seconds: float) -> Load:
    """The bare gRPC echo of the same request message, decoded and encoded (bench/rates.py)."""
    data = pin(random_digest()).SerializeToString()
    with echo_server("PinRequest") as echo:
        return unary_load(echo, "/bench.Echo/EchoMessage", data, len(data), seconds=seconds)


def _median(loads: list[Load]) -> Load:
    return sorted(loads, key=lambda load: load.rate)[len(loads) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each with new vaults")
    args = parser.parse_args()
    batched = BATCH * BATCH_CALLS
    bare: list[float] = []
    batches: dict[str, list[float]] = {kind: [] for kind in SEQUENCERS}
    for _ in range(args.rounds):
        bare.append(bare_sqlite_batch_rate(batched))
        for kind in SEQUENCERS:
            batches[kind].append(vault_batch_rate(kind))
    naive = naive_sqlite_rate(min(args.seconds, 3))
    echoes: list[Load] = []
    singles: dict[str, list[Load]] = {kind: [] for kind in SEQUENCERS}
    for _ in range(args.rounds):
        echoes.append(echo_rate(args.seconds))
        for kind in SEQUENCERS:
            singles[kind].append(vault_single_rate(kind, args.seconds))

    bare_rate = statistics.median(bare)
    print(
        f"batch appends, {BATCH} a call from {BATCH_WRITERS} writers, into a new ledger "
        f"(0 to {batched:,} entries), durable (synchronous=FULL); medians of {args.rounds} "
        "rounds (ratios: each round's own, then their median)"
    )
    print(f"  SQLite alone, the same rows        {bare_rate:>8,.0f} entries/s")
    for kind in SEQUENCERS:
        rate = statistics.median(batches[kind])
        ratios = [v / b for v, b in zip(batches[kind], bare, strict=True)]
        print(
            f"  append batches, sequencer {kind:<7}  {rate:>8,.0f} entries/s  "
            f"{statistics.median(ratios):.2f}x SQLite alone "
            f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    echo = _median(echoes)
    print(
        f"single-entry appends, durable, 16 calls in flight from h2load on one connection, "
        f"{args.seconds:.0f} s a run, ledger past {FILL:,} entries; medians of {args.rounds}"
    )
    print(f"  echo, message decoded        {echo}")
    for kind in SEQUENCERS:
        ratios = [v.rate / e.rate for v, e in zip(singles[kind], echoes, strict=True)]
        print(
            f"  append, sequencer {kind:<7}    {_median(singles[kind])}  "
            f"{statistics.median(ratios):.2f}x the echo "
            f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    print(f"  SQLite alone, 1 commit per entry, 1 writer: {naive:,.0f} entries/s")


if __name__ == "__main__":
    main()
