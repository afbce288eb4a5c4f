"""What `vault mirror status|sync|repair` do on the vault's host, with the mirrors and the
replication queue opened from its config (the queue is a SQLite file in the data folder, safe
to share with a running `vault serve`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vault.config import Config
from vault.server.assembly import open_hot_tier, open_mirror_set, open_replication_queue

if TYPE_CHECKING:
    from mirror.repair import RepairReport
    from mirror.replicate import DrainReport
    from mirror.status import MirrorStatus


def status(config: Config) -> list[MirrorStatus]:
    """Per mirror: whether it answers now (asked with short timeouts), the verified copies it
    holds, and the copies still queued for it."""
    from mirror.status import mirror_status

    with open_mirror_set(config, probe=True) as mirrors:
        queue = open_replication_queue(config)
        try:
            return mirror_status(mirrors, queue)
        finally:
            queue.close()


@dataclass(frozen=True, slots=True)
class MirrorSync:
    """How many copies were queued; per mirror, what draining its queue copied; and the copies
    each still has queued."""

    queued: int
    drained: dict[str, DrainReport]
    left: dict[str, int]


def sync(config: Config, *, queue_only: bool) -> MirrorSync:
    """Queue every copy a local blob lacks on its mirrors, then, unless `queue_only`, copy (and
    verify) everything queued, retrying what was waiting for a later attempt."""
    from mirror.repair import queue_missing
    from mirror.replicate import Replicator

    hot = open_hot_tier(config)
    with open_mirror_set(config) as mirrors:
        queue = open_replication_queue(config)
        try:
            queued = queue_missing(hot, mirrors, queue)
            drained: dict[str, DrainReport] = {}
            if not queue_only:
                queue.retry_now()
                replicator = Replicator(hot, mirrors, queue)
                drained = {mirror.name: replicator.drain(mirror) for mirror in mirrors}
            left = {name: counts.queued for name, counts in queue.counts().items()}
        finally:
            queue.close()
    return MirrorSync(queued, drained, left)


def repair(config: Config) -> RepairReport:
    """Read back every copy on every mirror (and the local one), and rewrite each damaged or
    missing copy from one that verifies."""
    from mirror.repair import repair as repair_copies

    hot = open_hot_tier(config)
    with open_mirror_set(config) as mirrors:
        queue = open_replication_queue(config)
        try:
            return repair_copies(hot, mirrors, queue)
        finally:
            queue.close()
