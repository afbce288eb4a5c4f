"""The ledger's sequencer as a child process of `vault serve`: the server starts it (and starts it
again if it stops), and hands it its appends over an anonymous socket pair, so that sequencing
and the database writes run beside the gRPC event loop rather than under its interpreter lock.

    python -m vault.server.sequencer FD   (started by the server only; FD is its end of the link)
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Final

from vault.errors import Unavailable, VaultError
from vault.ledger.db import open_database
from vault.ledger.log import Ledger
from vault.ledger.sequencer import Sequencer, SequencerLink, receive, send

log = logging.getLogger("pinvault")

# Importing the database driver and opening the database; a sequencer slower than this to
# answer is not used.
START_TIMEOUT: Final = 60.0
_READY: Final = "ready"


def start_sequencer(url: str, *, commit_window: float) -> socket.socket:
    """A new sequencer process on the database `url`, and the server's end of its link, once
    it is ready to commit. Only this process holds the other end: the link has no address."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "vault.server.sequencer", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
    except OSError as exc:
        ours.close()
        raise Unavailable(f"cannot start the ledger's sequencer: {exc.strerror}") from None
    finally:
        theirs.close()
    # The URL may hold a password: it goes over the link, never on a command line.
    try:
        send(ours, (url, commit_window))
        answer = receive(ours, START_TIMEOUT)
    except (OSError, EOFError, ValueError) as exc:
        ours.close()
        process.kill()
        process.wait()
        raise Unavailable(f"the ledger's sequencer did not start: {exc}") from None
    if answer != _READY:
        ours.close()
        process.wait()
        raise Unavailable(f"the ledger's sequencer did not start: {answer}")
    # Reaped by a thread of its own, so that a sequencer that stops leaves no zombie.
    _reap(process)
    log.info("ledger sequencer started (pid %d)", process.pid)
    return ours


def _reap(process: subprocess.Popen[bytes]) -> None:
    import threading

    threading.Thread(target=process.wait, name="sequencer-reaper", daemon=True).start()


async def open_sequencer(url: str, *, commit_window: float, ledger: Ledger) -> SequencerLink:
    """A sequencer process for `ledger` on the database `url`, linked on the running loop, and
    attached to the ledger: from now on its appends go there."""

    def connect() -> socket.socket:
        return start_sequencer(url, commit_window=commit_window)

    link = await SequencerLink.open(connect, ledger.committed)
    ledger.attach(link)
    return link


def main(argv: list[str]) -> int:
    # The server stops its sequencer by closing the link, once the appends in flight are
    # answered; a Ctrl-C that reaches the whole process group must not cut those short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s pinvault.sequencer: %(message)s"
    )
    if len(argv) != 1 or not argv[0].isdigit():
        print("vault.server.sequencer is started by `vault serve` only", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(argv[0]))
    try:
        url, commit_window = receive(sock, START_TIMEOUT)
        db = open_database(url, create=False)
    except VaultError as exc:
        send(sock, str(exc))
        return 1
    except Exception as exc:
        send(sock, f"cannot open the ledger database: {exc}")
        return 1
    try:
        sequencer = Sequencer(db, sock, commit_window=float(commit_window))
        send(sock, _READY)
        sequencer.run()
    finally:
        db.dispose()
        sock.close()
    return 0


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main(sys.argv[1:]))
