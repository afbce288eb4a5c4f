"""The file handoff: a client on the vault's own host passes an open file to the server over a
Unix socket (SCM_RIGHTS) instead of carrying its bytes in gRPC messages.

The socket only parks descriptors. It answers each with a ticket, and a ticket does nothing
until a Put or Get names it, a call authorised like any other; so the socket asks no
credential, and gRPC stays the one API. What a handed-off file gives the server is only what
its holder could do anyway: the client opened it, which proves it may read (for a put) or
write (for a get) it. A ticket is claimed once, by one call, and a parked file that no call
claims is closed after `TICKET_LIFETIME` seconds.

On the socket, the client sends one message, `read` or `write` (what the server may do with
the file), with the descriptor attached; the server answers one line, `ok INSTANCE TICKET` or
`error REASON`, and closes the connection.

A put through the handoff hashes and stores the file as a streamed put would; a get writes
each chunk into the caller's file once the chunk is verified, and the caller checks the whole
digest of what it reads back, as for a streamed get."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from vault.errors import InvalidArgument
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
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return "only regular files can be handed off"
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    access = flags & os.O_ACCMODE
    if mode == "read" and access == os.O_WRONLY:
        return "a file handed off for reading was opened write-only"
    if mode == "write" and access == os.O_RDONLY:
        return "a file handed off for writing was opened read-only"
    if mode == "write" and flags & os.O_APPEND:
        return "a file handed off for writing must not be opened for appending"
    return ""


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
