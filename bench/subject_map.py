"""What keeping the subject map costs the ledger's writer: commits of 1,000 pins through the
sequencer's own `write_commit` (in this process: no gRPC, no server), into two new SQLite
ledgers grown side by side, one keeping the map (its step and `index` entry in every commit,
as the vault does) and one whose map step is never due. Each stretch of `--stretch` entries is
timed on both, one after the other, alternating which goes first; the ratio is the map's share
of the writer's path at that size, the machine's noise falling on both alike.

The goal: the map costing batch appends at most 10% (a ratio of at least 0.90).

    uv run python -m bench.subject_map [--to 400000] [--stretch 20000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from vault.ledger.db import LEDGER_RESERVE, Database, Writer, open_database
from vault.ledger.sequencer import HEAD, PinFields, write_commit
from vault.ledger.subject_index import FOLD_ROWS
from vault.ledger.subject_map_store import MapWriter

BATCH = 1000


class Grown:
    """One ledger and its writer, as the sequencer process keeps them."""

    def __init__(self, path: Path, keep_map: bool) -> None:
        self.db: Database = open_database(f"sqlite:///{path}")
        self.writer = Writer(
            self.db, checkpoints_aside=True, reserve=LEDGER_RESERVE, fold_rows=FOLD_ROWS
        )
        self.map = MapWriter() if keep_map else MapWriter(None)

    def commit(self, pins: list[PinFields]) -> None:
        try:
            with self.writer.begin() as tx:
                ((size, last),) = tx.all(HEAD)
                write_commit(tx, [pins], int(size), bytes(last), self.map)
        except BaseException:
            self.map.failed()
            raise
        self.map.committed()

    def size(self) -> int:
        ((size, _),) = self.db.fetch(HEAD)
        return int(size)

    def close(self) -> None:
        self.writer.close()
        self.db.dispose()


def pins(count: int) -> list[list[PinFields]]:
    raw = os.urandom(32 * count).hex()
    return [
        [
            ("image", ("sha256:" + raw[64 * i : 64 * (i + 1)],), "bench", {}, True)
            for i in range(start, min(start + BATCH, count))
        ]
        for start in range(0, count, BATCH)
    ]


def stretch_rate(ledger: Grown, batches: list[list[PinFields]]) -> float:
    start = time.perf_counter()
    for batch in batches:
        ledger.commit(batch)
    return sum(map(len, batches)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--to", type=int, default=400_000, help="entries to grow each ledger to")
    parser.add_argument("--stretch", type=int, default=20_000, help="entries a timed stretch")
    args = parser.parse_args()
    if args.stretch < BATCH or args.to < args.stretch:
        parser.error(f"--stretch must be at least {BATCH} and --to at least --stretch")
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        ledgers = {
            "with the map": Grown(Path(tmp) / "map.db", keep_map=True),
            "without": Grown(Path(tmp) / "plain.db", keep_map=False),
        }
        print(f"commits of {BATCH} pins, SQLite, durable; entries/s a stretch of {args.stretch}")
        print(f"{'entries':>9}  {'with the map':>12}  {'without':>9}  ratio")
        ratios: list[float] = []
        grown = 0
        turn = 0
        try:
            while grown < args.to:
                batches = pins(args.stretch)  # made before either clock starts
                order = list(ledgers) if turn % 2 == 0 else list(reversed(ledgers))
                rates = {name: stretch_rate(ledgers[name], batches) for name in order}
                grown += args.stretch
                turn += 1
                ratio = rates["with the map"] / rates["without"]
                ratios.append(ratio)
                print(
                    f"{grown:>9,}  {rates['with the map']:>12,.0f}  {rates['without']:>9,.0f}"
                    f"  {ratio:.2f}x",
                    flush=True,
                )
            sizes = {name: ledger.size() for name, ledger in ledgers.items()}
        finally:
            for ledger in ledgers.values():
                ledger.close()
    last = ratios[len(ratios) // 2 :]
    print(
        f"the map's ledger holds {sizes['with the map']:,} entries (its `index` entries "
        f"among them), the other {sizes['without']:,}"
    )
    print(
        f"with the map / without, median of the last {len(last)} stretches: "
        f"{statistics.median(last):.2f}x (goal >= 0.90x)"
    )


if __name__ == "__main__":
    main()
