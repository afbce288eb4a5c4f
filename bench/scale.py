"""How the vault's figures move as the ledger grows: one ledger grown through a real `vault serve`
(PinBatch over gRPC) to each size in turn, on SQLite and on PostgreSQL, with every figure shown
beside its own value at 10,000 entries from the same run (the baseline is the small ledger).

At each size, on top of the ledger as grown (the measurements add about 50,000 entries; the
next size is then grown to exactly its count):

- batch appends (1,000 a call, 4 writers, 5 rounds of 8 calls, median) and single appends
  (16 in flight from h2load, a fixed count of calls so that every answer has the same size);
  on SQLite, beside them, SQLite alone appending the same number of the same rows to a copy of
  the grown database (bench.append's baseline), so that the curve of the store can be told
  from the vault's;
- look-ups of present and of absent digests, each call a different digest, from a Python loop
  with one call in flight (p50/p99), and of one present digest from h2load, 16 in flight;
- GetInclusionProof (random index) and GetConsistencyProof (random old size to the latest),
  from the same Python loop;
- checkpoint signing: GetCheckpoint straight after one append (it signs the new size), beside
  GetCheckpoint with nothing new to sign;
- `vault verify` (the real command) time and its peak RSS (GNU time);
- the server's RSS when idle after the growth, and its peak RSS (VmHWM) from a fresh start on
  the grown data; start-up from spawning `vault serve` to the first successful look-up, with the
  page cache warm and after dropping it (as root);
- bytes on disk per entry (vault.db and its WAL, or pg_database_size).

    uv run --no-sync python -m bench.scale [--to 10k|100k|1M|3M|10M]
        [--engine sqlite|postgres|both] [--two-servers] [--quick] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from pathlib import Path

import grpc
import sqlalchemy as sa

import tests.services.vault_server as vault_server_module
from bench.append import bare_sqlite_batch_rate
from bench.common import ROOT

# h2load's run-and-check-every-answer step, reused for a run by count rather than duration.
from bench.h2load import _run as h2load_checked
from bench.h2load import unary_load
from tests.services.postgres import PostgresServer
from tests.services.vault_server import VaultServer, command_env
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

SIZES = {"10k": 10_000, "100k": 100_000, "1M": 1_000_000, "3M": 3_000_000, "10M": 10_000_000}
ORIGIN = "bench.pinvault/scale"
ENV = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}
GROW_BATCH = 2000
WRITERS = 4
BATCH = 1000
BATCH_CALLS = 8
BATCH_ROUNDS = 5
SINGLE_CALLS = 5000
SINGLE_WARMUP = 500
PROBES = 1000
SIGNINGS = 15
PIN = "/pinvault.v1.Ledger/Pin"
LOOKUP = "/pinvault.v1.Ledger/Lookup"
MIB = 1 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
# A server rebuilding the tree of a large ledger takes longer than a test's server to listen.
vault_server_module.START_TIMEOUT = 600.0


@dataclass(frozen=True)
class Figure:
    key: str
    header: str
    unit: str
    # The second key of a "p50 / p99" cell; its ratio is the p99's.
    pair: str = ""
    digits: int = 0


FIGURES = [
    Figure("batch", "batch appends/s", "entries/s"),
    Figure("bare", "SQLite alone, the same rows", "entries/s"),
    Figure("single", "single appends/s", "appends/s"),
    Figure("hit_p50", "look-up, present, p50 / p99", "ms", "hit_p99", 2),
    Figure("miss_p50", "look-up, absent, p50 / p99", "ms", "miss_p99", 2),
    Figure("h2_rate", "look-ups/s (h2load)", "look-ups/s"),
    Figure("incl_p50", "inclusion proof p50 / p99", "ms", "incl_p99", 2),
    Figure("cons_p50", "consistency proof p50 / p99", "ms", "cons_p99", 2),
    Figure("sign", "checkpoint after 1 append", "ms", "", 2),
    Figure("verify_s", "`vault verify`", "s", "", 1),
    Figure("verify_mib", "verify peak RSS", "MiB"),
    Figure("rss_mib", "server RSS idle", "MiB"),
    Figure("hwm_mib", "server peak RSS at start", "MiB"),
    Figure("start_warm", "start-up, warm", "s", "", 2),
    Figure("start_cold", "start-up, caches dropped", "s", "", 2),
    Figure("bytes", "disk bytes/entry", "B"),
]


@dataclass
class Point:
    engine: str
    size: int
    figures: dict[str, float] = field(default_factory=dict)
    grow_s: float = 0.0
    grown: int = 0
    measure_s: float = 0.0
    label: str = ""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def random_digest() -> str:
    return "sha256:" + os.urandom(32).hex()


def pin(digest: str) -> pb.PinRequest:
    return pb.PinRequest(kind="artefact", subjects=[digest], external=True, author="bench")


def ledger_size(ledger: rpc.LedgerStub) -> int:
    return int(ledger.GetCheckpoint(pb.GetCheckpointRequest()).note.split("\n")[1])


def vm_kib(pid: int, field_name: str) -> int:
    found = re.search(rf"{field_name}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert found, field_name
    return int(found.group(1))


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(len(samples) * 0.99))]


# ------------------------------------------------------------------------------ the ledger


class Pool:
    """Digests known to be pinned, kept evenly over the whole ledger (every `stride`th pin)."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self.digests: list[str] = []
        self._seen = 0
        self._lock = threading.Lock()

    def offer(self, digests: Sequence[str]) -> None:
        with self._lock:
            start = (-self._seen) % self.stride
            self.digests.extend(digests[start :: self.stride])
            self._seen += len(digests)

    def sample(self, count: int) -> list[str]:
        return random.choices(self.digests, k=count)


def grow(address: str, target: int, pool: Pool) -> tuple[float, int]:
    """PinBatch calls from WRITERS threads of `target` entries in all (the ledger then holds
    those, and the `index` entries the writer appended among them); the seconds it took and
    the entries added."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        ledger = rpc.LedgerStub(channel)
        before = ledger_size(ledger)
        left = target - before
        lock = threading.Lock()

        def writer() -> None:
            nonlocal left
            while True:
                with lock:
                    count = min(GROW_BATCH, left)
                    left -= count
                if count <= 0:
                    return
                raw = os.urandom(32 * count).hex()
                digests = ["sha256:" + raw[i * 64 : (i + 1) * 64] for i in range(count)]
                ledger.PinBatch(pb.PinBatchRequest(pins=[pin(d) for d in digests]))
                pool.offer(digests)

        start = time.perf_counter()
        with ThreadPoolExecutor(WRITERS) as threads:
            for done in [threads.submit(writer) for _ in range(WRITERS)]:
                done.result()
        took = time.perf_counter() - start
        after = ledger_size(ledger)
        assert after >= target, (after, target)
    return took, after - before


def batch_rate(addresses: Sequence[str], writers: int) -> float:
    """Entries a second from `writers` threads per address, each sending BATCH_CALLS // 4
    batches of BATCH; the median of BATCH_ROUNDS rounds."""
    channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
    try:
        stubs = [rpc.LedgerStub(c) for c in channels]
        rates = []
        for _ in range(BATCH_ROUNDS):
            calls = [
                (stub, pb.PinBatchRequest(pins=[pin(random_digest()) for _ in range(BATCH)]))
                for stub in stubs
                for _ in range(BATCH_CALLS * writers // WRITERS)
            ]
            start = time.perf_counter()
            with ThreadPoolExecutor(writers * len(stubs)) as threads:
                list(threads.map(lambda call: call[0].PinBatch(call[1]), calls))
            rates.append(len(calls) * BATCH / (time.perf_counter() - start))
        return statistics.median(rates)
    finally:
        for channel in channels:
            channel.close()


def single_rate(address: str) -> float:
    """16 single appends in flight from h2load, a fixed count of calls (a run by duration
    could carry the index across a size of its encoding, which h2load's check of the answers
    would take for a failure)."""
    request = pin(random_digest())
    with grpc.insecure_channel(address) as channel:
        answer = rpc.LedgerStub(channel).Pin(request).ByteSize()
    with tempfile.TemporaryDirectory(prefix="pinvault-h2load-") as tmp:
        body = Path(tmp) / "request"
        data = request.SerializeToString()
        body.write_bytes(b"\0" + len(data).to_bytes(4, "big") + data)
        command = [
            "h2load",
            "--clients=1",
            "--max-concurrent-streams=16",
            "--threads=1",
            f"--data={body}",
            "--header=content-type: application/grpc",
            "--header=te: trailers",
            f"http://{address}{PIN}",
        ]
        h2load_checked([*command, f"--requests={SINGLE_WARMUP}"], answer)
        report = h2load_checked([*command, f"--requests={SINGLE_CALLS}"], answer)
    found = re.search(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s", report)
    assert found, report
    return float(found.group(3))


# ------------------------------------------------------------------------------ reads


def timed_calls(calls: Sequence[Callable[[], object]]) -> tuple[float, float]:
    """p50 and p99 in ms of `calls`, one at a time, after a tenth of them as a warm-up."""
    for call in calls[: len(calls) // 10]:
        call()
    samples = []
    for call in calls:
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    p50, p99 = percentiles(samples)
    return p50 * 1000, p99 * 1000


def reads(address: str, pool: Pool, point: Point) -> None:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        ledger = rpc.LedgerStub(channel)
        size = ledger_size(ledger)

        def present(digest: str) -> Callable[[], object]:
            def call() -> None:
                assert ledger.Lookup(pb.LookupRequest(digest=digest)).entries

            return call

        def absent(digest: str) -> Callable[[], object]:
            def call() -> None:
                # Answered with the proof that no entry names it (no entries), not an error.
                answer = ledger.Lookup(pb.LookupRequest(digest=digest))
                assert not answer.entries and answer.map.entries, f"{digest} was found"

            return call

        def inclusion(index: int) -> Callable[[], object]:
            return lambda: ledger.GetInclusionProof(pb.InclusionProofRequest(index=index))

        def consistency(old: int) -> Callable[[], object]:
            return lambda: ledger.GetConsistencyProof(pb.ConsistencyProofRequest(old_size=old))

        f = point.figures
        f["hit_p50"], f["hit_p99"] = timed_calls([present(d) for d in pool.sample(PROBES)])
        f["miss_p50"], f["miss_p99"] = timed_calls([absent(random_digest()) for _ in range(PROBES)])
        indexes = [random.randrange(size) for _ in range(PROBES)]
        f["incl_p50"], f["incl_p99"] = timed_calls([inclusion(i) for i in indexes])
        f["cons_p50"], f["cons_p99"] = timed_calls([consistency(i + 1) for i in indexes])

        request = pb.LookupRequest(digest=pool.sample(1)[0])
        answer = ledger.Lookup(request).ByteSize()
        hot = unary_load(
            address, LOOKUP, request.SerializeToString(), answer, seconds=3.0, warmup=0.5
        )
        f["h2_rate"], f["h2_p99"] = hot.rate, hot.p99 * 1000

        # GetCheckpoint straight after an append signs the new size before it answers (the
        # periodic signer, once a second, rarely gets there first); beside it, the same call
        # with nothing new to sign.
        signing, idle = [], []
        for _ in range(SIGNINGS):
            ledger.Pin(pin(random_digest()))
            start = time.perf_counter()
            ledger.GetCheckpoint(pb.GetCheckpointRequest())
            signing.append(time.perf_counter() - start)
            start = time.perf_counter()
            ledger.GetCheckpoint(pb.GetCheckpointRequest())
            idle.append(time.perf_counter() - start)
        f["sign"] = statistics.median(signing) * 1000
        f["getcp"] = statistics.median(idle) * 1000


def verify(address: str, tmp: Path, point: Point) -> None:
    """The real `vault verify`, under GNU time for its peak RSS, with fresh trust state."""
    state = Path(tempfile.mkdtemp(prefix="verify-state-", dir=tmp))
    env = command_env(state_home=state, extra={"PINVAULT_CLIENT_SERVER": address})
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "maxrss=%M", sys.executable, "-m", "cli.main", "verify"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - start
    if done.returncode != 0 or "ledger OK" not in done.stdout:
        raise RuntimeError(f"vault verify failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    found = re.search(r"maxrss=(\d+)", done.stderr)
    assert found, done.stderr
    point.figures["verify_s"] = took
    point.figures["verify_mib"] = int(found.group(1)) * 1024 / MIB


# ------------------------------------------------------------------------------ servers


class Engine:
    """Where a ledger lives: SQLite in the server's data folder, or a PostgreSQL database."""

    def __init__(self, name: str, base: Path, postgres: PostgresServer | None) -> None:
        self.name = name
        self.base = base
        self.data_dir = base / "data"
        self.url = postgres.create_database() if postgres is not None else None
        self._starts = 0

    def server(self) -> VaultServer:
        """A new `vault serve` (not yet started) on this engine's ledger."""
        self._starts += 1
        return VaultServer(
            self.base / f"serve-{self._starts}", data_dir=self.data_dir, database=self.url, env=ENV
        )

    def bare_rate(self, entries: int) -> float:
        """SQLite alone appending `entries` of the same rows to a copy of the stopped vault's
        database (bench.append's baseline, at this size)."""
        copy = self.base / "bare.db"
        try:
            for suffix in ("", "-wal"):
                if (self.data_dir / f"vault.db{suffix}").exists():
                    shutil.copyfile(self.data_dir / f"vault.db{suffix}", f"{copy}{suffix}")
            return bare_sqlite_batch_rate(entries, copy)
        finally:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{copy}{suffix}").unlink(missing_ok=True)

    def disk_bytes(self) -> int:
        if self.url is None:
            # The database's files and its subject index's runs beside it.
            files = [f for p in self.data_dir.glob("vault.db*") for f in [p, *p.rglob("*")]]
            return sum(f.stat().st_size for f in files if f.is_file())
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        sa.text("SELECT pg_database_size(current_database())")
                    ).scalar_one()
                )
        finally:
            engine.dispose()


def drop_caches() -> str | None:
    """Empty the page cache; the reason if this process may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"cannot drop the page cache ({exc.strerror}): start-up after it not measured"
    return None


def timed_start(engine: Engine, probe: str) -> tuple[VaultServer, float, float]:
    """A fresh `vault serve` on the grown data: seconds from spawn to the first successful
    look-up, and its peak RSS (MiB) by then."""
    server = engine.server()
    start = time.perf_counter()
    server.start()
    with grpc.insecure_channel(server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        ledger.Lookup(pb.LookupRequest(digest=probe), wait_for_ready=True, timeout=600)
    took = time.perf_counter() - start
    assert server.process is not None
    return server, took, vm_kib(server.process.pid, "VmHWM") / 1024


@contextmanager
def running(server: VaultServer) -> Iterator[VaultServer]:
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------------------ the run


def measure_engine(
    name: str,
    sizes: Sequence[int],
    postgres: PostgresServer | None,
    tmp: Path,
    *,
    two_servers: bool,
    notes: list[str],
    points: list[Point],
) -> None:
    """Grow one ledger on `name` through `sizes`, adding a point to `points` at each."""
    engine = Engine(name, tmp / name, postgres)
    pool = Pool(max(1, sizes[-1] // 50_000))
    server = engine.server().start()
    try:
        for size in sizes:
            point = Point(name, size)
            log(f"{name}: growing to {size:,}")
            point.grow_s, point.grown = grow(server.address, size, pool)
            log(f"{name}: {size:,} in {point.grow_s:.1f} s; measuring")
            begin = time.perf_counter()
            f = point.figures
            time.sleep(2)  # idle: let the periodic signer and the allocator settle
            assert server.process is not None
            f["rss_mib"] = vm_kib(server.process.pid, "VmRSS") / 1024
            f["bytes"] = engine.disk_bytes() / size
            reads(server.address, pool, point)
            verify(server.address, tmp, point)
            f["single"] = single_rate(server.address)
            f["batch"] = batch_rate([server.address], WRITERS)

            probe = pool.sample(1)[0]
            server.stop()
            if engine.url is None:
                f["bare"] = engine.bare_rate(BATCH * BATCH_CALLS * BATCH_ROUNDS)
            server, f["start_warm"], f["hwm_mib"] = timed_start(engine, probe)
            server.stop()
            reason = drop_caches()
            if reason is None:
                server, f["start_cold"], _ = timed_start(engine, probe)
            else:
                if reason not in notes:
                    notes.append(reason)
                server = engine.server().start()
            point.measure_s = time.perf_counter() - begin
            log(f"{name}: {size:,} measured in {point.measure_s:.1f} s: {summary(point)}")
            points.append(point)

            if two_servers and name == "postgres" and size == SIZES["1M"]:
                points.append(two_server_point(engine, server, pool, size))
    finally:
        server.stop()


def two_server_point(engine: Engine, first: VaultServer, pool: Pool, size: int) -> Point:
    """A second `vault serve` with the same key and origin on the same PostgreSQL database:
    batch appends through both at once beside the same writers through one, and look-ups."""
    log("postgres: two servers on one database")
    config = engine.base / "second.toml"
    config.write_text(f'[ledger]\nkey_file = "{engine.data_dir / "checkpoint.key"}"\n')
    point = Point("postgres, 2 servers", size, label="2 servers")
    begin = time.perf_counter()
    second = VaultServer(
        engine.base / "second",
        database=engine.url,
        env=ENV,
        args=["--config", str(config)],
    )
    with running(second.start()):
        one = batch_rate([first.address], 2 * WRITERS)
        both = batch_rate([first.address, second.address], WRITERS)
        point.figures["batch"] = both
        point.figures["batch_one"] = one
        hits = []
        for server in (first, second):
            with grpc.insecure_channel(server.address) as channel:
                ledger = rpc.LedgerStub(channel)
                requests = [pb.LookupRequest(digest=d) for d in pool.sample(PROBES // 2)]
                hits.append(timed_calls([partial(ledger.Lookup, r) for r in requests]))
        point.figures["hit_p50"] = max(h[0] for h in hits)
        point.figures["hit_p99"] = max(h[1] for h in hits)
    point.measure_s = time.perf_counter() - begin
    log(f"two servers: {both:,.0f} entries/s from both, {one:,.0f} through one")
    return point


def summary(point: Point) -> str:
    return ", ".join(f"{k} {v:,.2f}" for k, v in point.figures.items())


# ------------------------------------------------------------------------------ output


def human(size: int) -> str:
    for name, count in SIZES.items():
        if count == size:
            return name
    return f"{size:,}"


def cell(figure: Figure, point: Point, base: Point | None) -> str:
    f = point.figures
    if figure.key not in f:
        return ""
    fmt = f"{{:,.{figure.digits}f}}"
    text = fmt.format(f[figure.key])
    ratio_key = figure.key
    if figure.pair:
        text += " / " + fmt.format(f[figure.pair])
        ratio_key = figure.pair
    if point.label and figure.key == "batch":
        return f"{text} ({f['batch'] / f['batch_one']:.2f}× one server)"
    if base is not None and ratio_key in base.figures and base is not point:
        text += f" ({f[ratio_key] / base.figures[ratio_key]:.2f}×)"
    return text


def table(points: Sequence[Point]) -> str:
    headers = ["engine", "entries"] + [f"{f.header} ({f.unit})" for f in FIGURES]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    bases = {p.engine: p for p in reversed(points) if p.size == SIZES["10k"]}
    for point in points:
        base = bases.get(point.engine.split(",")[0])
        cells = [point.engine, human(point.size)] + [cell(f, point, base) for f in FIGURES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points: Sequence[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [f for f in FIGURES if any(f.key in p.figures for p in points)]
    columns = 4
    rows = (len(shown) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    engines = dict.fromkeys(p.engine for p in points if not p.label)
    for ax, figure in zip(axes.flat, shown, strict=False):
        for engine in engines:
            curve = [p for p in points if p.engine == engine and figure.key in p.figures]
            xs = [p.size for p in curve]
            (line,) = ax.plot(xs, [p.figures[figure.key] for p in curve], "o-", label=engine)
            if figure.pair:
                ax.plot(
                    xs,
                    [p.figures[figure.pair] for p in curve],
                    "s--",
                    color=line.get_color(),
                    label=f"{engine} p99",
                )
        ax.set_xscale("log")
        ax.set_title(figure.header, fontsize=9)
        ax.set_ylabel(figure.unit, fontsize=8)
        ax.set_xlabel("entries", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle(f"pinvault at scale ({date.today().isoformat()})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_size(text: str) -> int:
    if text not in SIZES:
        raise argparse.ArgumentTypeError(f"one of {', '.join(SIZES)}, not {text!r}")
    return SIZES[text]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--to", type=parse_size, default=SIZES["1M"], help="the largest size")
    parser.add_argument("--engine", choices=["sqlite", "postgres", "both"], default="sqlite")
    parser.add_argument(
        "--two-servers", action="store_true", help="also two servers on one PostgreSQL at 1M"
    )
    parser.add_argument("--quick", action="store_true", help="10k and 100k only (a smoke run)")
    parser.add_argument("--plot", type=Path, default=ROOT / ".cache/bench/scale.png")
    args = parser.parse_args()
    top = SIZES["100k"] if args.quick else args.to
    sizes = [s for s in SIZES.values() if s <= top]
    engines = ["sqlite", "postgres"] if args.engine == "both" else [args.engine]

    notes: list[str] = []
    points: list[Point] = []
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(
        prefix="pinvault-scale-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        for name in engines:
            # One engine failing part way still leaves the other's rows (and its own so far).
            try:
                if name == "postgres":
                    with PostgresServer(fsync=True) as postgres:
                        measure_engine(
                            name,
                            sizes,
                            postgres,
                            Path(tmp),
                            two_servers=args.two_servers,
                            notes=notes,
                            points=points,
                        )
                else:
                    measure_engine(
                        name, sizes, None, Path(tmp), two_servers=False, notes=notes, points=points
                    )
            except Exception as exc:
                log(f"{name} failed: {exc!r}")
                notes.append(f"{name} stopped early: {exc}")
    plot(points, args.plot)

    print(
        f"pinvault at scale, {date.today().isoformat()}: one ledger grown through `vault serve` "
        f"(PinBatch, {WRITERS} writers) to each size; in brackets, each figure over its value "
        "at 10k in the same run (for p50 / p99, the p99's)"
    )
    print(table(points))
    print()
    for point in points:
        extra = ""
        if "getcp" in point.figures:
            extra = (
                f"; GetCheckpoint with nothing to sign {point.figures['getcp']:.2f} ms; "
                f"look-up p99 from h2load {point.figures['h2_p99']:.2f} ms"
            )
        if "batch_one" in point.figures:
            extra = (
                f"; both servers {point.figures['batch']:,.0f} entries/s, one server with the "
                f"same {2 * WRITERS} writers {point.figures['batch_one']:,.0f} entries/s"
            )
        grown = (
            f"grown by {point.grown:,} in {point.grow_s:.1f} s "
            f"({point.grown / point.grow_s:,.0f} entries/s), "
            if point.grow_s
            else ""
        )
        print(
            f"  {point.engine} {human(point.size)}: {grown}measured in {point.measure_s:.1f} s"
            f"{extra}"
        )
    for note in notes:
        print(f"  note: {note}")
    print(f"  total {time.perf_counter() - begin:.0f} s; plot: {args.plot}")


if __name__ == "__main__":
    main()
