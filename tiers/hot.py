"""The hot tier: blobs as plain files in a local folder (the NVMe next to the server), each
beside its chunk list, written durably and checked chunk by chunk on every read."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import queue
import secrets
import sys
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Final

import blake3

from vault.digest import Digest
from vault.errors import IntegrityError, NotFound
from vault.files import fsync_dir, write_all
from vault.store.protocol import (
    CHUNK_SIZE,
    BatchBlob,
    BatchPut,
    BatchResult,
    BlobHasher,
    BlobInfo,
    BlobWriter,
    Chunk,
    ChunkHasher,
    ChunkList,
    check_expected,
    require_sha256,
)

log = logging.getLogger("pinvault.tiers")

CHUNKS_SUFFIX: Final = ".chunks"
# A batched put stages its files in a folder of tmp/ with this suffix.
BATCH_SUFFIX: Final = ".batch"

# Direct I/O needs page-aligned buffers, lengths and offsets; 4 KiB suits 512-byte and
# 4 KiB-sector devices alike.
ALIGN: Final = 4096
# A put copies the bytes it is handed into a ring of page-aligned slots, and threads take each
# full slot from there: one hashes SHA-256, one BLAKE3 and the chunk hashes, two write it out
# (two writes in flight keep an NVMe device busy). The caller only copies, so a server's
# thread goes straight back to receiving; the ring bounds the memory a put holds, and since
# the caller's buffers are released at once the allocator reuses them instead of faulting in
# new pages.
SLOT: Final = 2 * CHUNK_SIZE
SLOTS: Final = 8
WRITE_THREADS: Final = 2
# Without direct I/O the bytes pile up in the page cache; syncing every so many bytes in the
# background keeps the final sync, which the caller waits for, short.
SYNC_EVERY: Final = 64 << 20
# Reads with direct I/O: two threads, each reading a block into its own aligned buffer, keep
# two reads in flight, a few blocks ahead of the caller.
READ_BLOCK: Final = 2 * CHUNK_SIZE
READ_THREADS: Final = 2
READ_BLOCKS_AHEAD: Final = 4

_O_DIRECT: Final[int] = getattr(os, "O_DIRECT", 0)


class HotTier(BatchPut):
    """A BlobStore on a local folder::

        root/blobs/<hex[:2]>/<hex>          the blob's bytes, uncompressed
        root/blobs/<hex[:2]>/<hex>.chunks   its encoded ChunkList (none for a one-chunk blob
                                            stored by a batch: see _Batch)
        root/tmp/                           writes in progress (a batch: a folder of them)

    A blob is visible once its file is linked into blobs/, which happens only after its bytes
    and chunk list are on disk. Files left in tmp/ by a crash are removed at open; files still
    being written by another process (each holds an flock on its temp file) are left alone.

    Puts, and reads of more than READ_BLOCK bytes, use direct I/O where the file system
    allows it (`direct_io=None` asks it): that spares the CPU the page-cache copy, leaves the
    final sync of a put nothing but metadata, and keeps one large blob from evicting the small
    ones that are read over and over.
    """

    def __init__(self, root: Path, *, direct_io: bool | None = None) -> None:
        self.root = Path(root)
        self._blobs = self.root / "blobs"
        self._tmp = self.root / "tmp"
        created = False
        for folder in (self.root, self._blobs, self._tmp):
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                created = True
        # Every prefix folder exists from the start, so a commit never has to create one and
        # then sync its parent.
        for prefix in range(256):
            with contextlib.suppress(FileExistsError):
                (self._blobs / f"{prefix:02x}").mkdir()
                created = True
        if created:
            fsync_dir(self._blobs)
            fsync_dir(self.root)
            fsync_dir(self.root.parent)
        self._remove_leftovers()
        self.direct_io = self._probe_direct_io() if direct_io is None else direct_io
        # Told of each chunk list rebuilt from its blob's bytes (the list lost or damaged, the
        # bytes sound): the tier manager journals it as a repair.
        self.rebuilt: Callable[[Digest, str], None] | None = None

    def __repr__(self) -> str:
        return f"HotTier({str(self.root)!r})"

    # -- writes ------------------------------------------------------------------------------

    def writer(self) -> HotWriter:
        return HotWriter(self)

    def put_batch(self, blobs: Iterable[BatchBlob]) -> list[BatchResult]:
        """Many small blobs with shared syncs; see _Batch."""
        with _Batch(self) as batch:
            for data, expected in blobs:
                batch.add(data, expected)
            return batch.commit()

    def delete(self, sha256: Digest) -> None:
        blob = self._blob_path(sha256)
        try:
            blob.unlink()
        except FileNotFoundError:
            raise NotFound(f"blob {sha256} is not in the hot tier") from None
        with contextlib.suppress(FileNotFoundError):
            _chunks_path(blob).unlink()
        fsync_dir(blob.parent)

    # -- reads -------------------------------------------------------------------------------

    def info(self, sha256: Digest) -> BlobInfo | None:
        blob = self._blob_path(sha256)
        try:
            stored_size = blob.stat().st_size
        except FileNotFoundError:
            return None
        chunks = self._load_chunk_list(sha256, blob)
        _check_size(chunks, stored_size)
        return chunks.info

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        missing: dict[Digest, None] = {}
        for digest in digests:
            if digest not in missing and not self._blob_path(digest).exists():
                missing[digest] = None
        return list(missing)

    def chunk_list(self, sha256: Digest) -> ChunkList:
        return self._load_chunk_list(sha256, self._blob_path(sha256))

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        blob = self._blob_path(sha256)
        chunks = self._load_chunk_list(sha256, blob)
        wanted = chunks.chunk_range(offset, length)
        return self._read_chunks(blob, chunks, wanted)

    def verify(self, sha256: Digest) -> BlobInfo:
        """Re-hash every byte; if they match the digest, a chunk list that is lost, damaged or
        says otherwise is rewritten from them."""
        blob = self._blob_path(sha256)
        found = self._hash_stored_copy(sha256, blob)
        try:
            stored = ChunkList.decode(_chunks_path(blob).read_bytes(), sha256)
        except (FileNotFoundError, IntegrityError):
            stored = None
        # The bytes hash to their address, so they are right and a disagreeing list is not.
        # A one-chunk blob may have none at all (see _Batch).
        if stored != found and (stored is not None or found.count > 1):
            self._write_chunk_list(blob, found)
            self._note_rebuilt(
                sha256, "chunk list lost" if stored is None else "chunk list disagreed with bytes"
            )
        return found.info

    def digests(self) -> Iterator[Digest]:
        """Every stored blob, in order of digest."""
        for prefix in range(256):
            folder = self._blobs / f"{prefix:02x}"
            try:
                names = sorted(os.listdir(folder))
            except FileNotFoundError:
                continue
            for name in names:
                if len(name) == 64 and not name.endswith(CHUNKS_SUFFIX):
                    yield Digest("sha256", name)

    # -- inside ------------------------------------------------------------------------------

    def _blob_path(self, sha256: Digest) -> Path:
        hex_ = require_sha256(sha256)
        return self._blobs / hex_[:2] / hex_

    def _load_chunk_list(self, sha256: Digest, blob: Path) -> ChunkList:
        """The verified chunk list; rebuilt from the bytes if it is lost or damaged and the
        bytes still hash to their digest."""
        if not blob.exists():
            raise NotFound(f"blob {sha256} is not in the hot tier")
        missing = False
        try:
            return ChunkList.decode(_chunks_path(blob).read_bytes(), sha256)
        except FileNotFoundError:
            missing = True
        except IntegrityError:
            pass
        chunks = self._hash_stored_copy(sha256, blob)
        # A one-chunk blob stored by a batch has no list: the list is its two digests, which
        # hashing its bytes (as reading it does anyway) gives back.
        if not missing or chunks.count > 1:
            self._write_chunk_list(blob, chunks)
            self._note_rebuilt(sha256, "chunk list lost" if missing else "chunk list damaged")
        return chunks

    def _note_rebuilt(self, sha256: Digest, found: str) -> None:
        log.warning("hot tier: %s of %s rebuilt from its bytes", found, sha256)
        if self.rebuilt is not None:
            self.rebuilt(sha256, found)

    def _hash_stored_copy(self, sha256: Digest, blob: Path) -> ChunkList:
        hasher = BlobHasher()
        try:
            with self._open_blob(sha256, blob) as fd:
                for data in self._pieces(fd, 0, os.fstat(fd).st_size, CHUNK_SIZE):
                    hasher.update(data)
        except BaseException:
            hasher.cancel()
            raise
        found = hasher.finish()
        if found.sha256 != sha256:
            raise IntegrityError(
                f"stored copy of {sha256} is damaged: its {found.size} bytes hash to {found.sha256}"
            )
        return found

    def _write_chunk_list(self, blob: Path, chunks: ChunkList) -> None:
        fd, temp = self._temp_file(CHUNKS_SUFFIX)
        try:
            write_all(fd, chunks.encode())
            os.fdatasync(fd)
            os.replace(temp, _chunks_path(blob))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        finally:
            os.close(fd)
        fsync_dir(blob.parent)

    def _read_chunks(self, blob: Path, chunks: ChunkList, wanted: range) -> Iterator[Chunk]:
        if not wanted:
            return
        with self._open_blob(chunks.sha256, blob) as fd:
            _check_size(chunks, os.fstat(fd).st_size)
            start = chunks.span(wanted.start)[0]
            end = sum(chunks.span(wanted.stop - 1))
            pieces = self._pieces(fd, start, end, chunks.chunk_size)
            try:
                for index in wanted:
                    # A piece missing because the file was cut short fails the check as empty.
                    data = next(pieces, b"")
                    yield Chunk(chunks.span(index)[0], data, chunks.check(index, data))
            finally:
                pieces.close()

    @contextlib.contextmanager
    def _open_blob(self, sha256: Digest, blob: Path) -> Iterator[int]:
        try:
            fd = os.open(blob, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"blob {sha256} is not in the hot tier") from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _pieces(self, fd: int, start: int, end: int, piece: int) -> Generator[bytes, None, None]:
        """The bytes [start, end) of a blob file in pieces of `piece` bytes (the last may be
        shorter); a piece cut short by the end of the file ends the stream, for the caller's
        check to catch."""
        large = end - start > READ_BLOCK
        if self.direct_io and large and start % ALIGN == 0 and piece % ALIGN == 0:
            # Past the page cache, a large read does not evict everything else, nor pay for
            # filling the cache with pages it will not read again; small blobs, the ones read
            # over and over, stay cached.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
            return _direct_pieces(fd, start, end, piece)
        return _buffered_pieces(fd, start, end, piece)

    def _temp_file(self, suffix: str, flags: int = 0) -> tuple[int, str]:
        """A new file in tmp/, flocked for as long as it is open (see _new_locked)."""

        def create(path: str) -> int | None:
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o600)
            except FileExistsError:
                return None

        return self._new_locked(suffix, create)

    def _temp_folder(self) -> tuple[int, str]:
        """A new folder in tmp/ for a batch, flocked through the returned descriptor for as
        long as it is open (see _new_locked)."""

        def create(path: str) -> int | None:
            try:
                os.mkdir(path, 0o700)
                return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except (FileExistsError, FileNotFoundError):
                return None  # a name taken, or the folder cleaned up by another process at once

        return self._new_locked(BATCH_SUFFIX, create)

    def _new_locked(self, suffix: str, create: Callable[[str], int | None]) -> tuple[int, str]:
        """A new entry in tmp/ made by `create` (its descriptor, or None to try another name),
        flocked for as long as it is open so that another process opening this tier does not
        take it for a crash leftover."""
        while True:
            path = str(self._tmp / f"{secrets.token_hex(12)}{suffix}")
            fd = create(path)
            if fd is None:
                continue
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

    def _remove_leftovers(self) -> None:
        for entry in os.scandir(self._tmp):
            if entry.name.endswith(BATCH_SUFFIX) and entry.is_dir(follow_symlinks=False):
                self._remove_leftover_batch(entry.path)
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

    def _remove_leftover_batch(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a batch in progress elsewhere
            return
        _remove_folder(fd, path)

    def _probe_direct_io(self) -> bool:
        """Whether this file system takes aligned direct writes (tmpfs, for one, does not)."""
        if not _O_DIRECT:
            return False
        try:
            fd, path = self._temp_file(".probe", _O_DIRECT)
        except OSError as error:
            if error.errno == errno.EINVAL:
                return False
            raise
        try:
            with mmap.mmap(-1, ALIGN) as block:
                os.pwrite(fd, block, 0)
            return True
        except OSError as error:
            if error.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.unlink(path)
            os.close(fd)

    def _install(self, temp: _Pipeline, chunks: ChunkList) -> bool:
        """Make a temp blob durable and link it into place; False if it was already there."""
        blob = self._blob_path(chunks.sha256)
        if blob.exists():
            # The put that linked it may not have synced the folder yet; this one answers
            # too, so it syncs it (nearly free when there is nothing left to write).
            fsync_dir(blob.parent)
            return False
        temp.make_durable(chunks.size)
        # The chunk list goes first: a blob seen without one would cost a full re-read.
        self._write_chunk_list(blob, chunks)
        try:
            # link, not rename: it fails if a concurrent put of the same bytes got there
            # first, so exactly one of them reports the blob as newly stored.
            os.link(temp.path, blob)
            created = True
        except FileExistsError:
            created = False
        fsync_dir(blob.parent)
        return created


class _Batch:
    """One put_batch. Each new blob's bytes (and the chunk list of a blob of several chunks)
    are written to plain files in a folder of its own in tmp/, and nothing else happens per
    blob; then:

    1. one barrier makes all of them durable: syncfs(2) of the file system, one device flush
       for the whole batch where a sync per file costs a flush (and a journal commit) each:
       here about 30 ms for 1,000 small files against 0.4 ms a file (fdatasync per file
       where syncfs is not to be trusted);
    2. each is moved into blobs/, chunk list first, the blob by link(2) as single puts do;
    3. a second syncfs makes the new names durable (without it, each folder a blob went to
       is synced once; so is each folder of a blob found already stored, in any case).

    Only then does commit return, so a blob is acknowledged (and catalogued above) only once
    it is durable. A blob whose bytes do not match its expected digest is refused before
    anything of it is written. On any error the folder and whatever is in it are removed.

    A blob of one chunk gets no chunk-list file: its list holds nothing but its two digests,
    which a read recomputes from the bytes it reads anyway, while a second file per blob
    would double what a batch of small blobs costs the file system (an inode, a page of
    cache, a rename): measured, a third of the whole put.
    """

    def __init__(self, tier: HotTier) -> None:
        self._tier = tier
        self._fd, self._path = tier._temp_folder()
        self._results: list[BatchResult | None] = []
        # Result index and chunk list of each blob written to the folder, by digest.
        self._staged: dict[Digest, tuple[int, ChunkList]] = {}
        # Folders of blobs found already stored: synced too, in case the put that linked them
        # has not synced them yet (it has not answered yet either), as this batch will answer.
        # Paths are plain strings here: a batch handles thousands of blobs, and pathlib's
        # objects cost more than the system calls they name.
        self._folders: set[str] = set()
        self._blobs = os.fspath(tier._blobs)
        self._sync_each = _syncfs is None

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        _remove_folder(self._fd, self._path)

    def add(self, data: bytes | memoryview, expected: Digest | None) -> None:
        chunks = _chunk_list_of(data)
        if expected is not None:
            try:
                check_expected(expected, chunks.info)
            except IntegrityError as refused:
                self._results.append(refused)
                return
        name = chunks.sha256.hex
        folder = os.path.join(self._blobs, name[:2])
        if chunks.sha256 in self._staged or os.path.exists(os.path.join(folder, name)):
            self._folders.add(folder)
            self._results.append((chunks.info, False))
            return
        self._write(name, data)
        if chunks.count > 1:
            self._write(name + CHUNKS_SUFFIX, chunks.encode())
        self._staged[chunks.sha256] = (len(self._results), chunks)
        self._results.append(None)

    def commit(self) -> list[BatchResult]:
        if self._staged and _syncfs is not None:
            _syncfs(self._fd)
        folders = self._folders
        for index, chunks in self._staged.values():
            name = chunks.sha256.hex
            folder = os.path.join(self._blobs, name[:2])
            blob = os.path.join(folder, name)
            if chunks.count > 1:
                os.replace(name + CHUNKS_SUFFIX, blob + CHUNKS_SUFFIX, src_dir_fd=self._fd)
            try:
                os.link(name, blob, src_dir_fd=self._fd)
                created = True
            except FileExistsError:
                created = False  # a concurrent put of the same bytes got there first
            folders.add(folder)
            self._results[index] = (chunks.info, created)
        if _syncfs is not None and self._staged:
            # One more syncfs makes every new name durable at once: cheaper than a sync of
            # each of up to 256 folders.
            _syncfs(self._fd)
        else:
            for folder in folders:
                fsync_dir(folder)
        results = [result for result in self._results if result is not None]
        assert len(results) == len(self._results)
        return results

    def _write(self, name: str, data: bytes | memoryview) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._fd)
        try:
            write_all(fd, data)
            if self._sync_each:
                os.fdatasync(fd)
        finally:
            os.close(fd)


def _chunk_list_of(data: bytes | memoryview) -> ChunkList:
    """The chunk list of a blob held whole in memory, in one pass of each hash."""
    sha256 = Digest.sha256(hashlib.sha256(data).digest())
    size = memoryview(data).nbytes
    if size > CHUNK_SIZE:
        hasher = ChunkHasher()
        hasher.update(data)
        return hasher.chunk_list(sha256)
    # A blob of one chunk: the chunk's hash is the blob's BLAKE3, so one BLAKE3 pass is enough.
    whole = blake3.blake3(data).digest()
    return ChunkList(CHUNK_SIZE, size, sha256, Digest.blake3(whole), (whole,) if size else ())


def _remove_folder(fd: int, path: str) -> None:
    """Remove a batch folder (its files, then itself) and close its descriptor."""
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)
    finally:
        os.close(fd)


def _load_syncfs() -> Callable[[int], None] | None:
    """syncfs(2) from libc, where it can vouch for durability: Linux 5.8 and later. Before
    5.8 it returned 0 even when writing some file back had failed."""
    if sys.platform != "linux":
        return None
    try:
        version = tuple(int(part) for part in os.uname().release.split(".")[:2])
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (ValueError, OSError, AttributeError):
        return None
    if version < (5, 8):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if function(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs: {os.strerror(code)}")

    return syncfs


_syncfs: Final = _load_syncfs()


class HotWriter(BlobWriter):
    """One put into the hot tier; see _Pipeline for how the work is shared out."""

    def __init__(self, tier: HotTier) -> None:
        self._tier = tier
        self._pipeline = _Pipeline(tier)
        self._open = True

    def write(self, data: bytes | memoryview) -> None:
        if not self._open:
            raise ValueError("write to a blob writer that was committed or aborted")
        try:
            self._pipeline.write(data)
        except BaseException:
            self.abort()
            raise

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        if not self._open:
            raise ValueError("commit of a blob writer that was committed or aborted")
        try:
            chunks = self._pipeline.finish()
            if expected is not None:
                check_expected(expected, chunks.info)
            created = self._tier._install(self._pipeline, chunks)
        finally:
            self.abort()
        return chunks.info, created

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._pipeline.discard()


class _Pipeline:
    """A blob's bytes on their way into a temp file in tmp/, hashed on the way.

    The caller copies bytes into a ring of SLOTS page-aligned slots. Each full slot goes to
    three stages at once, each on its own thread(s): SHA-256, BLAKE3 with the chunk hashes,
    and writing it to the temp file (O_DIRECT when the tier allows it). A slot is free again
    when all three are done with it; the caller waits for a free slot, which is what bounds
    memory. None of the stages holds the GIL while it works. A blob smaller than one slot is
    done on the caller's thread at the end, without starting any thread.
    """

    def __init__(self, tier: HotTier) -> None:
        self.direct = tier.direct_io
        self.fd, self.path = tier._temp_file(".blob", _O_DIRECT if self.direct else 0)
        self._map: mmap.mmap | None = None
        self._slots: list[memoryview] = []
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._users = [0] * SLOTS
        self._lock = threading.Lock()
        self._sha = hashlib.sha256()
        self._chunks = ChunkHasher()
        self._sha_jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._chunk_jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._write_jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._current: int | None = None
        self._filled = 0
        self._offset = 0
        self._unsynced = 0
        self._error: BaseException | None = None

    def write(self, data: bytes | memoryview) -> None:
        self._raise_error()
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        position, total = 0, len(view)
        while position < total:
            if self._current is None:
                self._current = self._take_slot()
                self._filled = 0
            take = min(total - position, SLOT - self._filled)
            slot = self._slots[self._current]
            slot[self._filled : self._filled + take] = view[position : position + take]
            self._filled += take
            position += take
            if self._filled == SLOT:
                self._dispatch()

    def finish(self) -> ChunkList:
        """Wait for every stage and return the blob's chunk list."""
        if self._current is not None:
            if self._threads:
                self._dispatch()
            else:
                job = (self._current, self._filled, self._offset)
                self._hash_sha(job)
                self._hash_chunks(job)
                self._write(job)
        self._stop()
        self._raise_error()
        return self._chunks.chunk_list(Digest.sha256(self._sha.digest()))

    def make_durable(self, size: int) -> None:
        # Direct writes went out in whole aligned blocks; the padding is cut off here.
        os.ftruncate(self.fd, size)
        os.fdatasync(self.fd)

    def discard(self) -> None:
        """Stop the stages and remove the temp file; the end of every _Pipeline."""
        self._error = self._error or _Discarded()
        try:
            self._stop()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            # A failed stage's traceback may still hold a slice of a slot; the map is then
            # freed with it instead.
            with contextlib.suppress(BufferError):
                for slot in self._slots:
                    slot.release()
                if self._map is not None:
                    self._map.close()
            self._slots.clear()

    # -- the caller's side -------------------------------------------------------------------

    def _take_slot(self) -> int:
        if self._map is None:
            # Pages are only touched as they fill, so a small blob costs little of this.
            self._map = mmap.mmap(-1, SLOT * SLOTS)
            ring = memoryview(self._map)
            self._slots = [ring[index * SLOT : (index + 1) * SLOT] for index in range(SLOTS)]
            ring.release()
            for index in range(SLOTS):
                self._free.put(index)
        index = self._free.get()
        self._raise_error()
        return index

    def _dispatch(self) -> None:
        assert self._current is not None
        if not self._threads:
            self._start()
        job = (self._current, self._filled, self._offset)
        with self._lock:
            self._users[self._current] = _STAGES
        self._sha_jobs.put(job)
        self._chunk_jobs.put(job)
        self._write_jobs.put(job)
        self._offset += self._filled
        self._current = None
        self._filled = 0

    def _start(self) -> None:
        stages = [
            ("sha256", self._sha_jobs, self._hash_sha),
            ("blake3", self._chunk_jobs, self._hash_chunks),
        ] + [(f"write-{n}", self._write_jobs, self._write) for n in range(WRITE_THREADS)]
        for name, jobs, work in stages:
            thread = threading.Thread(
                target=self._run, args=(jobs, work), name=f"pinvault-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _stop(self) -> None:
        if not self._threads:
            return
        for jobs, count in (
            (self._sha_jobs, 1),
            (self._chunk_jobs, 1),
            (self._write_jobs, WRITE_THREADS),
        ):
            for _ in range(count):
                jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the stages --------------------------------------------------------------------------

    def _run(self, jobs: queue.SimpleQueue[_Job | None], work: Callable[[_Job], None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                if self._error is None:
                    work(job)
            except BaseException as error:
                self._error = self._error or error
            finally:
                self._release(job[0])

    def _release(self, index: int) -> None:
        with self._lock:
            self._users[index] -= 1
            free = self._users[index] == 0
        if free:
            self._free.put(index)

    def _hash_sha(self, job: _Job) -> None:
        index, length, _ = job
        self._sha.update(self._slots[index][:length])

    def _hash_chunks(self, job: _Job) -> None:
        index, length, _ = job
        self._chunks.update(self._slots[index][:length])

    def _write(self, job: _Job) -> None:
        index, length, offset = job
        padded = -(-length // ALIGN) * ALIGN if self.direct else length
        view = self._slots[index][:padded]
        written = 0
        while written < padded:
            written += os.pwrite(self.fd, view[written:], offset + written)
        if not self.direct:
            with self._lock:
                self._unsynced += length
                due = self._unsynced >= SYNC_EVERY
                if due:
                    self._unsynced = 0
            if due:
                os.fdatasync(self.fd)


# A slot's number, how many bytes it holds, and where they go in the blob.
_Job = tuple[int, int, int]
# Each slot is seen by the SHA-256 stage, the BLAKE3 stage and one writer.
_STAGES: Final = 3


class _Discarded(Exception):
    """Tells the stages that the put was given up."""


def _buffered_pieces(fd: int, start: int, end: int, piece: int) -> Generator[bytes, None, None]:
    """Bytes [start, end) of a file in pieces of `piece` bytes, through the page cache; a piece
    cut short by the end of the file is the last."""
    if end - start > piece:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
    for offset in range(start, end, piece):
        wanted = min(piece, end - offset)
        data = os.pread(fd, wanted, offset)
        yield data
        if len(data) < wanted:
            return


def _direct_pieces(fd: int, start: int, end: int, piece: int) -> Generator[bytes, None, None]:
    """As _buffered_pieces, with direct I/O: READ_THREADS threads each read READ_BLOCK bytes
    at a time into their own aligned buffer, up to READ_BLOCKS_AHEAD blocks ahead of the
    caller, so that the disk, the copies out and the caller's checks overlap."""
    block = max(READ_BLOCK // piece, 1) * piece
    blocks = range(start, end, block)
    ready: dict[int, tuple[list[bytes], bool] | BaseException] = {}
    changed = threading.Condition()
    taken = 0
    stopping = False

    def read_block(buffer: memoryview, offset: int) -> tuple[list[bytes], bool]:
        """The block's pieces, and whether it was read whole; a short read ends with the
        piece it cut (perhaps empty)."""
        length = min(block, end - offset)
        got = os.preadv(fd, [buffer[: -(-length // ALIGN) * ALIGN]], offset)
        available = min(got, length)
        pieces = [
            bytes(buffer[at : min(at + piece, available)])
            for at in range(0, length, piece)
            if at <= available
        ]
        return pieces, available == length

    def run(first: int) -> None:
        number = first
        try:
            with mmap.mmap(-1, block) as map_, memoryview(map_) as buffer:
                for number in range(first, len(blocks), READ_THREADS):
                    with changed:
                        while not stopping and number - taken >= READ_BLOCKS_AHEAD:
                            changed.wait()
                        if stopping:
                            return
                    result = read_block(buffer, blocks[number])
                    with changed:
                        ready[number] = result
                        changed.notify_all()
        except BaseException as error:
            # The caller raises it when it reaches this block.
            with changed:
                ready[number] = error
                changed.notify_all()

    threads = [
        threading.Thread(target=run, args=(first,), name=f"pinvault-read-{first}", daemon=True)
        for first in range(min(READ_THREADS, len(blocks)))
    ]
    for thread in threads:
        thread.start()
    try:
        for number in range(len(blocks)):
            with changed:
                while number not in ready:
                    changed.wait()
                result = ready.pop(number)
                taken = number + 1
                changed.notify_all()
            if isinstance(result, BaseException):
                raise result
            pieces, whole = result
            yield from pieces
            if not whole:
                return
    finally:
        with changed:
            stopping = True
            changed.notify_all()
        for thread in threads:
            thread.join()


def _chunks_path(blob: Path) -> Path:
    return blob.with_name(blob.name + CHUNKS_SUFFIX)


def _check_size(chunks: ChunkList, stored_size: int) -> None:
    if stored_size != chunks.size:
        raise IntegrityError(
            f"stored copy of {chunks.sha256} is damaged: it has {stored_size} bytes, "
            f"expected {chunks.size} (they differ from byte offset {min(stored_size, chunks.size)})"
        )
