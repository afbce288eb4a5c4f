"""`vault admission-agent`: a long-running process beside slurmctld that answers the Slurm
plugin's admission questions on a Unix socket with one warm, trust-keeping vault client, so that
a submission waits for one vault call instead of a Python start-up (slurm/README.md)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from cli.output import error_line
from cli.run import image_external
from vault.errors import FailedPrecondition, InvalidArgument, VaultError

# The client (gRPC) loads when the agent starts, not for `vault admission-agent --help`.
if TYPE_CHECKING:
    from cli.warm import Connect
    from vault.config import Config

# A request is a few digests and names; anything longer is not the plugin talking.
MAX_REQUEST: Final = 16 * 1024
# The plugin sends its line at once, so a request still incomplete after this is refused.
REQUEST_SECONDS: Final = 3.0
# After answering, how long and how much of an unread request is drained before closing.
DRAIN_SECONDS: Final = 0.5
MAX_DRAIN: Final = 1 << 20
# More requests at once than slurmctld (which admits one job at a time) ever makes.
MAX_CONCURRENT: Final = 64
SOCKET_MODE: Final = 0o660
# sockaddr_un's sun_path holds 108 bytes, with the terminating NUL.
MAX_SOCKET_PATH: Final = 107
_FIELDS: Final = ("image", "dataset", "config", "seed", "team", "run_id")
_REQUIRED: Final = ("image", "dataset", "seed")

log = logging.getLogger("pinvault.agent")
ErrorLine = Callable[[VaultError], str]


def agent_arguments(p: argparse.ArgumentParser, *, connect: Connect) -> None:
    """The arguments of `vault admission-agent` (cli/main.py adds the command, and imports
    this module only when it runs)."""
    p.description = "One JSON line in, one JSON line out, per connection (slurm/README.md)."
    p.add_argument("--listen", required=True, metavar="unix:PATH", help="the socket to create")
    p.add_argument(
        "--mode",
        type=_mode,
        default=SOCKET_MODE,
        help=f"the socket's permissions, octal (default {SOCKET_MODE:04o}); its folder's "
        "permissions decide who reaches it",
    )
    p.set_defaults(func=partial(_serve, connect=connect))


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected octal permissions, found {text!r}") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"expected permissions 0000 to 0777, found {text!r}")
    return mode


class Agent:
    """The warm client and the answer to one request."""

    def __init__(self, config: Config, connect: Connect, error_line: ErrorLine) -> None:
        from cli.warm import WarmClient

        self._vault = WarmClient(config, connect)
        self._error_line = error_line

    def close(self) -> None:
        self._vault.close()

    def warm_up(self) -> None:
        self._vault.warm_up()

    def refusal(self, exc: VaultError) -> dict[str, Any]:
        reason = self._error_line(exc)
        log.info("refused: %s", reason)
        return {"admitted": False, "reason": reason}

    def answer(self, line: bytes) -> dict[str, Any]:
        try:
            return self._admit(_parse(line))
        except VaultError as exc:
            return self.refusal(exc)
        except Exception as exc:
            # Fail closed, in one line to the user; the whole story goes to the agent's log.
            log.exception("admission failed")
            return {"admitted": False, "reason": f"the admission agent failed: {_one_line(exc)}"}

    def _admit(self, fields: dict[str, str]) -> dict[str, Any]:
        admission = self._vault.call(lambda client: client.admit(**fields))
        external = self._vault.call(lambda client: image_external(client, admission))
        log.info("admitted run %s for team %s", admission.run_id, admission.team)
        return {
            "admitted": True,
            "run_id": admission.run_id,
            "seed": str(admission.seed),
            # What was checked of the image, which the plugin tells the user; the count as a
            # string of digits, as the seed is, which an earlier job_submit.lua also reads.
            "image_blobs": str(admission.image_blobs),
            "image_external": external,
        }


def _parse(line: bytes) -> dict[str, str]:
    """The request's fields as `VaultClient.admit` takes them; one line of reason otherwise."""
    # Byte for byte as the command gets its arguments, so that both give the vault the same.
    text = line.decode("utf-8", "surrogateescape")
    try:
        request = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"the request is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidArgument("the request is not a JSON object")
    unknown = sorted(set(request) - set(_FIELDS))
    if unknown:
        raise InvalidArgument(f"unknown request field {unknown[0]!r} (known: {', '.join(_FIELDS)})")
    missing = [name for name in _REQUIRED if request.get(name, "") == ""]
    if missing:
        raise InvalidArgument(f"the request has no {', '.join(missing)}")
    fields: dict[str, str] = {}
    for name, value in request.items():
        # Strings only, the seed too, as the command's arguments are.
        if not isinstance(value, str):
            raise InvalidArgument(f"request field {name!r} is not a string")
        fields[name] = value
    return fields


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        connection: socket.socket = self.request
        if not self.server.slots.acquire(blocking=False):
            reason = f"UNAVAILABLE: the admission agent is busy ({MAX_CONCURRENT} requests at once)"
            self._send(connection, {"admitted": False, "reason": reason})
            return
        try:
            try:
                line = _read_line(connection)
            except VaultError as exc:
                answer = self.server.agent.refusal(exc)
            else:
                answer = self.server.agent.answer(line)
            self._send(connection, answer)
        finally:
            self.server.slots.release()

    def _send(self, connection: socket.socket, answer: dict[str, Any]) -> None:
        # ASCII JSON: the plugin decodes \u escapes and needs no UTF-8 of its own.
        data = json.dumps(answer).encode() + b"\n"
        try:
            connection.settimeout(REQUEST_SECONDS)
            connection.sendall(data)
        except OSError as exc:
            log.warning("could not answer (the plugin gave up?): %s", exc.strerror or exc)
            return
        # Closing with a request's unread rest would reset the connection and lose the answer
        # (an oversized request's sender is still sending): end ours, and drain a little.
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_WR)
            connection.settimeout(DRAIN_SECONDS)
            drained = 0
            while drained < MAX_DRAIN and (piece := connection.recv(65536)):
                drained += len(piece)


def _read_line(connection: socket.socket) -> bytes:
    """One request line, up to MAX_REQUEST bytes and REQUEST_SECONDS; the end of the stream
    ends it too."""
    deadline = time.monotonic() + REQUEST_SECONDS
    data = bytearray()
    while b"\n" not in data:
        if len(data) > MAX_REQUEST:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            raise InvalidArgument(f"no whole request line in {REQUEST_SECONDS:g} s")
        connection.settimeout(left)
        try:
            piece = connection.recv(MAX_REQUEST + 2 - len(data))
        except TimeoutError:
            raise InvalidArgument(f"no whole request line in {REQUEST_SECONDS:g} s") from None
        if not piece:
            break
        data += piece
    line = bytes(data).split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST:
        raise InvalidArgument(f"the request is longer than {MAX_REQUEST} bytes")
    return line


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    # slurmctld asks one at a time, but a burst must queue rather than be refused.
    request_queue_size = 128

    def __init__(self, path: str, agent: Agent) -> None:
        self.agent = agent
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        super().__init__(path, _Handler)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _socket_path(listen: str) -> str:
    if not listen.startswith("unix:"):
        raise InvalidArgument(
            f"--listen {listen!r}: the agent answers on a Unix socket only: give unix:PATH"
        )
    path = listen.removeprefix("unix:")
    if not path:
        raise InvalidArgument("--listen unix: names no path")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise InvalidArgument(
            f"socket path {path} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket takes"
        )
    return path


def _clear_stale(path: str) -> None:
    """Remove a socket left by an agent that died; refuse to take over a live one or to
    delete anything that is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FailedPrecondition(f"{path} exists and is not a socket: not removing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
        else:
            raise FailedPrecondition(f"another process already answers on {path}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def _listening(path: str, mode: int, agent: Agent) -> Iterator[_Server]:
    _clear_stale(path)
    # Created with no more than `mode` allows, so that it is never open wider, even briefly.
    old = os.umask(0o777 & ~mode)
    try:
        server = _Server(path, agent)
    finally:
        os.umask(old)
    identity = os.stat(path)
    try:
        os.chmod(path, mode)
        yield server
    finally:
        server.server_close()
        # Only our own socket: a newer agent may have replaced it since.
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (identity.st_dev, identity.st_ino):
                os.unlink(path)


def _serve(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    path = _socket_path(args.listen)
    # The command logs warnings only; the agent's decisions are its journal.
    log.setLevel(logging.INFO)
    agent = Agent(config, connect, error_line)
    try:
        with _listening(path, args.mode, agent) as server:
            agent.warm_up()

            def stop(signum: int, frame: object) -> None:
                # shutdown() waits for serve_forever to return, so not on its own thread.
                threading.Thread(target=server.shutdown, daemon=True).start()

            signal.signal(signal.SIGTERM, stop)
            print(f"pinvault admission agent on unix:{path}", flush=True)
            server.serve_forever(poll_interval=0.5)
    finally:
        agent.close()
    log.info("admission agent stopped")
    return 0
