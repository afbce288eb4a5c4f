"""Go programs the tests build into .cache/bin: from a source folder under tests/go, once for
each version of that source (the binary's name carries the digest of the files named), or a
module at a pinned version with `go install`."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = REPO_ROOT / ".cache" / "bin"
BUILD_TIMEOUT = 600.0


class BuildError(RuntimeError):
    """Go is missing or the program did not build; the message carries Go's output."""


def find_go(what: str) -> str:
    """The `go` command; BuildError naming `what` needed it when there is none."""
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None
    )
    if go is None:
        raise BuildError(f"building {what} needs Go (1.25 or later) on PATH or in /usr/local/go")
    return go


def build_source(
    name: str, source: Path, files: Sequence[str], command: Sequence[str], target: str
) -> Path:
    """The binary `name-DIGEST` built by `go COMMAND -trimpath -o BINARY TARGET` in `source`,
    where DIGEST is that of `files`; built only if missing, older builds of `name` removed."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.encode() + b"\0" + (source / file).read_bytes() + b"\0")
    binary = BIN_DIR / f"{name}-{digest.hexdigest()[:16]}"
    if os.access(binary, os.X_OK):
        return binary
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    temp = binary.with_name(f".{binary.name}.{os.getpid()}")
    result = subprocess.run(
        [find_go(name), *command, "-trimpath", "-o", str(temp), target],
        cwd=source,
        env={**os.environ, "GOFLAGS": "-buildvcs=false -mod=readonly"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        temp.unlink(missing_ok=True)
        raise BuildError(
            f"go {' '.join(command)} of {name} failed:\n{result.stdout}{result.stderr}"
        )
    os.replace(temp, binary)
    for old in BIN_DIR.glob(f"{name}-*"):
        if old != binary:
            old.unlink(missing_ok=True)
    return binary
