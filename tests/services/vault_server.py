"""The real `vault` command for tests: `vault serve` as a subprocess on port 0 with its own data
folder and environment (SQLite by default, or a PostgreSQL URL), and `run_vault` to run any
other `vault` command against it exactly as a user's shell would."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.services.base import terminate
from vault.client import VaultClient
from vault.ledger.checkpoint import SigningKey

REPO_ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("vault")
VAULT_COMMAND: tuple[str, ...] = (
    (str(_SCRIPT),) if _SCRIPT.exists() else (sys.executable, "-m", "cli.main")
)
BANNER = re.compile(r"pinvault serving on (\S+)$")
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
# Variables that would make a command read a developer's own vault, keys or state.
_PRIVATE_PREFIXES = ("PINVAULT_", "XDG_", "PG", "AWS_")


@functools.cache
def _tests_state_home() -> Path:
    """Where commands keep their state when a test names no folder: one of this test process,
    removed at its exit. Never the user's own, where a server address a test once saw would
    stay held to that server's key, and a later server on the same port be refused as an
    impostor."""
    folder = Path(tempfile.mkdtemp(prefix="pinvault-test-state-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def command_env(
    *, state_home: Path | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a `vault` process: the caller's, minus anything that could point it
    at a real vault, plus `extra`. XDG_STATE_HOME keeps the client's trust state in the test
    (`state_home`, else a folder of this test process), and XDG_CACHE_HOME (below it) the
    cache of file digests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    home = state_home if state_home is not None else _tests_state_home()
    env["XDG_STATE_HOME"] = str(home)
    env["XDG_CACHE_HOME"] = str(home / "cache")
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class VaultRun:
    """What a user sees from one `vault` command."""

    args: tuple[str, ...]
    returncode: int
    output: bytes
    stderr: str

    @property
    def stdout(self) -> str:
        return self.output.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.output)

    def json_lines(self) -> list[Any]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]

    def ok(self) -> VaultRun:
        """This run, after checking it succeeded (the failure shows what the user saw)."""
        assert self.returncode == 0, self.describe()
        return self

    def error_line(self, *, alone: bool = True) -> str:
        """The line of error a failed command prints last, after checking that it failed with
        no traceback and, if `alone`, printed nothing else (a server that got as far as
        logging may have logged before it failed)."""
        assert self.returncode != 0, self.describe()
        assert "Traceback" not in self.stderr, self.describe()
        lines = self.stderr.splitlines()
        if alone:
            assert len(lines) == 1, f"expected one line of error\n{self.describe()}"
        assert lines and lines[-1].startswith("vault: "), self.describe()
        return lines[-1]

    def describe(self) -> str:
        return (
            f"vault {' '.join(self.args)} exited {self.returncode}\n"
            f"--- stdout\n{self.stdout[:4000]}\n--- stderr\n{self.stderr[:4000]}"
        )


def run_vault(
    *args: str,
    input: bytes | None = None,
    server: str | None = None,
    state_home: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> VaultRun:
    """Run `vault ARGS…`; `server` becomes PINVAULT_CLIENT_SERVER, `env` is added last."""
    extra = dict(env or {})
    if server is not None:
        extra.setdefault("PINVAULT_CLIENT_SERVER", server)
    result = subprocess.run(
        [*VAULT_COMMAND, *args],
        input=input if input is not None else b"",
        capture_output=True,
        env=command_env(state_home=state_home, extra=extra),
        cwd=REPO_ROOT,
        timeout=timeout,
        check=False,
    )
    return VaultRun(
        tuple(args), result.returncode, result.stdout, result.stderr.decode(errors="replace")
    )


class VaultServer:
    """One `vault serve` process.

    `base` holds everything it owns: data/ (unless `data_dir` is given), state/ (the client
    trust state of commands run through `run`), and the server's stdout and log. The data
    folder is passed as PINVAULT_DATA_DIR unless `data_dir_from_config`, when the server must
    find it from its config file or defaults. `database` is a SQLAlchemy URL passed as
    PINVAULT_LEDGER_DATABASE; `env` adds or overrides variables; `args` go before `serve`.
    """

    def __init__(
        self,
        base: Path,
        *,
        data_dir: Path | None = None,
        data_dir_from_config: bool = False,
        database: str | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        serve_args: Sequence[str] = (),
        listen: str | None = "127.0.0.1:0",
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.base = base
        # How the health check connects to a server that serves TLS only.
        self.channel_credentials = channel_credentials
        self.data_dir = data_dir if data_dir is not None else base / "data"
        self.data_dir_from_config = data_dir_from_config
        self.state_home = base / "state"
        self.database = database
        self.extra_env = dict(env or {})
        self.args = tuple(args)
        self.serve_args = tuple(serve_args)
        self.listen = listen
        self.address = ""
        self.banner: list[str] = []
        self.process: subprocess.Popen[bytes] | None = None
        self.stdout_path = base / "serve.out"
        self.log_path = base / "serve.log"
        self._starts = 0

    # -- life cycle -------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        extra = {"XDG_DATA_HOME": str(self.base / "xdg-data")}
        if not self.data_dir_from_config:
            extra["PINVAULT_DATA_DIR"] = str(self.data_dir)
        if self.database is not None:
            extra["PINVAULT_LEDGER_DATABASE"] = self.database
        extra.update(self.extra_env)
        return command_env(state_home=self.base / "xdg-state-server", extra=extra)

    def start(self) -> Self:
        if self.process is not None:
            raise RuntimeError("vault server already running")
        self.base.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        self.stdout_path = self.base / f"serve-{self._starts}.out"
        self.log_path = self.base / f"serve-{self._starts}.log"
        listen = ("--listen", self.listen) if self.listen else ()
        with open(self.stdout_path, "wb") as out, open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*VAULT_COMMAND, *self.args, "serve", *listen, *self.serve_args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                env=self.env(),
                cwd=REPO_ROOT,
            )
        try:
            first = self._first_line()
            match = BANNER.fullmatch(first)
            if match is None:
                raise RuntimeError(f"vault serve printed {first!r}, not where it listens")
            self.address = match.group(1)
            self._wait_serving()
        except BaseException:
            self._kill()
            raise
        self.banner = self.stdout_path.read_text().splitlines()
        return self

    def _first_line(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        assert self.process is not None
        while time.monotonic() < deadline:
            text = self.stdout_path.read_text(errors="replace")
            if "\n" in text:
                return text.split("\n", 1)[0]
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vault serve exited with {self.process.returncode} before listening:\n"
                    f"{self.log()}"
                )
            time.sleep(0.02)
        raise RuntimeError(f"vault serve did not say where it listens in {START_TIMEOUT}s")

    def _wait_serving(self) -> None:
        with (
            grpc.secure_channel(self.address, self.channel_credentials)
            if self.channel_credentials
            else grpc.insecure_channel(self.address)
        ) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=START_TIMEOUT,
                wait_for_ready=True,
            )
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"vault server health is {response.status}, not SERVING")

    def stop(self) -> int:
        """SIGTERM, as a service manager would; returns the exit status."""
        process, self.process = self.process, None
        return terminate(process, "vault serve", STOP_TIMEOUT)

    def restart(self) -> Self:
        """Stop and start again at the same address, as a restarted service is found by its
        clients (whose trust state is kept per address)."""
        self.stop()
        if self.address:
            self.listen = self.address
        return self.start()

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- using it ---------------------------------------------------------------------------

    def run(
        self,
        *args: str,
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        state_home: Path | None = None,
    ) -> VaultRun:
        """Run a `vault` command against this server, keeping trust state in `state_home`
        (default: this server's own state folder)."""
        return run_vault(
            *args,
            input=input,
            server=self.address,
            state_home=state_home or self.state_home,
            env=env,
        )

    def client(self, *, state: Path | None = None, author: str | None = None) -> VaultClient:
        """A Python client; without `state` it keeps its trust state in memory."""
        return VaultClient(self.address, state=state, author=author, timeout=60)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- where it keeps things --------------------------------------------------------------

    @property
    def db_path(self) -> Path:
        return self.data_dir / "vault.db"

    @property
    def key_path(self) -> Path:
        return self.data_dir / "checkpoint.key"

    @property
    def hot_blobs(self) -> Path:
        return self.data_dir / "hot" / "blobs"

    def signing_key(self) -> SigningKey:
        return SigningKey.load(self.key_path)

    def blob_path(self, sha256: str) -> Path:
        hex_ = sha256.removeprefix("sha256:")
        return self.hot_blobs / hex_[:2] / hex_

    def stored_files(self) -> list[Path]:
        """Every file of the hot tier: blobs, chunk lists and anything left in tmp/."""
        return sorted(p for p in (self.data_dir / "hot").rglob("*") if p.is_file())

    def trust_files(self, state_home: Path | None = None) -> list[Path]:
        return sorted(((state_home or self.state_home) / "pinvault").glob("trust-*.json"))

    def copy_data(self, target: Path) -> Path:
        """Copy the data folder (the server must be stopped, so the copy is consistent)."""
        if self.process is not None:
            raise RuntimeError("stop the server before copying its data folder")
        shutil.copytree(self.data_dir, target)
        return target
