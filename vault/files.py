"""File helpers shared by the local tiers, dataset checkout, the run library and both halves of
the file handoff: complete writes, folder syncs (a rename or a new file is durable only once
its folder is synced), Unix socket addresses of any length, and byte counts as people read
them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Final


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)


def read_upto(fd: int, limit: int) -> bytes:
    """What `fd` holds from its position, `limit` bytes at most (a file that lies about its
    size, or grows, costs no more than that)."""
    parts = []
    left = limit
    while left > 0:
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The longest path a Unix socket address holds on Linux, less its terminating zero.
SOCKET_PATH_MAX: Final = 107


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """`path` as a Unix socket address: itself, or, when longer than an address holds, the
    same socket reached through a descriptor of its folder."""
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        yield path
        return
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def size_text(count: int) -> str:
    """A byte count as people read it: 512 B, 1.5 MiB."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
