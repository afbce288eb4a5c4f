"""The reference OCI registry (github.com/distribution/distribution's `registry`, the version
pinned in tests/go/distribution/go.mod), built with Go into .cache/bin once for each version of
that pin, and started on 127.0.0.1 with a filesystem store: the baseline bench/registry.py
measures the vault's registry against."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.services.go_build import build_source

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "go" / "distribution"
PACKAGE = "github.com/distribution/distribution/v3/cmd/registry"
START_TIMEOUT = 30.0
_LISTENING = re.compile(r"listening on ([0-9.:\[\]]+)")

CONFIG = """version: 0.1
log:
  level: info
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: false
http:
  addr: 127.0.0.1:0
"""


def build() -> Path:
    """The registry's binary, built if this pin has not been."""
    return build_source("distribution", SOURCE, ("go.mod", "go.sum"), ("build",), PACKAGE)


class DistributionRegistry:
    """`registry serve` on 127.0.0.1, port 0, its address read back from its log."""

    def __init__(self, binary: Path, base: Path) -> None:
        self.binary = binary
        self.base = base
        self.address = ""
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        self.base.mkdir(parents=True, exist_ok=True)
        config = self.base / "config.yml"
        config.write_text(CONFIG.format(root=self.base / "storage"))
        log = (self.base / "registry.log").open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        self._process = subprocess.Popen(
            [str(self.binary), "serve", str(config)], stdout=log, stderr=log, env=env
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            found = _LISTENING.search((self.base / "registry.log").read_text(errors="replace"))
            if found:
                self.address = found.group(1)
                return self
            if self._process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"the registry did not start:\n{(self.base / 'registry.log').read_text()}"
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
