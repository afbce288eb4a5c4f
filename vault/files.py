"""Durable-file helpers shared by the local tiers, dataset checkout and the run library:
complete writes and folder syncs (a rename or a new file is durable only once its folder is
synced)."""

from __future__ import annotations

import os


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


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
