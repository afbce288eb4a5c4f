"""What the vault knows of released blobs (docs/retention.md): the `release` entries of the
ledger, by digest, and the content store as the services see it once some blobs' bytes are
released: a get of one names the entry that released it, and a look-up or a pin takes it for
missing until its bytes are put again.

The catalogue keeps every blob it ever held (its rows are never changed or deleted), so that
a released blob is told apart from one never stored; what says its bytes are gone is the
release entry, read here from the ledger."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.digest import Digest
from vault.errors import NotFound
from vault.ledger.db import Database
from vault.ledger.entry import RELEASE
from vault.server.content import Content, StoredBlob
from vault.store.chunks import Chunk
from vault.store.protocol import BlobStore

# A look-up reads the release entries appended since the last one at most this often: another
# server's release is seen within this time.
REFRESH_INTERVAL: Final = 1.0
# How long a look-up waits at a time for a release in progress (it waits again until done).
RELEASING_WAIT: Final = 1.0
# Release entries read in one query.
_READ_BATCH: Final = 10_000
_RELEASES: Final = "SELECT idx, body FROM entries WHERE kind = ? AND idx >= ? ORDER BY idx LIMIT ?"


@dataclass(frozen=True, slots=True)
class Release:
    """The entry that released a blob's bytes, and the rule it names."""

    index: int
    rule: str

    def told(self, sha256: Digest | str) -> str:
        if self.index < 0:
            return f"blob {sha256} is being released by the vault's gc: its bytes are going"
        return (
            f"blob {sha256} was released by ledger entry {self.index} "
            f"(retention rule {self.rule}): its bytes are no longer kept"
        )


# A blob in the batch a gc pass is releasing now, asked about on the event loop: taken for
# released already (so no pin is accepted for it), rather than waited for.
BEING_RELEASED: Final = Release(-1, "")


class Releases:
    """The ledger's release entries by the digest each names (the latest of each), read from
    the database incrementally: every server sharing the ledger sees every server's."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._by_digest: dict[str, Release] = {}
        self._next = 0
        self._read_at = -REFRESH_INTERVAL
        self._lock = threading.Lock()

    def refresh(self, *, now: bool = False) -> None:
        """Read the release entries appended since the last read (`now`: whatever the time
        since; else only if REFRESH_INTERVAL has passed)."""
        if not now and time.monotonic() - self._read_at < REFRESH_INTERVAL:
            return
        # A look-up does not wait for another thread's read: it answers from what is known.
        if not self._lock.acquire(blocking=now):
            return
        try:
            if not now and time.monotonic() - self._read_at < REFRESH_INTERVAL:
                return
            self._read_at = time.monotonic()
            while True:
                rows = self.db.fetch(_RELEASES, (RELEASE, self._next, _READ_BATCH))
                for index, body in rows:
                    entry = json.loads(bytes(body))
                    rule = str(entry["meta"].get("rule", ""))
                    for subject in entry["subjects"]:
                        self._by_digest[subject] = Release(index, rule)
                    self._next = index + 1
                if len(rows) < _READ_BATCH:
                    return
        finally:
            self._lock.release()

    def of(self, sha256: Digest | str) -> Release | None:
        self.refresh()
        return self._by_digest.get(str(sha256))

    def among(self, sha256s: Iterable[str]) -> dict[str, Release]:
        """Those of these digests a release entry names."""
        self.refresh()
        if not self._by_digest:
            return {}
        return {d: r for d in sha256s if (r := self._by_digest.get(d)) is not None}

    def all(self) -> dict[str, Release]:
        self.refresh(now=True)
        return dict(self._by_digest)


class ReleasingContent(Content):
    """The content store of a vault whose gc may have released blobs: a released blob whose
    bytes are not back is missing to look-ups and pins (so that a client puts its bytes again
    rather than pin what is gone), and a get of it is NotFound naming the release entry."""

    def __init__(
        self,
        db: Database,
        store: BlobStore,
        *,
        folder: Path | None = None,
        releases: Releases | None = None,
    ) -> None:
        super().__init__(db, store, folder=folder)
        self.releases = releases or Releases(db)
        # Read before the first look-up, which never waits for a read.
        self.releases.refresh(now=True)
        # Blobs this server's gc is releasing now: a look-up of one waits until its bytes are
        # gone, so that no pin is accepted for bytes about to be removed.
        self._releasing: set[str] = set()
        self._released = threading.Condition()

    @contextmanager
    def releasing(self, sha256s: Iterable[str]) -> Iterator[None]:
        """Hold look-ups of these digests until the block ends (their release entries are
        appended and their bytes removed inside it)."""
        digests = set(sha256s)
        with self._released:
            self._releasing |= digests
        try:
            yield
        finally:
            with self._released:
                self._releasing -= digests
                self._released.notify_all()

    def _wait_released(self, sha256s: set[str]) -> None:
        with self._released:
            while self._releasing & sha256s:
                self._released.wait(RELEASING_WAIT)

    def gone(self, sha256s: Iterable[str]) -> dict[str, Release]:
        """Those of these sha256 digests that are released and whose bytes no tier holds."""
        wanted = set(sha256s)
        being: set[str] = set()
        if self._releasing:
            if _on_event_loop():
                # A batch's release takes seconds (its copies on every mirror): the loop that
                # answers every call must not wait for it.
                with self._released:
                    being = self._releasing & wanted
            else:
                self._wait_released(wanted)
        released = self.releases.among(wanted - being)
        if being:
            return {**self._gone(released), **dict.fromkeys(being, BEING_RELEASED)}
        return self._gone(released)

    def _gone(self, released: dict[str, Release]) -> dict[str, Release]:
        if not released:
            return {}
        missing = {
            str(d) for d in self.store.find_missing([Digest.parse(d) for d in sorted(released)])
        }
        return {d: r for d, r in released.items() if d in missing}

    def catalogued(self, sha256s: Iterable[str]) -> dict[str, StoredBlob]:
        """The catalogue's rows of these digests, released or not (the gc's own look-up,
        which must not wait for its own releases)."""
        return super().find_many(sha256s)

    def find(self, digest: Digest) -> StoredBlob | None:
        found = super().find(digest)
        if found is None or self.gone([str(found.info.sha256)]):
            return None
        return found

    def find_many(self, sha256s: Iterable[str]) -> dict[str, StoredBlob]:
        found = super().find_many(sha256s)
        for sha256 in self.gone(found):
            del found[sha256]
        return found

    def get(self, digest: Digest) -> StoredBlob:
        found = super().find(digest)
        if found is None:
            raise NotFound(f"blob {digest} is not in the store")
        sha256 = str(found.info.sha256)
        release = self.gone([sha256]).get(sha256)
        if release is not None:
            raise NotFound(release.told(sha256))
        return found

    def find_missing(self, digests: Iterable[str]) -> list[str]:
        wanted = list(digests)
        missing = super().find_missing(wanted)
        absent = set(missing)
        present = [d for d in wanted if d.startswith("sha256:") and d not in absent]
        gone = self.gone(present)
        if not gone:
            return missing
        lost = absent | set(gone)
        return [d for d in wanted if d in lost]

    def lacking(self, sha256s: Sequence[bytes], sizes: Mapping[bytes, int]) -> set[bytes]:
        lacking = super().lacking(sha256s, sizes)
        present = {"sha256:" + raw.hex(): raw for raw in sha256s if raw not in lacking}
        return lacking | {present[d] for d in self.gone(present)}

    def pinned_digests(self) -> list[str]:
        """The digests entries name, less the released blobs whose bytes are gone (a release
        entry names its blob: `vault verify --blobs` must not take it for lost)."""
        pinned = super().pinned_digests()
        gone = self.gone(pinned)
        return [d for d in pinned if d not in gone]

    def read(
        self, blob: StoredBlob, offset: int = 0, length: int | None = None
    ) -> tuple[int, Iterator[Chunk]]:
        try:
            size, chunks = super().read(blob, offset, length)
        except NotFound:
            raise self._told(blob) from None
        return size, self._reading(blob, chunks)

    def _reading(self, blob: StoredBlob, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        try:
            yield from chunks
        except NotFound:
            raise self._told(blob) from None

    def _told(self, blob: StoredBlob) -> NotFound:
        """The NotFound for a read that found no copy: naming the release, if one was
        (appended since the get looked, by this server's gc or another's)."""
        self.releases.refresh(now=True)
        release = self.releases.of(blob.info.sha256)
        if release is None:
            return NotFound(f"blob {blob.info.sha256} is on no tier")
        return NotFound(release.told(blob.info.sha256))


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (a call answered inline on it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
