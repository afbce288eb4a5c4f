"""The ledger's sequencer as a child process of `vault serve`: the server starts it (and starts it
again if it stops), and hands it its appends over an anonymous socket pair, so that sequencing
and the database writes run beside the gRPC event loop rather than under its interpreter lock.

    python -m vault.server.sequencer FD   (started by the server only; FD is its end of the link)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from vault.errors import Unavailable, VaultError

# The ledger's code is imported where it is used: `vault serve` starts its sequencer before
# it imports its own code (`Ahead`), and the sequencer imports its own while it waits for the
# server.
if TYPE_CHECKING:
    from vault.ledger.log import Ledger

log = logging.getLogger("pinvault")

# Importing the database driver and opening the database; a sequencer slower than this to
# answer is not used.
START_TIMEOUT: Final = 60.0
# For a sequencer to exit once its link is closed (it finishes the commit under way).
STOP_TIMEOUT: Final = 30.0
_READY: Final = "ready"


@dataclass
class Ahead:
    """A sequencer process started before the server that will use it has imported its own
    code, so that the two import at once; until it is sent its database it has opened
    nothing."""

    process: subprocess.Popen[bytes]
    link: socket.socket
    taken: bool = False

    @classmethod
    def start(cls) -> Ahead:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen(
                # -P: the code is this server's own (below), never a `vault` folder that
                # happens to be in the working directory.
                [sys.executable, "-P", "-m", "vault.server.sequencer", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=_child_environment(),
            )
        except OSError as exc:
            ours.close()
            raise Unavailable(f"cannot start the ledger's sequencer: {exc.strerror}") from None
        finally:
            theirs.close()
        return cls(process, ours)

    def discard(self) -> None:
        """Stop it if no server took it (it has touched nothing then)."""
        if self.taken:
            return
        self.link.close()
        self.process.kill()
        self.process.wait()


class SequencerProcesses:
    """Starts the ledger's sequencer processes for one server: one at a time, another when one
    stops, each on an anonymous socket pair whose other end only this process holds."""

    def __init__(
        self, url: str, *, commit_window: float, fold_rows: int, ahead: Ahead | None = None
    ) -> None:
        self.url = url
        self.commit_window = commit_window
        self.fold_rows = fold_rows
        self._ahead = ahead
        self._started: list[subprocess.Popen[bytes]] = []

    def start(self) -> socket.socket:
        """A new sequencer process (the one started ahead, the first time), and the server's
        end of its link, once it is ready to commit."""
        from vault.ledger.sequencer import receive, send

        # Reaps those that stopped.
        self._started = [p for p in self._started if p.poll() is None]
        ahead, self._ahead = self._ahead or Ahead.start(), None
        ahead.taken = True
        process, ours = ahead.process, ahead.link
        self._started.append(process)
        # The URL may hold a password: it goes over the link, never on a command line.
        try:
            send(ours, (self.url, self.commit_window, self.fold_rows))
            answer = receive(ours, START_TIMEOUT)
        except (OSError, EOFError, ValueError) as exc:
            ours.close()
            process.kill()
            raise Unavailable(f"the ledger's sequencer did not start: {exc}") from None
        if answer != _READY:
            ours.close()
            raise Unavailable(f"the ledger's sequencer did not start: {answer}")
        log.info("ledger sequencer started (pid %d)", process.pid)
        return ours

    def wait(self, timeout: float) -> None:
        """Wait for the sequencers whose links are closed to exit (killed past `timeout`)."""
        for process in self._started:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("the ledger's sequencer (pid %d) did not exit: killed", process.pid)
                process.kill()
                process.wait()
        self._started.clear()


def _child_environment() -> dict[str, str]:
    """This environment, with the folder this server's `vault` package was imported from first
    on the child's import path."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


@contextlib.asynccontextmanager
async def linked_sequencer(
    url: str,
    *,
    commit_window: float,
    fold_rows: int,
    ledger: Ledger,
    ahead: Ahead | None = None,
) -> AsyncIterator[None]:
    """A sequencer process for `ledger` on the database `url` (the one started `ahead`, if
    any), linked on the running loop and attached to the ledger (its appends go there) until
    the block ends; then the appends in flight are answered, and the sequencer exits."""
    from vault.ledger.sequencer import SequencerLink

    processes = SequencerProcesses(
        url, commit_window=commit_window, fold_rows=fold_rows, ahead=ahead
    )
    link = await SequencerLink.open(processes.start, ledger.committed)
    ledger.attach(link)
    try:
        yield
    finally:
        await link.close()
        await asyncio.get_running_loop().run_in_executor(None, processes.wait, STOP_TIMEOUT)


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
    # Imported while the server imports its own code and opens the database.
    from vault.ledger.db import open_database
    from vault.ledger.sequencer import Sequencer, receive, send

    try:
        # No time limit: the server may first be upgrading a large ledger's schema. If it
        # goes away instead, the link closes.
        message = receive(sock, None)
    except (OSError, EOFError, ValueError):
        return 0  # the server stopped before it needed this sequencer
    try:
        url, commit_window, fold_rows = message
        db = open_database(url, create=False)
    except VaultError as exc:
        send(sock, str(exc))
        return 1
    except Exception as exc:
        send(sock, f"cannot open the ledger database: {exc}")
        return 1
    try:
        sequencer = Sequencer(
            db, sock, commit_window=float(commit_window), fold_rows=int(fold_rows)
        )
        send(sock, _READY)
        sequencer.run()
    finally:
        db.dispose()
        sock.close()
    return 0


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main(sys.argv[1:]))
