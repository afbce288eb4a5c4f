"""Chunk lists and the hashers that make them: a blob's SHA-256, BLAKE3 and the BLAKE3 of each
chunk in one pass, so that any byte range can be verified without reading the whole blob."""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
from dataclasses import dataclass
from typing import Final

import blake3

from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument

CHUNK_SIZE: Final = 1 << 20
HASH_SIZE: Final = 32

# SHA-256 is the slowest of the hashes, so BlobHasher runs it on its own thread; this bounds how
# far the calling thread may run ahead of it (and so the memory held for it) to a few batches.
_SHA_BATCH: Final = CHUNK_SIZE
SHA_QUEUE_DEPTH: Final = 8
# Many tiny pieces are joined before hashing so that each update is large enough for hashlib
# to release the GIL.
_SHA_MAX_PIECES: Final = 64


@dataclass(frozen=True, slots=True)
class BlobInfo:
    sha256: Digest
    blake3: Digest
    size: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One whole chunk as stored, already verified against the blob's chunk list."""

    offset: int
    data: bytes
    hash: bytes


def check_expected(expected: Digest, info: BlobInfo) -> None:
    """Refuse bytes whose digest is not the one the caller announced."""
    if expected.algorithm == "sha256":
        actual = info.sha256
    elif expected.algorithm == "blake3":
        actual = info.blake3
    else:
        raise InvalidArgument(f"unknown digest algorithm in expected digest {expected}")
    if actual != expected:
        raise IntegrityError(
            f"received bytes do not match: expected {expected}, computed {actual} "
            f"({info.size} bytes)"
        )


# -- chunk lists -------------------------------------------------------------------------------

_MAGIC: Final = b"PVCL"
_VERSION: Final = 1
# magic, version, 3 reserved zero bytes, chunk size, blob size, sha256, blake3
_HEADER = struct.Struct(">4sB3xQQ32s32s")


@dataclass(frozen=True, slots=True)
class ChunkList:
    """The BLAKE3-256 of each `chunk_size` piece of a blob, bound to the blob's digests.

    Encoded form (all integers big-endian)::

        offset  length    field
        0       4         magic b"PVCL"
        4       1         format version, 1
        5       3         zero
        8       8         chunk size in bytes
        16      8         blob size in bytes
        24      32        SHA-256 of the blob
        56      32        BLAKE3-256 of the blob
        88      32 * n    BLAKE3-256 of each chunk, n = ceil(size / chunk size)
        88+32n  32        SHA-256 of every byte before it

    The trailing SHA-256 catches damage to the list itself; it is not a signature, so a chunk
    list is only as trustworthy as the place it was kept.
    """

    chunk_size: int
    size: int
    sha256: Digest
    blake3: Digest
    hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.size < 0:
            raise ValueError(f"bad chunk list: chunk size {self.chunk_size}, size {self.size}")
        if len(self.hashes) != self.count:
            raise ValueError(
                f"bad chunk list: {len(self.hashes)} chunk hashes for {self.size} bytes "
                f"in chunks of {self.chunk_size}, expected {self.count}"
            )

    @property
    def count(self) -> int:
        return -(-self.size // self.chunk_size)

    @property
    def info(self) -> BlobInfo:
        return BlobInfo(self.sha256, self.blake3, self.size)

    def span(self, index: int) -> tuple[int, int]:
        """The byte offset and length of chunk `index`."""
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

    def chunk_range(self, offset: int = 0, length: int | None = None) -> range:
        """The chunk numbers covering bytes [offset, offset + length); length None means to the
        end. A range reaching beyond the blob is refused, naming its size."""
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument(
                f"negative offset or length ({offset}, {length}) for {self.sha256}"
            )
        if offset > self.size:
            raise InvalidArgument(
                f"offset {offset} is beyond the end of {self.sha256} ({self.size} bytes)"
            )
        if length is None:
            length = self.size - offset
        elif offset + length > self.size:
            raise InvalidArgument(
                f"range {offset}+{length} is beyond the end of {self.sha256} ({self.size} bytes)"
            )
        if length == 0:
            return range(0)
        return range(offset // self.chunk_size, (offset + length - 1) // self.chunk_size + 1)

    def check(self, index: int, data: bytes | memoryview) -> bytes:
        """The chunk's hash if `data` is chunk `index` exactly, else IntegrityError naming the
        blob and the chunk's byte offset."""
        offset, length = self.span(index)
        if len(data) != length:
            raise IntegrityError(
                f"stored copy of {self.sha256} is damaged: chunk at byte offset {offset} "
                f"has {len(data)} bytes, expected {length}"
            )
        found = blake3.blake3(data).digest()
        if found != self.hashes[index]:
            raise IntegrityError(
                f"stored copy of {self.sha256} is damaged: chunk at byte offset {offset} "
                f"hashes to {found.hex()}, expected {self.hashes[index].hex()}"
            )
        return found

    def encode(self) -> bytes:
        body = b"".join(
            (
                _HEADER.pack(
                    _MAGIC,
                    _VERSION,
                    self.chunk_size,
                    self.size,
                    self.sha256.raw,
                    self.blake3.raw,
                ),
                *self.hashes,
            )
        )
        return body + hashlib.sha256(body).digest()

    @classmethod
    def decode(cls, data: bytes, expected_sha256: Digest) -> ChunkList:
        """Parse and self-check an encoded chunk list, refusing one that names another blob."""
        where = f"chunk list of {expected_sha256}"
        if len(data) < _HEADER.size + HASH_SIZE:
            raise IntegrityError(f"{where} is damaged: only {len(data)} bytes")
        body, trailer = data[:-HASH_SIZE], data[-HASH_SIZE:]
        if hashlib.sha256(body).digest() != trailer:
            raise IntegrityError(f"{where} is damaged: its trailing SHA-256 does not match")
        magic, version, chunk_size, size, sha_raw, b3_raw = _HEADER.unpack_from(body)
        if magic != _MAGIC or version != _VERSION:
            raise IntegrityError(
                f"{where} is not a version {_VERSION} chunk list "
                f"(found magic {magic!r}, version {version})"
            )
        sha256 = Digest.sha256(sha_raw)
        if sha256 != expected_sha256:
            raise IntegrityError(f"{where} names another blob: {sha256}")
        if chunk_size <= 0:
            raise IntegrityError(f"{where} is damaged: chunk size {chunk_size}")
        count = -(-size // chunk_size)
        hashes_length = len(body) - _HEADER.size
        if hashes_length != count * HASH_SIZE:
            raise IntegrityError(
                f"{where} is damaged: {hashes_length} bytes of chunk hashes, "
                f"expected {count * HASH_SIZE} for {size} bytes"
            )
        hashes = tuple(
            body[start : start + HASH_SIZE] for start in range(_HEADER.size, len(body), HASH_SIZE)
        )
        return cls(chunk_size, size, sha256, Digest.blake3(b3_raw), hashes)


class ChunkHasher:
    """The BLAKE3 of a stream and of each `chunk_size` piece of it, in one pass and on whatever
    thread calls it (the blake3 package releases the GIL while it hashes)."""

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self.size = 0
        self.hashes: list[bytes] = []
        self._whole = blake3.blake3()
        self._chunk = blake3.blake3()
        self._chunk_filled = 0

    def update(self, data: bytes | memoryview) -> None:
        total = len(data)
        if not total:
            return
        self._whole.update(data)
        view = memoryview(data)
        position = 0
        while position < total:
            take = min(total - position, self.chunk_size - self._chunk_filled)
            piece = view[position : position + take]
            if take == self.chunk_size:
                self.hashes.append(blake3.blake3(piece).digest())
            else:
                self._chunk.update(piece)
                self._chunk_filled += take
                if self._chunk_filled == self.chunk_size:
                    self.hashes.append(self._chunk.digest())
                    self._chunk.reset()
                    self._chunk_filled = 0
            position += take
        self.size += total

    def chunk_list(self, sha256: Digest) -> ChunkList:
        """The chunk list of everything hashed so far, given the blob's SHA-256."""
        hashes = list(self.hashes)
        if self._chunk_filled:
            hashes.append(self._chunk.digest())
        return ChunkList(
            self.chunk_size, self.size, sha256, Digest.blake3(self._whole.digest()), tuple(hashes)
        )


class BlobHasher:
    """SHA-256, BLAKE3 and the per-chunk BLAKE3 of one stream of bytes, in one pass.

    SHA-256 runs on a background thread (hashlib releases the GIL on large buffers) while the
    caller's thread does both BLAKE3s, so hashing costs about as much wall time as SHA-256
    alone. The thread starts only once a blob outgrows one batch, so small blobs spawn nothing.
    Bytes handed in are hashed later by that thread: a `bytes` object is kept as is, anything
    mutable is copied first so that the caller may reuse its buffer at once.
    """

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self._chunks = ChunkHasher(chunk_size)
        self._sha = hashlib.sha256()
        self._pending: list[bytes | memoryview] = []
        self._pending_size = 0
        self._queue: queue.Queue[list[bytes | memoryview] | None] | None = None
        self._thread: threading.Thread | None = None
        self._cancelled = False
        self._finished = False

    @property
    def size(self) -> int:
        return self._chunks.size

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._finished:
            raise ValueError("update after the hasher finished")
        view = _stable_view(data)
        if not len(view):
            return
        self._chunks.update(view)
        self._pending.append(view)
        self._pending_size += len(view)
        if self._pending_size >= _SHA_BATCH:
            self._hand_off()

    def finish(self) -> ChunkList:
        """Wait for the SHA-256 thread and return the blob's chunk list."""
        if self._finished:
            raise ValueError("the hasher already finished")
        self._finished = True
        if self._thread is not None:
            self._hand_off()
            self._stop()
        else:
            for piece in self._pending:
                self._sha.update(piece)
            self._pending.clear()
        return self._chunks.chunk_list(Digest.sha256(self._sha.digest()))

    def cancel(self) -> None:
        """Drop whatever is still queued and stop the SHA-256 thread."""
        self._finished = True
        self._cancelled = True
        self._pending.clear()
        if self._thread is not None:
            self._stop()

    def _hand_off(self) -> None:
        if not self._pending:
            return
        batch = self._pending
        if len(batch) > _SHA_MAX_PIECES:
            batch = [b"".join(batch)]
        self._pending = []
        self._pending_size = 0
        if self._queue is None:
            self._queue = queue.Queue(maxsize=SHA_QUEUE_DEPTH)
            self._thread = threading.Thread(
                target=self._run, args=(self._queue,), name="pinvault-sha256", daemon=True
            )
            self._thread.start()
        self._queue.put(batch)

    def _stop(self) -> None:
        assert self._queue is not None and self._thread is not None
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    def _run(self, batches: queue.Queue[list[bytes | memoryview] | None]) -> None:
        sha = self._sha
        while (batch := batches.get()) is not None:
            if not self._cancelled:
                for piece in batch:
                    sha.update(piece)


def _stable_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of `data` that no one can change later: zero-copy for `bytes`."""
    view = memoryview(data)
    if not isinstance(view.obj, bytes) or not view.c_contiguous:
        return memoryview(view.tobytes())
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
