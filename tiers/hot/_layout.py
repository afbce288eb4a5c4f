"""Where the hot tier keeps its files: each blob beside its chunk list in blobs/, and tmp/ for
writes in progress, each entry flocked while in use so that only a crash's leftovers are removed
when the tier is opened."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Final

from tiers.copies import new_temp_file

CHUNKS_SUFFIX: Final = ".chunks"
# A batched put stages its files in a folder of tmp/ with this suffix.
BATCH_SUFFIX: Final = ".batch"


def chunks_path(blob: Path) -> Path:
    """Where the chunk list of the blob kept at `blob` is."""
    return blob.with_name(blob.name + CHUNKS_SUFFIX)


def new_file(tmp: Path, suffix: str, flags: int = 0) -> tuple[int, str]:
    """A new file in tmp/, flocked for as long as it is open (see _locked)."""
    return _locked(lambda: new_temp_file(tmp, suffix, flags))


def new_batch_folder(tmp: Path) -> tuple[int, str]:
    """A new folder in tmp/ for a batch, flocked through the returned descriptor for as long
    as it is open (see _locked)."""

    def create() -> tuple[int, str]:
        while True:
            path = str(tmp / f"{secrets.token_hex(12)}{BATCH_SUFFIX}")
            try:
                os.mkdir(path, 0o700)
                return os.open(path, os.O_RDONLY | os.O_DIRECTORY), path
            except (FileExistsError, FileNotFoundError):
                continue  # a name taken, or the folder cleaned up by another process at once

    return _locked(create)


def remove_folder(fd: int, path: str) -> None:
    """Remove a batch folder (its files, then itself) and close its descriptor."""
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)
    finally:
        os.close(fd)


def remove_leftovers(tmp: Path) -> None:
    """Remove what a crash left in tmp/; entries still flocked by a write in progress in
    another process stay."""
    for entry in os.scandir(tmp):
        if entry.name.endswith(BATCH_SUFFIX) and entry.is_dir(follow_symlinks=False):
            _remove_leftover_batch(entry.path)
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a write in progress elsewhere
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        finally:
            os.close(fd)


def _remove_leftover_batch(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # a batch in progress elsewhere
        return
    remove_folder(fd, path)


def _locked(create: Callable[[], tuple[int, str]]) -> tuple[int, str]:
    """A new entry in tmp/ made by `create` (under a fresh name each time), flocked for as long
    as it is open so that another process opening this tier does not take it for a crash
    leftover."""
    while True:
        fd, path = create()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Another process's clean-up may have removed it between creation and lock.
            if os.fstat(fd).st_nlink:
                return fd, path
        except BlockingIOError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
