"""What the test servers share: a private folder while they run, and use with `with`."""

from __future__ import annotations

import atexit
import shutil
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
    def _shut_down(self) -> None:
        """Stop the server's processes; its folder is still there."""

    def stop(self) -> None:
        """Shut the server down and delete its folder; harmless if it is not running. A server
        that fails to shut down keeps its folder, so that its log can be read."""
        base = self._base
        if base is None:
            return
        atexit.unregister(self.stop)
        try:
            self._shut_down()
        finally:
            self._base = None
        shutil.rmtree(base, ignore_errors=True)

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
