"""The content store with mirrors: every committed put is queued, durably, for its mirror copies
before the put returns, and the replication worker runs beside it; reads go to the store below.
When several servers share one vault, a put also waits for verified copies on the mirrors (the
storage every server reads) before it is acknowledged."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import ReplicationQueue
from mirror.replicate import Replicator, copy_to_mirror
from mirror.uploads import Issued
from tiers.cold import DirectRead, DirectUpload
from vault.digest import Digest
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
    VaultError,
)
from vault.store.chunks import BlobInfo, Chunk, ChunkList
from vault.store.protocol import BlobStore, BlobWriter, Closing, CommitHook, Placed, PlacementRecord


@dataclass(frozen=True, slots=True)
class Adopted:
    """A blob taken in from a client's direct upload: whether the first mirror's copy was
    new, and the mirrors that held a verified copy once it was taken (the others follow from
    the queue)."""

    info: BlobInfo
    created: bool
    mirrors: tuple[str, ...]


# How long a presigned request stays valid by default: a part of a large upload on a slow
# link starts within it, and a client asks for new ones when it runs out.
PRESIGN_SECONDS: Final = 3600


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
        presign_seconds: float = PRESIGN_SECONDS,
    ) -> None:
        self.inner = inner
        # How long the requests handed to a client for a direct transfer stay valid.
        self.presign_seconds = int(presign_seconds)
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
        resume: Sequence[tuple[str, str, str]] = (),
        copies: int = 1,
    ) -> list[tuple[str, DirectUpload]]:
        """Where a client uploads the blob itself: on each of `copies` mirrors (at most the
        blob's replicas; its assigned mirrors first, those last seen down last), a presigned
        PUT that takes only the blob's bytes; or, given `parts` (part size, each part's
        SHA-256), an upload in parts, new or the one `resume` names for that mirror (mirror,
        key, upload id). A mirror that cannot begin an upload is left out, while another can:
        its copy follows from the queue. Encrypted mirrors are never planned (a client would
        put clear bytes there): their copies follow from the queue, sealed; FailedPrecondition
        if every mirror is encrypted."""
        if all(mirror.encrypted for mirror in self.mirrors):
            raise FailedPrecondition(
                "every mirror of this vault is encrypted: no direct upload; stream the bytes "
                "through the vault"
            )
        assigned = [m for m in self.mirrors.assigned(sha256) if not m.encrypted]
        wanted = max(1, min(copies, len(assigned)))
        resumed = {mirror: (key, upload_id) for mirror, key, upload_id in resume}
        # Mirrors resumed keep their uploads: they come first. One the vault no longer has
        # is passed over.
        ordered = [
            self.mirrors.get(name)
            for name in resumed
            if name in self.mirrors.names and not self.mirrors.get(name).encrypted
        ]
        ordered += [
            mirror
            for mirror in self._by_preference(sha256)
            if mirror not in ordered and not mirror.encrypted
        ]
        planned: list[tuple[str, DirectUpload]] = []
        errors: list[str] = []
        for mirror in ordered:
            if len(planned) == wanted:
                break
            try:
                planned.append(
                    (
                        mirror.name,
                        self._plan_one(
                            mirror, sha256, size, expires, parts, resumed.get(mirror.name)
                        ),
                    )
                )
            except Unavailable as error:
                mirror.seen_down(str(error))
                errors.append(f"{mirror.name}: {error}")
        if not planned:
            raise Unavailable("no mirror can take an upload: " + "; ".join(errors))
        # Recorded before the client learns a key: what it never finishes is collected.
        self.queue.uploads.issued(
            Issued(name, upload.key, sha256, upload.upload_id) for name, upload in planned
        )
        return planned

    @staticmethod
    def _plan_one(
        mirror: Mirror,
        sha256: Digest,
        size: int,
        expires: int,
        parts: tuple[int, Sequence[bytes]] | None,
        resume: tuple[str, str] | None,
    ) -> DirectUpload:
        if parts is None:
            return mirror.tier.presign_upload(sha256, size, expires)
        part_size, digests = parts
        if resume is not None:
            try:
                return mirror.tier.presign_parts(
                    sha256, size, part_size, digests, expires, resume=resume
                )
            except NotFound:
                pass  # finished, aborted or expired: begin anew
        return mirror.tier.presign_parts(sha256, size, part_size, digests, expires)

    def adopt_uploads(
        self, sha256: Digest, uploads: Sequence[tuple[str, str, str]], size: int = 0
    ) -> Adopted:
        """Take in a blob a client uploaded, as a put's copies: each of `uploads` (mirror,
        key, upload id) on its own mirror. The first is read back and hashed here; each other
        counts once its store holds it with the first's checksums, which it took only with
        those bytes, so it is not read. Any upload that is not the blob refuses the whole
        (IntegrityError), before anything is stored under the digest; a mirror that cannot be
        reached now is left to the queue. The copies taken are recorded as placements, and
        the rest queued, as for any put. Only uploads the vault handed out for this blob are
        taken: not another blob's object, nor one handed out for other bytes. Returns the blob,
        whether the first mirror's copy is new, and the mirrors that hold a copy now."""
        names = [mirror for mirror, _, _ in uploads]
        if not uploads or len(set(names)) != len(names):
            raise InvalidArgument(
                f"a finished upload names each mirror once, and at least one: {names}"
            )
        mirrors = [self.mirrors.get(name) for name in names]
        for mirror in mirrors:
            if mirror.encrypted:
                raise FailedPrecondition(
                    f"mirror {mirror.name} is encrypted: it takes no direct upload; stream the "
                    "bytes through the vault"
                )
        for mirror, (_, key, _) in zip(mirrors, uploads, strict=True):
            mirror.tier.check_upload_key(key)
        handed = self.queue.uploads.handed_out(sha256, [(name, key) for name, key, _ in uploads])
        for name, key, _ in uploads:
            if (name, key) not in handed:
                raise IntegrityError(
                    f"{key} on mirror {name} is not an upload the vault handed out for "
                    f"{sha256}: refused"
                )
        first, (_, key, upload_id) = mirrors[0], uploads[0]
        checked = first.tier.check_upload(sha256, key, upload_id, size)
        taken = [(first, key)]
        for mirror, (_, key, upload_id) in zip(mirrors[1:], uploads[1:], strict=True):
            try:
                mirror.tier.check_copy(checked, key, upload_id)
            except Unavailable as error:
                mirror.seen_down(str(error))
                continue
            taken.append((mirror, key))
        created = first.tier.install_upload(checked, taken[0][1])
        info = checked.chunks.info
        made = [(sha256, first.name, info.size)]
        installed = [(first.name, taken[0][1])]
        for mirror, key in taken[1:]:
            try:
                mirror.tier.install_upload(checked, key)
            except Unavailable as error:
                mirror.seen_down(str(error))
                continue
            made.append((sha256, mirror.name, info.size))
            installed.append((mirror.name, key))
        self.queue.done_many(made)
        # An upload left out stays recorded: the sweep deletes it unless an index names it.
        self.queue.uploads.adopted(installed)
        self._queue_copies(info)
        return Adopted(info, created, tuple(name for name, _ in installed))

    def plan_read(self, sha256: Digest, expires: int) -> DirectRead:
        """A presigned read of a mirror copy of the blob: NotFound if no mirror has one;
        FailedPrecondition if only encrypted mirrors do (a client cannot read those)."""
        copies = self.queue.copies(sha256)
        errors: list[str] = []
        sealed = [m.name for m in self.mirrors if m.encrypted and m.name in copies]
        for mirror in self._by_preference(sha256):
            if mirror.name not in copies or mirror.encrypted:
                continue
            try:
                return mirror.tier.presign_read(sha256, expires)
            except (NotFound, Unavailable) as error:
                errors.append(f"{mirror.name}: {error}")
        if sealed and not errors:
            raise FailedPrecondition(
                f"{sha256} is kept only on encrypted mirrors ({', '.join(sealed)}), which a "
                "client cannot read directly: stream it through the vault"
            )
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
