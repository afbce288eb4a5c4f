"""`vault verify` of a large ledger, end to end over gRPC, beside the bare cost of hashing the
same entry bytes (SHA-256 leaf hashes only) in the same run.

    uv run python -m bench.verify [--entries 1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from bench.common import vault_server
from vault.client import VaultClient
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import open_database
from vault.ledger.log import Ledger, PinSpec

ORIGIN = "bench.pinvault/verify"


def build(data: Path, entries: int) -> None:
    """Fill a data folder's ledger directly (fast), as `vault serve` would find it."""
    data.mkdir(parents=True)
    key = SigningKey.generate(ORIGIN)
    key.save(data / "checkpoint.key")
    db = open_database(f"sqlite:///{data / 'vault.db'}")
    ledger = Ledger(db, key, origin=ORIGIN, checkpoint_interval=3600)
    for start in range(0, entries, 10_000):
        pins = [
            PinSpec(
                kind="artefact",
                subjects=("sha256:" + os.urandom(32).hex(),),
                author="bench",
                meta={"run": str(start // 10_000)},
                external=True,
            )
            for _ in range(min(10_000, entries - start))
        ]
        ledger.append(pins)
        if start % 100_000 == 0:
            ledger.checkpoint(ledger.size)
    ledger.checkpoint(ledger.size)
    ledger.close()
    db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        data = Path(tmp) / "data"
        start = time.perf_counter()
        build(data, args.entries)
        print(f"built a {args.entries:,}-entry ledger in {time.perf_counter() - start:.1f} s")
        with vault_server(data_dir=data, env={"PINVAULT_LEDGER_ORIGIN": ORIGIN}) as server:
            client = VaultClient(server.address, state=Path(tmp) / "state.json")
            bodies: list[bytes] = []
            start = time.perf_counter()
            report = client.audit()
            audit = time.perf_counter() - start
            assert report.ok, report.failures[:3]
            assert report.entries == args.entries
            for batch in client.ledger.ReadEntries(
                __import__("vault.wire.pinvault_pb2", fromlist=["x"]).ReadEntriesRequest()
            ):
                bodies.extend(e.body for e in batch.entries)
                if len(bodies) >= 200_000:
                    break
            client.close()
    sha = hashlib.sha256
    start = time.perf_counter()
    for body in bodies:
        sha(b"\x00" + body).digest()
    hash_rate = len(bodies) / (time.perf_counter() - start)
    rate = args.entries / audit
    print(
        f"vault verify: {args.entries:,} entries, {report.checkpoints} checkpoints in {audit:.2f} s"
    )
    print(f"  {rate:,.0f} entries/s (goal >= 100,000/s); bare leaf hashing {hash_rate:,.0f}/s")


if __name__ == "__main__":
    main()
