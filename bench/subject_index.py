"""Two layouts of the subject index as a ledger grows, written by SQLite alone into the ledger's
own tables (bench.append's rows: one pin of a random digest an entry, 1,000 entries a commit,
every subject row also in `entry_subjects` in append order, the head moved and the log copied
back beside the writer), in the same run:

- b-tree: schema 5's layout, every subject inserted into one B-tree keyed by its raw digest;
- the vault's (schema 6): every subject inserted into the small recent table, which the
  vault's own fold thread (`vault.ledger.subject_index.Folds`) folds into sorted runs on levels
  of 8× beside the writer, as a vault's writer does; look-ups through the vault's
  `SubjectIndex`, every run probed.

For each stretch of growth: entries/s, the longest commit (every append waits behind it: a
fold's short transaction, or the writer waiting for it), and look-ups of present digests
(p50/p99, one digest a query). Each rate is also given over the layout's own rate at the first
size.

    uv run --no-sync python -m bench.subject_index [--to 1M|3M|10M]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.append import (
    ledger_batches,
    log_copied_back,
    sqlite_connection,
    write_batch,
)
from vault.ledger.db import WAL_BACKSTOP_PAGES, open_database
from vault.ledger.subject_index import Folds

SIZES = {"10k": 10_000, "100k": 100_000, "1M": 1_000_000, "3M": 3_000_000, "10M": 10_000_000}
LOOKUPS = 2_000
# One subject kept for look-ups in this many.
SAMPLE_EVERY = 97


@dataclass
class Stretch:
    size: int
    rate: float
    longest_commit_s: float
    runs: int
    lookup_ms: tuple[float, float]


class Layout:
    name = ""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path

    def insert(self, subjects: Sequence[tuple[bytes, int]]) -> None:
        """The subject rows' index rows, inside the append's transaction."""
        raise NotImplementedError

    def lookup(self, digest: bytes) -> list[int]:
        raise NotImplementedError

    def runs(self) -> int:
        return 0

    def close(self) -> None:
        pass


class BTree(Layout):
    name = "b-tree"

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        super().__init__(conn, path)
        conn.execute(
            "CREATE TABLE subjects_btree (digest BLOB NOT NULL, idx INTEGER NOT NULL, "
            "PRIMARY KEY (digest, idx)) WITHOUT ROWID"
        )

    def insert(self, subjects: Sequence[tuple[bytes, int]]) -> None:
        self.conn.executemany("INSERT INTO subjects_btree (digest, idx) VALUES (?, ?)", subjects)

    def lookup(self, digest: bytes) -> list[int]:
        rows = self.conn.execute("SELECT idx FROM subjects_btree WHERE digest = ?", (digest,))
        return [index for (index,) in rows]


class Vaults(Layout):
    name = "the vault's"

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        super().__init__(conn, path)
        self.folds = Folds(str(path))
        # Look-ups as a server reads them: the database's own subject index.
        self.db = open_database(f"sqlite:///{path}")

    def insert(self, subjects: Sequence[tuple[bytes, int]]) -> None:
        self.conn.executemany("INSERT INTO subject_recent (digest, idx) VALUES (?, ?)", subjects)
        self.folds.due()

    def lookup(self, digest: bytes) -> list[int]:
        return self.db.subjects.indexes([digest])

    def runs(self) -> int:
        ((count,),) = self.db.fetch("SELECT count(*) FROM subject_runs")
        return int(count)

    def close(self) -> None:
        self.folds.stop()
        self.db.dispose()


def grow(layout: Layout, sizes: Sequence[int]) -> list[Stretch]:
    conn = layout.conn
    stretches = []
    sample: list[bytes] = []
    done = 0
    with log_copied_back(layout.path):
        for size in sizes:
            spent = longest = 0.0
            for batch in ledger_batches(conn, size - done):
                begin = time.perf_counter()
                write_batch(conn, batch, layout.insert)
                took = time.perf_counter() - begin
                spent += took
                longest = max(longest, took)
                sample += [digest for digest, _ in batch.subjects[::SAMPLE_EVERY]]
            rate = (size - done) / spent
            done = size
            stretches.append(Stretch(size, rate, longest, layout.runs(), lookups(layout, sample)))
            print(f"  {layout.name} at {size:,}: {rate:,.0f} entries/s", flush=True)
    return stretches


def lookups(layout: Layout, sample: list[bytes]) -> tuple[float, float]:
    times = []
    for digest in random.sample(sample, min(LOOKUPS, len(sample))):
        begin = time.perf_counter()
        if not layout.lookup(digest):
            raise AssertionError(f"{layout.name}: a present digest was not found")
        times.append((time.perf_counter() - begin) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99)]


def measure(kind: type[Layout], sizes: Sequence[int]) -> list[Stretch]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        path = Path(tmp) / "ledger.db"
        open_database(f"sqlite:///{path}").dispose()
        conn = sqlite_connection(path)
        conn.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
        layout = kind(conn, path)
        try:
            return grow(layout, sizes)
        finally:
            layout.close()
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--to", choices=list(SIZES)[1:], default="1M")
    args = parser.parse_args()
    sizes = [n for n in SIZES.values() if n <= SIZES[args.to]]
    results = {}
    for kind in (BTree, Vaults):
        print(f"{kind.name}:", flush=True)
        results[kind.name] = measure(kind, sizes)
    print()
    print("| layout | entries | entries/s | longest commit (s) | runs | look-up p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for name, stretches in results.items():
        first = stretches[0].rate
        for s in stretches:
            label = next(k for k, v in SIZES.items() if v == s.size)
            print(
                f"| {name} | {label} | {s.rate:,.0f} ({s.rate / first:.2f}×) "
                f"| {s.longest_commit_s:.3f} | {s.runs} "
                f"| {s.lookup_ms[0]:.3f} / {s.lookup_ms[1]:.3f} |"
            )


if __name__ == "__main__":
    main()
