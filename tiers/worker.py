"""A background thread of `vault serve` that runs passes of a tier job (migration, scrub) until
it is closed; a failed pass is logged and the next one tries again."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from vault.errors import VaultError

log = logging.getLogger(__name__)


class Worker(ABC):
    name: str = "tier-worker"
    # Seconds to wait after a pass that failed, or between passes that return at once.
    pause: float = 60.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    @abstractmethod
    def run_pass(self, stop: threading.Event) -> None:
        """One pass; it returns early once `stop` is set."""

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_pass(self._stop)
            except (VaultError, OSError) as error:
                log.warning("%s pass failed: %s", self.name, error)
            self._stop.wait(self.pause)
