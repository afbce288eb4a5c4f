"""The vault's Prometheus metrics: every call by method and status code and its latency (counted
at the transport edge), admission verdicts, and, read live at each scrape, the ledger's size and
checkpoint, the copies and bytes on each tier, the queues of copies still to make, scrubbing and
the damage found and repaired (counted by the tier manager, or from the journal of a hot tier
alone); served over HTTP for `vault serve --metrics-port`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from vault.errors import VaultError
from vault.server.assembly import manager_of
from vault.server.damage import KnownDamage
from vault.server.http_endpoint import Endpoint, Limits, Request, Response

if TYPE_CHECKING:
    from tiers.migrate import Migrator
    from tiers.scrub import Scrubber
    from tiers.worker import Worker
    from vault.ledger.log import Ledger
    from vault.server.content import Content
    from vault.server.store_service import ScrubRunner
    from vault.store.protocol import BlobStore

Family = GaugeMetricFamily | CounterMetricFamily

# Counters carry no `_created` series: one per label set, which nobody graphs.
disable_created_metrics()  # type: ignore[no-untyped-call]

# From a cached look-up (well under a millisecond) to a stream of a large blob (minutes).
_LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

RPCS: Final = Counter(
    "pinvault_rpc_requests",
    "Calls finished, by method (Service.Method) and gRPC status code.",
    ["method", "code"],
    registry=None,
)
RPC_SECONDS: Final = Histogram(
    "pinvault_rpc_duration_seconds",
    "Time from a call's arrival to its last response or its error, by method.",
    ["method"],
    buckets=_LATENCY_BUCKETS,
    registry=None,
)
ADMISSIONS: Final = Counter(
    "pinvault_admissions",
    "Admission verdicts: admitted, or refused with the class of error that refused the job.",
    ["verdict", "reason"],
    registry=None,
)

# A few scrapers, each every few seconds. The per-address cap is kept well above what they
# need: a new scrape evicts the oldest waiting connection of its address, so the more there
# are, the longer a genuine one outlasts callers that drip bytes and reconnect.
LIMITS: Final = Limits(workers=2, queue=8, per_address=32, connections=128)

ADMITTED: Final = "admitted"
REFUSED: Final = "refused"


def count_rpc(method: str, code: str, seconds: float) -> None:
    RPCS.labels(method, code).inc()
    RPC_SECONDS.labels(method).observe(seconds)


def count_admission(error: BaseException | None) -> None:
    """One admission verdict: admitted (no error), or refused by `error`."""
    if error is None:
        ADMISSIONS.labels(ADMITTED, "").inc()
    else:
        reason = type(error).__name__ if isinstance(error, VaultError) else "internal"
        ADMISSIONS.labels(REFUSED, reason).inc()


class ScrubWatch:
    """What on-demand scrubs (Store.Scrub) have done: the running one's progress, and the copies,
    bytes and faults of every finished one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = False
        self.done_bytes = 0
        self.total_bytes = 0
        self.finished: dict[str, int] = {}

    def watch(self, runner: ScrubRunner) -> ScrubRunner:
        """`runner`, telling this watch how it goes."""

        def run(
            rate: float | None, progress: Callable[[int, int], None], stop: threading.Event
        ) -> dict[str, int]:
            def relay(done: int, total: int) -> None:
                self.done_bytes, self.total_bytes = done, total
                progress(done, total)

            with self._lock:
                self.running, self.done_bytes, self.total_bytes = True, 0, 0
            try:
                stats = runner(rate, relay, stop)
            finally:
                self.running = False
            with self._lock:
                for name, value in stats.items():
                    self.finished[name] = self.finished.get(name, 0) + value
            return stats

        return run

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self.finished)


@dataclass(slots=True)
class Sources:
    """What the collector reads at each scrape; the parts a vault lacks are None or empty."""

    ledger: Ledger
    content: Content
    store: BlobStore
    workers: Sequence[Worker] = ()
    scrub: ScrubWatch = field(default_factory=ScrubWatch)


# The content catalogue's totals: a store with a single tier keeps no placement record.
_CATALOGUE_TOTALS: Final = "SELECT count(*), coalesce(sum(size), 0) FROM blobs"
_SCRUB_COUNTS: Final = (
    ("copies", "pinvault_scrub_checked_copies", "Copies the scrubber has checked."),
    ("bytes", "pinvault_scrub_checked_bytes", "Bytes of the copies the scrubber has checked."),
    ("faults", "pinvault_scrub_faults", "Damaged or missing copies the scrubber has found."),
)
_REPAIR_COUNTS: Final = (
    (
        "faults",
        "pinvault_copies_damaged",
        "Copies found damaged or missing (reads, audits, scrub).",
    ),
    (
        "repaired",
        "pinvault_copies_repaired",
        "Damaged or missing copies rewritten from a good one.",
    ),
    ("unrepairable", "pinvault_copies_unrepairable", "Damaged copies with no good copy anywhere."),
    ("failed_rewrites", "pinvault_copy_rewrites_failed", "Rewrites of a damaged copy that failed."),
)


class VaultCollector(Collector):
    """Reads the vault's live state at each scrape. Every family is always named, empty when
    the vault has no such part (no tiers to manage, no mirrors)."""

    def __init__(self, sources: Sources, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.sources = sources
        self.clock = clock
        self._started_size = sources.ledger.size
        # The latest checkpoint's size and when this server first saw it.
        latest = sources.ledger.latest
        self._checkpoint = None if latest is None else (latest.size, clock())
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Family]:
        return list(self._families().values())

    def collect(self) -> Iterable[Family]:
        families = self._families()
        with self._lock:
            self._ledger(families)
            self._tiers(families)
            self._queues(families)
            self._scrub(families)
        return families.values()

    @staticmethod
    def _families() -> dict[str, Family]:
        found: dict[str, Family] = {}

        def gauge(name: str, text: str, labels: Sequence[str] = ()) -> None:
            found[name] = GaugeMetricFamily(name, text, labels=labels)

        def counter(name: str, text: str) -> None:
            found[name] = CounterMetricFamily(name, text, labels=())

        gauge("pinvault_ledger_entries", "Entries in the ledger.")
        counter(
            "pinvault_ledger_appended_entries",
            "Entries the ledger grew by since this server started (appends of other servers "
            "sharing its database included).",
        )
        gauge("pinvault_ledger_checkpoint_entries", "Size of the latest signed checkpoint.")
        gauge(
            "pinvault_ledger_checkpoint_age_seconds",
            "Seconds since this server first saw the latest checkpoint signed.",
        )
        counter(
            "pinvault_ledger_tiles_rewritten",
            "Tile files (hash tiles, entry bundles, the published checkpoint) found damaged or "
            "missing on disk and written again from the database.",
        )
        gauge("pinvault_tier_blobs", "Copies of blobs on each tier.", ["tier"])
        gauge("pinvault_tier_bytes", "Bytes of the copies on each tier.", ["tier"])
        gauge(
            "pinvault_migration_pending_moves",
            "Moves between tiers the last migration pass planned and has not made yet.",
        )
        gauge("pinvault_mirror_queue_copies", "Copies queued for each mirror.", ["mirror"])
        gauge(
            "pinvault_mirror_queue_bytes", "Bytes of the copies queued for each mirror.", ["mirror"]
        )
        gauge(
            "pinvault_mirror_queue_oldest_age_seconds",
            "Seconds the oldest copy queued for each mirror has waited.",
            ["mirror"],
        )
        for _, name, text in (*_SCRUB_COUNTS, *_REPAIR_COUNTS):
            counter(name, text)
        gauge("pinvault_scrub_running", "1 while an on-demand scrub (Store.Scrub) runs.")
        gauge("pinvault_scrub_done_bytes", "Bytes the latest on-demand scrub has checked.")
        gauge("pinvault_scrub_total_bytes", "Bytes the latest on-demand scrub has to check.")
        return found

    def _ledger(self, families: dict[str, Family]) -> None:
        ledger = self.sources.ledger
        size = ledger.size
        _add(families["pinvault_ledger_entries"], size)
        _add(families["pinvault_ledger_appended_entries"], max(size - self._started_size, 0))
        _add(families["pinvault_ledger_tiles_rewritten"], ledger.tiles_rewritten)
        latest = ledger.latest
        if latest is None:
            return
        now = self.clock()
        if self._checkpoint is None or self._checkpoint[0] != latest.size:
            self._checkpoint = (latest.size, now)
        _add(families["pinvault_ledger_checkpoint_entries"], latest.size)
        _add(families["pinvault_ledger_checkpoint_age_seconds"], now - self._checkpoint[1])

    def _tiers(self, families: dict[str, Family]) -> None:
        manager = manager_of(self.sources.store)
        if manager is None:
            ((blobs, size),) = self.sources.content.db.fetch(_CATALOGUE_TOTALS)
            totals = {"hot": (int(blobs), int(size))}
        else:
            totals = manager.journal.totals()
        for tier, (blobs, size) in sorted(totals.items()):
            _add(families["pinvault_tier_blobs"], blobs, tier)
            _add(families["pinvault_tier_bytes"], size, tier)

    def _queues(self, families: dict[str, Family]) -> None:
        for migrator in _migrators(self.sources.workers):
            _add(families["pinvault_migration_pending_moves"], migrator.pending)
        queue = getattr(self.sources.store, "queue", None)
        if queue is None:
            return
        now = time.time()
        for mirror, counts in sorted(queue.counts().items()):
            _add(families["pinvault_mirror_queue_copies"], counts.queued, mirror)
            _add(families["pinvault_mirror_queue_bytes"], counts.queued_bytes, mirror)
            oldest = 0.0 if counts.oldest_queued is None else now - counts.oldest_queued
            _add(families["pinvault_mirror_queue_oldest_age_seconds"], max(oldest, 0.0), mirror)

    def _scrub(self, families: dict[str, Family]) -> None:
        manager = manager_of(self.sources.store)
        if manager is None:
            self._lone_tier_damage(families)
            return
        watch = self.sources.scrub
        finished = watch.totals()
        background = [s.stats for s in _scrubbers(self.sources.workers)]
        for key, name, _ in _SCRUB_COUNTS:
            total = finished.get(key, 0) + sum(getattr(stats, key) for stats in background)
            _add(families[name], total)
        for key, name, _ in _REPAIR_COUNTS:
            _add(families[name], getattr(manager.stats, key))
        _add(families["pinvault_scrub_running"], 1 if watch.running else 0)
        _add(families["pinvault_scrub_done_bytes"], watch.done_bytes)
        _add(families["pinvault_scrub_total_bytes"], watch.total_bytes)

    def _lone_tier_damage(self, families: dict[str, Family]) -> None:
        """A hot tier alone has no tier manager to count its damage: it journals what reads,
        `vault verify --blobs`, `vault scrub` and puts find (vault/server/damage.py), in any
        process, and the series count that, under the names the tier manager's counts take."""
        with KnownDamage(self.sources.store) as damage:
            counts = damage.counts()
        if counts is None:
            return
        for key, name, _ in _REPAIR_COUNTS:
            _add(families[name], counts[key])


def _add(family: Family, value: float, *labels: str) -> None:
    family.add_metric(list(labels), value)


def _migrators(workers: Iterable[Worker]) -> Iterator[Migrator]:
    from tiers.migrate import MigrationWorker

    for worker in workers:
        if isinstance(worker, MigrationWorker):
            yield worker.migrator


def _scrubbers(workers: Iterable[Worker]) -> Iterator[Scrubber]:
    from tiers.scrub import ScrubWorker

    for worker in workers:
        if isinstance(worker, ScrubWorker):
            yield worker.scrubber


def registry_for(sources: Sources) -> CollectorRegistry:
    """The metrics one server exports: its calls and admissions, its live state, its process."""
    registry = CollectorRegistry()
    for metric in (RPCS, RPC_SECONDS, ADMISSIONS):
        registry.register(metric)
    registry.register(VaultCollector(sources))
    ProcessCollector(registry=registry)
    return registry


class MetricsServer(Endpoint):
    """`/metrics` (the Prometheus text format) over HTTP on `host`:`port` (port 0: one the
    system picks), on the bounded edge the tiles use: a scrape reads the database on one of
    two worker threads that live as long as the endpoint, and a caller who opens connections
    and sends nothing holds no thread at all."""

    what = "metrics"
    path = "/metrics"

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: Limits = LIMITS,
    ) -> None:
        super().__init__(host, port, limits=limits)
        self.registry = registry

    def respond(self, request: Request) -> Response:
        if request.target.partition("?")[0] != self.path:
            return Response.text(404, "not found")
        # The format the scraper asks for (Prometheus's own negotiation, as its HTTP server does).
        encode, content_type = choose_encoder(", ".join(request.header("Accept")))
        return Response(200, encode(self.registry), content_type)


def serve_metrics(sources: Sources, address: tuple[str, int]) -> MetricsServer:
    """The vault's metrics served on `address` (host, port), started."""
    return MetricsServer(registry_for(sources), *address).start()
