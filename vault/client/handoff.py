"""The client's half of the file handoff (the server's is `vault.store.handoff`): on the vault's
own host, park an open file at the server's handoff socket and name the ticket it answers in a
Put or Get, instead of carrying the bytes in gRPC messages.

On the socket, the client sends one message, `read` or `write` (what the server may do with
the file), with the descriptor attached; the server answers one line, `ok INSTANCE TICKET` or
`error REASON`, and closes the connection."""

from __future__ import annotations

import socket
from typing import Final, Literal

from vault.files import unix_address

Mode = Literal["read", "write"]

# Below this size a transfer streams: the handoff's extra round trips cost more than the
# copies through gRPC they save.
HANDOFF_MIN: Final = 8 * 1024 * 1024
_ANSWER_MAX: Final = 1024
_ANSWER_WITHIN: Final = 5.0


def hand_off(socket_path: str, instance: str, fd: int, mode: Mode) -> str:
    """The client's side: park `fd` at the server's handoff socket and return its ticket.
    Raises OSError when the socket cannot be reached or answers for another server, or
    refuses the file (the caller then streams instead)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(_ANSWER_WITHIN)
        with unix_address(socket_path) as address:
            connection.connect(address)
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
