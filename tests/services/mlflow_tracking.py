"""A private MLflow tracking server for tests: `mlflow server` from the locked environment that
scripts/test installs into .cache/mlflow-server (tests/services/mlflow-server/), on a SQLite
backend and an artifact folder in a fresh temp folder, serving artifacts itself, bound by
uvicorn on 127.0.0.1 port 0 and the port read back from its log. It runs in a session of its own,
so that stopping it ends every process it started, and sends nothing anywhere else."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final, Self

from tests.services.base import PrivateServer, terminate

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
ENVIRONMENT: Final = REPO_ROOT / ".cache" / "mlflow-server"
PROGRAM: Final = ENVIRONMENT / "bin" / "mlflow"
START_TIMEOUT: Final = 120.0
STOP_TIMEOUT: Final = 30.0
# uvicorn reports the port it bound, so port 0 needs no guess and has no race.
_LISTENING: Final = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
_INSTALL_HINT: Final = "run scripts/test, which installs it"
# For the server and for every MLflow client a test starts: no usage telemetry leaves the machine.
QUIET_MLFLOW: Final = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


class MlflowUnavailable(RuntimeError):
    """The server's environment is not installed on this machine."""


class MlflowServerError(RuntimeError):
    """The server failed to start; the message carries the end of its log."""


class MlflowServer(PrivateServer):
    """One tracking server: `start()` (or `with`) runs it, `url` is its address, `artifacts`
    the folder it keeps artifacts in, and `stop()` shuts it down and deletes its folder."""

    name = "MLflow"

    def __init__(self) -> None:
        self._base: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError(f"MLflow server already started in {self._base}")
        if not os.access(PROGRAM, os.X_OK):
            raise MlflowUnavailable(f"{PROGRAM} is missing; {_INSTALL_HINT}")
        self._base = Path(tempfile.mkdtemp(prefix="pinvault-mlflow-"))
        try:
            (self._base / "home").mkdir()
            self.artifacts.mkdir()
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [
                        str(PROGRAM),
                        "server",
                        "--backend-store-uri",
                        f"sqlite:///{self._base / 'mlflow.db'}",
                        "--artifacts-destination",
                        str(self.artifacts),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                        "--workers",
                        "1",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    cwd=self._base,
                    start_new_session=True,
                )
            self.port = self._wait_for_port()
            self._wait_ready()
        except BaseException:
            self._kill()
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None
            raise
        atexit.register(self.stop)
        return self

    def _shut_down(self) -> None:
        process, self.process = self.process, None
        try:
            terminate(process, "mlflow server", STOP_TIMEOUT)
        finally:
            if process is not None:
                # What it started (uvicorn's worker) goes with it.
                _kill_session(process.pid)

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("MLflow server is not running: call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def artifacts(self) -> Path:
        return self.base_dir / "artifacts"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "server.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.base_dir / "home"),
            "TMPDIR": str(self.base_dir),
            "LANG": "C.UTF-8",
            # The job runner (a dozen worker processes for GenAI evaluation) is not needed.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            **QUIET_MLFLOW,
        }

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            found = _LISTENING.search(self.log())
            if found:
                return int(found.group(1))
            self._check_alive()
            time.sleep(0.05)
        raise MlflowServerError(
            f"mlflow server did not listen in {START_TIMEOUT:.0f}s{self._tail()}"
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            self._check_alive()
            time.sleep(0.05)
        raise MlflowServerError(
            f"mlflow server was not healthy in {START_TIMEOUT:.0f}s{self._tail()}"
        )

    def _check_alive(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise MlflowServerError(
                f"mlflow server exited with {self.process.returncode} while starting{self._tail()}"
            )

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            _kill_session(process.pid)
            process.wait()

    def _tail(self, lines: int = 40) -> str:
        text = self.log()
        if not text:
            return ""
        return "\nserver.log ends:\n" + "\n".join(text.splitlines()[-lines:])


def _kill_session(leader: int) -> None:
    """SIGKILL every process left in the session the server led."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)
