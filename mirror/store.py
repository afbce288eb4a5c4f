"""The content store with mirrors: every committed put is queued, durably, for its mirror copies
before the put returns, and the replication worker runs beside it; reads go to the store below."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import ReplicationQueue
from mirror.replicate import Replicator
from vault.digest import Digest
from vault.errors import NotFound, Unavailable
from vault.store.chunks import BlobInfo, Chunk, ChunkList
from vault.store.protocol import BlobStore, BlobWriter, Closing, CommitHook, Placed, PlacementRecord


class ReplicatingStore(Closing, BlobStore):
    """`inner` (the tier manager over hot and the mirrors) plus replication. A put is
    acknowledged only once its copies are in the queue, so a crash after the
    acknowledgement cannot lose them; the copies themselves are made in the background."""

    def __init__(
        self,
        inner: BlobStore,
        mirrors: MirrorSet,
        queue: ReplicationQueue,
        replicator: Replicator,
    ) -> None:
        self.inner = inner
        self.mirrors = mirrors
        self.queue = queue
        self.replicator = replicator

    def close(self) -> None:
        self.replicator.close()
        self.queue.close()
        if isinstance(self.inner, Closing):
            self.inner.close()
        self.mirrors.close()

    def writer(self) -> BlobWriter:
        return CommitHook(self.inner.writer(), self._queue_copies)

    def _queue_copies(self, info: BlobInfo) -> None:
        names = [mirror.name for mirror in self.mirrors.assigned(info.sha256)]
        if self.queue.enqueue([(info.sha256, info.size, names)]):
            self.replicator.notify(names)

    def info(self, sha256: Digest) -> BlobInfo | None:
        return self.inner.info(sha256)

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        return self.inner.find_missing(digests)

    def chunk_list(self, sha256: Digest) -> ChunkList:
        return self.inner.chunk_list(sha256)

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        return self.inner.read(sha256, offset, length)

    def verify(self, sha256: Digest) -> BlobInfo:
        return self.inner.verify(sha256)

    def delete(self, sha256: Digest) -> None:
        self.inner.delete(sha256)

    def placements(self, sha256: Digest) -> Sequence[PlacementRecord]:
        return self.inner.placements(sha256) if isinstance(self.inner, Placed) else []

    def repair_count(self, sha256: Digest) -> int:
        return self.inner.repair_count(sha256) if isinstance(self.inner, Placed) else 0

    def digests(self) -> Iterator[Digest]:
        return self.inner.digests()


class MirrorUnreachable(NotFound, Unavailable):
    """A mirror that cannot be reached: a NotFound, so that a read or a check goes on to the
    next copy, and an Unavailable, so that its copy is not taken for missing (and rewritten,
    or reported lost) when it is only out of reach."""


class MirrorReads(BlobStore):
    """A mirror as one tier of the tier manager, for reads: a mirror that cannot be reached
    answers MirrorUnreachable, as if it lacked the blob, so that a read or a check goes on to
    the next copy instead of failing; damage (IntegrityError) still surfaces, so it is
    repaired."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    def writer(self) -> BlobWriter:
        return self.mirror.tier.writer()

    def info(self, sha256: Digest) -> BlobInfo | None:
        try:
            return self.mirror.tier.info(sha256)
        except Unavailable as error:
            self.mirror.seen_down(str(error))
            return None

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        wanted = list(digests)
        try:
            return self.mirror.tier.find_missing(wanted)
        except Unavailable as error:
            self.mirror.seen_down(str(error))
            return list(dict.fromkeys(wanted))

    def chunk_list(self, sha256: Digest) -> ChunkList:
        try:
            return self.mirror.tier.chunk_list(sha256)
        except Unavailable as error:
            raise self._down(error) from None

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        try:
            chunks = self.mirror.tier.read(sha256, offset, length)
        except Unavailable as error:
            raise self._down(error) from None
        return self._reading(chunks)

    def _reading(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        try:
            yield from chunks
        except Unavailable as error:
            raise self._down(error) from None

    def verify(self, sha256: Digest) -> BlobInfo:
        try:
            return self.mirror.tier.verify(sha256)
        except Unavailable as error:
            raise self._down(error) from None

    def delete(self, sha256: Digest) -> None:
        self.mirror.tier.delete(sha256)

    def digests(self) -> Iterator[Digest]:
        try:
            yield from self.mirror.tier.digests()
        except Unavailable as error:
            self.mirror.seen_down(str(error))

    def _down(self, error: Unavailable) -> MirrorUnreachable:
        self.mirror.seen_down(str(error))
        return MirrorUnreachable(f"mirror {self.mirror.name} cannot be reached: {error}")
