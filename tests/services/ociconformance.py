"""The OCI distribution-spec conformance suite (github.com/opencontainers/distribution-spec/
conformance, the version pinned in tests/go/ociconformance/go.mod), built with `go test -c` into
.cache/bin once for each version of that pin, and run against a registry."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "go" / "ociconformance"
BIN_DIR = REPO_ROOT / ".cache" / "bin"
PACKAGE = "github.com/opencontainers/distribution-spec/conformance"
BUILD_TIMEOUT = 600.0
RUN_TIMEOUT = 300.0


class BuildError(RuntimeError):
    """Go is missing or the suite did not build; the message carries Go's output."""


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    output: str
    # The suite's summary: each workflow's line ("Blob push", "Pass"), from its report.
    results: dict[str, str]


def find_go() -> str:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None
    )
    if go is None:
        raise BuildError("building the OCI conformance suite needs Go on PATH or in /usr/local/go")
    return go


def build() -> Path:
    """The suite's test binary, built if this pin has not been (its name carries the digest of
    go.mod and go.sum)."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "tools.go"):
        digest.update(name.encode() + b"\0" + (SOURCE / name).read_bytes() + b"\0")
    binary = BIN_DIR / f"oci-conformance-{digest.hexdigest()[:16]}"
    if os.access(binary, os.X_OK):
        return binary
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    temp = binary.with_name(f".{binary.name}.{os.getpid()}")
    env = {**os.environ, "GOFLAGS": "-buildvcs=false -mod=readonly"}
    result = subprocess.run(
        [find_go(), "test", "-c", "-trimpath", "-o", str(temp), PACKAGE],
        cwd=SOURCE,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        temp.unlink(missing_ok=True)
        raise BuildError(f"go test -c of {PACKAGE} failed:\n{result.stdout}{result.stderr}")
    os.replace(temp, binary)
    for old in BIN_DIR.glob("oci-conformance-*"):
        if old != binary:
            old.unlink(missing_ok=True)
    return binary


def run(binary: Path, work: Path, settings: Mapping[str, str]) -> Outcome:
    """Run the suite in the folder `work` with `settings` (its OCI_* variables)."""
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCI_")}
    env.update({"OCI_RESULTS_DIR": str(work / "results"), "OCI_LOG": "warn", **settings})
    result = subprocess.run(
        [str(binary)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    output = result.stdout + result.stderr
    results = {}
    for line in output.splitlines():
        name, dots, verdict = line.strip().partition("...")
        if dots and ":" in verdict:
            results[name.strip()] = verdict.rpartition(":")[2].strip()
    return Outcome(result.returncode, output, results)
