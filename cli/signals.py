"""SIGTERM stops a transfer as Ctrl-C does: the command's clean-up runs (a download removes its
partial file, a put is cancelled before its commit), and it exits 143 with one line."""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from types import FrameType
from typing import Final, TypeVar

# 128 + SIGTERM, as a shell reports a process that SIGTERM ended.
EXIT_TERMINATED: Final = 128 + signal.SIGTERM

A = TypeVar("A")
C = TypeVar("C")


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM; like KeyboardInterrupt, no `except Exception`
    stops it on its way out."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM must not cut the clean-up short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def terminable(command: Callable[[A, C], int]) -> Callable[[A, C], int]:
    """A command that SIGTERM interrupts with its clean-up run, exiting EXIT_TERMINATED."""

    @functools.wraps(command)
    def run(args: A, config: C) -> int:
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            try:
                return command(args, config)
            finally:
                signal.signal(signal.SIGTERM, previous)
        except Terminated:
            from cli.output import report

            as_json = bool(getattr(args, "json", False))
            return report("terminated", "terminated", EXIT_TERMINATED, as_json=as_json)

    return run
