"""What `vault serve` claims in its data folder before it touches anything else there, and the
folder itself, private to the vault's user.

One server per folder: it holds an exclusive lock on a file in the folder for as long as it
runs, with its process id written in it, so that a second server on the same folder refuses to
start, naming the first. The lock is the kernel's (flock): a server killed outright leaves none
behind.

Room to start on a full disk: opening the ledger's database needs room for SQLite's
shared-memory index, which a full disk lacks. A file of zeros holds that room back; a server
that finds the disk (nearly) full at start gives it up, and one that finds room takes it back."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from vault.errors import FailedPrecondition, InvalidArgument
from vault.files import size_text

LOCK_FILE: Final = "serve.lock"
RESERVE_FILE: Final = "reserve"
# SQLite's index (32 KiB) and the hot tier's probe of direct I/O (4 KiB), with room to spare.
RESERVE: Final = 128 * 1024
_PID_MAX: Final = 32

log = logging.getLogger("pinvault")


@contextlib.contextmanager
def only_server(folder: Path) -> Iterator[None]:
    """Hold the data folder `folder` (created if need be) for this process until the block
    ends; FailedPrecondition, naming the holder's pid, if another server holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FailedPrecondition(
                f"another vault server{_holder(fd)} is serving the data folder {folder}: stop "
                "it, or give this one a data folder of its own (data_dir)"
            ) from None
        _write_pid(fd, path)
        _keep_reserve(folder / RESERVE_FILE)
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """' (pid N)' as the holder wrote it, or '' while it has not yet."""
    text = os.pread(fd, _PID_MAX, 0).decode("ascii", errors="replace").strip("\0\n ")
    return f" (pid {text})" if text.isdigit() else ""


def _write_pid(fd: int, path: Path) -> None:
    # Written over the last holder's pid before the rest is cut off, so that a restart on a
    # full disk reuses the block the file already has.
    pid = f"{os.getpid()}\n".encode()
    try:
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
    except OSError as exc:
        log.warning("cannot write this server's pid into %s: %s", path, exc.strerror)


def _keep_reserve(path: Path) -> None:
    """Give up the room held back in `path` when the disk has less than twice as much free,
    else hold it back again (in a file of blocks allocated, not a sparse one)."""
    try:
        free = shutil.disk_usage(path.parent).free
        if free < 2 * RESERVE:
            if path.exists():
                path.unlink()
                log.warning(
                    "the disk holding %s is nearly full (%s free): giving up the %s held back "
                    "so that the vault can start",
                    path.parent,
                    size_text(free),
                    size_text(RESERVE),
                )
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot hold back room to start on a full disk in %s: %s", path, exc)


def make_data_folder(path: Path) -> None:
    """The data folder, private to the vault's user: everything the server creates from here
    on is too (`serve` sets the umask to 077 first), whatever the umask it started with."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot make the data folder {path} private (mode 0700): {exc.strerror}"
        ) from None
