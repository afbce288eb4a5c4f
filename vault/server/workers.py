"""The background passes of a vault whose store has tiers to manage: the migration worker and
the scrubber as [policy] asks, and the scrub that Store.Scrub runs on demand."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from vault.config import Config
from vault.server.assembly import hot_capacity, manager_of, warm_configured
from vault.store.protocol import BlobStore

if TYPE_CHECKING:
    from tiers.manager import TierManager
    from tiers.migrate import Migrator, MirrorCopies
    from tiers.worker import Worker
    from vault.digest import Digest
    from vault.ledger.db import Database
    from vault.server.store_service import ScrubRunner


def start_tier_workers(config: Config, store: BlobStore, db: Database) -> list[Worker]:
    """The migration worker and the background scrubber, started, when the store has tiers to
    manage and the policy asks for them."""
    from tiers.migrate import MigrationWorker
    from tiers.scrub import Scrubber, ScrubWorker

    manager = manager_of(store)
    if manager is None:
        return []
    manager.promote = config.policy.promote_on_read
    policy = config.policy
    workers: list[Worker] = []
    if policy.migrate_interval > 0:
        queue = getattr(store, "queue", None)
        migrator = build_migrator(config, manager, db, None if queue is None else queue.copies)
        workers.append(MigrationWorker(migrator, policy.migrate_interval))
    if policy.scrub_window_days > 0:
        scrubber = Scrubber(
            manager,
            rate=policy.scrub_rate_mb_s * 1e6 if policy.scrub_rate_mb_s > 0 else None,
            window=policy.scrub_window_days * 86_400,
        )
        workers.append(ScrubWorker(scrubber))
    for worker in workers:
        worker.start()
    return workers


def scrub_runner(store: BlobStore) -> ScrubRunner | None:
    """What Store.Scrub runs: every copy on every tier checked now, as `vault scrub` does on a
    stopped vault; None when the store has no tiers to manage."""
    from tiers.scrub import Scrubber

    manager = manager_of(store)
    if manager is None:
        return None

    def run(
        rate: float | None, progress: Callable[[int, int], None], stop: threading.Event
    ) -> dict[str, int]:
        stats = Scrubber(manager, rate=rate).scrub_all(progress=progress, stop=stop)
        return dataclasses.asdict(stats)

    return run


def build_migrator(
    config: Config,
    manager: TierManager,
    db: Database | None,
    mirror_copies: MirrorCopies | None,
) -> Migrator:
    """The migrator [policy] configures, told the kinds each blob is pinned as (from the
    ledger's database) and the mirror copies each holds (from the replication queue)."""
    from tiers.migrate import Migrator

    return Migrator(
        manager,
        config.policy,
        hot_capacity=hot_capacity(config),
        warm_configured=warm_configured(config),
        kinds_of=None if db is None else _kinds_of(db),
        mirror_copies=mirror_copies,
    )


def _kinds_of(db: Database) -> Callable[[list[Digest]], dict[Digest, set[str]]]:
    """The kinds each blob is pinned as, by either of its digests, from the ledger."""
    from vault.digest import Digest, digest_key
    from vault.ledger.db import placeholders

    def kinds(digests: list[Digest]) -> dict[Digest, set[str]]:
        found: dict[Digest, set[str]] = {}
        for start in range(0, len(digests), 200):
            part = [str(d) for d in digests[start : start + 200]]
            # Each blob's two names, as the subject index keys them.
            names: dict[bytes, str] = {}
            sql = f"SELECT sha256, blake3 FROM blobs WHERE sha256 IN ({placeholders(len(part))})"
            for sha, blake in db.fetch(sql, part):
                names[digest_key(sha)] = names[digest_key(blake)] = sha
            if not names:
                continue
            for key, kind in db.naming("s.digest, e.kind", list(names)):
                found.setdefault(Digest.parse(names[bytes(key)]), set()).add(str(kind))
        return found

    return kinds
