"""A real full disk for tests: a tmpfs of its own (the tests run as root), filled to its last
byte by a filler file, and the one line a command refused for want of room prints."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

DISK_SIZE = "48m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own (the tests run as root); a failed mount fails the test. Listed before
    `start_vault`, so that the servers on it are stopped before it is unmounted."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(mount_point)],
        check=True,
        capture_output=True,
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)


def fill(disk: Path) -> None:
    """Fill `disk` to its last byte with the filler file (again, if it was filled before)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for piece in (1 << 20, 4096, 1):
            block = b"\xa5" * piece
            try:
                while True:
                    os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0


def refused_for_room(line: str, folder: Path) -> None:
    """`line` is the one line of a write refused for want of room on the disk of `folder`."""
    pattern = (
        rf"vault: RESOURCE_EXHAUSTED: no space left on the disk holding {re.escape(str(folder))} "
        r"\(\d+(\.\d)? (B|KiB) free, at least \d+(\.\d)? (B|KiB|MiB) needed\): free space there "
        r"and retry"
    )
    assert re.fullmatch(pattern, line), line
