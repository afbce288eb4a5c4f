"""Two layouts of the subject index as a ledger grows, written by SQLite alone into the ledger's
own tables (bench.append's rows: one pin of a random digest an entry, 1,000 entries a commit,
the head moved and the log copied back beside the writer), in the same run:

- b-tree: the vault's layout, every subject inserted into one B-tree keyed by its raw digest
  (entry_subjects);
- sorted runs: every subject inserted into a small run (a table keyed the same way, at most
  RUN rows); when it is full it is merged with the levels below it into one sorted run, each
  level holding up to FANOUT times the one above (a levelled log-structured merge, as LevelDB
  and RocksDB keep their tables), in one transaction that rewrites the runs it takes. A
  look-up probes every run.

For each stretch of growth: entries/s with the merges' time counted, the merges' share of it,
the longest merge (every append waits behind it), and look-ups of present digests (p50/p99,
one digest a query; for runs, every run probed). Each rate is also given over the layout's
own rate at the first size.

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
    INSERT_SUBJECTS,
    ledger_batches,
    log_copied_back,
    sqlite_connection,
    write_batch,
)
from vault.ledger.db import WAL_BACKSTOP_PAGES, open_database

SIZES = {"10k": 10_000, "100k": 100_000, "1M": 1_000_000, "3M": 3_000_000, "10M": 10_000_000}
RUN = 16_384
FANOUT = 8
LOOKUPS = 2_000
# One subject kept for look-ups in this many.
SAMPLE_EVERY = 97


@dataclass
class Stretch:
    size: int
    rate: float
    merge_s: float
    longest_merge_s: float
    lookup_ms: tuple[float, float]


class Layout:
    name = ""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def insert(self, subjects: Sequence[tuple[bytes, int]]) -> None:
        raise NotImplementedError

    def after_commit(self) -> None:
        """Work the layout does between commits (merges), timed by the caller."""

    def tables(self) -> list[str]:
        raise NotImplementedError

    def lookup(self, digest: bytes) -> list[int]:
        found: list[int] = []
        for table in self.tables():
            rows = self.conn.execute(f"SELECT idx FROM {table} WHERE digest = ?", (digest,))
            found += [index for (index,) in rows]
        return found


class BTree(Layout):
    name = "b-tree"

    def insert(self, subjects: Sequence[tuple[bytes, int]]) -> None:
        self.conn.executemany(INSERT_SUBJECTS, subjects)

    def tables(self) -> list[str]:
        return ["entry_subjects"]


@dataclass
class Level:
    table: str
    rows: int = 0


class SortedRuns(Layout):
    name = "sorted runs"

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        self.made = 0
        self.levels: list[Level] = [self._new(0)]

    def _new(self, rows: int) -> Level:
        self.made += 1
        table = f"run_{self.made}"
        self.conn.execute(
            f"CREATE TABLE {table} (digest BLOB NOT NULL, idx INTEGER NOT NULL, "
            "PRIMARY KEY (digest, idx)) WITHOUT ROWID"
        )
        return Level(table, rows)

    def insert(self, subjects: Sequence[tuple[bytes, int]]) -> None:
        self.conn.executemany(
            f"INSERT INTO {self.levels[0].table} (digest, idx) VALUES (?, ?)", subjects
        )
        self.levels[0].rows += len(subjects)

    def after_commit(self) -> None:
        if self.levels[0].rows < RUN:
            return
        # The first level below the top that can take everything above it, or a new one.
        depth, rows = 1, self.levels[0].rows
        while depth < len(self.levels) and rows + self.levels[depth].rows > RUN * FANOUT**depth:
            rows += self.levels[depth].rows
            depth += 1
        taken = self.levels[: depth + 1]
        rows = sum(level.rows for level in taken)
        self.conn.execute("BEGIN IMMEDIATE")
        merged = self._new(rows)
        union = " UNION ALL ".join(f"SELECT digest, idx FROM {level.table}" for level in taken)
        self.conn.execute(
            f"INSERT INTO {merged.table} SELECT digest, idx FROM ({union}) ORDER BY digest, idx"
        )
        for level in taken:
            self.conn.execute(f"DROP TABLE {level.table}")
        emptied = [self._new(0) for _ in range(depth)]
        self.conn.execute("COMMIT")
        self.levels[: depth + 1] = [*emptied, merged]

    def tables(self) -> list[str]:
        return [level.table for level in self.levels if level.rows]


def grow(layout: Layout, path: Path, sizes: Sequence[int]) -> list[Stretch]:
    conn = layout.conn
    stretches = []
    sample: list[bytes] = []
    done = 0
    with log_copied_back(path):
        for size in sizes:
            spent = merges = longest = 0.0
            for batch in ledger_batches(conn, size - done):
                begin = time.perf_counter()
                write_batch(conn, batch, layout.insert)
                merging = time.perf_counter()
                layout.after_commit()
                end = time.perf_counter()
                spent += end - begin
                merges += end - merging
                longest = max(longest, end - merging)
                sample += [digest for digest, _ in batch.subjects[::SAMPLE_EVERY]]
            rate = (size - done) / spent
            done = size
            stretches.append(Stretch(size, rate, merges, longest, lookups(layout, sample)))
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
        try:
            return grow(kind(conn), path, sizes)
        finally:
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--to", choices=list(SIZES)[1:], default="1M")
    args = parser.parse_args()
    sizes = [n for n in SIZES.values() if n <= SIZES[args.to]]
    results = {}
    for kind in (BTree, SortedRuns):
        print(f"{kind.name}:", flush=True)
        results[kind.name] = measure(kind, sizes)
    print()
    print(
        "| layout | entries | entries/s | merges (s) | longest merge (s) | look-up p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for name, stretches in results.items():
        first = stretches[0].rate
        for s in stretches:
            label = next(k for k, v in SIZES.items() if v == s.size)
            print(
                f"| {name} | {label} | {s.rate:,.0f} ({s.rate / first:.2f}×) | {s.merge_s:.1f} "
                f"| {s.longest_merge_s:.2f} | {s.lookup_ms[0]:.3f} / {s.lookup_ms[1]:.3f} |"
            )


if __name__ == "__main__":
    main()
