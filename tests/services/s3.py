"""Private S3 servers for tests: MinIO and versitygw, built from source by scripts/test into
.cache/bin, each run on 127.0.0.1 with its own temp folder and credentials, and removed when
stopped."""

from __future__ import annotations

import atexit
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import boto3  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]

from tests.services.base import PrivateServer

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = REPO_ROOT / ".cache" / "bin"
REGION = "us-east-1"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
# MinIO picks its port itself by opening and closing a socket on port 0 before binding for
# real, so another process may take the port in between; MinIO then exits, and we start it
# again. The same holds when `resume` finds the old port taken for a moment.
START_ATTEMPTS = 5
_INSTALL_HINT = "run scripts/test, which builds it into .cache/bin"
_BIND_FAILURES = ("address already in use", "bind: ")


class S3Unavailable(RuntimeError):
    """The server program is not built on this machine."""


class S3ServerError(RuntimeError):
    """The server failed to start or to stop; the message carries the end of its log."""


@dataclass(frozen=True, slots=True)
class S3Endpoint:
    """What a client needs to reach one bucket on one server."""

    server: str
    url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str

    def client(self, **config: Any) -> Any:
        return s3_client(self.url, self.access_key, self.secret_key, self.region, **config)


def s3_client(url: str, access_key: str, secret_key: str, region: str, **config: Any) -> Any:
    """A boto3 S3 client for a test server, with its credentials and region given explicitly."""
    session = boto3.session.Session(
        aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region
    )
    settings: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "retries": {"max_attempts": 2, "mode": "standard"},
        "connect_timeout": 5,
        "read_timeout": 30,
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }
    settings.update(config)
    return session.client("s3", endpoint_url=url, config=Config(**settings))


class S3Server(PrivateServer):
    """One server process and the folder it owns.

    `start()` (or `with`) makes a fresh folder and runs the server on 127.0.0.1 at a port the
    server binds itself and that is then read back; `halt()` stops the process but keeps the
    folder and port, so that `resume()` brings the same server back at the same address (for
    tests of an outage); `stop()` stops it and deletes the folder.
    """

    name: ClassVar[str]
    program: ClassVar[str]
    # Made in the server's folder before its first start.
    folders: ClassVar[tuple[str, ...]] = ("data", "home")

    def __init__(self) -> None:
        self.access_key = "pv" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.region = REGION
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._base: Path | None = None
        self._starts = 0
        self._buckets = itertools.count(1)
        self._client: Any = None
        self._client_port = 0

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError(f"{self.name} server already started")
        binary = BIN_DIR / self.program
        if not os.access(binary, os.X_OK):
            raise S3Unavailable(
                f"{self.program} is not built ({binary} is missing); {_INSTALL_HINT}"
            )
        self._base = Path(tempfile.mkdtemp(prefix=f"pinvault-{self.name}-"))
        try:
            for folder in self.folders:
                (self._base / folder).mkdir()
            self._launch(port=0)
        except BaseException:
            self._abandon()
            raise
        atexit.register(self.stop)
        return self

    def halt(self) -> None:
        """Stop the process as an operator would (SIGTERM), keeping its data and port."""
        process = self.process
        if process is None:
            return
        self.process = None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                status = process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise S3ServerError(
                    f"{self.name} did not stop within {STOP_TIMEOUT:.0f}s of SIGTERM"
                    f"{self._log_tail()}"
                ) from None
            if status != 0:
                raise S3ServerError(
                    f"{self.name} exited with {status} on SIGTERM{self._log_tail()}"
                )

    def crash(self) -> None:
        """Kill the process with SIGKILL, as a power cut would, keeping its data and port for
        `resume()`."""
        self._kill()

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its port and accepts connections but answers nothing."""
        assert self.process is not None, f"{self.name} server is not running"
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after `freeze()`."""
        assert self.process is not None, f"{self.name} server is not running"
        self.process.send_signal(signal.SIGCONT)

    def resume(self) -> None:
        """Start a halted server again on the same folder and port."""
        if self._base is None or self.process is not None:
            raise RuntimeError(f"{self.name} server is not halted")
        self._launch(port=self.port)

    def _shut_down(self) -> None:
        self.halt()

    # -- where things are -------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.base_dir / f"server-{self._starts}.log"

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError(f"{self.name} server has not started")
        return f"http://127.0.0.1:{self.port}"

    # -- buckets ----------------------------------------------------------------------------

    def client(self) -> Any:
        """A client for the server as a whole, made once (it follows the port on resume)."""
        if self._client is None or self._client_port != self.port:
            self._client = s3_client(self.url, self.access_key, self.secret_key, self.region)
            self._client_port = self.port
        return self._client

    def create_bucket(self) -> S3Endpoint:
        """A new empty bucket, named so that no two in one run collide."""
        name = f"pv-{next(self._buckets)}-{secrets.token_hex(4)}"
        self.client().create_bucket(Bucket=name)
        return S3Endpoint(self.name, self.url, self.access_key, self.secret_key, self.region, name)

    def delete_bucket(self, name: str) -> None:
        """Abort the bucket's unfinished uploads, delete its objects, then the bucket."""
        client = self.client()
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=item["Key"])
        client.delete_bucket(Bucket=name)

    # -- what each server does its own way --------------------------------------------------

    @abstractmethod
    def _command(self, address: str) -> list[str]: ...

    @abstractmethod
    def _env(self) -> dict[str, str]: ...

    @abstractmethod
    def _bound_port(self) -> int | None:
        """The port the running server listens on, as it reports it or the kernel shows it;
        None until it is known."""

    @abstractmethod
    def _ready(self) -> bool:
        """Whether the server answers requests."""

    # -- internals --------------------------------------------------------------------------

    def _launch(self, *, port: int) -> None:
        for attempt in range(1, START_ATTEMPTS + 1):
            self._starts += 1
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    self._command(f"127.0.0.1:{port}"),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    cwd=self.base_dir,
                )
            try:
                self.port = self._wait_for_port(expected=port)
                self._wait_ready()
                return
            except _BindFailed:
                self._kill()
                if attempt == START_ATTEMPTS:
                    raise S3ServerError(
                        f"{self.name} could not bind 127.0.0.1:{port} in {attempt} attempts"
                        f"{self._log_tail()}"
                    ) from None
                time.sleep(0.2 * attempt)
            except BaseException:
                self._kill()
                raise

    def _wait_for_port(self, *, expected: int) -> int:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            self._check_alive()
            port = self._bound_port()
            if port is not None:
                if expected and port != expected:
                    raise S3ServerError(
                        f"{self.name} was asked for port {expected} and bound {port}"
                    )
                # The kernel's own record that this process holds the port guards against a
                # report about a socket that another process took first.
                if port in listening_ports(self._pid()):
                    return port
            time.sleep(0.02)
        raise S3ServerError(
            f"{self.name} did not bind a port within {START_TIMEOUT:.0f}s{self._log_tail()}"
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            self._check_alive()
            if self._ready():
                return
            time.sleep(0.02)
        raise S3ServerError(
            f"{self.name} did not become ready within {START_TIMEOUT:.0f}s{self._log_tail()}"
        )

    def _check_alive(self) -> None:
        assert self.process is not None
        status = self.process.poll()
        if status is None:
            return
        log = self._log_text()
        if any(sign in log for sign in _BIND_FAILURES):
            raise _BindFailed()
        raise S3ServerError(f"{self.name} exited with {status} while starting{self._log_tail()}")

    def _pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _kill(self) -> None:
        process = self.process
        self.process = None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def _abandon(self) -> None:
        self._kill()
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
        self._base = None

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def _log_tail(self, lines: int = 40) -> str:
        text = self._log_text()
        if not text:
            return ""
        return f"\n{self.log_path.name} ends:\n" + "\n".join(text.splitlines()[-lines:])


class _BindFailed(Exception):
    """The server exited because its port was taken."""


class MinioServer(S3Server):
    """MinIO on one drive. It binds port 0 itself and reports the port in its JSON log as
    `API: http://127.0.0.1:PORT`; it is ready once /minio/health/ready answers 200."""

    name = "minio"
    program = "minio"

    def _command(self, address: str) -> list[str]:
        return [
            str(BIN_DIR / self.program),
            "server",
            "--address",
            address,
            "--json",
            "--certs-dir",
            str(self.base_dir / "certs"),
            str(self.data_dir),
        ]

    def _env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.base_dir / "home"),
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            # The web console would take a second port; the update check would go online.
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
        }

    def _bound_port(self) -> int | None:
        for line in self._log_text().splitlines():
            try:
                message = json.loads(line).get("message", "")
            except (ValueError, AttributeError):
                continue
            if isinstance(message, str) and message.startswith("API: "):
                for url in message[len("API: ") :].split():
                    if url.startswith("http://127.0.0.1:"):
                        return int(url.rsplit(":", 1)[1])
        return None

    def _ready(self) -> bool:
        return self._http_ok("/minio/health/ready")


class VersityGatewayServer(S3Server):
    """versitygw over a POSIX folder, with object metadata in a sidecar folder (so that it
    needs no extended attributes from the file system). It binds port 0 but reports only
    `:0`, so the port is read back from the kernel's socket table for its process; it is
    ready once its health path answers 200."""

    name = "versitygw"
    program = "versitygw"

    folders = ("data", "home", "meta")

    def _command(self, address: str) -> list[str]:
        return [
            str(BIN_DIR / self.program),
            "--access",
            self.access_key,
            "--secret",
            self.secret_key,
            "--region",
            self.region,
            "--port",
            address,
            "--health",
            "/health",
            "posix",
            "--sidecar",
            str(self.base_dir / "meta"),
            str(self.data_dir),
        ]

    def _env(self) -> dict[str, str]:
        # Its every option also reads a variable (ROOT_ACCESS_KEY, VGW_*…); none may leak in.
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.base_dir / "home"),
        }

    def _bound_port(self) -> int | None:
        ports = listening_ports(self._pid())
        return min(ports) if ports else None

    def _ready(self) -> bool:
        return self._http_ok("/health")


SERVERS: dict[str, type[S3Server]] = {
    server.name: server for server in (MinioServer, VersityGatewayServer)
}


def listening_ports(pid: int) -> set[int]:
    """The TCP ports on 127.0.0.1 that process `pid` is listening on, from /proc (Linux)."""
    inodes: set[str] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports: set[int] = set()
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except FileNotFoundError:
        return set()
    for line in lines:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        address, port = local.split(":")
        # 0A is TCP_LISTEN; the address is 127.0.0.1 in host byte order (little-endian here).
        if state == "0A" and inode in inodes and address in ("0100007F", "00000000"):
            ports.add(int(port, 16))
    return ports


def bucket_is_empty(endpoint: S3Endpoint) -> bool:
    """No objects and no unfinished multipart uploads."""
    client = endpoint.client()
    objects = client.list_objects_v2(Bucket=endpoint.bucket).get("KeyCount", 0)
    uploads = client.list_multipart_uploads(Bucket=endpoint.bucket).get("Uploads", [])
    return objects == 0 and not uploads
