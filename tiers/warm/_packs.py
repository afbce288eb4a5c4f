"""The warm tier's pack files: their names in archive/, the one pack open for appends, and the
read handles kept open on packs for concurrent reads."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.errors import IntegrityError

PACK_SUFFIX: Final = ".pack"
# Read handles kept open on pack files; an idle one past this is closed.
_OPEN_FILES: Final = 128


def pack_path(archive: Path, number: int) -> Path:
    return archive / f"{number:012d}{PACK_SUFFIX}"


def pack_number(name: str) -> int | None:
    """The number of the pack file called `name`; None for any other name."""
    stem = name.removesuffix(PACK_SUFFIX)
    if name.endswith(PACK_SUFFIX) and stem.isdigit():
        return int(stem)
    return None


class PackGone(IntegrityError):
    """A pack file that is not there: damage, unless a compaction moved the record asked for
    between its look-up and the opening of its pack."""


@dataclass(slots=True)
class OpenPack:
    """The pack being appended to: its number, its descriptor, and its acknowledged size."""

    number: int
    fd: int
    size: int


class PackFiles:
    """Read handles on pack files, shared by concurrent reads and kept open between them; an
    idle one is closed once more than _OPEN_FILES are open."""

    def __init__(self, path_of: Callable[[int], Path]) -> None:
        self._path_of = path_of
        self._lock = threading.Lock()
        self._open: OrderedDict[int, list[int]] = OrderedDict()

    @contextlib.contextmanager
    def open(self, number: int) -> Iterator[int]:
        with self._lock:
            handle = self._open.get(number)
            if handle is not None:
                handle[1] += 1
                self._open.move_to_end(number)
        if handle is None:
            path = self._path_of(number)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise PackGone(f"pack file {path} is missing") from None
            with self._lock:
                handle = self._open.get(number)
                if handle is None:
                    handle = self._open[number] = [fd, 1]
                else:
                    handle[1] += 1
                    os.close(fd)
                self._evict()
        try:
            yield handle[0]
        finally:
            with self._lock:
                handle[1] -= 1
                self._evict()

    def forget(self, number: int) -> None:
        """Close the read handle on pack `number` if no read holds it (its file is about to
        be removed: an open handle would keep its blocks allocated)."""
        with self._lock:
            handle = self._open.get(number)
            if handle is not None and handle[1] == 0:
                del self._open[number]
                os.close(handle[0])

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._open.values():
                os.close(fd)
            self._open.clear()

    def _evict(self) -> None:
        excess = len(self._open) - _OPEN_FILES
        for number in list(self._open):
            if excess <= 0:
                return
            fd, users = self._open[number]
            if users == 0:
                del self._open[number]
                os.close(fd)
                excess -= 1
