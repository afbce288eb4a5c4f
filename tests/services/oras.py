"""The `oras` command (oras.land/oras, the version pinned in tests/go/oras/go.mod), built with Go
into .cache/bin once for each version of that pin, and run against a registry over plain HTTP."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.services.go_build import build_source

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "go" / "oras"
RUN_TIMEOUT = 120.0


def build() -> Path:
    """The `oras` binary, built if this pin has not been (its name carries the digest of go.mod
    and go.sum)."""
    return build_source("oras", SOURCE, ("go.mod", "go.sum"), ("build",), "oras.land/oras/cmd/oras")


def run(
    binary: Path, home: Path, *args: str, cwd: Path | None = None, env: Mapping[str, str] = {}
) -> subprocess.CompletedProcess[str]:
    """`oras ARGS` with a home of its own (no credentials of the machine's user are read)."""
    home.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "ORAS_"))}
    return subprocess.run(
        [str(binary), *args],
        cwd=cwd or home,
        env={**clean, "HOME": str(home), "DOCKER_CONFIG": str(home / ".docker"), **env},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
