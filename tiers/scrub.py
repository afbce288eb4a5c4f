"""The scrubber: re-verifies every copy in the placement record on every tier the tier manager
holds (mirror copies that replication made included), least recently verified first, at a
bounded rate so that it does not starve reads, and hands any damaged or missing copy to the
tier manager's repair; `vault scrub` runs it once, `vault serve` all the time."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import blake3

from tiers.hot import HotTier
from tiers.manager import TierManager
from tiers.maphash import MapHasher
from tiers.placements import MIRROR_TIER_PREFIX, Placement
from tiers.worker import Worker
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound, Unavailable, VaultError
from vault.store.chunks import ChunkList
from vault.store.protocol import BlobStore

log = logging.getLogger("pinvault.tiers")

# Copies fetched from the journal at a time by the background scrubber.
_BATCH: Final = 64
# A hot copy is checked in segments of this many chunks, on this many threads.
_SEGMENT_CHUNKS: Final = 4
_THREADS: Final = max(2, min(4, os.cpu_count() or 1))
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# Copies at least this large are hashed through a map in a child process first; for smaller
# ones, the round trip to the child costs more than the copy it saves.
_MAP_MIN: Final = 4 * 1024 * 1024
_MAPPER: MapHasher | None = None
_buffers = threading.local()
# The background scrubber looks again at least this often when nothing is due.
_IDLE: Final = 60.0


@dataclass(slots=True)
class ScrubStats:
    """Copies checked and their bytes, faults found (damaged or missing copies), copies
    repaired from a good one, and faults with no good copy anywhere."""

    copies: int = 0
    bytes: int = 0
    faults: int = 0
    repaired: int = 0
    unrepairable: int = 0


def verify_copy(tier: BlobStore, sha256: Digest) -> int:
    """Check one copy whole and return its size. A hot copy is checked against the BLAKE3 in
    its chunk list, which is bound to the digest: what every read relies on, at the cost of
    one BLAKE3 pass, hashed on every core; other tiers run their own verify.

    A large hot copy is first hashed whole through a memory map in a child process (see
    tiers/maphash.py), as `b3sum` does; only when that fails or disagrees is it read chunk by
    chunk, which names the damaged chunk or the read error."""
    if isinstance(tier, HotTier):
        return _verify_hot_copy(tier, sha256)
    return tier.verify(sha256).size


def _verify_hot_copy(tier: HotTier, sha256: Digest) -> int:
    chunks = tier.chunk_list(sha256)
    # The layout HotTier documents: root/blobs/<hex[:2]>/<hex>.
    path = tier.root / "blobs" / sha256.hex[:2] / sha256.hex
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise NotFound(f"blob {sha256} is not in the hot tier") from None
    try:
        stored = os.fstat(fd).st_size
        if stored != chunks.size:
            raise IntegrityError(
                f"stored copy of {sha256} is damaged: {stored} bytes, expected {chunks.size}"
            )
        if stored >= _MAP_MIN and _mapper().hash(path) == (chunks.blake3.raw, chunks.size):
            return chunks.size
        # Read, not mmap, in this process: a read error or a file cut short under a map kills
        # the process with SIGBUS, and finding exactly those is the scrubber's job. Segments
        # of whole chunks go to a few threads, which read and hash at once (both release the
        # GIL).
        step = _SEGMENT_CHUNKS * chunks.chunk_size
        for failure in _pool().map(
            lambda start: _check_segment(fd, chunks, start, step), range(0, chunks.size, step)
        ):
            if failure:
                raise IntegrityError(f"stored copy of {sha256} is damaged: {failure}")
    finally:
        os.close(fd)
    return chunks.size


def _check_segment(fd: int, chunks: ChunkList, start: int, length: int) -> str:
    """ "" if the chunks in [start, start + length) match the chunk list, else what failed."""
    length = min(length, chunks.size - start)
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < length:
        buffer = _buffers.buffer = bytearray(_SEGMENT_CHUNKS * chunks.chunk_size)
    view = memoryview(buffer)[:length]
    got = os.preadv(fd, [view], start)
    if got != length:
        return f"short read at byte offset {start + got}"
    index = start // chunks.chunk_size
    for offset in range(0, length, chunks.chunk_size):
        found = blake3.blake3(view[offset : offset + chunks.chunk_size]).digest()
        if found != chunks.hashes[index]:
            return (
                f"chunk at byte offset {start + offset} hashes to {found.hex()}, expected "
                f"{chunks.hashes[index].hex()}"
            )
        index += 1
    return ""


def _mapper() -> MapHasher:
    global _MAPPER
    with _POOL_LOCK:
        if _MAPPER is None:
            _MAPPER = MapHasher()
            atexit.register(_MAPPER.close)
        return _MAPPER


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="scrub-hash")
        return _POOL


class Scrubber:
    """Checks the manager's copies. `rate` (bytes per second, None: as fast as it goes)
    paces the checks: after each copy the scrubber waits until its bytes so far fit the rate.
    `window` (seconds) is how old a copy's last check may grow before it is due again."""

    def __init__(
        self,
        manager: TierManager,
        *,
        rate: float | None = None,
        window: float = 30 * 86_400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.manager = manager
        self.rate = rate
        self.window = window
        self.clock = clock
        # What the background passes (`run`) have checked and found, since the start.
        self.stats = ScrubStats()

    def scrub_all(
        self,
        progress: Callable[[int, int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> ScrubStats:
        """Check now every copy the placement record has on the manager's tiers (mirror
        copies made by replication too), after recording local copies it did not know;
        `progress` is told the bytes checked so far and the total."""
        self.manager.adopt([n for n in self.manager.names if not n.startswith(MIRROR_TIER_PREFIX)])
        placements = [p for p in self.manager.journal.placements() if p.tier in self.manager.names]
        total = sum(p.size or 0 for p in placements)
        stats = ScrubStats()
        pace = _Pace(self.rate, stop)
        for placement in placements:
            if stop is not None and stop.is_set():
                break
            self.check(placement, stats)
            pace.spent(placement.size or 0)
            if progress is not None:
                progress(stats.bytes, total)
        return stats

    def run(self, stop: threading.Event) -> None:
        """Check copies as they fall due, for ever (until `stop`)."""
        pace = _Pace(self.rate, stop)
        stats = self.stats
        warned = False
        while not stop.is_set():
            batch = self.manager.journal.least_recently_verified(_BATCH, self.manager.names)
            due = [p for p in batch if self._age(p) >= self.window]
            if not due:
                oldest = min((self._age(p) for p in batch), default=0.0)
                stop.wait(min(_IDLE, max(self.window - oldest, 1.0)))
                # Idle time is not credit: the next checks keep to the rate from now on.
                pace = _Pace(self.rate, stop)
                continue
            for placement in due:
                if stop.is_set():
                    return
                self.check(placement, stats)
                pace.spent(placement.size or 0)
            if not warned and self.rate:
                warned = self._warn_if_behind()

    def check(self, placement: Placement, stats: ScrubStats) -> None:
        """Verify one copy; journal it verified, or have the manager repair it."""
        digest, name = placement.digest, placement.tier
        tier = self.manager.tiers[self.manager.names.index(name)]
        stats.copies += 1
        try:
            with self.manager.repair_lock:
                size = verify_copy(tier, digest)
                self.manager.journal.place(digest, name, size=size, verified=self.clock())
            stats.bytes += size
            return
        except NotFound as error:
            if isinstance(error, Unavailable):
                # A mirror out of reach: its copy is not checked this time, nor missing.
                log.warning("scrub: could not check the %s copy of %s: %s", name, digest, error)
                return
            if name not in self.manager.journal.placed(digest):
                return  # moved away by the migration worker since the batch was read
            # The tier manager's repair below logs the damage it finds, one line a copy.
            log.debug("scrub: the %s copy of %s is missing", name, digest)
        except IntegrityError as error:
            log.debug("scrub: the %s copy of %s is damaged: %s", name, digest, error)
        except VaultError as error:
            # A mirror that cannot be reached: its copy is not checked this time.
            log.warning("scrub: could not check the %s copy of %s: %s", name, digest, error)
            return
        stats.faults += 1
        stats.bytes += placement.size or 0
        try:
            self.manager.verify(digest)
            verify_copy(tier, digest)
        except IntegrityError:
            stats.unrepairable += 1
        except NotFound:
            stats.unrepairable += 1
        else:
            stats.repaired += 1

    def _age(self, placement: Placement) -> float:
        return self.clock() - (placement.last_verified or 0.0)

    def _warn_if_behind(self) -> bool:
        total = sum(size for _, size in self.manager.journal.totals().values())
        assert self.rate
        needed = total / self.rate
        if needed > self.window:
            log.warning(
                "scrub: %d bytes at %.0f bytes/s take %.1f days, more than the window of "
                "%.1f days: raise policy.scrub_rate_mb_s",
                total,
                self.rate,
                needed / 86_400,
                self.window / 86_400,
            )
            return True
        return False


class ScrubWorker(Worker):
    """A thread of `vault serve` that runs the scrubber; after a failed pass it waits a
    while before the next."""

    name = "tier-scrub"
    pause = _IDLE

    def __init__(self, scrubber: Scrubber) -> None:
        self.scrubber = scrubber
        super().__init__()

    def run_pass(self, stop: threading.Event) -> None:
        self.scrubber.run(stop)


class _Pace:
    """Waits so that the bytes spent since the start stay within `rate` per second."""

    def __init__(self, rate: float | None, stop: threading.Event | None) -> None:
        self.rate = rate
        self.stop = stop or threading.Event()
        self.start = time.monotonic()
        self.spent_bytes = 0

    def spent(self, size: int) -> None:
        if not self.rate:
            return
        self.spent_bytes += size
        ahead = self.spent_bytes / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            self.stop.wait(ahead)
