"""A background thread of `vault serve` that runs passes of a job (migration, scrub, the gc)
until it is closed; a failed pass is logged and the next one tries again."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Self

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
    def run_pass(self, stop: threading.Event) -> float | None:
        """One pass; it returns early once `stop` is set. Returns how long to wait before the
        next (None: `pause`)."""

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            pause = self.pause
            try:
                wait = self.run_pass(self._stop)
                if wait is not None:
                    pause = wait
            except (VaultError, OSError) as error:
                log.warning("%s pass failed: %s", self.name, error)
            except Exception:  # a pass must not end the worker for good
                log.exception("%s pass failed", self.name)
            self._stop.wait(pause)
