"""The cost of signing at every size: a ledger with tiles (SQLite, as `vault serve` opens it)
appends one entry at a time and signs a checkpoint after each, so that every signed size has
its tiles written before it is handed out (the partial tile and entry bundle of each size).
With `--baseline TREE` (a checkout of another version of the project, such as one that wrote
tiles only once an interval), the same loop runs on that tree too, in its own process,
alternating with this tree's, and the figure is printed beside it.

    uv run python -m bench.signing [--entries 1024] [--rounds 3] [--baseline /path/to/tree]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORIGIN = "bench.test/ledger"


def per_append(entries: int) -> float:
    """Seconds an append of one entry and the signing of the checkpoint over it take, the
    median over `entries` appends into a new ledger (every width of partial tile is met)."""
    from vault.ledger.checkpoint import SigningKey
    from vault.ledger.db import open_database
    from vault.ledger.log import Ledger
    from vault.ledger.records import PinSpec

    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        data = Path(tmp)
        db = open_database(f"sqlite:///{data / 'vault.db'}")
        options: dict[str, object] = {"checkpoint_interval": 3600, "tiles": data / "tiles"}
        if "tiles_check_interval" in inspect.signature(Ledger).parameters:
            options["tiles_check_interval"] = None
        ledger = Ledger(db, SigningKey.generate(ORIGIN), origin=ORIGIN, **options)  # type: ignore[arg-type]
        taken = []
        try:
            for n in range(entries):
                pin = PinSpec.checked(
                    kind="config", subjects=[f"sha256:{n:064x}"], author="bench", external=True
                )
                began = time.perf_counter()
                ledger.append([pin])
                ledger.checkpoint(n + 1)
                taken.append(time.perf_counter() - began)
        finally:
            ledger.close()
            db.dispose()
    return statistics.median(taken)


def run_in(tree: Path, entries: int) -> float:
    """`per_append` in a process of its own, importing the project from `tree`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINVAULT_")}
    env["PYTHONPATH"] = str(tree)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import importlib.util, json; "
        "spec = importlib.util.spec_from_file_location('signing', sys.argv[2]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(json.dumps(m.per_append(int(sys.argv[3]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tree), __file__, str(entries)],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout of the project")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    taken: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in reversed(trees.items()):
            taken[name].append(run_in(tree, args.entries))
    print(
        f"append one entry and sign over it, {args.entries} times into a new ledger with "
        f"tiles; medians of {args.rounds} rounds"
    )
    for name, samples in taken.items():
        rounds = " ".join(f"{s * 1000:.2f}" for s in samples)
        print(f"  {name:<10} {statistics.median(samples) * 1000:8.2f} ms  (rounds: {rounds})")
    if args.baseline is not None:
        ratio = statistics.median(taken["this tree"]) / statistics.median(taken["baseline"])
        print(f"  this tree / baseline: {ratio:.2f}x")


if __name__ == "__main__":
    main()
