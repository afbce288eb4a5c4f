"""The storage protocol every tier implements (hot, warm, cold, and the tier manager over them),
and what any store gets from it: puts of bytes, files and batches, verified ranges, copies."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList

_HEX = re.compile(r"[0-9a-f]{64}")


def require_sha256(digest: Digest) -> str:
    """The hex of a digest that may address a tier: only sha256 does; blake3 is resolved above."""
    if digest.algorithm != "sha256":
        raise InvalidArgument(f"a tier is addressed by sha256 digests, not {digest}")
    if not _HEX.fullmatch(digest.hex):
        raise InvalidArgument(f"malformed digest {digest}: expected 64 lowercase hex digits")
    return digest.hex


# -- the protocol ------------------------------------------------------------------------------


class BlobWriter(Protocol):
    """One blob being stored. Use it as a context manager: leaving the block without a commit,
    or by an exception, aborts the write and leaves nothing behind. A writer that subclasses
    this protocol inherits that behaviour."""

    def write(self, data: bytes | memoryview) -> None:
        """Append bytes, any amount at a time; the caller may reuse its buffer once this
        returns. After commit or abort, ValueError."""
        ...

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        """Make the blob durable and visible; the bool says whether it was newly stored.

        If `expected` (sha256 or blake3) does not match the bytes, raise IntegrityError naming
        both digests, and store nothing.
        """
        ...

    def abort(self) -> None:
        """Drop the write; safe to call more than once, and after commit (then a no-op)."""
        ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


# A small blob of a batch, whole in memory, with the digest (sha256 or blake3) its bytes must
# have, if any.
BatchBlob = tuple[bytes | memoryview, Digest | None]
# What became of one blob of a batch: its info and whether it was newly stored, or the
# IntegrityError that refused it (its bytes do not match its expected digest).
BatchResult = tuple[BlobInfo, bool] | IntegrityError


class CommitHook(BlobWriter):
    """Another store's writer that calls `then(info)` after each commit: how a store that
    wraps others records what it must know of each new blob (a placement, mirror copies to
    make), without a copy of the writer's plumbing each."""

    def __init__(self, inner: BlobWriter, then: Callable[[BlobInfo], None]) -> None:
        self._inner = inner
        self._then = then

    def write(self, data: bytes | memoryview) -> None:
        self._inner.write(data)

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        info, created = self._inner.commit(expected)
        # Also for a blob already stored: what `then` records may not have been recorded (a
        # crash between the commit and it), and recording is idempotent.
        self._then(info)
        return info, created

    def abort(self) -> None:
        self._inner.abort()


class BatchPut:
    """A store that takes many small blobs in one call and shares its durability barriers
    (syncs) among them, where single puts pay one each. Use it through `put_many`.

    A store opts in by subclassing, not by having a method of that name: a wrapper that only
    forwards single puts (a replicating mirror, the tier manager) must not be taken for one,
    since its batch would skip the wrapper's own work, and the warm tier's `put_many` is
    another call (no expected digests, nothing refused blob by blob)."""

    def put_batch(self, blobs: Iterable[BatchBlob]) -> list[BatchResult]:
        """Store every blob whose bytes match its expected digest; one result per blob, in
        order, returned once every stored blob is durable and visible. A refused blob leaves
        nothing behind. `blobs` may be consumed lazily; if iterating it raises, or the store
        fails, the error propagates and nothing of the batch is left but blobs already
        durable in place."""
        raise NotImplementedError


class PlacementRecord(Protocol):
    """What an audit reports of one copy: where it is and when it was last verified."""

    @property
    def tier(self) -> str: ...

    @property
    def last_verified(self) -> float | None: ...


@runtime_checkable
class Placed(Protocol):
    """A store that keeps several copies of a blob and journals them (the tier manager, and
    what wraps it): `vault verify --blobs` reports each copy and the repairs recorded."""

    def placements(self, sha256: Digest) -> Sequence[PlacementRecord]: ...

    def repair_count(self, sha256: Digest) -> int: ...


class Closing:
    """A store that holds resources: `with` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BlobStore(Protocol):
    """Blobs addressed by sha256 digest, each kept with its chunk list. Every byte handed out
    has been checked against the chunk list, and the chunk list against the digest."""

    def writer(self) -> BlobWriter: ...

    def info(self, sha256: Digest) -> BlobInfo | None:
        """The blob's digests and size, or None if it is not stored (or not yet durable)."""
        ...

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        """The digests not stored here, in the order given, each once."""
        ...

    def chunk_list(self, sha256: Digest) -> ChunkList:
        """The blob's verified chunk list; NotFound if the blob is not stored."""
        ...

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        """The whole stored chunks covering [offset, offset + length), each verified before it
        is yielded. NotFound and InvalidArgument (a range beyond the blob) are raised by the
        call itself, IntegrityError by the iteration when a chunk fails."""
        ...

    def verify(self, sha256: Digest) -> BlobInfo:
        """Re-hash the whole stored copy against its digest and chunk list: IntegrityError if
        the bytes are not what the digest says, NotFound if the blob is not stored."""
        ...

    def delete(self, sha256: Digest) -> None:
        """Remove the blob; NotFound if it is not stored."""
        ...

    def digests(self) -> Iterator[Digest]:
        """Every stored blob's sha256 digest."""
        ...


# -- conveniences over any store ---------------------------------------------------------------


def put_bytes(store: BlobStore, data: bytes, *, expected: Digest | None = None) -> BlobInfo:
    with store.writer() as writer:
        writer.write(data)
        info, _ = writer.commit(expected)
    return info


def put_many(store: BlobStore, blobs: Iterable[BatchBlob]) -> list[BatchResult]:
    """Store many small blobs: in one batch where the store takes batches (BatchPut), else one
    writer per blob. Each result is the blob's info and whether it was newly stored, or the
    IntegrityError that refused it; every stored blob is durable when this returns.

    Nothing is stored unless `blobs` can be iterated to its end: a batch store stages every
    blob before it links any, and for any other store the blobs are all taken in first, so
    that a batch whose source fails half-way (a stream cut short) leaves none of them."""
    if isinstance(store, BatchPut):
        return store.put_batch(blobs)
    results: list[BatchResult] = []
    for data, expected in list(blobs):
        with store.writer() as writer:
            writer.write(data)
            try:
                results.append(writer.commit(expected))
            except IntegrityError as refused:
                # The writer stored nothing of it; the rest of the batch goes on.
                results.append(refused)
    return results


def put_file(store: BlobStore, path: Path, *, expected: Digest | None = None) -> BlobInfo:
    """Store a file's bytes, streaming them in chunks: memory stays bounded whatever its size."""
    with path.open("rb", buffering=0) as source, store.writer() as writer:
        while data := source.read(CHUNK_SIZE):
            writer.write(data)
        info, _ = writer.commit(expected)
    return info


def read_range(
    store: BlobStore, sha256: Digest, offset: int = 0, length: int | None = None
) -> Iterator[bytes]:
    """Exactly the bytes [offset, offset + length) of a blob, verified, cut from whole chunks."""
    chunks = store.read(sha256, offset, length)
    end = None if length is None else offset + length

    def trimmed() -> Iterator[bytes]:
        for chunk in chunks:
            start = max(offset - chunk.offset, 0)
            stop = len(chunk.data) if end is None else min(end - chunk.offset, len(chunk.data))
            if start == 0 and stop == len(chunk.data):
                yield chunk.data
            elif stop > start:
                yield chunk.data[start:stop]

    return trimmed()


def copy_blob(source: BlobStore, target: BlobStore, sha256: Digest) -> tuple[BlobInfo, bool]:
    """Stream a blob from one store into another: each chunk checked as it is read, the whole
    against the digest on commit; whether the target had to make it."""
    with target.writer() as writer:
        for chunk in source.read(sha256):
            writer.write(chunk.data)
        return writer.commit(sha256)


def get_bytes(store: BlobStore, sha256: Digest) -> bytes:
    """A whole blob in memory, verified: for tests and small blobs only."""
    return b"".join(read_range(store, sha256))
