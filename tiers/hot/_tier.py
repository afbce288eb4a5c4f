"""The hot tier's BlobStore: blobs as plain files in a local folder, each beside its chunk list,
linked into place once durable, and checked chunk by chunk on every read; a lost or damaged chunk
list is rebuilt from the blob's bytes."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path

from tiers.copies import rehash
from tiers.hot._batch import Batch
from tiers.hot._direct import ALIGN, O_DIRECT, read_pieces
from tiers.hot._layout import (
    CHUNKS_SUFFIX,
    chunks_path,
    new_batch_folder,
    new_file,
    remove_leftovers,
)
from tiers.hot._repair import REWRITTEN, Damage, damage
from tiers.hot._writer import HotWriter, Pipeline
from tiers.placements import Journal
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound
from vault.files import fsync_dir, write_all
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList
from vault.store.protocol import BatchBlob, BatchPut, BatchResult, require_sha256

log = logging.getLogger("pinvault.tiers")


class HotTier(BatchPut):
    """A BlobStore on a local folder::

        root/blobs/<hex[:2]>/<hex>          the blob's bytes, uncompressed
        root/blobs/<hex[:2]>/<hex>.chunks   its encoded ChunkList (none for a one-chunk blob
                                            stored by a batch: see Batch)
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
        remove_leftovers(self._tmp)
        self.direct_io = self._probe_direct_io() if direct_io is None else direct_io
        # Told of each chunk list rebuilt from its blob's bytes (the list lost or damaged, the
        # bytes sound): the tier manager journals it as a repair.
        self.rebuilt: Callable[[Digest, str], None] | None = None
        # Told of each damaged copy a put is about to replace with its own bytes, before it
        # does (the first bad offset, what was found, what is done): journaled as a repair by
        # the tier manager, or by `journal_repairs` for a hot tier that runs alone.
        self.repairing: Callable[[Digest, int | None, str, str], None] | None = None
        # Where a hot tier with no tier manager over it journals, and as which tier: set by
        # `journal_repairs`, read by the audit of pinned blobs.
        self.journaled_as: tuple[Path | str, str, str] | None = None

    def __repr__(self) -> str:
        return f"HotTier({str(self.root)!r})"

    def journal_repairs(self, where: Path | str, name: str = "hot", host: str = "") -> None:
        """Journal the repairs puts make, as those of tier `name` (of `host`, in a record
        several servers share), in the placement record at `where` (tiers/placements.py: a
        SQLite file or a database URL): for a hot tier with no tier manager over it to journal
        them. The record is opened for each repair, as repairs are rare."""

        def record(sha256: Digest, offset: int | None, found: str, action: str) -> None:
            journal = Journal(where, host=host)
            try:
                journal.record(sha256, name, offset, found, action)
            finally:
                journal.close()

        self.repairing = record
        self.journaled_as = (where, name, host)

    # -- writes ------------------------------------------------------------------------------

    def writer(self) -> HotWriter:
        return HotWriter(self)

    def put_batch(self, blobs: Iterable[BatchBlob]) -> list[BatchResult]:
        """Many small blobs with shared syncs; see Batch."""
        with Batch(self) as batch:
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
            chunks_path(blob).unlink()
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
            stored = ChunkList.decode(chunks_path(blob).read_bytes(), sha256)
        except (FileNotFoundError, IntegrityError):
            stored = None
        # The bytes hash to their address, so they are right and a disagreeing list is not.
        # A one-chunk blob may have none at all (see Batch).
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
            return ChunkList.decode(chunks_path(blob).read_bytes(), sha256)
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

    def _damage(self, blob: Path, chunks: ChunkList) -> Damage | None:
        """Where the copy at `blob` differs from the blob `chunks` describes, read in chunks;
        FileNotFoundError if there is none."""
        fd = os.open(blob, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            pieces = self._pieces(fd, 0, min(size, chunks.size), chunks.chunk_size)
            try:
                return damage(chunks, size, pieces)
            finally:
                pieces.close()
        finally:
            os.close(fd)

    def _check_chunk_list(self, blob: Path, chunks: ChunkList) -> None:
        """Rewrite a chunk list that is lost, damaged or disagrees with the put's, as `verify`
        would; a one-chunk blob may have none (see Batch)."""
        try:
            stored = ChunkList.decode(chunks_path(blob).read_bytes(), chunks.sha256)
        except (FileNotFoundError, IntegrityError):
            stored = None
        if stored != chunks and (stored is not None or chunks.count > 1):
            self._write_chunk_list(blob, chunks)
            self._note_rebuilt(
                chunks.sha256,
                "chunk list lost" if stored is None else "chunk list disagreed with bytes",
            )

    def _note_repairing(self, sha256: Digest, found: Damage) -> None:
        offset, what = found
        log.warning("hot tier: %s; rewriting it from the bytes of a put", what)
        if self.repairing is not None:
            self.repairing(sha256, offset, what, REWRITTEN)

    def _note_rebuilt(self, sha256: Digest, found: str) -> None:
        log.warning("hot tier: %s of %s rebuilt from its bytes", found, sha256)
        if self.rebuilt is not None:
            self.rebuilt(sha256, found)

    def _hash_stored_copy(self, sha256: Digest, blob: Path) -> ChunkList:
        with self._open_blob(sha256, blob) as fd:
            found = rehash(self._pieces(fd, 0, os.fstat(fd).st_size, CHUNK_SIZE))
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
            os.replace(temp, chunks_path(blob))
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
        return read_pieces(fd, start, end, piece, direct=self.direct_io)

    def _temp_file(self, suffix: str, flags: int = 0) -> tuple[int, str]:
        """A new file in tmp/, flocked for as long as it is open."""
        return new_file(self._tmp, suffix, flags)

    def _temp_folder(self) -> tuple[int, str]:
        """A new folder in tmp/ for a batch, flocked for as long as it is open."""
        return new_batch_folder(self._tmp)

    def _probe_direct_io(self) -> bool:
        """Whether this file system takes aligned direct writes (tmpfs, for one, does not)."""
        if not O_DIRECT:
            return False
        try:
            fd, path = self._temp_file(".probe", O_DIRECT)
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

    def _install(self, temp: Pipeline, chunks: ChunkList) -> bool:
        """Make a temp blob durable and link it into place; False if it was already there. A
        copy already there is checked against the put's chunk list and, if damaged, replaced
        by the put's bytes."""
        blob = self._blob_path(chunks.sha256)
        if blob.exists():
            try:
                found = self._damage(blob, chunks)
            except FileNotFoundError:
                found = None  # removed meanwhile (moved to another tier): stored anew below
            else:
                if found is None:
                    self._check_chunk_list(blob, chunks)
                    # The put that linked it may not have synced the folder yet; this one
                    # answers too, so it syncs it (nearly free when there is nothing to write).
                    fsync_dir(blob.parent)
                    return False
                self._note_repairing(chunks.sha256, found)
                temp.make_durable(chunks.size)
                self._write_chunk_list(blob, chunks)
                os.replace(temp.path, blob)
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


def _check_size(chunks: ChunkList, stored_size: int) -> None:
    if stored_size != chunks.size:
        raise IntegrityError(
            f"stored copy of {chunks.sha256} is damaged: it has {stored_size} bytes, "
            f"expected {chunks.size} (they differ from byte offset {min(stored_size, chunks.size)})"
        )
