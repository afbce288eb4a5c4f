"""A `vault` command run with its standard error on a pseudo-terminal, as a person at a
terminal runs it: what it showed there (progress bars draw only on a terminal)."""

from __future__ import annotations

import os
import pty
import subprocess
import threading
from collections.abc import Mapping, Sequence

from tests.services.vault_server import VAULT_COMMAND


def read_terminal(terminal: int) -> str:
    """Everything written to a pseudo-terminal whose other side is closed."""
    shown = b""
    try:
        while data := os.read(terminal, 4096):
            shown += data
    except OSError:  # EIO: the other side is closed and everything was read
        pass
    finally:
        os.close(terminal)
    return shown.decode(errors="replace")


def run_on_terminal(
    args: Sequence[str], env: Mapping[str, str], timeout: float = 60
) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """`vault ARGS` with standard error on a terminal: its result, and what the terminal showed."""
    terminal, child_side = pty.openpty()
    shown: list[str] = []
    # Read while the command runs, so that it never waits on a full terminal buffer.
    reader = threading.Thread(target=lambda: shown.append(read_terminal(terminal)))
    reader.start()
    try:
        result = subprocess.run(
            [*VAULT_COMMAND, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=child_side,
            env=dict(env),
            timeout=timeout,
            check=False,
        )
    finally:
        os.close(child_side)
        reader.join(30)
    (text,) = shown
    return result, text
