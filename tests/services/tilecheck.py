"""The independent tile verifier (tests/go/tilecheck, Go's golang.org/x/mod/sumdb code), built
with Go into .cache/bin, once for each version of its source, and run against a tiles endpoint."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "go" / "tilecheck"
BIN_DIR = REPO_ROOT / ".cache" / "bin"
BUILD_TIMEOUT = 600.0
RUN_TIMEOUT = 120.0


class BuildError(RuntimeError):
    """Go is missing or the program did not build; the message carries Go's output."""


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    line: str


def find_go() -> str:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None
    )
    if go is None:
        raise BuildError(
            "building tests/go/tilecheck needs Go (1.25 or later) on PATH or in /usr/local/go"
        )
    return go


def build() -> Path:
    """The verifier's binary, built if this version of its source has not been (the binary's
    name carries the digest of its source, so a changed source is always rebuilt)."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update(name.encode() + b"\0" + (SOURCE / name).read_bytes() + b"\0")
    binary = BIN_DIR / f"tilecheck-{digest.hexdigest()[:16]}"
    if os.access(binary, os.X_OK):
        return binary
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    temp = binary.with_name(f".{binary.name}.{os.getpid()}")
    env = {**os.environ, "GOFLAGS": "-buildvcs=false -mod=readonly"}
    result = subprocess.run(
        [find_go(), "build", "-trimpath", "-o", str(temp), "."],
        cwd=SOURCE,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        temp.unlink(missing_ok=True)
        raise BuildError(f"go build of tests/go/tilecheck failed:\n{result.stdout}{result.stderr}")
    os.replace(temp, binary)
    for old in BIN_DIR.glob("tilecheck-*"):
        if old != binary:
            old.unlink(missing_ok=True)
    return binary


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
