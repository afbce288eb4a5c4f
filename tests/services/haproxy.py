"""HAProxy (Debian's) in front of several vault servers, as a lab runs them, with the
configuration the project ships: gRPC over HTTP/2 balanced per call, and the tiles over HTTP.
Its listening sockets are bound on port 0 by the test and handed to HAProxy as inherited
descriptors (`fd@N`), so no port is guessed."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from tests.services.base import PrivateServer, terminate

_INSTALL_HINT = "run scripts/test, which installs it"
CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "pinvault.cfg"


class HAProxyUnavailable(RuntimeError):
    """HAProxy is not on this machine."""


def find_haproxy() -> str:
    found = shutil.which("haproxy")
    if found is None and os.access("/usr/sbin/haproxy", os.X_OK):
        found = "/usr/sbin/haproxy"
    if found is None:
        raise HAProxyUnavailable(f"haproxy is not installed; {_INSTALL_HINT}")
    return found


def _listener() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    listener.set_inheritable(True)
    return listener


class HAProxy(PrivateServer):
    """HAProxy running the shipped configuration (deploy/haproxy/pinvault.cfg) in front of three
    vault servers: `grpc` and `tiles` are each server's gRPC and tiles host:port, and
    `grpc_address` and `tiles_url` are what clients use."""

    name = "HAProxy"
    servers = 3

    def __init__(self, grpc: Sequence[str], tiles: Sequence[str]) -> None:
        if len(grpc) != self.servers or len(tiles) != self.servers:
            raise ValueError(f"the shipped configuration balances {self.servers} servers")
        self._grpc = list(grpc)
        self._tiles = list(tiles)
        self._process: subprocess.Popen[bytes] | None = None
        self._listeners: list[socket.socket] = []

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self._listeners[0].getsockname()[1]}"

    @property
    def tiles_url(self) -> str:
        return f"http://127.0.0.1:{self._listeners[1].getsockname()[1]}/"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "haproxy.log"

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError(f"HAProxy already started in {self._base}")
        program = find_haproxy()
        self._base = Path(tempfile.mkdtemp(prefix="pinvault-haproxy-"))
        try:
            self._listeners = [_listener(), _listener()]
            fds = [s.fileno() for s in self._listeners]
            env = self._environment()
            command = [program, "-f", str(CONFIG)]
            check = subprocess.run(
                [*command, "-c"], capture_output=True, text=True, timeout=30, env=env, pass_fds=fds
            )
            if check.returncode != 0:
                raise RuntimeError(f"haproxy refused {CONFIG}:\n{check.stdout}{check.stderr}")
            with self.log_path.open("wb") as log:
                self._process = subprocess.Popen(
                    [*command, "-db"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=fds,
                )
            self._wait_ready()
        except BaseException:
            self._shut_down()
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self._base = None
            raise
        atexit.register(self.stop)
        return self

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINVAULT_")}
        env["PINVAULT_GRPC_BIND"] = f"fd@{self._listeners[0].fileno()}"
        env["PINVAULT_TILES_BIND"] = f"fd@{self._listeners[1].fileno()}"
        for n, (grpc, tiles) in enumerate(zip(self._grpc, self._tiles, strict=True), start=1):
            env[f"PINVAULT_VAULT{n}_GRPC"] = grpc
            env[f"PINVAULT_VAULT{n}_TILES"] = tiles
        return env

    def _wait_ready(self) -> None:
        # The listeners were bound and listening before HAProxy started, so a client's connect
        # waits in their backlog until HAProxy takes them over; all to wait for is that it
        # read its configuration and did not exit.
        assert self._process is not None
        try:
            self._process.wait(0.5)
        except subprocess.TimeoutExpired:
            return
        raise RuntimeError(
            f"haproxy exited with {self._process.returncode}:\n"
            + self.log_path.read_text(errors="replace")
        )

    def _shut_down(self) -> None:
        try:
            terminate(self._process, "haproxy", 15)
        finally:
            self._process = None
            for listener in self._listeners:
                listener.close()
            self._listeners = []
