"""A hostile process in the vault server's place on its handoff socket: it passes every
descriptor a client hands it on to the real socket (so puts and gets succeed), keeps a copy,
and, told `rewrite` on its standard input, tries everything it can through each copy, printing
one JSON line of what it got and what it managed.

    python -m tests.services.hostile_handoff FAKE_SOCKET REAL_SOCKET UID

It binds FAKE_SOCKET first, then runs (and listens) as UID and its group; everything it uses
is imported before, as a process of another uid may not read the interpreter's folders."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pwd
import selectors
import socket
import stat
import sys
from typing import Any

REWRITTEN = b"REWRITTEN BY THE HOSTILE SERVER "


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "pipe"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _access(fd: int) -> str:
    access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    return {os.O_RDONLY: "read-only", os.O_WRONLY: "write-only"}.get(access, "read-write")


def _attempt(action: Any) -> str:
    try:
        result = action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return f"ok {result}" if result is not None else "ok"


def _rewrite(kept: list[tuple[str, int]]) -> list[dict[str, str]]:
    """Everything a holder of each descriptor might try, and how it went."""
    done = []
    for mode, fd in kept:
        info = os.fstat(fd)
        tried = {"mode": mode, "kind": _kind(info.st_mode), "access": _access(fd)}
        if stat.S_ISFIFO(info.st_mode):
            os.set_blocking(fd, False)
            tried["write"] = _attempt(lambda fd=fd: os.write(fd, REWRITTEN))
        else:
            tried["write"] = _attempt(lambda fd=fd: os.pwrite(fd, REWRITTEN, 0))

            def reopen(fd: int = fd) -> None:
                again = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
                try:
                    os.pwrite(again, REWRITTEN, 0)
                finally:
                    os.close(again)

            tried["reopen"] = _attempt(reopen)
            tried["chmod"] = _attempt(lambda fd=fd: os.fchmod(fd, 0o666))
        done.append(tried)
    return done


def _relay(connection: socket.socket, real: str, kept: list[tuple[str, int]]) -> None:
    message, fds, _, _ = socket.recv_fds(connection, 16, 2)
    if not fds:
        return  # the client thought better of it
    for fd in fds:
        kept.append((message.decode(errors="replace"), os.dup(fd)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
        upstream.connect(real)
        socket.send_fds(upstream, [message], fds)
        answer = upstream.recv(1024)
    for fd in fds:
        os.close(fd)
    connection.sendall(answer)


def main() -> None:
    fake, real, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(fake)
    os.chmod(fake, 0o777)
    gid = pwd.getpwuid(uid).pw_gid
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    # After the uid changed: a client reads the credentials the socket listened with.
    listener.listen(16)
    kept: list[tuple[str, int]] = []
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                with connection:
                    _relay(connection, real, kept)
                continue
            line = sys.stdin.readline()
            if not line:
                return
            print(json.dumps(_rewrite(kept)), flush=True)


if __name__ == "__main__":
    main()
