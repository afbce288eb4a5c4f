"""What the test servers share: a private folder while they run, and use with `with`."""

from __future__ import annotations

import signal
import subprocess
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self


class PrivateServer(ABC):
    """A server the tests start in a folder of its own and stop (removing it) after."""

    name: ClassVar[str]
    _base: Path | None = None

    @abstractmethod
    def start(self) -> Self: ...

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        return self if self._base is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def base_dir(self) -> Path:
        if self._base is None:
            raise RuntimeError(f"{self.name} server is not running: call start() first")
        return self._base


def terminate(process: subprocess.Popen[bytes] | None, what: str, timeout: float) -> int:
    """SIGTERM, as a service manager stops a service; its exit status. A process that ignores
    it is killed and the test fails, since a service must stop when asked."""
    if process is None:
        return 0
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"{what} ignored SIGTERM for {timeout}s") from None
