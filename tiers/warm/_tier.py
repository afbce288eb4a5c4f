"""The warm tier's BlobStore: records appended to pack files in groups (one sync of the pack and
one of the index for everyone queued), found through the index, read and checked chunk by chunk,
and the archive brought back to what the index acknowledged after a crash."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from tiers.copies import rehash
from tiers.warm import _index
from tiers.warm._codec import ChunkCodec
from tiers.warm._index import INDEX_NAME, Readers, Row
from tiers.warm._packs import OpenPack, PackFiles, PackGone, pack_number, pack_path
from tiers.warm._record import LENGTH, ZSTD, StoredRecord, check_trailer, frames, trailer_size
from tiers.warm._writer import Put, WarmWriter, small_put
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound, Unavailable
from vault.files import fsync_dir, pwrite_all
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList
from vault.store.protocol import Closing, require_sha256

# The warm tier's logger keeps the name it had as one module.
log = logging.getLogger("tiers.warm")

# A pack takes small blobs until it holds about this much, then it is sealed (made read-only)
# and a new one is opened.
PACK_LIMIT: Final = 256 << 20
# A blob of at most one chunk is packed; anything larger gets a pack of its own, so that a
# large blob never holds the shared pack open for the length of its upload.
SMALL_LIMIT: Final = CHUNK_SIZE
LEVEL: Final = 3
# A sealed pack whose deleted blobs' records are at least this share of it is rewritten by a
# compaction: its live records copied to the open pack, the pack removed.
SPARSE: Final = 0.5

# put_many commits this many blobs, or this many bytes of records, at a time: enough that the
# syncs vanish in the cost per blob, little enough to bound the memory held.
_MANY_BLOBS: Final = 4096
_MANY_BYTES: Final = 64 << 20
_DIGEST_PAGE: Final = 1000


class WarmTier(Closing):
    """A BlobStore on an append-only archive folder::

        root/archive/<number>.pack    write-once pack files of records; mode 0444 once sealed
        root/index.sqlite             sha256 -> pack, position, stored length, compression,
                                      chunk list; the packs and their acknowledged sizes;
                                      tombstones (SQLite, WAL, synchronous=FULL)
        root/tmp/                     large blobs being written
        root/lock                     flocked by the one WarmTier that has the folder open

    A record is a blob's chunks, each a zstd frame or the raw bytes, then a trailer: the table
    of frame lengths (big-endian u32, top bit set for zstd), then a footer (magic b"PVWR",
    version, chunk count, payload length, the blob's SHA-256), then a CRC-32 over the table
    and footer. With the trailer a pack can be walked record by record from its end without
    the index, and a read checks that the index sent it to the right record.

    A blob of at most one chunk is appended to the open pack; a larger one is written to tmp/,
    sealed, and renamed into archive/ as a pack of its own. Puts commit in groups: whoever
    arrives while a commit is under way queues, and the next commit takes the whole queue, so
    concurrent puts share one sync of the pack and one of the index. A put returns once its
    record and index row are synced, and a blob is visible only from then on.

    The index records each pack's acknowledged size; at open, bytes past it in the open pack
    (a record torn by a crash) are cut off, packs the index never heard of are removed, and
    SQLite's own journal drops a torn index transaction. Delete moves the blob's row to the
    tombstones, which remember where its record is: the bytes stay in their pack until a
    compaction, which `reclaimable` tells where to look.

    One WarmTier at a time may have a folder open; `close` releases it.
    """

    def __init__(self, root: Path, *, pack_limit: int = PACK_LIMIT, level: int = LEVEL) -> None:
        self.root = Path(root)
        self.pack_limit = pack_limit
        self.level = level
        self._archive = self.root / "archive"
        self._tmp = self.root / "tmp"
        self._index_path = self.root / INDEX_NAME
        created = False
        for folder in (self.root, self._archive, self._tmp):
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                created = True
        if created:
            fsync_dir(self.root)
            fsync_dir(self.root.parent)
        self._lock_fd = _lock(self.root / "lock")
        self._closed = False
        self._write_lock = threading.Lock()
        self._queue = threading.Condition(threading.Lock())
        self._pending: list[Put] = []
        self._leading = False
        self._readers = Readers(self._index_path)
        self._files = PackFiles(self._pack_path)
        self._codec = ChunkCodec(level)
        self._open_pack: OpenPack | None = None
        try:
            for entry in os.scandir(self._tmp):
                # Only the holder of the lock writes here, so anything left is a crash's.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            # The one connection every change to the index goes through.
            self._db = _index.open_index(self._index_path)
            self._next_pack = 1
            self._recover()
        except BaseException:
            self._release()
            raise

    def __repr__(self) -> str:
        return f"WarmTier({str(self.root)!r})"

    def close(self) -> None:
        """Release the folder. Every put that returned is already durable: nothing is flushed
        here, and the open pack stays open for the next WarmTier on this folder."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    # -- writes ------------------------------------------------------------------------------

    def writer(self) -> WarmWriter:
        self._check_open()
        return WarmWriter(self)

    def put_many(self, blobs: Iterable[bytes | memoryview]) -> list[tuple[BlobInfo, bool]]:
        """Store many blobs, committing them in large groups; returns, in order, each blob's
        info and whether it was newly stored, once every one of them is durable."""
        results: list[tuple[BlobInfo, bool]] = []
        batch: list[Put] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch_bytes
            if batch:
                self._submit(batch)
                results.extend((put.chunks.info, bool(put.created)) for put in batch)
                batch.clear()
                batch_bytes = 0

        for data in blobs:
            if memoryview(data).nbytes > SMALL_LIMIT:
                flush()
                with self.writer() as writer:
                    writer.write(data)
                    results.append(writer.commit())
                continue
            put = small_put(bytes(data), None, self._codec)
            batch.append(put)
            batch_bytes += len(put.record)
            if len(batch) >= _MANY_BLOBS or batch_bytes >= _MANY_BYTES:
                flush()
        flush()
        return results

    def delete(self, sha256: Digest) -> None:
        """Write a tombstone: the blob is gone from every look-up at once; its bytes stay in
        their pack until a compaction."""
        raw = bytes.fromhex(require_sha256(sha256))
        with self._write_lock:
            self._check_open()
            if not _index.tombstone(self._db, raw):
                raise NotFound(f"blob {sha256} is not in the warm tier")

    def compact(self, sparse: float = SPARSE) -> int:
        """Free the bytes of deleted blobs' records. A sealed pack whose deleted records are
        at least `sparse` of it has its live records copied, as they are and checked, to the
        open pack, and goes; a pack left with deleted records alone (a large blob's pack of
        its own once the blob is deleted; a shared pack whose every blob is) goes at once.
        Returns how many bytes were freed. The index moves the live records and forgets the
        pack in one transaction, after the copies are synced and before the file goes: a crash
        before it leaves unacknowledged bytes the next open cuts off, one after it a file the
        index never heard of, which the next open removes."""
        freed = 0
        with self._write_lock:
            self._check_open()
            for number in _index.sparse_packs(self._db, sparse):
                freed += self._rewrite_live(number)
            dead = _index.dead_packs(self._db)
            for number, size in dead:
                _index.drop_pack(self._db, number)
                self._files.forget(number)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._pack_path(number))
                freed += size
            if dead:
                fsync_dir(self._archive)
        if dead:
            log.info("compacted the warm tier: %d packs removed, %d bytes freed", len(dead), freed)
        return freed

    def _rewrite_live(self, number: int) -> int:
        """Copy the live records of sealed pack `number` to the open pack and remove it (the
        caller holds the write lock); the bytes freed. One record is held at a time."""
        path = self._pack_path(number)
        live = _index.live_in_pack(self._db, number)
        total = sum(length for _, _, length, _ in live)
        pack = self._open_pack
        if pack is None or pack.size + total > self.pack_limit:
            if pack is not None:
                self._seal(pack)
            pack = self._new_pack()
        start = end = pack.size
        moved = []
        try:
            with self._files.open(number) as fd:
                for raw, position, length, encoded in live:
                    record = os.pread(fd, length, position)
                    chunks = ChunkList.decode(encoded, Digest.sha256(raw))
                    self._check_trailer(
                        record[len(record) - trailer_size(chunks.count) :],
                        Row(number, position, length, "", chunks),
                    )
                    pwrite_all(pack.fd, record, end)
                    moved.append((raw, pack.number, end))
                    end += length
            os.fdatasync(pack.fd)
            _index.move_records(self._db, moved, grown=(pack.number, end), emptied=number)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(pack.fd, start)
            raise
        size = os.stat(path).st_size
        pack.size = end
        self._files.forget(number)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return size - total

    def reclaimable(self) -> dict[Path, int]:
        """The bytes of deleted blobs' records in each pack: what a compaction would free."""
        with self._reader() as db:
            rows = _index.reclaimable(db)
        return {self._pack_path(pack): size for pack, size in rows}

    # -- reads -------------------------------------------------------------------------------

    def info(self, sha256: Digest) -> BlobInfo | None:
        row = self._find(sha256)
        return None if row is None else row.chunks.info

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        wanted: dict[Digest, bytes] = {}
        for digest in digests:
            if digest not in wanted:
                wanted[digest] = bytes.fromhex(require_sha256(digest))
        with self._reader() as db:
            present = _index.live(db, list(wanted.values()))
        return [digest for digest, raw in wanted.items() if raw not in present]

    def chunk_list(self, sha256: Digest) -> ChunkList:
        return self._get(sha256).chunks

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        row = self._get(sha256)
        wanted = row.chunks.chunk_range(offset, length)
        return self._following(sha256, row, wanted)

    def verify(self, sha256: Digest) -> BlobInfo:
        """Read and decompress the whole record, checking every chunk, and re-hash it all."""
        row = self._get(sha256)
        chunks = row.chunks
        try:
            with self._files.open(row.pack) as fd:
                # An empty blob has no chunk to read, but its record must still be whole.
                self._load_trailer(fd, row)
        except PackGone:
            row = self._moved(sha256, row)
        found = rehash(chunk.data for chunk in self._following(sha256, row, range(chunks.count)))
        if found != chunks:
            raise IntegrityError(
                f"stored copy of {sha256} is damaged: its {found.size} bytes hash to "
                f"{found.sha256} and {found.blake3}, expected {chunks.sha256} and {chunks.blake3}"
            )
        return chunks.info

    def digests(self) -> Iterator[Digest]:
        """Every stored blob, in order of digest."""
        last = b""
        while True:
            with self._reader() as db:
                page = _index.digests_after(db, last, _DIGEST_PAGE)
            for raw in page:
                yield Digest.sha256(raw)
            if len(page) < _DIGEST_PAGE:
                return
            last = page[-1]

    def locate(self, sha256: Digest) -> StoredRecord:
        """Where the blob's record is, with each chunk's frame; NotFound if it is not stored."""
        row = self._get(sha256)
        with self._files.open(row.pack) as fd:
            entries = self._load_trailer(fd, row)
        return StoredRecord(
            self._pack_path(row.pack),
            row.position,
            row.length,
            row.compression,
            frames(entries, row.position),
        )

    # -- reading records ---------------------------------------------------------------------

    def _find(self, sha256: Digest) -> Row | None:
        raw = bytes.fromhex(require_sha256(sha256))
        with self._reader() as db:
            return _index.find(db, sha256, raw)

    def _get(self, sha256: Digest) -> Row:
        row = self._find(sha256)
        if row is None:
            raise NotFound(f"blob {sha256} is not in the warm tier")
        return row

    def _following(self, sha256: Digest, row: Row, wanted: range) -> Iterator[Chunk]:
        """The chunks of `row`'s record, or, if its pack went before it was opened, of the
        record the index names now (a compaction moved it)."""
        chunks = self._read_chunks(row, wanted)
        try:
            first = next(chunks, None)
        except PackGone:
            chunks = self._read_chunks(self._moved(sha256, row), wanted)
            first = next(chunks, None)
        if first is not None:
            yield first
            yield from chunks

    def _moved(self, sha256: Digest, row: Row) -> Row:
        """Where the index puts the blob now that `row`'s pack is gone: a moved record, or
        PackGone if the index still names that pack (damage)."""
        moved = self._get(sha256)
        if moved.pack == row.pack:
            raise PackGone(f"pack file {self._pack_path(row.pack)} is missing")
        return moved

    def _read_chunks(self, row: Row, wanted: range) -> Iterator[Chunk]:
        if not wanted:
            return
        chunks = row.chunks
        with self._files.open(row.pack) as fd:
            # A blob of one chunk is read with its trailer in one pread; a larger one reads its
            # trailer, then only the frames of the chunks wanted.
            whole: bytes | None = None
            if chunks.count <= 1:
                whole = os.pread(fd, row.length, row.position)
                entries = self._check_trailer(whole[-trailer_size(chunks.count) :], row)
            else:
                entries = self._load_trailer(fd, row)
                os.posix_fadvise(fd, row.position, row.length, os.POSIX_FADV_SEQUENTIAL)
            position = sum(entry & LENGTH for entry in entries[: wanted.start])
            for index in wanted:
                entry = entries[index]
                stored = entry & LENGTH
                if whole is not None:
                    frame = whole[position : position + stored]
                else:
                    frame = os.pread(fd, stored, row.position + position)
                data = self._codec.inflate(frame, bool(entry & ZSTD), chunks, index)
                yield Chunk(chunks.span(index)[0], data, chunks.check(index, data))
                position += stored

    def _load_trailer(self, fd: int, row: Row) -> array[int]:
        size = trailer_size(row.chunks.count)
        return self._check_trailer(os.pread(fd, size, row.position + row.length - size), row)

    def _check_trailer(self, trailer: bytes, row: Row) -> array[int]:
        return check_trailer(
            trailer, row.chunks, pack=row.pack, position=row.position, length=row.length
        )

    # -- group commit ------------------------------------------------------------------------

    def _submit(self, puts: Sequence[Put]) -> None:
        """Queue puts for the next group commit and return once they are durable; the caller
        that finds no commit under way runs the next one for everyone queued."""
        if not puts:
            return
        with self._queue:
            self._pending.extend(puts)
            # A caller's puts are queued together and a commit takes the whole queue, so all
            # of them are committed by the same one.
            while not puts[0].done:
                if self._leading:
                    self._queue.wait()
                    continue
                self._leading = True
                batch, self._pending = self._pending, []
                self._queue.release()
                try:
                    self._commit(batch)
                finally:
                    self._queue.acquire()
                    for put in batch:
                        put.done = True
                    self._leading = False
                    self._queue.notify_all()
        for put in puts:
            if put.error is not None:
                raise put.error

    def _commit(self, batch: list[Put]) -> None:
        """Store a batch: records are appended to the open pack, or renamed into the archive,
        and synced before the index rows that make them visible are committed. On failure every
        put not yet committed carries the error and nothing of it stays."""
        with self._write_lock:
            fresh: list[Put] = []
            try:
                self._check_open()
                fresh = self._deduplicate(batch)
                group: list[Put] = []
                group_bytes = 0
                for put in fresh:
                    if put.temp is not None:
                        continue
                    pack = self._open_pack or self._new_pack()
                    if pack.size + group_bytes + len(put.record) > self.pack_limit and (
                        pack.size + group_bytes
                    ):
                        self._append(pack, group, [])
                        group, group_bytes = [], 0
                        self._seal(pack)
                        pack = self._new_pack()
                    group.append(put)
                    group_bytes += len(put.record)
                large = [put for put in fresh if put.temp is not None]
                if group or large:
                    self._append(self._open_pack, group, large)
            except BaseException as error:
                # The others waiting on this commit hear of an interruption as a failure.
                shared = (
                    error
                    if isinstance(error, Exception)
                    else Unavailable(f"the warm tier's commit was interrupted: {error!r}")
                )
                for put in fresh or batch:
                    if put.created is None:
                        put.error = shared
                        put.discard()
                if not isinstance(error, Exception):
                    raise

    def _deduplicate(self, batch: list[Put]) -> list[Put]:
        raws = [put.chunks.sha256.raw for put in batch]
        stored = _index.live(self._db, raws)
        fresh = []
        for put, raw in zip(batch, raws, strict=True):
            if raw in stored:
                put.created = False
                put.discard()
            else:
                stored.add(raw)
                fresh.append(put)
        return fresh

    def _append(self, pack: OpenPack | None, group: list[Put], large: list[Put]) -> None:
        rows = []
        start = end = 0
        if group:
            assert pack is not None
            start = end = pack.size
            for put in group:
                rows.append(put.row(pack.number, end, len(put.record)))
                end += len(put.record)
        moved: list[Path] = []
        try:
            if group:
                assert pack is not None
                pwrite_all(pack.fd, b"".join(put.record for put in group), start)
                os.fdatasync(pack.fd)
            packs = []
            for put in large:
                assert put.temp is not None
                number = self._next_pack
                self._next_pack += 1
                target = self._pack_path(number)
                os.rename(put.temp, target)
                put.temp = None
                moved.append(target)
                rows.append(put.row(number, 0, put.length))
                packs.append((number, put.length))
            if moved:
                fsync_dir(self._archive)
            grown = None
            if group:
                assert pack is not None
                grown = (pack.number, end)
            _index.add_records(self._db, rows, grown=grown, sealed=packs)
        except BaseException:
            if group:
                assert pack is not None
                with contextlib.suppress(OSError):
                    os.ftruncate(pack.fd, start)
            for target in moved:
                with contextlib.suppress(OSError):
                    os.unlink(target)
            raise
        if group:
            assert pack is not None
            pack.size = end
        for put in (*group, *large):
            put.created = True

    def _new_pack(self) -> OpenPack:
        number = self._next_pack
        self._next_pack += 1
        path = self._pack_path(number)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsync_dir(self._archive)
            _index.add_pack(self._db, number)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._open_pack = OpenPack(number, fd, 0)
        return self._open_pack

    def _seal(self, pack: OpenPack) -> None:
        os.fchmod(pack.fd, 0o444)
        # fsync, not fdatasync: the mode is metadata.
        os.fsync(pack.fd)
        _index.seal_pack(self._db, pack.number)
        os.close(pack.fd)
        if self._open_pack is pack:
            self._open_pack = None

    # -- the index and the archive ---------------------------------------------------------

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        self._check_open()
        with self._readers.reader() as db:
            yield db

    def _recover(self) -> None:
        """Bring the archive back to what the index acknowledged after a crash."""
        packs = _index.packs(self._db)
        on_disk = set()
        for name in os.listdir(self._archive):
            number = pack_number(name)
            if number is not None:
                on_disk.add(number)
        orphans = sorted(on_disk - packs.keys())
        for number in orphans:
            # Renamed into place by a commit whose index transaction never landed.
            log.warning("removing %s: no acknowledged blob is in it", self._pack_path(number))
            os.unlink(self._pack_path(number))
        if orphans:
            fsync_dir(self._archive)
        self._next_pack = max((*packs, *on_disk), default=0) + 1
        unsealed = [number for number, (_, sealed) in packs.items() if not sealed]
        for number in unsealed:
            path = self._pack_path(number)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                log.error("pack %s is missing; its blobs will fail their checks", path)
                _index.seal_pack(self._db, number)
                continue
            pack = OpenPack(number, fd, packs[number][0])
            found = os.fstat(fd).st_size
            if found > pack.size:
                # Bytes past the acknowledged size were never acknowledged: a torn record.
                log.warning("%s: dropping %d unacknowledged bytes", path, found - pack.size)
                os.ftruncate(fd, pack.size)
                os.fsync(fd)
            if number != unsealed[-1] or pack.size >= self.pack_limit or found < pack.size:
                if found < pack.size:
                    log.error("%s has %d of its %d bytes; sealing it", path, found, pack.size)
                self._seal(pack)
            else:
                self._open_pack = pack

    # -- inside ------------------------------------------------------------------------------

    def _pack_path(self, number: int) -> Path:
        return pack_path(self._archive, number)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    def _release(self) -> None:
        if self._open_pack is not None:
            os.close(self._open_pack.fd)
            self._open_pack = None
        self._files.close()
        self._readers.close()
        if hasattr(self, "_db"):
            self._db.close()
        os.close(self._lock_fd)


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Unavailable(
            f"the warm tier at {path.parent} is already open (another WarmTier holds {path})"
        ) from None
    return fd
