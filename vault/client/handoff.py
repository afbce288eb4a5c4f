"""The client's half of the file handoff (the server's is `vault.store.handoff`, which says why
it is built so): on the vault's own host, park a descriptor at the server's handoff socket and
name the ticket it answers in a Put or Get, instead of carrying the bytes in gRPC messages.

Whatever answers on the socket keeps what it is handed. A put hands its source file read-only,
and only to a peer that could not open that file for writing itself (a descriptor can be
opened again through /proc with the file's own permissions, whatever folder hides it); a get
hands the write end of a pipe, never a file.

On the socket, the client sends one message, `read` or `write` (what the server may do with
the file), with the descriptor attached; the server answers one line, `ok INSTANCE TICKET` or
`error REASON`, and closes the connection."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

from vault.errors import IntegrityError, Unavailable
from vault.files import unix_address

Mode = Literal["read", "write"]

# Below this size a transfer streams: the handoff's extra round trips cost more than the
# copies through gRPC they save.
HANDOFF_MIN: Final = 8 * 1024 * 1024
_ANSWER_MAX: Final = 1024
_ANSWER_WITHIN: Final = 5.0
# The server writes a chunk into the pipe as soon as it has sent word of it: a pipe that stays
# empty longer than this is a server that stopped.
PIPE_STALL: Final = 60.0
# A chunk fits in the pipe, so the server never waits on this client to write the next one.
_PIPE_SIZE: Final = 1 << 20


def hand_off(socket_path: str, instance: str, fd: int, mode: Mode) -> str:
    """The client's side: park `fd` at the server's handoff socket and return its ticket.
    Raises OSError when the socket cannot be reached or answers for another server, or
    refuses the file (the caller then streams instead)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(_ANSWER_WITHIN)
        with unix_address(socket_path) as address:
            connection.connect(address)
        if mode == "read":
            _lends_nothing_more(fd, connection)
        socket.send_fds(connection, [mode.encode()], [fd])
        answer = b""
        while not answer.endswith(b"\n") and len(answer) < _ANSWER_MAX:
            data = connection.recv(_ANSWER_MAX)
            if not data:
                break
            answer += data
    word, _, rest = answer.decode(errors="replace").strip().partition(" ")
    if word == "ok":
        theirs, _, ticket = rest.partition(" ")
        if theirs != instance:
            raise OSError(f"{socket_path} belongs to another vault server")
        return ticket
    if word == "error":
        raise OSError(f"the handoff socket refused the file: {rest}")
    raise OSError(f"the handoff socket at {socket_path} gave no answer")


def open_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) for a get through the handoff, as large as a chunk where
    the system lets it be."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(read_end, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
    return read_end, write_end


def read_piped(fd: int, size: int, within: float = PIPE_STALL) -> memoryview:
    """The next `size` bytes from the pipe handed off for a get; IntegrityError if it ends
    first, Unavailable if it stays empty for `within` seconds."""
    data = bytearray(size)
    view = memoryview(data)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    got = 0
    while got < size:
        if not poller.poll(within * 1000):
            raise Unavailable(
                f"the vault server wrote nothing into the pipe for {within:g} seconds"
            )
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise IntegrityError(
                f"the pipe of a get through the handoff ended {size - got} bytes before "
                "the end of a chunk"
            )
        got += n
    # A fresh buffer for each chunk: the hashing thread may still read it while the next fills.
    return view


class PipedGet:
    """The bytes of a whole-blob get that the server writes into the handed-off pipe, read as
    fast as it writes them.

    The server sends a message naming each chunk, then writes the chunk into the pipe, which
    holds one chunk. A reader that waited for each message before taking its chunk would leave
    the server idle for a message's trip through both event loops at every chunk (measured: two
    of a 1 GiB get's four seconds). So the pipe is read on its own, a chunk at a time, while a
    thread takes the messages: they carry nothing the digest checked at the end does not cover,
    but they must be taken for the server to go on, and the call's end says whether the server
    finished or failed (a damaged copy: it closes the pipe and the call ends in its error)."""

    def __init__(
        self,
        fd: int,
        messages: Iterator[Any],
        start: int,
        end: int,
        chunk_size: int,
        errors: Callable[[], Any],
    ) -> None:
        self._fd = fd
        self._messages = messages
        self._position = start
        self._end = end
        self._chunk_size = chunk_size
        self._error: BaseException | None = None
        self._ended = threading.Event()
        self._thread = threading.Thread(
            target=self._take_messages,
            args=(messages, start, errors),
            name="pinvault-get-messages",
            daemon=True,
        )
        self._thread.start()

    def _take_messages(
        self, messages: Iterator[Any], expected: int, errors: Callable[[], Any]
    ) -> None:
        try:
            with errors():
                for message in messages:
                    chunk = message.chunk
                    if message.WhichOneof("part") != "chunk" or chunk.data:
                        raise IntegrityError(
                            "the server sent bytes for a get into a handed-off pipe"
                        )
                    if chunk.offset != expected or expected >= self._end:
                        raise IntegrityError(
                            f"the server named a chunk at offset {chunk.offset} of a get into a "
                            f"handed-off pipe, expected {expected}"
                        )
                    expected += self._chunk_size
        except BaseException as error:
            self._error = error
        finally:
            self._ended.set()

    def next_chunk(self) -> memoryview | None:
        """The next chunk's bytes from the pipe, or None once all were read and the call ended
        well; the call's error if it failed, IntegrityError if the pipe ends early."""
        if self._position >= self._end:
            self._finish(within=PIPE_STALL)
            return None
        size = min(self._chunk_size, self._end - self._position)
        try:
            data = read_piped(self._fd, size)
        except (IntegrityError, Unavailable):
            # A server that failed closed the pipe first: its error says why, not the pipe.
            self._finish(within=_ANSWER_WITHIN)
            raise
        self._position += size
        return data

    def close(self) -> None:
        """Cancel the call unless it has ended (a get given up, or a server that keeps the call
        open past its pipe), and wait for the thread taking its messages to end with it: a
        thread left inside the call as the process exits can hang the exit in gRPC's own
        shutdown."""
        cancel = getattr(self._messages, "cancel", None)
        if cancel is not None and not self._ended.is_set():
            cancel()
        if self._thread is not threading.current_thread():  # a reader collected on it
            self._thread.join(_ANSWER_WITHIN)

    def _finish(self, within: float) -> None:
        if not self._ended.wait(within):
            raise Unavailable(
                f"the vault server did not end a get {within:g} seconds after its pipe"
            )
        if self._error is not None:
            raise self._error


def _lends_nothing_more(fd: int, connection: socket.socket) -> None:
    """Refuse (OSError) to hand the file `fd` for reading to the peer of `connection` if that
    peer could open it for writing through the descriptor: a uid other than this process's and
    root's, to whom the file's permissions give write."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    if uid in (0, os.geteuid()):
        return  # it may already open whatever this process may
    info = os.fstat(fd)
    writable = bool(info.st_mode & stat.S_IWOTH) or (
        info.st_uid == uid and bool(info.st_mode & stat.S_IWUSR)
    )
    if not writable and info.st_mode & stat.S_IWGRP:
        writable = _in_group(pid, gid, info.st_gid)
    if writable:
        raise OSError(
            f"the handoff socket's owner (uid {uid}) may write the file: it is not handed off"
        )


def _in_group(pid: int, gid: int, group: int) -> bool:
    """Whether process `pid` (of primary group `gid`) is in `group`; True when its groups
    cannot be read."""
    if group == gid:
        return True
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return group in {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return True
