"""The gc pass `vault serve` runs every retention.interval seconds, the first at start (which
finishes any release a crash cut short)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Final

from vault.config import Config
from vault.errors import Unavailable, VaultError
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


class GcWorker:
    """A thread of `vault serve` that runs a gc pass at start and every `interval` seconds."""

    def __init__(self, retention: Retention, interval: float) -> None:
        self.retention = retention
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gc", daemon=True)
        # Passes finished since start, for whoever waits for one (tests, the benchmark).
        self.passes = 0

    def start(self) -> GcWorker:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            pause = self.interval
            try:
                self.retention.run(self._stop)
                self.passes += 1
            except Unavailable as error:
                log.info("gc pass put off: %s", error)
                pause = min(_RETRY, self.interval)
            except (VaultError, OSError) as error:
                log.warning("gc pass failed: %s", error)
            except Exception:  # a pass must not end the server's gc for good
                log.exception("gc pass failed")
            self._stop.wait(pause)


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
