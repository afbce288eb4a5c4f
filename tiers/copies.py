"""What the tiers do alike with a copy of a blob: start a local put in a new temp file (hot and
warm), and re-hash a whole stored copy to check it (every tier)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from vault.store.chunks import CHUNK_SIZE, BlobHasher, ChunkList


def new_temp_file(folder: Path, suffix: str, flags: int = 0) -> tuple[int, str]:
    """A file of the caller's own under a fresh random name in `folder`, open for reading and
    writing, and its path. O_EXCL: a name already taken is never reused, only tried again."""
    while True:
        path = str(folder / f"{secrets.token_hex(12)}{suffix}")
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o600), path
        except FileExistsError:
            continue


def rehash(pieces: Iterable[bytes], chunk_size: int = CHUNK_SIZE) -> ChunkList:
    """The chunk list of a copy's bytes, handed in as read; the hasher's thread is stopped
    if reading them fails."""
    hasher = BlobHasher(chunk_size)
    try:
        for data in pieces:
            hasher.update(data)
    except BaseException:
        hasher.cancel()
        raise
    return hasher.finish()
