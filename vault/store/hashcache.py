"""The SHA-256 of files already hashed, by path and what `stat` says of them, so that adding a
folder again reads only the files that changed (as git's index and borg's files cache do).

An entry is used only while the file's device, inode, size, modification time and change time
are all as they were when it was hashed. Any write changes the change time, and nothing but
the clock can set it back, so a file that matches was not written since. A file changed within
`RACY` seconds before it was hashed is not recorded: a write in the same tick of the file
system's clock would leave its times as they were.

The cache is only ever a shortcut: a damaged or unreadable cache file is set aside and the
files are hashed, and a digest taken from it is still checked by the vault against the bytes
whenever they are sent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

FILE_NAME: Final = "file-hashes.db"
RACY: Final = 2.0
_QUERY_BATCH: Final = 500


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pinvault" / FILE_NAME


def stamp(info: os.stat_result) -> tuple[int, int, int, int, int]:
    """What must not have changed for a cached digest to stand."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class HashCache:
    """A cache file; safe to share among threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        try:
            self._db = self._open()
        except (sqlite3.Error, OSError) as exc:
            log.warning("file hash cache %s is unusable (%s): hashing every file", path, exc)

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # A cache: losing its last writes to a crash costs only hashing those files again.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS hashes (path TEXT PRIMARY KEY, dev INTEGER, "
                "ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, "
                "sha256 TEXT NOT NULL) WITHOUT ROWID"
            )
        except sqlite3.DatabaseError:
            db.close()
            # Not a cache we can read: start a new one rather than fail the caller.
            aside = self.path.with_name(self.path.name + ".damaged")
            os.replace(self.path, aside)
            log.warning("file hash cache %s was damaged: moved to %s", self.path, aside)
            return self._open()
        return db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def lookup(self, files: Sequence[tuple[str, os.stat_result]]) -> dict[str, str]:
        """The cached digests of those of `files` (path, stat) unchanged since hashed."""
        found: dict[str, str] = {}
        wanted = {path: stamp(info) for path, info in files}
        paths = list(wanted)
        with self._lock:
            if self._db is None:
                return found
            try:
                for start in range(0, len(paths), _QUERY_BATCH):
                    part = paths[start : start + _QUERY_BATCH]
                    rows = self._db.execute(
                        "SELECT path, dev, ino, size, mtime_ns, ctime_ns, sha256 FROM hashes "
                        f"WHERE path IN ({','.join('?' * len(part))})",
                        part,
                    )
                    for path, *seen, sha256 in rows:
                        if tuple(seen) == wanted[path]:
                            found[path] = sha256
            except sqlite3.Error as exc:
                log.warning("file hash cache %s: %s", self.path, exc)
        return found

    def record(self, hashed: Iterable[tuple[str, os.stat_result, str, float]]) -> None:
        """Remember digests: (path, stat when hashed, sha256, time the hashing began)."""
        rows = [
            (path, *stamp(info), sha256)
            for path, info, sha256, began in hashed
            if max(info.st_mtime_ns, info.st_ctime_ns) < (began - RACY) * 1e9
        ]
        if not rows:
            return
        with self._lock:
            if self._db is None:
                return
            try:
                with contextlib.closing(self._db.cursor()) as cursor:
                    cursor.execute("BEGIN")
                    cursor.executemany(
                        "INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?, ?, ?)", rows
                    )
                    cursor.execute("COMMIT")
            except sqlite3.Error as exc:
                log.warning("file hash cache %s: %s", self.path, exc)
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
