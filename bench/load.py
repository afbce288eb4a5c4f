"""A load that holds: clients of mixed traffic against one `vault serve` with three MinIO mirrors,
the server killed (SIGKILL) and started again once half-way, and then every acknowledged write
checked. The figures: errors outside the restart window (goal 0), acknowledged writes lost (goal
0), `vault verify --blobs` (goal: passes), the server's memory over the run (goal: flat), and
p50 / p99 latency per call kind.

Each client calls back to back, one call at a time, choosing among puts (1 KiB up to
--max-put-mib, sizes spread evenly over their logarithm; the bytes are generated as they are
sent, never held whole), whole gets and range gets (every byte compared with what was put),
pins, batch pins, look-ups (each must show the acknowledged pin it looks for, with a verified
proof) and admissions. Puts share a budget of --put-mib-s, so that the disk holds the run (each
blob is kept four times: hot and three mirrors); a client that finds it spent calls something
else, so puts are fewer than their share of the mix. The clients run as threads, spread over
--processes processes so that no one interpreter lock paces them all. After the load: every
acknowledged put is fetched and its digest checked, every acknowledged pin and admission is
looked up and must be there with a verified proof, the mirrors catch up and `vault verify
--blobs` runs. The server's RSS is read from /proc every second and drawn to --plot.

    uv run python -m bench.load [--seconds 600] [--clients 64] [--max-put-mib 64]
        [--put-mib-s 4] [--processes 2] [--plot .cache/bench/load.png]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import math
import multiprocessing
import os
import queue
import random
import secrets
import signal
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, cast

from bench.common import ROOT
from tests.services.s3 import MinioServer
from tests.services.vault_server import VaultServer
from tests.test_mirror import mirror_env
from vault.client import VaultClient
from vault.client.channel import rpc_errors
from vault.ledger.entry import Entry
from vault.store.manifest import FileEntry, build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb

# Call kinds and how often each is chosen.
MIX: Final = {
    "put": 20,
    "get": 15,
    "range": 15,
    "pin": 15,
    "pin-batch": 5,
    "lookup": 20,
    "admit": 10,
}
KINDS: Final = tuple(MIX)
MIN_PUT: Final = 1 << 10
MAX_RANGE: Final = 1 << 20
PINS_PER_BATCH: Final = (2, 32)
# Admissions choose among this many seeds: a first admission of a seed appends a run, a later
# one finds it.
ADMIT_SEEDS: Final = 2000
# A call that takes longer than this has failed.
CALL_TIMEOUT: Final = 120.0
# A client waits this long after a failed call before its next, as a client would.
BACKOFF: Final = 0.25
# After the restarted server answers, clients' channels reconnect on gRPC's own backoff (1 s,
# growing by 1.6 each attempt): their failures until this many seconds later count as the
# restart's.
RECONNECT_GRACE: Final = 10.0
# The server's RSS is compared over these many seconds (medians of the samples).
RSS_SPAN: Final = 5.0
SEED: Final = 20261125
_POOL: Final = 8 << 20
_BLOCK: Final = 64 << 10
_READ: Final = 1 << 20
# Clients that fetch the acknowledged puts back at the end.
_FETCHERS: Final = 4


# -- generated blobs ---------------------------------------------------------------------------


class Content:
    """The bytes of every generated blob, any range of which is made again without the rest:
    blocks of one pool of random bytes at offsets that the blob's name and the block's number
    pick, the first bytes of the first block being the name (so no two blobs are the same)."""

    def __init__(self) -> None:
        self.pool = random.Random(SEED).randbytes(_POOL)

    def block(self, name: bytes, number: int) -> bytes:
        pick = hashlib.blake2b(name + number.to_bytes(8, "little"), digest_size=8).digest()
        at = int.from_bytes(pick, "little") % (_POOL - _BLOCK)
        data = self.pool[at : at + _BLOCK]
        return name + data[len(name) :] if number == 0 else data

    def read(self, name: bytes, start: int, length: int) -> bytes:
        parts = []
        at = start
        end = start + length
        while at < end:
            number, into = divmod(at, _BLOCK)
            piece = self.block(name, number)[into : into + end - at]
            parts.append(piece)
            at += len(piece)
        return b"".join(parts)


class Generated(io.RawIOBase):
    """A blob as a stream, made as it is read, hashed (sha256) as it goes."""

    def __init__(self, content: Content, name: bytes, size: int) -> None:
        super().__init__()
        self.content = content
        self.name = name
        self.size = size
        self.at = 0
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        left = self.size - self.at
        n = left if n < 0 else min(n, left)
        data = self.content.read(self.name, self.at, n)
        self.at += len(data)
        self.sha256.update(data)
        return data


# -- what the clients record --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Blob:
    digest: str
    name: bytes
    size: int


@dataclass(frozen=True, slots=True)
class Pin:
    digest: str
    index: int
    tag: str


@dataclass(frozen=True, slots=True)
class Call:
    kind: str
    start: float
    seconds: float
    error: str = ""
    size: int = 0


@dataclass
class Recorded:
    """What one process of clients saw: every call, and every write acknowledged to it."""

    calls: list[Call] = field(default_factory=list)
    blobs: list[Blob] = field(default_factory=list)
    pins: list[Pin] = field(default_factory=list)
    # Run id and the index of its admission entry.
    runs: list[tuple[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """What every process of clients is told."""

    address: str
    seconds: float
    threads: int
    process: int
    max_put: int
    put_bytes_per_s: float
    image: str
    dataset: str
    token: str
    cache: str


class ByteBudget:
    """Puts share a rate of bytes. A put may start while the budget is not spent, and its bytes
    are taken whatever its size (the budget may go below nothing, and refills from there), so
    large puts are not crowded out by small ones; a client that finds it spent calls something
    else."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.left = 0.0
        self.when = time.monotonic()
        self.lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self.lock:
            now = time.monotonic()
            # At most a second's worth is saved up while nobody puts.
            self.left = min(self.rate, self.left + (now - self.when) * self.rate)
            self.when = now
            if self.left <= 0:
                return False
            self.left -= size
            return True


class Client:
    """One client: a connection of its own, calling back to back until the deadline."""

    def __init__(
        self, plan: Plan, number: int, content: Content, budget: ByteBudget, seen: Recorded
    ) -> None:
        self.plan = plan
        self.number = number
        self.content = content
        self.budget = budget
        self.seen = seen
        self.rng = random.Random(f"{SEED}-{plan.token}-{plan.process}-{number}")
        self.count = 0
        self.vault = VaultClient(plan.address, author="load", timeout=CALL_TIMEOUT)

    def loop(self, deadline: float) -> None:
        calls: dict[str, Callable[[Any], int]] = {
            "put": self.put,
            "get": self.get,
            "range": self.range,
            "pin": self.pin,
            "pin-batch": self.pin_batch,
            "lookup": self.lookup,
            "admit": self.admit,
        }
        weights = [MIX[kind] for kind in KINDS]
        with self.vault:
            while time.monotonic() < deadline:
                kind, prepared = self._choose(weights)
                start = time.monotonic()
                try:
                    size = calls[kind](prepared)
                except Exception as exc:
                    failed = " ".join(f"{type(exc).__name__}: {exc}".split())
                    self.seen.calls.append(Call(kind, start, time.monotonic() - start, failed))
                    time.sleep(BACKOFF)
                else:
                    self.seen.calls.append(Call(kind, start, time.monotonic() - start, "", size))

    def _choose(self, weights: list[int]) -> tuple[str, Any]:
        """The next call and what it works on, chosen before its clock starts: a put only while
        the budget of bytes allows; a call that needs what was put or pinned only once there
        is some."""
        while True:
            kind = self.rng.choices(KINDS, weights)[0]
            if kind == "put":
                span = math.log(self.plan.max_put / MIN_PUT)
                size = int(MIN_PUT * math.exp(self.rng.random() * span))
                if self.budget.take(size):
                    self.count += 1
                    name = f"{self.plan.token}/{self.plan.process}/{self.number}/{self.count}"
                    return kind, (name.encode(), size)
            elif kind in ("get", "range", "pin") and self.seen.blobs:
                return kind, self.rng.choice(self.seen.blobs)
            elif kind == "pin-batch" and self.seen.blobs:
                count = self.rng.randint(*PINS_PER_BATCH)
                return kind, [self.rng.choice(self.seen.blobs) for _ in range(count)]
            elif kind == "lookup" and self.seen.pins:
                return kind, self.rng.choice(self.seen.pins)
            elif kind == "admit":
                return kind, self.rng.randrange(ADMIT_SEEDS)
            elif not self.seen.blobs:
                # Nothing put yet and no budget for it: wait for the budget to refill.
                time.sleep(0.05)

    def _tag(self) -> str:
        self.count += 1
        return f"{self.plan.process}.{self.number}.{self.count}"

    def put(self, job: tuple[bytes, int]) -> int:
        name, size = job
        stream = Generated(self.content, name, size)
        stored = self.vault.put(cast(IO[bytes], stream)).blob
        made = f"sha256:{stream.sha256.hexdigest()}"
        if str(stored.sha256) != made or stored.size != size:
            raise AssertionError(f"put {made} of {size} bytes, the vault stored {stored.sha256}")
        self.seen.blobs.append(Blob(made, name, size))
        return size

    def get(self, blob: Blob) -> int:
        digest = hashlib.sha256()
        with self.vault.open(blob.digest) as reader:
            while data := reader.read(_READ):
                digest.update(data)
        if f"sha256:{digest.hexdigest()}" != blob.digest:
            raise AssertionError(f"get {blob.digest} read other bytes")
        return blob.size

    def range(self, blob: Blob) -> int:
        offset = self.rng.randrange(blob.size)
        length = min(self.rng.randint(1, MAX_RANGE), blob.size - offset)
        with self.vault.open(blob.digest, offset=offset, length=length) as reader:
            data = reader.read()
        if data != self.content.read(blob.name, offset, length):
            raise AssertionError(f"range {offset}+{length} of {blob.digest} read other bytes")
        return length

    def pin(self, blob: Blob) -> int:
        tag = self._tag()
        proven = self.vault.pin("artefact", blob.digest, meta={"load": tag})
        self.seen.pins.append(Pin(blob.digest, proven.entry.index, tag))
        return 1

    def pin_batch(self, blobs: list[Blob]) -> int:
        tags = [self._tag() for _ in blobs]
        request = pb.PinBatchRequest(
            pins=[
                pb.PinRequest(kind="artefact", subjects=[b.digest], meta={"load": t}, author="load")
                for b, t in zip(blobs, tags, strict=True)
            ]
        )
        with rpc_errors():
            response = self.vault.ledger.PinBatch(request, timeout=CALL_TIMEOUT)
        if len(response.entries) != len(blobs):
            raise AssertionError(f"pinned {len(blobs)}, the vault answered {len(response.entries)}")
        for blob, tag, stored in zip(blobs, tags, response.entries, strict=True):
            entry = Entry.decode(stored.body)
            if entry.subjects != (blob.digest,) or entry.meta.get("load") != tag:
                raise AssertionError(f"pin {tag} of {blob.digest}: entry {stored.index} is another")
            self.seen.pins.append(Pin(blob.digest, stored.index, tag))
        return len(blobs)

    def lookup(self, pin: Pin) -> int:
        found = self.vault.lookup(pin.digest)
        if pin.index not in {p.entry.index for p in found}:
            raise AssertionError(f"look-up of {pin.digest} lacks acknowledged entry {pin.index}")
        return len(found)

    def admit(self, seed: int) -> int:
        admission = self.vault.admit(image=self.plan.image, dataset=self.plan.dataset, seed=seed)
        self.seen.runs.append((admission.run_id, admission.entry.entry.index))
        return 1


def clients(plan: Plan, go: Any, start: Any, out: Any) -> None:
    """One process of clients (in a process of its own): says on `out` that it is ready, calls
    from `go` until `start` + the plan's seconds, then puts what it saw on `out`."""
    os.environ["XDG_CACHE_HOME"] = plan.cache
    content = Content()
    budget = ByteBudget(plan.put_bytes_per_s)
    seen = Recorded()
    team = [Client(plan, n, content, budget, seen) for n in range(plan.threads)]
    out.put(None)
    go.wait()
    deadline = start.value + plan.seconds
    threads = [threading.Thread(target=client.loop, args=(deadline,)) for client in team]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(seen)


def run_clients(plans: list[Plan], during: Callable[[float], None]) -> tuple[float, list[Recorded]]:
    """Every process of clients started and ready, then set going at once; `during` is called
    with the time they started, while they run. Returns that time and what each saw."""
    context = multiprocessing.get_context("spawn")
    go, start, out = context.Event(), context.Value("d", 0.0), context.Queue()
    workers = [context.Process(target=clients, args=(plan, go, start, out)) for plan in plans]
    for worker in workers:
        worker.start()
    try:
        _collect(out, workers)
        began = time.monotonic()
        start.value = began
        go.set()
        during(began)
        recorded: list[Recorded] = _collect(out, workers)
    finally:
        for worker in workers:
            worker.join(60)
            if worker.is_alive():
                worker.kill()
    return began, recorded


def _collect(out: Any, workers: list[Any]) -> list[Any]:
    """One message from each worker, failing if a worker dies first."""
    got: list[Any] = []
    while len(got) < len(workers):
        with contextlib.suppress(queue.Empty):
            got.append(out.get(timeout=1.0))
            continue
        dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"a process of clients exited with status {dead[0]}")
    return got


# -- the server, its memory and its restart ------------------------------------------------------


class Memory:
    """The server's resident set size (the `vault serve` process, VmRSS), read every second."""

    def __init__(self, server: VaultServer, began: float) -> None:
        self.server = server
        self.began = began
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            process = self.server.process
            if process is None:
                continue
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
            except OSError:
                continue
            # A process killed and not yet reaped has no memory left to show.
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    mib = int(line.split()[1]) / 1024
                    self.samples.append((time.monotonic() - self.began, mib))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def median(self, start: float, end: float) -> float:
        values = [mib for t, mib in self.samples if start <= t <= end]
        return statistics.median(values) if values else math.nan


def kill_and_restart(server: VaultServer) -> tuple[float, float]:
    """SIGKILL, then `vault serve` again on the same data and address; when each happened."""
    process = server.process
    assert process is not None
    killed = time.monotonic()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    server.process = None
    server.listen = server.address
    server.start()
    return killed, time.monotonic()


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Result:
    seconds: float
    clients: int
    calls: list[Call]
    killed: float
    ready: float
    began: float
    blobs: int
    blob_bytes: int
    pins: int
    runs: int
    lost: list[str]
    verify_ok: bool
    verify_tail: str
    memory: Memory
    # (segment, RSS after warm-up, RSS at its end) for the server before and after the restart.
    segments: list[tuple[str, float, float]]

    @property
    def window(self) -> tuple[float, float]:
        return self.killed, self.ready + RECONNECT_GRACE

    def in_window(self, call: Call) -> bool:
        start, end = self.window
        return call.start <= end and call.start + call.seconds >= start

    @property
    def errors(self) -> list[Call]:
        """Failed calls outside the restart window."""
        return [c for c in self.calls if c.error and not self.in_window(c)]

    @property
    def restart_errors(self) -> list[Call]:
        return [c for c in self.calls if c.error and self.in_window(c)]


def run_load(
    *,
    seconds: float,
    clients_count: int,
    max_put: int,
    put_bytes_per_s: float,
    processes: int,
    work: Path,
    warmup: float,
    log: Callable[[str], None] = print,
) -> Result:
    """Start three MinIO servers and a vault on them, run the load with one SIGKILL and restart
    half-way, then check every acknowledged write and run `vault verify --blobs`."""
    with contextlib.ExitStack() as stack:
        minios = [stack.enter_context(MinioServer()) for _ in range(3)]
        endpoints = [server.create_bucket() for server in minios]
        env = mirror_env(endpoints)
        server = VaultServer(work / "vault", env=env)
        stack.enter_context(server)
        host_env = {**env, "PINVAULT_DATA_DIR": str(server.data_dir)}
        image, dataset = _inputs(server)
        log(
            f"vault serve on {server.address} with mirrors on 3 MinIO servers; {clients_count} "
            f"clients in {processes} processes for {seconds:.0f} s"
        )

        token = secrets.token_hex(4)
        per = [
            clients_count // processes + (n < clients_count % processes) for n in range(processes)
        ]
        plans = [
            Plan(
                address=server.address,
                seconds=seconds,
                threads=count,
                process=n,
                max_put=max_put,
                put_bytes_per_s=put_bytes_per_s * count / clients_count,
                image=image,
                dataset=dataset,
                token=token,
                cache=str(work / "cache"),
            )
            for n, count in enumerate(per)
            if count
        ]
        restart: list[float] = []
        memories: list[Memory] = []

        def during(began: float) -> None:
            memories.append(Memory(server, began))
            time.sleep(max(0.0, began + seconds / 2 - time.monotonic()))
            killed, ready = kill_and_restart(server)
            log(f"killed at {killed - began:.1f} s, serving again {ready - killed:.1f} s later")
            restart.extend((killed, ready))

        began, recorded = run_clients(plans, during)
        killed, ready = restart
        (memory,) = memories
        memory.stop()
        ended = began + seconds
        first, second = killed - began, ready - began
        segments = [
            (
                "before the restart",
                memory.median(warmup, warmup + RSS_SPAN),
                memory.median(first - RSS_SPAN, first),
            ),
            (
                "after the restart",
                memory.median(second + warmup, second + warmup + RSS_SPAN),
                memory.median(ended - began - RSS_SPAN, ended - began),
            ),
        ]

        calls = [c for r in recorded for c in r.calls]
        blobs = [b for r in recorded for b in r.blobs]
        pins = [p for r in recorded for p in r.pins]
        runs = [run for r in recorded for run in r.runs]
        log(
            f"load over: {len(calls):,} calls; checking {len(blobs):,} puts, {len(pins):,} pins "
            f"and {len(runs):,} admissions"
        )
        lost = check_writes(server.address, blobs, pins, runs)
        wait_for_mirrors(server, host_env)
        verified = server.run("verify", "--blobs")
        tail = "\n".join(
            line for line in verified.stdout.splitlines() if not line.startswith("  blob ")
        )
        return Result(
            seconds=seconds,
            clients=clients_count,
            calls=calls,
            killed=killed,
            ready=ready,
            began=began,
            blobs=len(blobs),
            blob_bytes=sum(b.size for b in blobs),
            pins=len(pins),
            runs=len(runs),
            lost=lost,
            verify_ok=verified.returncode == 0,
            verify_tail=(tail + "\n" + verified.stderr).strip(),
            memory=memory,
            segments=segments,
        )


def _inputs(server: VaultServer) -> tuple[str, str]:
    """An image and a dataset (a manifest of files, all stored), pinned, for the admissions."""
    with server.client() as client:
        image = str(client.put(b"an OCI image the load admits jobs on\n").blob.sha256)
        client.pin("image", image)
        files = []
        for n in range(8):
            data = f"x,y\n{n},{n * n}\n".encode()
            stored = str(client.put(data).blob.sha256)
            files.append(FileEntry(f"part-{n}.csv", len(data), 0o644, stored))
        manifest = encode_manifest(build_manifest(files))
        dataset = str(client.put(manifest).blob.sha256)
        client.pin("dataset", dataset, meta={"name": "load"})
    return image, dataset


def check_writes(
    address: str, blobs: Sequence[Blob], pins: Sequence[Pin], runs: Sequence[tuple[str, int]]
) -> list[str]:
    """Every acknowledged put fetched and its digest checked; every acknowledged pin and
    admission looked up, with a verified proof. What is missing or wrong, one line each."""
    lost: list[str] = []

    def fetch(share: Sequence[Blob]) -> None:
        with VaultClient(address, timeout=CALL_TIMEOUT) as client:
            for blob in share:
                digest = hashlib.sha256()
                try:
                    with client.open(blob.digest) as reader:
                        while data := reader.read(_READ):
                            digest.update(data)
                except Exception as exc:
                    lost.append(f"put {blob.digest}: {type(exc).__name__}: {exc}")
                    continue
                if f"sha256:{digest.hexdigest()}" != blob.digest:
                    lost.append(f"put {blob.digest}: read back other bytes")

    with ThreadPoolExecutor(_FETCHERS) as pool:
        list(pool.map(fetch, [blobs[n::_FETCHERS] for n in range(_FETCHERS)]))

    wanted: dict[str, set[int]] = defaultdict(set)
    for pin in pins:
        wanted[pin.digest].add(pin.index)
    for run_id, index in runs:
        wanted[run_id].add(index)
    digests = sorted(wanted)
    with VaultClient(address, timeout=CALL_TIMEOUT) as client:
        for at in range(0, len(digests), 500):
            batch = digests[at : at + 500]
            try:
                found = client.lookup_many(batch)
            except Exception as exc:
                lost.append(f"look-up of {len(batch)} digests: {type(exc).__name__}: {exc}")
                continue
            for digest in batch:
                missing = wanted[digest] - {p.entry.index for p in found.get(digest, [])}
                lost.extend(f"entry {index} pinning {digest}: not found" for index in missing)
    return lost


def wait_for_mirrors(server: VaultServer, env: dict[str, str], timeout: float = 1800) -> None:
    """Until every blob has its mirror copies (`vault mirror status`: nothing queued)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = server.run("mirror", "status", "--json", env=env).ok().json()
        if all(row["queued"] == 0 for row in rows):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mirrors did not catch up in {timeout:.0f} s: {rows}")
        time.sleep(1.0)


# -- the report ----------------------------------------------------------------------------------


def table(result: Result) -> str:
    by_kind: dict[str, list[Call]] = defaultdict(list)
    for call in result.calls:
        by_kind[call.kind].append(call)
    lines = [
        f"{'call':<10} {'calls':>9} {'per s':>8} {'MiB/s':>7} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'restart errors':>15} {'other errors':>13}"
    ]
    for kind in KINDS:
        calls = by_kind.get(kind, [])
        times = sorted(c.seconds for c in calls if not c.error)
        restart = sum(1 for c in calls if c.error and result.in_window(c))
        other = sum(1 for c in calls if c.error and not result.in_window(c))
        p50 = _percentile(times, 0.50) * 1000
        p99 = _percentile(times, 0.99) * 1000
        moved = (
            f"{sum(c.size for c in calls) / result.seconds / (1 << 20):>7.1f}"
            if kind in ("put", "get", "range")
            else f"{'':>7}"
        )
        lines.append(
            f"{kind:<10} {len(calls):>9,} {len(calls) / result.seconds:>8.1f} {moved} "
            f"{p50:>9.1f} {p99:>9.1f} {restart:>15,} {other:>13,}"
        )
    return "\n".join(lines)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(len(values) * q))]


def summary(result: Result) -> str:
    rss = [mib for _, mib in result.memory.samples]
    restart_errors = result.restart_errors
    last = max((c.start + c.seconds for c in restart_errors), default=result.ready) - result.ready
    lines = [
        f"restart: SIGKILL at {result.killed - result.began:.1f} s, serving again "
        f"{result.ready - result.killed:.1f} s later; {len(restart_errors):,} calls failed "
        f"in the window (the last {last:.1f} s after it served again)",
        f"errors outside the restart window: {len(result.errors)}",
        f"acknowledged writes: {result.blobs:,} puts ({result.blob_bytes / (1 << 20):,.0f} MiB), "
        f"{result.pins:,} pins, {result.runs:,} admissions; lost: {len(result.lost)}",
        f"vault verify --blobs: {'passed' if result.verify_ok else 'FAILED'}",
        f"server RSS: start {rss[0]:.0f} MiB, peak {max(rss):.0f} MiB, end {rss[-1]:.0f} MiB"
        if rss
        else "server RSS: no samples",
    ]
    for name, warm, end_rss in result.segments:
        lines.append(
            f"  {name}: {warm:.0f} MiB after warm-up, {end_rss:.0f} MiB at its end "
            f"({end_rss / warm:.2f}x)"
        )
    for call in result.errors[:10]:
        lines.append(f"  error: {call.kind} at {call.start - result.began:.1f} s: {call.error}")
    lines.extend(f"  lost: {line}" for line in result.lost[:10])
    if not result.verify_ok:
        lines.append(result.verify_tail)
    return "\n".join(lines)


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    times = [t for t, _ in result.memory.samples]
    rss = [mib for _, mib in result.memory.samples]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(times, rss, "-", linewidth=1, label="vault serve RSS")
    ax.axvspan(
        result.killed - result.began,
        result.ready - result.began,
        color="red",
        alpha=0.2,
        label="SIGKILL to serving again",
    )
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result.clients} clients, mixed traffic, 3 MinIO mirrors")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-put-mib", type=float, default=64.0)
    parser.add_argument("--put-mib-s", type=float, default=4.0, help="bytes put a second, shared")
    parser.add_argument("--processes", type=int, default=2, help="processes the clients share")
    parser.add_argument(
        "--warmup", type=float, help="seconds of each half before its RSS is taken (a fifth)"
    )
    parser.add_argument("--plot", type=Path, default=ROOT / ".cache/bench/load.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(
        prefix="pinvault-load-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        result = run_load(
            seconds=args.seconds,
            clients_count=args.clients,
            max_put=int(args.max_put_mib * (1 << 20)),
            put_bytes_per_s=args.put_mib_s * (1 << 20),
            processes=args.processes,
            work=Path(tmp),
            warmup=args.warmup if args.warmup is not None else args.seconds / 5,
        )
    plot(result, args.plot)
    print(table(result))
    print(summary(result))
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
