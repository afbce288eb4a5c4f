"""The independent tile verifier (tests/go/tilecheck, Go's golang.org/x/mod/sumdb code), built
with Go into .cache/bin, once for each version of its source, and run against a tiles endpoint."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.services.go_build import build_source

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "go" / "tilecheck"
RUN_TIMEOUT = 120.0


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    line: str


def build() -> Path:
    """The verifier's binary, built if this version of its source has not been (the binary's
    name carries the digest of its source, so a changed source is always rebuilt)."""
    return build_source("tilecheck", SOURCE, ("go.mod", "go.sum", "main.go"), ("build",), ".")


def run(
    binary: Path,
    url: str,
    key: str,
    *,
    leaves: Sequence[int] = (),
    old: Path | None = None,
    checkpoint: Path | None = None,
) -> Outcome:
    """Run the verifier (on the signed checkpoint in the file `checkpoint`, else on the
    endpoint's); its exit status and its one line of output."""
    command = [str(binary), "-url", url, "-key", key]
    if checkpoint is not None:
        command += ["-checkpoint", str(checkpoint)]
    if leaves:
        command += ["-leaf", ",".join(map(str, leaves))]
    if old is not None:
        command += ["-old", str(old)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    return Outcome(result.returncode, " | ".join(lines))
