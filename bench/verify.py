"""`vault verify` of a large ledger, end to end over gRPC (the real command): the audit in
chunks on worker processes beside the audit in one process (`--workers 1`) in the same run,
runs interleaved, with the bare cost of hashing the same entry bytes (SHA-256 leaf hashes
only) as a floor. Peak memory is the sum of the command's processes (it and its workers),
sampled every 20 ms, and the largest single process; CPU time of the command (with its
workers) and of the server, per million entries.

    uv run python -m bench.verify [--entries 1000000] [--repeat 3] [--workers N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT, Server, vault_server
from vault.client import VaultClient
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import open_database
from vault.ledger.log import Ledger, PinSpec
from vault.wire import pinvault_pb2 as pb

ORIGIN = "bench.pinvault/verify"
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
MIB = 1 << 20


def build(data: Path, entries: int) -> int:
    """Fill a data folder's ledger directly (fast), as `vault serve` would find it: `entries`
    pins and the `index` entry the writer appends after each commit of them. Its size."""
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
    size = ledger.size
    ledger.close()
    db.dispose()
    return size


def tiles_written(data: Path, entries: int, timeout: float = 600.0) -> None:
    """Wait until the server has written the tiles of a ledger `build` made (it writes them
    on its first start, beside serving): an audit measured meanwhile would share the machine
    with that catch-up."""
    checkpoint = data / "tiles" / "checkpoint"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if int(checkpoint.read_text().splitlines()[1]) == entries:
                return
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server wrote no tiles for {entries:,} entries in {timeout:.0f} s")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return found


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class Run:
    seconds: float
    entries: int
    workers: int
    peak_sum: int  # bytes: the command and its workers together, sampled
    # bytes: the largest single process, sampled (the kernel's high-water mark of a child
    # forked from this process counts this process's own memory)
    peak_one: int
    cpu: float  # seconds: the command and its workers
    server_cpu: float


def verify(server: Server, workers: int) -> Run:
    """The real `vault verify` against the running server, its memory sampled as it runs."""
    env = server.env()
    with tempfile.TemporaryDirectory(prefix="verify-state-") as state:
        env["XDG_STATE_HOME"] = state
        server_before = _cpu(server.pid)
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "verify", "--json", "--workers", str(workers)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        peak = [0, 0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                each = [_rss(process.pid), *(_rss(c) for c in _children(process.pid))]
                peak[0] = max(peak[0], sum(each))
                peak[1] = max(peak[1], *each)

        sampler = threading.Thread(target=sample)
        sampler.start()
        assert process.stdout is not None
        output = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
        server_cpu = _cpu(server.pid) - server_before
    report = json.loads(output)
    assert process.returncode == 0 and report["ok"], output[-2000:]
    return Run(
        seconds,
        report["ledger"]["entries"],
        report["ledger"]["workers"],
        peak[0],
        peak[1],
        usage.ru_utime + usage.ru_stime,
        server_cpu,
    )


def bare_hashing(server: Server, tmp: Path, limit: int = 200_000) -> float:
    """Leaf hashes of the first `limit` stored entries a second, in this process."""
    client = VaultClient(server.address, state=tmp / "state.json")
    bodies: list[bytes] = []
    for batch in client.ledger.ReadEntries(pb.ReadEntriesRequest()):
        bodies.extend(e.body for e in batch.entries)
        if len(bodies) >= limit:
            break
    client.close()
    sha = hashlib.sha256
    start = time.perf_counter()
    for body in bodies:
        sha(b"\x00" + body).digest()
    return len(bodies) / (time.perf_counter() - start)


def summary(label: str, runs: list[Run]) -> tuple[float, float]:
    rate = statistics.median(r.entries / r.seconds for r in runs)
    peak = max(r.peak_sum for r in runs) / MIB
    print(
        f"{label:<28} {rate:>10,.0f} entries/s  median of {len(runs)} "
        f"({', '.join(f'{r.seconds:.1f}' for r in runs)} s); peak RSS {peak:.0f} MiB all "
        f"processes, {max(r.peak_one for r in runs) / MIB:.0f} MiB the largest; CPU s per "
        f"million: command {statistics.median(r.cpu / r.entries for r in runs) * 1e6:.1f}, "
        f"server {statistics.median(r.server_cpu / r.entries for r in runs) * 1e6:.1f}"
    )
    return rate, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        data = Path(tmp) / "data"
        start = time.perf_counter()
        size = build(data, args.entries)
        print(f"built a {size:,}-entry ledger in {time.perf_counter() - start:.1f} s")
        with vault_server(data_dir=data, env={"PINVAULT_LEDGER_ORIGIN": ORIGIN}) as server:
            tiles_written(data, size)
            alone: list[Run] = []
            chunks: list[Run] = []
            for _ in range(args.repeat):
                alone.append(verify(server, 1))
                chunks.append(verify(server, args.workers))
            hash_rate = bare_hashing(server, Path(tmp))
    assert all(r.entries == size for r in alone + chunks)
    print(f"vault verify of {size:,} entries, load average {os.getloadavg()[0]:.1f}:")
    old, _ = summary("one process (--workers 1)", alone)
    new, peak = summary(f"in chunks (--workers {chunks[0].workers})", chunks)
    print(f"{'bare leaf hashing':<28} {hash_rate:>10,.0f} entries/s (one core, no decoding)")
    print(
        f"in chunks / one process: {new / old:.2f}x; goals: >= 200,000 entries/s "
        f"({'met' if new >= 200_000 else 'not met'}), peak < 200 MiB "
        f"({'met' if peak < 200 else 'not met'})"
    )


if __name__ == "__main__":
    main()
