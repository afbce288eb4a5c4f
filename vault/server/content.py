"""The content store as the services see it: any `BlobStore` for the bytes, plus the catalog
that makes a blob visible once durable and answers for it by either digest."""

from __future__ import annotations

import binascii
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from sqlalchemy import select, text

from vault.digest import Digest, check_digest, digest_from_key
from vault.errors import (
    DiskFull,
    IntegrityError,
    InvalidArgument,
    NotFound,
    is_disk_full,
)
from vault.ledger import db as tables
from vault.ledger.db import Database, Writer
from vault.store.chunks import BlobInfo, Chunk
from vault.store.protocol import BatchBlob, BlobStore, Placed, PlacementRecord, put_many

_QUERY_BATCH: Final = 450
# Digests `lacking` looks up in one query.
_LOOKUP_BATCH: Final = 10_000

# The catalogue's queries on the hot path, here so that the tests of their query plans read the
# statements the server runs. `{0}`: a batch's placeholders.
FIND: Final = "SELECT sha256, blake3, size, stored_at FROM blobs WHERE {} = ?"
FIND_MANY: Final = "SELECT sha256, blake3, size, stored_at FROM blobs WHERE sha256 IN ({0})"
# A batch put's answer: when each blob of the batch was first catalogued.
STORED_AT: Final = "SELECT sha256, stored_at FROM blobs WHERE sha256 IN ({0})"
# FindMissing: the rows naming a batch of digests by either name (the batch given twice).
PRESENT: Final = "SELECT sha256, blake3 FROM blobs WHERE sha256 IN ({0}) OR blake3 IN ({0})"

# The places in a batch of the digests that are not catalogued with the size given beside
# them, as one list ("4,17,…") or NULL: a digest not stored, or stored with another size. The
# batch is one parameter and its sizes another (each as _SIZE_DIGITS decimal digits), so the
# database, not Python, makes each digest's text and looks it up by its key, then compares the
# size of the one row found: SQLite takes the digests in hex, PostgreSQL raw. Both parameters
# are bytes, which both engines slice in place (a slice of text is found by walking its
# characters from the start, which over a batch is quadratic).
_SIZE_DIGITS: Final = 20
_LACKING_SQLITE: Final = (
    "WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 64 FROM i WHERE n + 64 < length(?1))"
    " SELECT group_concat(n / 64) FROM i WHERE NOT EXISTS"
    " (SELECT 1 FROM blobs WHERE sha256 = 'sha256:' || substr(?1, n + 1, 64)"
    f" AND size = CAST(substr(?2, n / 64 * {_SIZE_DIGITS} + 1, {_SIZE_DIGITS}) AS INTEGER))"
)
_LACKING_POSTGRES: Final = (
    "SELECT string_agg((n / 32)::text, ',') FROM generate_series(0, length(?) - 32, 32) AS n"
    " WHERE NOT EXISTS (SELECT 1 FROM blobs"
    " WHERE sha256 = 'sha256:' || encode(substring(? FROM n + 1 FOR 32), 'hex')"
    " AND size = convert_from("
    f"substring(? FROM n / 32 * {_SIZE_DIGITS} + 1 FOR {_SIZE_DIGITS}), 'UTF8')::bigint)"
)


def batch_query(sql: str, values: Sequence[str], *, times: int = 1) -> tuple[str, list[str]]:
    """`sql` for one batch of `values`: its `{0}` placeholders are the batch, `times` over."""
    return sql.format(tables.placeholders(len(values))), list(values) * times


def lacking_query(
    sha256s: Sequence[bytes], sizes: Sequence[int], *, sqlite: bool
) -> tuple[str, tuple[bytes, ...]]:
    """The query of the places in `sha256s` (32 raw bytes each) not catalogued with the size
    at the same place in `sizes`."""
    joined = b"".join(sha256s)
    stated = "".join(f"{size:0{_SIZE_DIGITS}d}" for size in sizes).encode()
    if sqlite:
        return _LACKING_SQLITE, (binascii.hexlify(joined), stated)
    return _LACKING_POSTGRES, (joined, joined, stated)


@dataclass(frozen=True, slots=True)
class StoredBlob:
    info: BlobInfo
    stored_at: str


# A catalog row: sha256, blake3, size, stored_at.
_Row = tuple[str, str, int, str]


class _Catalogue:
    """Records stored blobs in the catalog, durably, many puts to one commit: concurrent puts
    share one transaction and one sync instead of queueing for the database's write lock."""

    # A blob already catalogued is left as it is: the database refuses any insert over a
    # catalogued row (even one its conflict clause would skip), so the insert first looks.
    _INSERT: Final = (
        "INSERT INTO blobs (sha256, blake3, size, stored_at) SELECT ?, ?, ?, ? "
        "WHERE NOT EXISTS (SELECT 1 FROM blobs WHERE sha256 = ?) ON CONFLICT DO NOTHING"
    )

    def __init__(self, db: Database) -> None:
        self._writer = Writer(db)
        self._queue: queue.SimpleQueue[tuple[list[_Row], Future[None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="catalog-writer", daemon=True)
        self._thread.start()

    def record(self, info: BlobInfo, stored_at: str) -> None:
        """Returns once the row is committed."""
        self.record_many([info], stored_at)

    def record_many(self, infos: Iterable[BlobInfo], stored_at: str) -> None:
        """Returns once every row is committed, all in one transaction."""
        rows = [(str(info.sha256), str(info.blake3), info.size, stored_at) for info in infos]
        if not rows:
            return
        done: Future[None] = Future()
        self._queue.put((rows, done))
        done.result()

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            stop = False
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                with self._writer.begin() as tx:
                    tx.many(self._INSERT, [(*row, row[0]) for rows, _ in batch for row in rows])
            except BaseException as exc:  # every waiting put must hear of it
                for _, done in batch:
                    done.set_exception(exc)
            else:
                for _, done in batch:
                    done.set_result(None)
            if stop:
                break
        self._writer.close()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class Content:
    def __init__(self, db: Database, store: BlobStore, *, folder: Path | None = None) -> None:
        """`folder`: where the store writes new blobs, named when its disk is full."""
        self.db = db
        self.store = store
        self.folder = folder
        self._catalogue = _Catalogue(db)

    def close(self) -> None:
        self._catalogue.close()

    # ------------------------------------------------------------------ writes

    def put(
        self,
        data: Iterable[bytes],
        expected: Digest | Callable[[], Digest | None] | None = None,
    ) -> tuple[StoredBlob, bool]:
        """Stream bytes into the store; the blob is catalogued (visible) only once durable.
        `expected` may be a function, asked once every byte is in: a streamed put learns the
        digest its bytes must have from its last message."""
        size = 0
        try:
            with self.store.writer() as writer:
                for piece in data:
                    size += len(piece)
                    writer.write(piece)
                info, created = writer.commit(expected() if callable(expected) else expected)
        except OSError as exc:
            self._refuse_if_full(exc, size)
            raise
        self._catalogue.record(info, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        found = self.find(info.sha256)
        assert found is not None
        return found, created

    def adopt(self, info: BlobInfo, stored_at: str) -> StoredBlob:
        """Catalogue a blob the store took in by other means (a verified direct upload)."""
        self._catalogue.record(info, stored_at)
        found = self.find(info.sha256)
        assert found is not None
        return found

    def put_many(
        self, blobs: Iterable[BatchBlob]
    ) -> list[tuple[StoredBlob, bool] | IntegrityError]:
        """Store many small blobs with shared syncs (storage.put_many), then catalogue every
        stored one in one transaction: each is visible only once durable. One result per blob,
        in order: the blob and whether it was newly stored, or the IntegrityError refusing it
        (it left nothing, in the store or the catalog)."""
        sizes: list[int] = []

        def counted() -> Iterator[BatchBlob]:
            for data, expected in blobs:
                sizes.append(len(data))
                yield data, expected

        try:
            results = put_many(self.store, counted())
        except OSError as exc:
            self._refuse_if_full(exc, sum(sizes))
            raise
        infos = [result[0] for result in results if not isinstance(result, IntegrityError)]
        # Blobs the store already held are recorded too: a crash may have come between a
        # put's store commit and its catalog commit.
        self._catalogue.record_many(infos, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        # The store's infos are the rows' (the same bytes' digests): only when each row was
        # made is read back, which keeps its first time for a blob catalogued before.
        stored_at: dict[str, str] = {}
        for _, rows in self._batches(STORED_AT, list({str(info.sha256) for info in infos})):
            stored_at.update(rows)
        return [
            result
            if isinstance(result, IntegrityError)
            else (StoredBlob(result[0], stored_at[str(result[0].sha256)]), result[1])
            for result in results
        ]

    def _refuse_if_full(self, error: OSError, needed: int) -> None:
        """Raise DiskFull, naming the store's folder, if `error` says its disk is full."""
        if self.folder is not None and is_disk_full(error):
            raise DiskFull(self.folder, needed=needed) from error

    # ------------------------------------------------------------------ reads

    def find(self, digest: Digest) -> StoredBlob | None:
        rows = self.db.fetch(FIND.format(digest.algorithm), (str(digest),))
        if not rows:
            return None
        sha, b3, size, stored_at = rows[0]
        return StoredBlob(BlobInfo(Digest.parse(sha), Digest.parse(b3), size), stored_at)

    def find_many(self, sha256s: Iterable[str]) -> dict[str, StoredBlob]:
        """The catalogued blobs among these sha256 digests (well-formed, as text), by digest."""
        found: dict[str, StoredBlob] = {}
        for _, rows in self._batches(FIND_MANY, list(dict.fromkeys(sha256s))):
            for sha, b3, size, stored_at in rows:
                found[sha] = StoredBlob(
                    BlobInfo(Digest.parse(sha), Digest.parse(b3), size), stored_at
                )
        return found

    def _batches(
        self, sql: str, values: Sequence[str], *, times: int = 1
    ) -> Iterator[tuple[Sequence[str], list[tuple[Any, ...]]]]:
        """Each batch of `values` and the rows of `sql` for it: its `{0}` placeholders are
        the batch, `times` over."""
        for start in range(0, len(values), _QUERY_BATCH):
            part = values[start : start + _QUERY_BATCH]
            yield part, self.db.fetch(*batch_query(sql, part, times=times))

    def get(self, digest: Digest) -> StoredBlob:
        found = self.find(digest)
        if found is None:
            raise NotFound(f"blob {digest} is not in the store")
        return found

    def find_missing(self, digests: Iterable[str]) -> list[str]:
        """The digests (as given) that the store does not hold, in the order given."""
        wanted = list(digests)
        for d in wanted:
            check_digest(d)
        present: set[str] = set()
        for _, rows in self._batches(PRESENT, list(dict.fromkeys(wanted)), times=2):
            for sha, b3 in rows:
                present.add(sha)
                present.add(b3)
        return [d for d in wanted if d not in present]

    def lacking(self, sha256s: Sequence[bytes], sizes: Mapping[bytes, int]) -> set[bytes]:
        """Those of these SHA-256 digests (32 raw bytes each) that are not catalogued with the
        size `sizes` gives for each: absent, or stored with another size. Given in sorted order
        (or nearly: by their first two bytes), neighbouring look-ups share the index pages
        they read: a million take about 0.6 s, the GIL released for all but the batching."""
        lacking: set[bytes] = set()
        for start in range(0, len(sha256s), _LOOKUP_BATCH):
            part = sha256s[start : start + _LOOKUP_BATCH]
            statement = lacking_query(
                part, [sizes[sha256] for sha256 in part], sqlite=self.db.is_sqlite
            )
            ((places,),) = self.db.fetch(*statement)
            if places:
                lacking.update(map(part.__getitem__, map(int, places.split(","))))
        return lacking

    def read(
        self, blob: StoredBlob, offset: int = 0, length: int | None = None
    ) -> tuple[int, Iterator[Chunk]]:
        """The length of the range, checked first, and the whole verified chunks covering it."""
        size, digest = blob.info.size, blob.info.sha256
        if offset > size:
            raise InvalidArgument(f"offset {offset} is beyond the end of {digest} ({size} bytes)")
        if length is not None and offset + length > size:
            raise InvalidArgument(
                f"range {offset}+{length} is beyond the end of {digest} ({size} bytes)"
            )
        if length is None:
            length = size - offset
        return length, self.store.read(digest, offset, length)

    # ------------------------------------------------------------------ audit

    _PINNED = text(
        "SELECT DISTINCT s.digest FROM entry_subjects s JOIN entries e ON e.idx = s.idx "
        "WHERE e.external = :external"
    )

    def pinned_digests(self) -> list[str]:
        with self.db.read.connect() as conn:
            found = conn.execute(self._PINNED, {"external": False})
            return sorted(digest_from_key(bytes(key)) for (key,) in found)

    def placements(self, digest: str) -> tuple[list[PlacementRecord], int]:
        """A blob's copies and the repairs recorded of it, where the store journals them."""
        if not isinstance(self.store, Placed):
            return [], 0
        sha256 = Digest.parse(digest)
        return list(self.store.placements(sha256)), self.store.repair_count(sha256)

    def count(self) -> int:
        with self.db.read.connect() as conn:
            return len(conn.execute(select(tables.blobs.c.sha256)).all())
