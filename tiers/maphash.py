"""The BLAKE3 of whole files through a memory map, hashed on every core, in a child process.

A map is the fastest way to hash a file that sits in the page cache: no byte is copied before
it is hashed. But a read error, or a file cut short, under a map is SIGBUS, which kills the
process; and finding exactly those is what a scrub is for. In a child process it kills only the
child: the caller is told the file could not be hashed this way, reads it instead (which turns
the same fault into an error it can report), and the next file gets a new child.

    python -m tiers.maphash     (the child: one path a line in, `ok HEX SIZE` or `error WHY` out)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import blake3


class MapHasher:
    """A lazily started child that hashes files by path, one at a time."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def hash(self, path: Path) -> tuple[bytes, int] | None:
        """The BLAKE3 digest and size of the file at `path`, or None when the child could not
        map and hash it (it failed, or died on a fault): the caller reads the file instead."""
        with self._lock:
            child = self._start()
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write(os.fsencode(path) + b"\n")
                child.stdin.flush()
                answer = child.stdout.readline()
            except OSError:
                answer = b""
            if not answer:  # the child died: on this file, presumably
                self._stop()
                return None
        word, *rest = answer.split()
        if word != b"ok" or len(rest) != 2:
            return None
        return bytes.fromhex(rest[0].decode()), int(rest[1])

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tiers.maphash"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=Path(__file__).resolve().parent.parent,
            )
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    for line in requests:
        path = line.rstrip(b"\n")
        try:
            size = os.stat(path).st_size
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            if size:
                hasher.update_mmap(os.fsdecode(path))
            answer = f"ok {hasher.hexdigest()} {size}\n"
        except OSError as exc:
            answer = f"error {exc.strerror}\n"
        answers.write(answer.encode())
        answers.flush()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
