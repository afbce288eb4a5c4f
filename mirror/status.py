"""`vault mirror status`: per mirror, whether it answers now, the copies the placement record has
on it and when one was last verified, and the replication lag (copies queued for it, their
bytes, and the age of the oldest)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from mirror.mirrors import MirrorSet
from mirror.queue import ReplicationQueue


@dataclass(frozen=True, slots=True)
class MirrorStatus:
    name: str
    where: str
    reachable: bool
    error: str
    objects: int
    bytes: int
    queued: int
    queued_bytes: int
    lag_seconds: float
    last_error: str
    # When a copy on the mirror was last verified (seconds since the epoch; None: never).
    last_verified: float | None

    def as_json(self) -> dict[str, object]:
        """Every field, with `last_verified` as an RFC 3339 time in UTC (null: never)."""
        found = {field: getattr(self, field) for field in self.__slots__}
        if self.last_verified is not None:
            when = datetime.fromtimestamp(self.last_verified, UTC)
            found["last_verified"] = when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return found


def mirror_status(mirrors: MirrorSet, queue: ReplicationQueue) -> list[MirrorStatus]:
    """Probe every mirror at once (each bounded by its timeouts) and read the queue and the
    placement record it keeps the copies made in."""
    with ThreadPoolExecutor(max_workers=len(mirrors), thread_name_prefix="mirror-probe") as pool:
        healths = list(pool.map(lambda mirror: mirror.probe(), mirrors))
    counts = queue.counts()
    now = time.time()
    found: list[MirrorStatus] = []
    for mirror, health in zip(mirrors, healths, strict=True):
        count = counts.get(mirror.name)
        oldest = None if count is None else count.oldest_queued
        found.append(
            MirrorStatus(
                name=mirror.name,
                where=mirror.where,
                reachable=bool(health.reachable),
                error=health.error,
                objects=0 if count is None else count.objects,
                bytes=0 if count is None else count.bytes,
                queued=0 if count is None else count.queued,
                queued_bytes=0 if count is None else count.queued_bytes,
                lag_seconds=0.0 if oldest is None else max(0.0, now - oldest),
                last_error="" if count is None else count.last_error,
                last_verified=None if count is None else count.last_verified,
            )
        )
    return found
