"""The real `vault admission-agent` for tests: started as a subprocess on a Unix socket in a
folder of the caller's (short enough for a socket's path), against a given vault, and asked
exactly as the Slurm plugin asks it: one JSON line each way per connection."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tests.services.base import terminate
from tests.services.vault_server import REPO_ROOT, VAULT_COMMAND, command_env

BANNER = "pinvault admission agent on unix:"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


class AdmissionAgent:
    """One `vault admission-agent` asking the vault at `server`, keeping its client trust
    state in base/state; `args` go after `--listen`, `env` is added to its environment."""

    def __init__(
        self,
        base: Path,
        server: str,
        *,
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.base = base
        self.server = server
        self.socket = base / "agent.sock"
        self.args = args
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.stdout_path = base / "agent.out"
        self.log_path = base / "agent.log"

    def command(self) -> list[str]:
        return [*VAULT_COMMAND, "admission-agent", "--listen", f"unix:{self.socket}", *self.args]

    def env(self) -> dict[str, str]:
        extra = {"PINVAULT_CLIENT_SERVER": self.server, **self.extra_env}
        return command_env(state_home=self.base / "state", extra=extra)

    def start(self) -> Self:
        if self.process is not None:
            raise RuntimeError("admission agent already running")
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.stdout_path, "wb") as out, open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                env=self.env(),
                cwd=REPO_ROOT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self.stdout_path.read_text(errors="replace").startswith(BANNER):
            if self.process.poll() is not None:
                status, self.process = self.process.returncode, None
                raise RuntimeError(f"the admission agent exited with {status}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the admission agent did not start in {START_TIMEOUT}s")
            time.sleep(0.02)
        return self

    def stop(self) -> int:
        """SIGTERM, as systemd stops it; returns the exit status."""
        process, self.process = self.process, None
        return terminate(process, "the admission agent", STOP_TIMEOUT)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def send(self, data: bytes, *, end: bool = False, timeout: float = 30.0) -> bytes:
        """Send `data` on a connection of its own (and with `end`, end the stream); everything
        the agent answered."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            connection.connect(str(self.socket))
            connection.sendall(data)
            if end:
                connection.shutdown(socket.SHUT_WR)
            answer = bytearray()
            while piece := connection.recv(65536):
                answer += piece
        return bytes(answer)

    def ask(self, request: Mapping[str, Any] | bytes) -> dict[str, Any]:
        """One request, as the plugin sends it; the answer, after checking it is one line of
        JSON object."""
        data = request if isinstance(request, bytes) else json.dumps(request).encode() + b"\n"
        answer = self.send(data)
        assert answer.endswith(b"\n") and answer.count(b"\n") == 1, answer
        decoded: dict[str, Any] = json.loads(answer)
        assert isinstance(decoded, dict), answer
        return decoded

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""
