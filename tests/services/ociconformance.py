"""The OCI distribution-spec conformance suite (github.com/opencontainers/distribution-spec/
conformance, the version pinned in tests/go/ociconformance/go.mod), built with `go test -c` into
.cache/bin once for each version of that pin, and run against a registry."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.services.go_build import build_source

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "tests" / "go" / "ociconformance"
PACKAGE = "github.com/opencontainers/distribution-spec/conformance"
RUN_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    output: str
    # The suite's summary: each workflow's line ("Blob push", "Pass"), from its report.
    results: dict[str, str]


def build() -> Path:
    """The suite's test binary, built if this pin has not been (its name carries the digest of
    go.mod and go.sum)."""
    return build_source(
        "oci-conformance", SOURCE, ("go.mod", "go.sum", "tools.go"), ("test", "-c"), PACKAGE
    )


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
