"""The transparency-dev witness for tests: its `omniwitness` program (c2sp.org/tlog-witness),
built with Go from its module at a pinned version into .cache/bin, run on 127.0.0.1 port 0 with
a key, a SQLite file and the logs it witnesses in a private folder, and removed when stopped."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Self

from tests.services.base import PrivateServer, terminate
from tests.services.go_build import BIN_DIR, BuildError, find_go
from tests.services.s3 import listening_ports
from vault.ledger.checkpoint import SigningKey
from vault.ledger.cosignature import WitnessKey

REPO_ROOT = Path(__file__).resolve().parents[2]
# The witness module has no tagged releases; this is the Go module proxy's pseudo-version of
# the commit the tests were written against.
MODULE = "github.com/transparency-dev/witness"
VERSION = "v0.0.0-20260720115447-2e1c6971d19e"
PACKAGE = f"{MODULE}/cmd/omniwitness"
BUILD_TIMEOUT = 900.0
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def build() -> Path:
    """The omniwitness binary of the pinned version, built with `go install` if it is not yet
    (the binary's name carries the version, so a new pin is always built)."""
    binary = BIN_DIR / f"omniwitness-{VERSION}"
    if os.access(binary, os.X_OK):
        return binary
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omniwitness-build-") as folder:
        env = {**os.environ, "GOBIN": folder, "GOFLAGS": "-buildvcs=false"}
        result = subprocess.run(
            [find_go("omniwitness"), "install", f"{PACKAGE}@{VERSION}"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
        if result.returncode != 0:
            raise BuildError(f"go install {PACKAGE}@{VERSION} failed:\n{result.stderr}")
        os.replace(Path(folder) / "omniwitness", binary)
    for old in BIN_DIR.glob("omniwitness-*"):
        if old != binary:
            old.unlink(missing_ok=True)
    return binary


class WitnessServer(PrivateServer):
    """One omniwitness process witnessing the logs `logs` names (origin -> the log's verifier
    key), with a key of its own named `name`. `start()` runs it on a port it binds itself and
    the kernel then shows; `freeze()` makes it hang, `thaw()` answer again."""

    name: ClassVar[str] = "witness"

    def __init__(self, logs: Mapping[str, str], *, name: str = "witness.test/w1") -> None:
        self.logs = dict(logs)
        self.signing_key = SigningKey.generate(name)
        # Its cosignatures verify with the same Ed25519 key, under the cosignature/v1 id.
        self.key = WitnessKey(name, self.signing_key.verifier().public_key)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._base: Path | None = None

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError("witness already started")
        binary = build()
        self._base = Path(tempfile.mkdtemp(prefix="pinvault-witness-"))
        try:
            self.signing_key.save(self._base / "witness.key")
            logs = "".join(
                f"  - Origin: {origin}\n    PublicKey: {key}\n" for origin, key in self.logs.items()
            )
            (self._base / "logs.yaml").write_text(f"Logs:\n{logs}")
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [
                        str(binary),
                        "--listen=127.0.0.1:0",
                        "--metrics_listen=",
                        f"--db_file={self._base / 'witness.db'}",
                        f"--private_key_path={self._base / 'witness.key'}",
                        f"--additional_logs={self._base / 'logs.yaml'}",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._base,
                )
            self.port = self._wait_for_port()
        except BaseException:
            process, self.process = self.process, None
            if process is not None:
                process.kill()
                process.wait()
            self.stop()
            raise
        atexit.register(self.stop)
        return self

    def _wait_for_port(self) -> int:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the witness exited with {self.process.returncode}:\n{self.log()}"
                )
            ports = listening_ports(self.process.pid)
            if ports:
                return min(ports)
            time.sleep(0.02)
        raise RuntimeError(f"the witness bound no port in {START_TIMEOUT:.0f}s:\n{self.log()}")

    def _shut_down(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            # Go ends on SIGTERM without a handler: its status is the signal's.
            terminate(process, "the witness", STOP_TIMEOUT)

    def freeze(self) -> None:
        """SIGSTOP: the witness keeps its port and accepts connections but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the witness has not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """The witness as the vault's witnesses.endpoints names it: `URL KEY`."""
        return f"{self.url} {self.key}"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "witness.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def add_checkpoint(self, body: bytes) -> tuple[int, bytes]:
        """POST /add-checkpoint with `body` as given: the status and the answer."""
        request = urllib.request.Request(f"{self.url}/add-checkpoint", data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
