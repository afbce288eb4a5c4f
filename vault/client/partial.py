"""The partial file a download writes beside its target until the blob is verified: created so
that nothing planted in the folder is followed or reused, removed unless renamed onto the
target, and, for a whole blob, named after its digest so that the next get of the same blob
resumes from what a killed one left (each byte it keeps checked first)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

import blake3

from vault.client.reader import ChunkHashes
from vault.digest import Digest
from vault.errors import InvalidArgument

_FLAGS: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
# What a partial file of this client's making is: the only kind a get reuses.
_MODE: Final = 0o600


T = TypeVar("T")


def settle(fd: int, partial: Path, target: Path, fill: Callable[[], T]) -> T:
    """Run `fill`, which writes and verifies the partial file `fd`; then give the file the
    mode a new file of the user's would have and rename it onto `target`. Any failure, an
    interrupt too, removes the partial file instead (only a process killed outright leaves it,
    for a later get to resume from); the descriptor is closed either way."""
    renamed = False
    try:
        result = fill()
        os.fchmod(fd, new_file_mode())
        check_still_ours(fd, partial)
        os.replace(partial, target)
        renamed = True
        return result
    finally:
        if not renamed:
            remove_if_ours(fd, partial)
        os.close(fd)


def new_file_mode() -> int:
    """The mode a file the user creates would have (0666 less the umask, read without changing
    it); 0600 when the umask cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o600


def create_partial(target: Path) -> tuple[int, Path]:
    """A new, empty file (mode 0600) of a random name beside `target`, for its bytes until they
    are verified. O_EXCL|O_NOFOLLOW: a name planted in the folder (a symlink to a file of the
    user's) is never followed nor reused."""
    for _ in range(16):
        partial = target.with_name(f".{target.name}.pinvault-partial-{secrets.token_hex(8)}")
        try:
            return os.open(partial, _FLAGS | os.O_CREAT | os.O_EXCL, _MODE), partial
        except FileExistsError:
            continue
        except OSError as exc:
            raise InvalidArgument(f"cannot write {target}: {exc.strerror}") from None
    raise InvalidArgument(f"cannot write {target}: no unused name for its partial file")


def resumable_name(target: Path, digest: Digest) -> Path:
    """Where a get of the whole blob `digest` into `target` keeps its bytes until verified."""
    return target.with_name(f".{target.name}.pinvault-partial-{digest.hex[:16]}")


def open_resumable(target: Path, digest: Digest) -> tuple[int, Path]:
    """The partial file of a whole blob, locked (flock) for as long as it is open: the one a
    killed get of the same blob into the same target left, if it is safe to reuse, else a new
    one under that name, else (the name is taken by something else, or by a get still
    running) a new one of a random name.

    A file is reused only if it is what this client makes: a regular file (opened with
    O_NOFOLLOW, so a symlink is refused), owned by this user, of mode 0600, with no other
    name. A file planted by someone else is left alone, never opened for writing; its bytes,
    and those of any reused file, are only kept once checked (`keep_verified`)."""
    name = resumable_name(target, digest)
    fd: int | None
    try:
        fd = os.open(name, _FLAGS | os.O_CREAT | os.O_EXCL, _MODE)
    except FileExistsError:
        fd = _reusable(name)
    except OSError as exc:
        raise InvalidArgument(f"cannot write {target}: {exc.strerror}") from None
    else:
        # Whatever the umask, so that a get after a kill finds it reusable.
        os.fchmod(fd, _MODE)
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, name
        except BlockingIOError:
            os.close(fd)  # another get of the same blob into the same target is running
    return create_partial(target)


def _reusable(name: Path) -> int | None:
    """The file at `name`, open, if it is one this client made; else None."""
    try:
        named = os.lstat(name)
        # Only a regular file is opened at all: opening a device or a pipe may block or act.
        if not stat.S_ISREG(named.st_mode):
            return None
        fd = os.open(name, _FLAGS | os.O_NONBLOCK)
    except OSError:
        return None
    found = os.fstat(fd)
    if (
        (found.st_dev, found.st_ino) != (named.st_dev, named.st_ino)
        or not stat.S_ISREG(found.st_mode)
        or found.st_uid != os.geteuid()
        or stat.S_IMODE(found.st_mode) != _MODE
        or found.st_nlink != 1
    ):
        os.close(fd)
        return None
    return fd


def keep_verified(fd: int, listed: ChunkHashes, hashed: Callable[[bytes], None]) -> int:
    """Check the chunks a partial file holds against the blob's chunk hashes, from the first,
    and cut the file after the last that matches, before the first that does not (or that it
    holds only in part); the length kept. `hashed` is given each kept chunk, in order: the
    whole blob's digest is checked over them and the rest before the file is renamed."""
    held = os.fstat(fd).st_size
    kept = 0
    for index, expected in enumerate(listed.hashes):
        offset, length = listed.span(index)
        if offset + length > held:
            break
        data = os.pread(fd, length, offset)
        if len(data) != length or blake3.blake3(data).digest() != expected:
            break
        hashed(data)
        kept = offset + length
    os.ftruncate(fd, kept)
    return kept


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def check_still_ours(fd: int, partial: Path) -> None:
    if not _same_file(fd, partial):
        raise InvalidArgument(f"{partial} was replaced while the blob was written into it")


def remove_if_ours(fd: int, partial: Path) -> None:
    """Unlink `partial` only if the name still holds the file this client created."""
    if _same_file(fd, partial):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
