"""The hot tier: blobs as plain files in a local folder (the NVMe next to the server), each
beside its chunk list, written durably and checked chunk by chunk on every read."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Final, Self

from vault.digest import Digest
from vault.errors import IntegrityError, NotFound
from vault.storage import (
    CHUNK_SIZE,
    BlobHasher,
    BlobInfo,
    Chunk,
    ChunkList,
    check_expected,
    require_sha256,
)

# A background fdatasync every so many bytes keeps the final one, which the caller waits for,
# down to the last few tens of MiB.
FLUSH_EVERY: Final = 64 << 20
CHUNKS_SUFFIX: Final = ".chunks"


class HotTier:
    """A BlobStore on a local folder::

        root/blobs/<hex[:2]>/<hex>          the blob's bytes, uncompressed
        root/blobs/<hex[:2]>/<hex>.chunks   its encoded ChunkList
        root/tmp/                           writes in progress

    A blob is visible once its file is linked into blobs/, which happens only after its bytes
    and chunk list are on disk. Files left in tmp/ by a crash are removed at open; files still
    being written by another process (each holds an flock on its temp file) are left alone.
    """

    def __init__(self, root: Path) -> None:
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
            _fsync_dir(self._blobs)
            _fsync_dir(self.root)
            _fsync_dir(self.root.parent)
        self._remove_leftovers()

    def __repr__(self) -> str:
        return f"HotTier({str(self.root)!r})"

    # -- writes ------------------------------------------------------------------------------

    def writer(self) -> HotWriter:
        return HotWriter(self)

    def delete(self, sha256: Digest) -> None:
        blob = self._blob_path(sha256)
        try:
            blob.unlink()
        except FileNotFoundError:
            raise NotFound(f"blob {sha256} is not in the hot tier") from None
        with contextlib.suppress(FileNotFoundError):
            _chunks_path(blob).unlink()
        _fsync_dir(blob.parent)

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
        blob = self._blob_path(sha256)
        found = self._hash_stored_copy(sha256, blob)
        try:
            stored = ChunkList.decode(_chunks_path(blob).read_bytes(), sha256)
        except (FileNotFoundError, IntegrityError):
            stored = None
        # The bytes hash to their address, so they are right and a disagreeing list is not.
        if stored != found:
            self._write_chunk_list(blob, found)
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
        try:
            return ChunkList.decode(_chunks_path(blob).read_bytes(), sha256)
        except (FileNotFoundError, IntegrityError):
            pass
        chunks = self._hash_stored_copy(sha256, blob)
        self._write_chunk_list(blob, chunks)
        return chunks

    def _hash_stored_copy(self, sha256: Digest, blob: Path) -> ChunkList:
        hasher = BlobHasher()
        try:
            fd = os.open(blob, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"blob {sha256} is not in the hot tier") from None
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while data := os.read(fd, CHUNK_SIZE):
                hasher.update(data)
        except BaseException:
            hasher.cancel()
            raise
        finally:
            os.close(fd)
        found = hasher.finish()
        if found.sha256 != sha256:
            raise IntegrityError(
                f"stored copy of {sha256} is damaged: its {found.size} bytes hash to {found.sha256}"
            )
        return found

    def _write_chunk_list(self, blob: Path, chunks: ChunkList) -> None:
        fd, temp = self._temp_file(CHUNKS_SUFFIX)
        try:
            _write_all(fd, chunks.encode())
            os.fdatasync(fd)
            os.replace(temp, _chunks_path(blob))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        finally:
            os.close(fd)
        _fsync_dir(blob.parent)

    def _read_chunks(self, blob: Path, chunks: ChunkList, wanted: range) -> Iterator[Chunk]:
        if not wanted:
            return
        try:
            fd = os.open(blob, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"blob {chunks.sha256} is not in the hot tier") from None
        try:
            _check_size(chunks, os.fstat(fd).st_size)
            for index in wanted:
                offset, length = chunks.span(index)
                data = os.pread(fd, length, offset)
                yield Chunk(offset, data, chunks.check(index, data))
        finally:
            os.close(fd)

    def _temp_file(self, suffix: str) -> tuple[int, str]:
        """A new file in tmp/, flocked for as long as it is open so that another process opening
        this tier does not take it for a crash leftover."""
        while True:
            fd, path = tempfile.mkstemp(suffix=suffix, dir=self._tmp)
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

    def _install(self, fd: int, temp: str, chunks: ChunkList) -> bool:
        """Sync a temp file and link it into place; False if the blob was already there."""
        blob = self._blob_path(chunks.sha256)
        if blob.exists():
            return False
        os.fdatasync(fd)
        # The chunk list goes first: a blob seen without one would cost a full re-read.
        self._write_chunk_list(blob, chunks)
        try:
            # link, not rename: it fails if a concurrent put of the same bytes got there
            # first, so exactly one of them reports the blob as newly stored.
            os.link(temp, blob)
        except FileExistsError:
            return False
        _fsync_dir(blob.parent)
        return True


class HotWriter:
    """One put into the hot tier.

    The calling thread hashes BLAKE3 and writes; SHA-256 runs on its own thread (see
    BlobHasher), and a flusher thread syncs the temp file every FLUSH_EVERY bytes so that commit
    only waits for the tail. The blob is never held in memory.
    """

    def __init__(self, tier: HotTier) -> None:
        self._tier = tier
        self._hasher = BlobHasher()
        self._fd, self._temp = tier._temp_file(".blob")
        self._flusher: _Flusher | None = None
        self._written = 0
        self._flush_at = FLUSH_EVERY
        self._open = True

    def write(self, data: bytes | memoryview) -> None:
        if not self._open:
            raise ValueError("write to a blob writer that was committed or aborted")
        try:
            self._hasher.update(data)
            self._written += _write_all(self._fd, data)
            if self._written >= self._flush_at:
                self._flush_at = self._written + FLUSH_EVERY
                if self._flusher is None:
                    self._flusher = _Flusher(self._fd)
                self._flusher.poke()
        except BaseException:
            self.abort()
            raise

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        if not self._open:
            raise ValueError("commit of a blob writer that was committed or aborted")
        try:
            chunks = self._hasher.finish()
            if expected is not None:
                check_expected(expected, chunks.info)
            flusher, self._flusher = self._flusher, None
            if flusher is not None:
                flusher.stop()
            created = self._tier._install(self._fd, self._temp, chunks)
        except BaseException:
            self.abort()
            raise
        self._discard_temp()
        return chunks.info, created

    def abort(self) -> None:
        if not self._open:
            return
        self._hasher.cancel()
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            with contextlib.suppress(OSError):
                flusher.stop()
        self._discard_temp()

    def _discard_temp(self) -> None:
        self._open = False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._temp)
        finally:
            os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class _Flusher:
    """Runs fdatasync on a file in the background whenever poked, so that the final sync in
    commit has little left to write."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wake = threading.Event()
        self._stopping = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="pinvault-flush", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        if self._error is not None:
            raise self._error
        self._wake.set()

    def stop(self) -> None:
        """Wait for the flusher to finish; raise the error of a sync that failed."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                os.fdatasync(self._fd)
            except OSError as error:
                self._error = error
                return


def _chunks_path(blob: Path) -> Path:
    return blob.with_name(blob.name + CHUNKS_SUFFIX)


def _check_size(chunks: ChunkList, stored_size: int) -> None:
    if stored_size != chunks.size:
        raise IntegrityError(
            f"stored copy of {chunks.sha256} is damaged: it has {stored_size} bytes, "
            f"expected {chunks.size} (differs from byte offset {min(stored_size, chunks.size)})"
        )


def _write_all(fd: int, data: bytes | memoryview) -> int:
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    total = len(view)
    written = 0
    while written < total:
        written += os.write(fd, view[written:])
    return total


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
