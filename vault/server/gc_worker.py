"""The gc pass `vault serve` runs every retention.interval seconds, the first at start (which
finishes any release a crash cut short)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Final

from tiers.worker import Worker
from vault.config import Config
from vault.errors import Unavailable
from vault.server.released import ReleasingContent
from vault.server.retention import Policy, Retention
from vault.store.protocol import BlobStore

if TYPE_CHECKING:
    from vault.ledger.db import Database
    from vault.ledger.log import Ledger

log = logging.getLogger("pinvault.retention")

# After a pass that could not append (the ledger's sequencer not linked yet, the database out
# of reach), the next is tried this soon rather than a whole interval later.
_RETRY: Final = 2.0


class GcWorker(Worker):
    """A thread of `vault serve` that runs a gc pass at start and every `interval` seconds."""

    name = "gc"

    def __init__(self, retention: Retention, interval: float) -> None:
        self.retention = retention
        self.pause = interval
        super().__init__()
        # Passes finished since start, for whoever waits for one (tests, the benchmark).
        self.passes = 0

    def run_pass(self, stop: threading.Event) -> float | None:
        try:
            self.retention.run(stop)
        except Unavailable as error:
            log.info("gc pass put off: %s", error)
            return min(_RETRY, self.pause)
        self.passes += 1
        return None


def start_gc(
    config: Config, db: Database, content: ReleasingContent, store: BlobStore, ledger: Ledger
) -> GcWorker | None:
    """The server's gc worker, started, when [retention] sets a policy and an interval."""
    policy = Policy.from_config(config.retention)
    if not policy.enabled or config.retention.interval <= 0:
        return None
    log.info("gc every %g s by retention rule %s", config.retention.interval, policy.rule)
    retention = Retention(policy, db, content, store, ledger)
    return GcWorker(retention, config.retention.interval).start()
