"""The file handoff: a client on the vault's own host passes a descriptor to the server over a
Unix socket (SCM_RIGHTS) instead of carrying a blob's bytes in gRPC messages.

The socket only parks descriptors. It answers each with a ticket, and a ticket does nothing
until a Put or Get names it, a call authorised like any other; so the socket asks no
credential, and gRPC stays the one API. A ticket is claimed once, by one call, and a parked
descriptor that no call claims is closed after `TICKET_LIFETIME` seconds.

Nothing the server is handed reaches further than the one call: a descriptor cannot be taken
back, so whatever answers on the socket (this server, a compromised one, or a process bound in
its place) keeps it for as long as it likes.
- A put hands the source file, opened read-only: reading it is what the client asked for. (The
  client hands it only to a server that could not open it for writing anyway, see
  `vault.client.handoff`.)
- A get hands the write end of a pipe, never a file: the server writes each verified chunk into
  it, and the client reads, hashes and writes its file itself. Once the client has read the
  blob's size and closed its end, the pipe leads nowhere, so nothing written later can change
  the file, or what a reader of it sees, after its digest matched.

Of the ways to keep a get fast on one host, the pipe is the one that leaves the holder nothing.
Handing the client's own file lets the holder rewrite it at any time after the check. A private
temporary file, copied into the destination once written, keeps the destination safe, but the
holder can still fill the client's disk through it, and every byte is written twice. The server
handing the client a descriptor of its stored blob gives away its pack files, and works only
for blobs on a local tier. The pipe costs one more copy in memory than writing into the file:
on-host gets measured about a fifth slower than that, and still well ahead of streaming
(bench/put_get.py).

On the socket, the client sends one message, `read` or `write` (what the server may do with
the descriptor), with the descriptor attached; the server answers one line,
`ok INSTANCE TICKET` or `error REASON`, and closes the connection."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import select
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from vault.errors import InvalidArgument, Unavailable
from vault.files import unix_address

log = logging.getLogger(__name__)

Mode = Literal["read", "write"]
MODES: Final[tuple[Mode, ...]] = ("read", "write")

TICKET_LIFETIME: Final = 60.0
MAX_PARKED: Final = 64
_GERUND: Final[dict[Mode, str]] = {"read": "reading", "write": "writing"}
_READ_PIECE: Final = 4 * 1024 * 1024
# One connection is served at a time, and a client sends at once: one that does not holds the
# socket up at most this long.
_SEND_WITHIN: Final = 1.0
# A caller that takes no bytes from its pipe for this long gives the server's thread back.
PIPE_STALL: Final = 30.0


@dataclass(frozen=True, slots=True)
class _Parked:
    fd: int
    mode: Mode
    deadline: float


class Desk:
    """The server's side: a thread accepting connections on `path`, parking each descriptor
    handed to it under a fresh ticket until one call claims it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.instance = secrets.token_hex(16)
        self._parked: dict[str, _Parked] = {}
        self._lock = threading.Lock()
        # A socket already there was left by a server that did not stop cleanly: the server
        # opens its desk only while it holds the data folder's lock, which a live one keeps.
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(os.fspath(path)) as address:
                self._listener.bind(address)
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="pinvault-handoff", daemon=True)
        self._thread.start()

    def claim(self, ticket: str, mode: Mode) -> int:
        """The descriptor parked under `ticket`, which the caller now owns (and closes)."""
        with self._lock:
            parked = self._parked.pop(ticket, None)
        if parked is None or parked.deadline < time.monotonic():
            if parked is not None:
                os.close(parked.fd)
            raise InvalidArgument(
                "unknown or expired handoff ticket: hand the file to this server's handoff "
                "socket again"
            )
        if parked.mode != mode:
            os.close(parked.fd)
            raise InvalidArgument(
                f"the handed-off file was given for {_GERUND[parked.mode]}; this call needs it "
                f"for {_GERUND[mode]}"
            )
        if mode == "write":
            # Waits are bounded by `write_handed_off`, not by the caller's reading.
            os.set_blocking(parked.fd, False)
        return parked.fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        self._thread.join()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self._lock:
            for parked in self._parked.values():
                os.close(parked.fd)
            self._parked.clear()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with connection:
                try:
                    connection.settimeout(_SEND_WITHIN)
                    answer = self._take(connection)
                except OSError as exc:
                    log.info("a handoff connection failed: %s", exc)
                    continue
                with contextlib.suppress(OSError):
                    connection.sendall(answer.encode() + b"\n")

    def _take(self, connection: socket.socket) -> str:
        message, fds, _, _ = socket.recv_fds(connection, 16, 2)
        try:
            if len(fds) != 1:
                return f"error expected one file descriptor, got {len(fds)}"
            word = message.decode(errors="replace")
            if word not in MODES:
                return f"error unknown handoff mode {word!r}: expected read or write"
            mode: Mode = "read" if word == "read" else "write"
            reason = _unsuitable(fds[0], mode)
            if reason:
                return f"error {reason}"
            ticket = self._park(fds[0], mode)
            if ticket is None:
                return f"error {MAX_PARKED} handed-off files wait unclaimed; try again later"
            fds.clear()  # parked: no longer ours to close here
            return f"ok {self.instance} {ticket}"
        finally:
            for fd in fds:
                os.close(fd)

    def _park(self, fd: int, mode: Mode) -> str | None:
        now = time.monotonic()
        with self._lock:
            for ticket in [t for t, p in self._parked.items() if p.deadline < now]:
                os.close(self._parked.pop(ticket).fd)
            if len(self._parked) >= MAX_PARKED:
                return None
            ticket = secrets.token_hex(16)
            self._parked[ticket] = _Parked(fd, mode, now + TICKET_LIFETIME)
            return ticket


def _unsuitable(fd: int, mode: Mode) -> str:
    """Why the server cannot use this descriptor as asked, or ''."""
    kind = os.fstat(fd).st_mode
    access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if mode == "read":
        if not stat.S_ISREG(kind):
            return "only regular files can be handed off for reading"
        if access == os.O_WRONLY:
            return "a file handed off for reading was opened write-only"
        return ""
    if not stat.S_ISFIFO(kind):
        return "only the write end of a pipe can be handed off for a get: the server writes no file"
    if access != os.O_WRONLY:
        return "the pipe handed off for a get is not its write end"
    return ""


def write_handed_off(fd: int, data: bytes | memoryview, within: float = PIPE_STALL) -> None:
    """Write one verified chunk into the pipe handed off for a get, waiting at most `within`
    seconds at a time for the caller to make room in it."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    written = 0
    try:
        while written < len(view):
            try:
                written += os.write(fd, view[written:])
            except BlockingIOError:
                if not poller.poll(within * 1000):
                    raise Unavailable(
                        f"the caller took no bytes from its handed-off pipe for {within:g} seconds"
                    ) from None
    except BrokenPipeError:
        raise Unavailable("the caller closed its handed-off pipe before the blob's end") from None


def read_handed_off(fd: int, size: int) -> Iterator[bytes]:
    """The first `size` bytes of a file handed off for a put; closes `fd` when done. A file
    shorter than that is an error, not a shorter blob."""
    try:
        offset = 0
        while offset < size:
            piece = os.pread(fd, min(_READ_PIECE, size - offset), offset)
            if not piece:
                raise InvalidArgument(
                    f"the handed-off file ends at byte {offset}, before the {size} bytes to put"
                )
            offset += len(piece)
            yield piece
    finally:
        os.close(fd)
