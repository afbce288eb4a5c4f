"""The warm tier: an append-only archive folder of write-once pack files, small blobs packed
together and large ones in a file of their own, zstd-compressed chunk by chunk where that saves
space, found through a crash-safe SQLite index, and checked chunk by chunk on every read."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import sqlite3
import struct
import sys
import threading
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import blake3
import zstandard

from vault.digest import Digest
from vault.errors import FailedPrecondition, IntegrityError, NotFound, Unavailable
from vault.files import fsync_dir, pwrite_all, write_all
from vault.store.protocol import (
    CHUNK_SIZE,
    BlobHasher,
    BlobInfo,
    BlobWriter,
    Chunk,
    ChunkList,
    Closing,
    check_expected,
    require_sha256,
)

log = logging.getLogger(__name__)

_C = TypeVar("_C")

# A pack takes small blobs until it holds about this much, then it is sealed (made read-only)
# and a new one is opened.
PACK_LIMIT: Final = 256 << 20
# A blob of at most one chunk is packed; anything larger gets a pack of its own, so that a
# large blob never holds the shared pack open for the length of its upload.
SMALL_LIMIT: Final = CHUNK_SIZE
LEVEL: Final = 3
PACK_SUFFIX: Final = ".pack"
INDEX_NAME: Final = "index.sqlite"
INDEX_VERSION: Final = 1

# A chunk is stored compressed only if that saves at least 1/32 of it: below that, the
# decompression on every read costs more than the space is worth.
_MIN_SAVING: Final = 32
# Chunks shorter than this are not worth a compression attempt.
_MIN_COMPRESS: Final = 64
# Before compressing a large chunk, three samples of it are compressed at level 1; if they do
# not shrink, the chunk is taken to be incompressible (already compressed media, encrypted or
# random bytes) and stored raw without paying for a full compression.
_SAMPLE: Final = 16 << 10
_SAMPLE_ABOVE: Final = 4 * _SAMPLE
_SAMPLE_KEEP: Final = 0.9

# put_many commits this many blobs, or this many bytes of records, at a time: enough that the
# syncs vanish in the cost per blob, little enough to bound the memory held.
_MANY_BLOBS: Final = 4096
_MANY_BYTES: Final = 64 << 20
# SQLite binds at most 999 parameters in older builds; stay well under.
_QUERY_BATCH: Final = 450
_DIGEST_PAGE: Final = 1000
# Read handles kept open on pack files; an idle one past this is closed.
_OPEN_FILES: Final = 128

# -- the record format -------------------------------------------------------------------------

_MAGIC: Final = b"PVWR"
_FORMAT: Final = 1
# magic, format version, 3 zero bytes, chunk count, payload length, SHA-256 of the blob
_FOOTER = struct.Struct(">4sB3xIQ32s")
_CRC_SIZE: Final = 4
_FOOTER_SIZE: Final = _FOOTER.size + _CRC_SIZE
_ENTRY_SIZE: Final = 4
# A frame table entry is the frame's stored length, with this bit set if it is a zstd frame.
_ZSTD: Final = 1 << 31
_LENGTH: Final = _ZSTD - 1

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS packs (
    number INTEGER PRIMARY KEY,
    size INTEGER NOT NULL,
    sealed INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    id INTEGER PRIMARY KEY,
    sha256 BLOB NOT NULL UNIQUE,
    pack INTEGER NOT NULL,
    position INTEGER NOT NULL,
    stored_length INTEGER NOT NULL,
    compression TEXT NOT NULL,
    chunk_list BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS tombstones (
    id INTEGER PRIMARY KEY,
    sha256 BLOB NOT NULL,
    pack INTEGER NOT NULL,
    position INTEGER NOT NULL,
    stored_length INTEGER NOT NULL,
    deleted_at TEXT NOT NULL
);
"""
_FIND: Final = (
    "SELECT pack, position, stored_length, compression, chunk_list FROM blobs WHERE sha256 = ?"
)
_INSERT: Final = (
    "INSERT INTO blobs (sha256, pack, position, stored_length, compression, chunk_list) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
_TOMBSTONE: Final = (
    "INSERT INTO tombstones (sha256, pack, position, stored_length, deleted_at) "
    "SELECT sha256, pack, position, stored_length, strftime('%Y-%m-%dT%H:%M:%fZ', 'now') "
    "FROM blobs WHERE sha256 = ?"
)


@dataclass(frozen=True, slots=True)
class Frame:
    """One chunk as stored: where its bytes are in the pack file, and whether they are zstd."""

    offset: int
    length: int
    compressed: bool


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """Where a blob's record is: its pack file, the byte range of the whole record in it, and
    the frame of each chunk."""

    pack: Path
    offset: int
    length: int
    compression: str
    frames: tuple[Frame, ...]


@dataclass(frozen=True, slots=True)
class _Row:
    pack: int
    position: int
    length: int
    compression: str
    chunks: ChunkList


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
        self._index = self.root / INDEX_NAME
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
        self._pending: list[_Put] = []
        self._leading = False
        self._readers: list[sqlite3.Connection] = []
        self._idle_readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._files = _PackFiles(self._pack_path)
        self._compressors: list[zstandard.ZstdCompressor] = []
        self._samplers: list[zstandard.ZstdCompressor] = []
        self._decompressors: list[zstandard.ZstdDecompressor] = []
        self._open_pack: _OpenPack | None = None
        try:
            for entry in os.scandir(self._tmp):
                # Only the holder of the lock writes here, so anything left is a crash's.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            self._db = self._connect()
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("PRAGMA cache_size = -65536")
            self._create_schema()
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
        batch: list[_Put] = []
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
            put = self._small_put(bytes(data), None)
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
            with self._transaction() as db:
                if db.execute(_TOMBSTONE, (raw,)).rowcount == 0:
                    raise NotFound(f"blob {sha256} is not in the warm tier")
                db.execute("DELETE FROM blobs WHERE sha256 = ?", (raw,))

    def reclaimable(self) -> dict[Path, int]:
        """The bytes of deleted blobs' records in each pack: what a compaction would free."""
        with self._reader() as db:
            rows = db.execute(
                "SELECT pack, sum(stored_length) FROM tombstones GROUP BY pack ORDER BY pack"
            ).fetchall()
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
        raws = list(wanted.values())
        present: set[bytes] = set()
        with self._reader() as db:
            for start in range(0, len(raws), _QUERY_BATCH):
                present.update(_live(db, raws[start : start + _QUERY_BATCH]))
        return [digest for digest, raw in wanted.items() if raw not in present]

    def chunk_list(self, sha256: Digest) -> ChunkList:
        return self._get(sha256).chunks

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        row = self._get(sha256)
        wanted = row.chunks.chunk_range(offset, length)
        return self._read_chunks(row, wanted)

    def verify(self, sha256: Digest) -> BlobInfo:
        """Read and decompress the whole record, checking every chunk, and re-hash it all."""
        row = self._get(sha256)
        chunks = row.chunks
        with self._files.open(row.pack) as fd:
            # An empty blob has no chunk to read, but its record must still be whole.
            self._load_trailer(fd, row)
        hasher = BlobHasher()
        try:
            for chunk in self._read_chunks(row, range(chunks.count)):
                hasher.update(chunk.data)
        except BaseException:
            hasher.cancel()
            raise
        found = hasher.finish()
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
                page = db.execute(
                    "SELECT sha256 FROM blobs WHERE sha256 > ? ORDER BY sha256 LIMIT ?",
                    (last, _DIGEST_PAGE),
                ).fetchall()
            for (raw,) in page:
                yield Digest.sha256(raw)
            if len(page) < _DIGEST_PAGE:
                return
            last = page[-1][0]

    def locate(self, sha256: Digest) -> StoredRecord:
        """Where the blob's record is, with each chunk's frame; NotFound if it is not stored."""
        row = self._get(sha256)
        with self._files.open(row.pack) as fd:
            entries = self._load_trailer(fd, row)
        start = row.position
        frames = []
        for entry in entries:
            frames.append(Frame(start, entry & _LENGTH, bool(entry & _ZSTD)))
            start += entry & _LENGTH
        return StoredRecord(
            self._pack_path(row.pack), row.position, row.length, row.compression, tuple(frames)
        )

    # -- reading records ---------------------------------------------------------------------

    def _find(self, sha256: Digest) -> _Row | None:
        raw = bytes.fromhex(require_sha256(sha256))
        with self._reader() as db:
            rows = db.execute(_FIND, (raw,)).fetchall()
        if not rows:
            return None
        pack, position, length, compression, encoded = rows[0]
        return _Row(pack, position, length, compression, ChunkList.decode(encoded, sha256))

    def _get(self, sha256: Digest) -> _Row:
        row = self._find(sha256)
        if row is None:
            raise NotFound(f"blob {sha256} is not in the warm tier")
        return row

    def _read_chunks(self, row: _Row, wanted: range) -> Iterator[Chunk]:
        if not wanted:
            return
        chunks = row.chunks
        with self._files.open(row.pack) as fd:
            # A blob of one chunk is read with its trailer in one pread; a larger one reads its
            # trailer, then only the frames of the chunks wanted.
            whole: bytes | None = None
            if chunks.count <= 1:
                whole = os.pread(fd, row.length, row.position)
                entries = self._check_trailer(whole[-_trailer_size(chunks.count) :], row)
            else:
                entries = self._load_trailer(fd, row)
                os.posix_fadvise(fd, row.position, row.length, os.POSIX_FADV_SEQUENTIAL)
            position = sum(entry & _LENGTH for entry in entries[: wanted.start])
            for index in wanted:
                entry = entries[index]
                stored = entry & _LENGTH
                if whole is not None:
                    frame = whole[position : position + stored]
                else:
                    frame = os.pread(fd, stored, row.position + position)
                data = self._inflate(frame, bool(entry & _ZSTD), chunks, index)
                yield Chunk(chunks.span(index)[0], data, chunks.check(index, data))
                position += stored

    def _load_trailer(self, fd: int, row: _Row) -> array[int]:
        size = _trailer_size(row.chunks.count)
        return self._check_trailer(os.pread(fd, size, row.position + row.length - size), row)

    def _check_trailer(self, trailer: bytes, row: _Row) -> array[int]:
        """The record's frame table, once the trailer is whole and names the blob the index
        says is there."""
        chunks = row.chunks
        where = f"stored copy of {chunks.sha256} is damaged: its record in pack {row.pack}"
        size = _trailer_size(chunks.count)
        if len(trailer) != size:
            raise IntegrityError(f"{where} is cut short ({len(trailer)} of {size} trailer bytes)")
        body, crc = trailer[:-_CRC_SIZE], int.from_bytes(trailer[-_CRC_SIZE:], "big")
        if zlib.crc32(body) != crc:
            raise IntegrityError(f"{where} at byte {row.position} fails its trailer checksum")
        magic, version, count, payload, sha_raw = _FOOTER.unpack_from(
            body, len(body) - _FOOTER.size
        )
        if (magic, version) != (_MAGIC, _FORMAT) or sha_raw != chunks.sha256.raw:
            raise IntegrityError(
                f"{where} at byte {row.position} is not its record "
                f"(found magic {magic!r}, version {version}, blob sha256:{sha_raw.hex()})"
            )
        entries = _unpack_entries(body[: count * _ENTRY_SIZE]) if count == chunks.count else None
        if entries is None or payload + size != row.length:
            raise IntegrityError(
                f"{where} at byte {row.position} does not match its chunk list "
                f"({count} chunks in {payload} bytes, expected {chunks.count} chunks in "
                f"{row.length - size} bytes)"
            )
        return entries

    def _inflate(self, frame: bytes, compressed: bool, chunks: ChunkList, index: int) -> bytes:
        if not compressed:
            return frame
        offset, length = chunks.span(index)
        where = f"stored copy of {chunks.sha256} is damaged: chunk at byte offset {offset}"
        try:
            # A damaged frame header could claim any size; nothing is allocated before the
            # claim matches the chunk list.
            claimed = zstandard.frame_content_size(frame)
            if claimed != length:
                raise IntegrityError(f"{where} claims {claimed} bytes, expected {length}")
            with self._codec(self._decompressors, zstandard.ZstdDecompressor) as decompressor:
                data: bytes = decompressor.decompress(frame, max_output_size=length)
                return data
        except zstandard.ZstdError as error:
            raise IntegrityError(f"{where} does not decompress: {error}") from None

    # -- writing records ---------------------------------------------------------------------

    def _small_put(self, data: bytes, expected: Digest | None) -> _Put:
        sha_raw = hashlib.sha256(data).digest()
        b3_raw = blake3.blake3(data).digest()
        # A blob of one chunk is its only chunk, so its BLAKE3 is that chunk's hash.
        chunks = ChunkList(
            CHUNK_SIZE,
            len(data),
            Digest.sha256(sha_raw),
            Digest.blake3(b3_raw),
            (b3_raw,) if data else (),
        )
        if expected is not None:
            check_expected(expected, chunks.info)
        entries = array("I")
        if data:
            frame, compressed = self._deflate(data)
            entries.append(len(frame) | (_ZSTD if compressed else 0))
        else:
            frame, compressed = b"", False
        record = frame + _trailer(entries, len(frame), sha_raw)
        return _Put(chunks, "zstd" if compressed else "none", record=record)

    def _deflate(self, chunk: bytes) -> tuple[bytes, bool]:
        """The chunk's frame as stored, and whether it is compressed."""
        if len(chunk) < _MIN_COMPRESS:
            return chunk, False
        if len(chunk) > _SAMPLE_ABOVE:
            middle = len(chunk) // 2
            sample = b"".join((chunk[:_SAMPLE], chunk[middle : middle + _SAMPLE], chunk[-_SAMPLE:]))
            with self._codec(self._samplers, _fast_compressor) as sampler:
                if len(sampler.compress(sample)) > _SAMPLE_KEEP * len(sample):
                    return chunk, False
        with self._codec(self._compressors, self._compressor) as compressor:
            frame = compressor.compress(chunk)
        if len(frame) > len(chunk) - len(chunk) // _MIN_SAVING:
            return chunk, False
        return frame, True

    def _compressor(self) -> zstandard.ZstdCompressor:
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True)

    @contextlib.contextmanager
    def _codec(self, pool: list[_C], make: Callable[[], _C]) -> Iterator[_C]:
        # zstd contexts are not thread-safe and are costly to make for every chunk: each
        # caller borrows one from a pool (list pop and append are atomic).
        try:
            codec = pool.pop()
        except IndexError:
            codec = make()
        try:
            yield codec
        finally:
            pool.append(codec)

    def _temp_file(self) -> tuple[int, str]:
        while True:
            path = str(self._tmp / f"{secrets.token_hex(12)}.part")
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), path
            except FileExistsError:
                continue

    # -- group commit ------------------------------------------------------------------------

    def _submit(self, puts: Sequence[_Put]) -> None:
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

    def _commit(self, batch: list[_Put]) -> None:
        """Store a batch: records are appended to the open pack, or renamed into the archive,
        and synced before the index rows that make them visible are committed. On failure every
        put not yet committed carries the error and nothing of it stays."""
        with self._write_lock:
            fresh: list[_Put] = []
            try:
                self._check_open()
                fresh = self._deduplicate(batch)
                group: list[_Put] = []
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

    def _deduplicate(self, batch: list[_Put]) -> list[_Put]:
        raws = [put.chunks.sha256.raw for put in batch]
        stored: set[bytes] = set()
        for start in range(0, len(raws), _QUERY_BATCH):
            stored.update(_live(self._db, raws[start : start + _QUERY_BATCH]))
        fresh = []
        for put, raw in zip(batch, raws, strict=True):
            if raw in stored:
                put.created = False
                put.discard()
            else:
                stored.add(raw)
                fresh.append(put)
        return fresh

    def _append(self, pack: _OpenPack | None, group: list[_Put], large: list[_Put]) -> None:
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
            with self._transaction() as db:
                db.executemany(_INSERT, rows)
                if group:
                    assert pack is not None
                    db.execute("UPDATE packs SET size = ? WHERE number = ?", (end, pack.number))
                db.executemany("INSERT INTO packs (number, size, sealed) VALUES (?, ?, 1)", packs)
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

    def _new_pack(self) -> _OpenPack:
        number = self._next_pack
        self._next_pack += 1
        path = self._pack_path(number)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsync_dir(self._archive)
            with self._transaction() as db:
                db.execute("INSERT INTO packs (number, size, sealed) VALUES (?, 0, 0)", (number,))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._open_pack = _OpenPack(number, fd, 0)
        return self._open_pack

    def _seal(self, pack: _OpenPack) -> None:
        os.fchmod(pack.fd, 0o444)
        # fsync, not fdatasync: the mode is metadata.
        os.fsync(pack.fd)
        with self._transaction() as db:
            db.execute("UPDATE packs SET sealed = 1 WHERE number = ?", (pack.number,))
        os.close(pack.fd)
        if self._open_pack is pack:
            self._open_pack = None

    # -- the index ---------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Autocommit mode, so that transactions are exactly the ones begun below.
        return sqlite3.connect(self._index, isolation_level=None, check_same_thread=False)

    def _create_schema(self) -> None:
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version not in (0, INDEX_VERSION):
            raise FailedPrecondition(
                f"{self._index} is a version {version} warm index; this pinvault reads "
                f"version {INDEX_VERSION}"
            )
        with self._transaction() as db:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {INDEX_VERSION}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        self._check_open()
        try:
            db = self._idle_readers.pop()
        except IndexError:
            db = self._connect()
            with self._readers_lock:
                self._readers.append(db)
        try:
            yield db
        finally:
            self._idle_readers.append(db)

    def _recover(self) -> None:
        """Bring the archive back to what the index acknowledged after a crash."""
        packs = {
            number: (size, bool(sealed))
            for number, size, sealed in self._db.execute(
                "SELECT number, size, sealed FROM packs ORDER BY number"
            )
        }
        on_disk = set()
        for name in os.listdir(self._archive):
            stem = name.removesuffix(PACK_SUFFIX)
            if name.endswith(PACK_SUFFIX) and stem.isdigit():
                on_disk.add(int(stem))
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
                with self._transaction() as db:
                    db.execute("UPDATE packs SET sealed = 1 WHERE number = ?", (number,))
                continue
            pack = _OpenPack(number, fd, packs[number][0])
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
        return self._archive / f"{number:012d}{PACK_SUFFIX}"

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    def _release(self) -> None:
        if self._open_pack is not None:
            os.close(self._open_pack.fd)
            self._open_pack = None
        self._files.close()
        with self._readers_lock:
            for db in self._readers:
                db.close()
            self._readers.clear()
            self._idle_readers.clear()
        if hasattr(self, "_db"):
            self._db.close()
        os.close(self._lock_fd)


class WarmWriter(BlobWriter):
    """One put into the warm tier. The first chunk is held in memory; a blob that outgrows it
    streams on, chunk by chunk, into a record file in tmp/, so memory stays bounded."""

    def __init__(self, tier: WarmTier) -> None:
        self._tier = tier
        self._buffer = bytearray()
        self._large: _LargeRecord | None = None
        self._open = True

    def write(self, data: bytes | memoryview) -> None:
        if not self._open:
            raise ValueError("write to a blob writer that was committed or aborted")
        try:
            view = memoryview(data)
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            position, total = 0, len(view)
            while position < total:
                if len(self._buffer) == CHUNK_SIZE:
                    # Another byte is coming, so the chunk held is whole.
                    self._spill()
                take = min(CHUNK_SIZE - len(self._buffer), total - position)
                self._buffer += view[position : position + take]
                position += take
        except BaseException:
            self.abort()
            raise

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        if not self._open:
            raise ValueError("commit of a blob writer that was committed or aborted")
        try:
            if self._large is None:
                put = self._tier._small_put(bytes(self._buffer), expected)
                self._buffer = bytearray()
            else:
                self._spill()
                put = self._large.finish(expected)
            self._tier._submit([put])
            assert put.created is not None
            return put.chunks.info, put.created
        finally:
            self.abort()

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._buffer = bytearray()
            if self._large is not None:
                self._large.discard()

    def _spill(self) -> None:
        if self._large is None:
            self._large = _LargeRecord(self._tier)
        chunk = bytes(self._buffer)
        self._buffer.clear()
        self._large.add(chunk)


class _LargeRecord:
    """A large blob's record being written to its own file in tmp/."""

    def __init__(self, tier: WarmTier) -> None:
        self._tier = tier
        self._fd, self.path = tier._temp_file()
        self._closed = False
        self._hasher = BlobHasher()
        self._entries = array("I")
        self._payload = 0
        self._compressed = False

    def add(self, chunk: bytes) -> None:
        self._hasher.update(chunk)
        frame, compressed = self._tier._deflate(chunk)
        write_all(self._fd, frame)
        self._entries.append(len(frame) | (_ZSTD if compressed else 0))
        self._payload += len(frame)
        self._compressed |= compressed

    def finish(self, expected: Digest | None) -> _Put:
        """Seal the record file: trailer, read-only, synced. It is moved into the archive by
        the commit that takes the returned put."""
        chunks = self._hasher.finish()
        if expected is not None:
            check_expected(expected, chunks.info)
        trailer = _trailer(self._entries, self._payload, chunks.sha256.raw)
        write_all(self._fd, trailer)
        os.fchmod(self._fd, 0o444)
        os.fsync(self._fd)
        self._close()
        return _Put(
            chunks,
            "zstd" if self._compressed else "none",
            temp=self.path,
            length=self._payload + len(trailer),
        )

    def discard(self) -> None:
        self._hasher.cancel()
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class _Put:
    """One blob on its way through a group commit: either a packed record in memory or a record
    file in tmp/. `created` is set once it is committed (or found already stored), `error` if
    the commit failed, `done` once its commit is over either way."""

    __slots__ = ("chunks", "compression", "created", "done", "error", "length", "record", "temp")

    def __init__(
        self,
        chunks: ChunkList,
        compression: str,
        *,
        record: bytes = b"",
        temp: str | None = None,
        length: int = 0,
    ) -> None:
        self.chunks = chunks
        self.compression = compression
        self.record = record
        self.temp = temp
        self.length = length
        self.created: bool | None = None
        self.error: BaseException | None = None
        self.done = False

    def row(self, pack: int, position: int, length: int) -> tuple[object, ...]:
        return (
            self.chunks.sha256.raw,
            pack,
            position,
            length,
            self.compression,
            self.chunks.encode(),
        )

    def discard(self) -> None:
        if self.temp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp)
            self.temp = None


@dataclass(slots=True)
class _OpenPack:
    number: int
    fd: int
    size: int


class _PackFiles:
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
                raise IntegrityError(f"pack file {path} is missing") from None
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


def _fast_compressor() -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=1)


def _trailer_size(count: int) -> int:
    return count * _ENTRY_SIZE + _FOOTER_SIZE


def _trailer(entries: array[int], payload: int, sha_raw: bytes) -> bytes:
    table = _pack_entries(entries)
    body = table + _FOOTER.pack(_MAGIC, _FORMAT, len(entries), payload, sha_raw)
    return body + zlib.crc32(body).to_bytes(_CRC_SIZE, "big")


def _pack_entries(entries: array[int]) -> bytes:
    if sys.byteorder == "little":
        entries = array("I", entries)
        entries.byteswap()
    return entries.tobytes()


def _unpack_entries(table: bytes) -> array[int]:
    entries = array("I", table)
    if sys.byteorder == "little":
        entries.byteswap()
    return entries


def _live(db: sqlite3.Connection, raws: Sequence[bytes]) -> set[bytes]:
    """Which of these sha256 digests (raw) are stored."""
    if not raws:
        return set()
    marks = ",".join("?" * len(raws))
    query = f"SELECT sha256 FROM blobs WHERE sha256 IN ({marks})"
    return {raw for (raw,) in db.execute(query, list(raws)).fetchall()}


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
