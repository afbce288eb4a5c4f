"""The content store with mirrors: every committed put is queued, durably, for its mirror copies
before the put returns, and the replication worker runs beside it; reads go to the store below.
When several servers share one vault, a put also waits for verified copies on the mirrors (the
storage every server reads) before it is acknowledged."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import ReplicationQueue
from mirror.replicate import Replicator, copy_to_mirror
from tiers.cold import DirectRead, DirectUpload
from vault.digest import Digest
from vault.errors import NotFound, Unavailable, VaultError
from vault.store.chunks import BlobInfo, Chunk, ChunkList
from vault.store.protocol import BlobStore, BlobWriter, Closing, CommitHook, Placed, PlacementRecord


class ReplicatingStore(Closing, BlobStore):
    """`inner` (the tier manager over hot and the mirrors) plus replication. A put is
    acknowledged only once its copies are in the queue, so a crash after the
    acknowledgement cannot lose them; the copies themselves are made in the background.

    With `acknowledged` > 0, a put is acknowledged only once that many mirrors hold a copy
    verified as it was written (the first of the blob's assigned mirrors that answer, then the
    others): what the vault catalogues is then on storage every server of the vault reads, and
    no crash of this host can lose it. The rest of its copies follow from the queue."""

    def __init__(
        self,
        inner: BlobStore,
        mirrors: MirrorSet,
        queue: ReplicationQueue,
        replicator: Replicator,
        *,
        acknowledged: int = 0,
    ) -> None:
        self.inner = inner
        self.mirrors = mirrors
        self.queue = queue
        self.replicator = replicator
        self.acknowledged = min(acknowledged, len(list(mirrors)))

    def close(self) -> None:
        self.replicator.close()
        self.queue.close()
        if isinstance(self.inner, Closing):
            self.inner.close()
        self.mirrors.close()

    def writer(self) -> BlobWriter:
        return CommitHook(self.inner.writer(), self._queue_copies)

    def _queue_copies(self, info: BlobInfo) -> None:
        assigned = list(self.mirrors.assigned(info.sha256))
        if self.acknowledged:
            self._copy_now(info, assigned)
        names = [mirror.name for mirror in assigned]
        if self.queue.enqueue([(info.sha256, info.size, names)]):
            self.replicator.notify(names)

    def _copy_now(self, info: BlobInfo, assigned: Sequence[Mirror]) -> None:
        """Make `acknowledged` verified mirror copies of the blob before its put returns,
        assigned mirrors first; Unavailable, naming each mirror's error, if they cannot be
        made (the put is then not acknowledged: its local copy stays, uncatalogued)."""
        have = self.queue.copies(info.sha256)
        if len(have) >= self.acknowledged:
            return
        others = [mirror for mirror in self.mirrors if mirror not in assigned]
        errors: list[str] = []
        for mirror in [*assigned, *others]:
            if mirror.name in have:
                continue
            try:
                size = copy_to_mirror(self.inner, mirror, info.sha256, info.size)
            except VaultError as error:
                errors.append(f"{mirror.name}: {error}")
                continue
            self.queue.done(info.sha256, mirror.name, size)
            have.add(mirror.name)
            if len(have) >= self.acknowledged:
                return
        raise Unavailable(
            f"{info.sha256} is stored on this server but not acknowledged: "
            f"{len(have)} of the {self.acknowledged} mirror copies every server needs could be "
            "made (" + "; ".join(errors) + ")"
        )

    # -- bytes straight to and from the mirrors ------------------------------------------------

    def _by_preference(self, sha256: Digest) -> list[Mirror]:
        """The blob's assigned mirrors, then the others; those last seen down go last."""
        assigned = self.mirrors.assigned(sha256)
        ordered = [*assigned, *(m for m in self.mirrors if m not in assigned)]
        return sorted(ordered, key=lambda mirror: mirror.health.reachable is False)

    def plan_upload(
        self,
        sha256: Digest,
        size: int,
        expires: int,
        *,
        parts: tuple[int, Sequence[bytes]] | None = None,
        resume: tuple[str, str, str] | None = None,
    ) -> tuple[str, DirectUpload]:
        """Where a client uploads the blob itself: a presigned PUT on the first of its
        mirrors, which takes only the blob's bytes; or, given `parts` (part size, each part's
        SHA-256), an upload in parts, new or the one `resume` names (mirror, key, upload id)."""
        if resume is not None:
            mirror = self.mirrors.get(resume[0])
        else:
            mirror = self._by_preference(sha256)[0]
        if parts is None:
            return mirror.name, mirror.tier.presign_upload(sha256, size, expires)
        part_size, digests = parts
        return mirror.name, mirror.tier.presign_parts(
            sha256,
            size,
            part_size,
            digests,
            expires,
            resume=None if resume is None else (resume[1], resume[2]),
        )

    def adopt_upload(
        self, sha256: Digest, mirror: str, key: str, upload_id: str = "", size: int = 0
    ) -> tuple[BlobInfo, bool]:
        """Take in a blob a client uploaded to `mirror` (read back and verified there), as a
        put's copy: recorded as a placement, with the acknowledged copies made and the rest
        queued, as for any put."""
        found = self.mirrors.get(mirror)
        info, created = found.tier.adopt_upload(sha256, key, upload_id, size)
        self.queue.done(sha256, found.name, info.size)
        self._queue_copies(info)
        return info, created

    def plan_read(self, sha256: Digest, expires: int) -> DirectRead:
        """A presigned read of a mirror copy of the blob: NotFound if no mirror has one."""
        copies = self.queue.copies(sha256)
        errors: list[str] = []
        for mirror in self._by_preference(sha256):
            if mirror.name not in copies:
                continue
            try:
                return mirror.tier.presign_read(sha256, expires)
            except (NotFound, Unavailable) as error:
                errors.append(f"{mirror.name}: {error}")
        raise NotFound(
            f"{sha256} has no mirror copy to read directly"
            + (f" ({'; '.join(errors)})" if errors else "")
            + ": read it through the vault"
        )

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
