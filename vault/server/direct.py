"""Bytes straight between clients and the object store: the vault hands a writer presigned PUTs
of one blob to one or more of its mirrors, each taking only bytes with the blob's SHA-256, and
adopts what was uploaded once it has read one copy back and verified it, and found the store to
hold each other copy with the same checksums; and hands a reader a presigned GET of a mirror
copy, which the client verifies as it does every read. The vault handles names and proofs; the
bytes pass through it once on their way in, to be verified (no digest is catalogued on the
client's word), and never on their way out or to the other mirrors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument
from vault.server.content import Content, StoredBlob

# The mirror modules (and botocore under them) load only when a store has mirrors.
if TYPE_CHECKING:
    from mirror.store import ReplicatingStore
    from tiers.cold import DirectRead, DirectUpload

# The most mirrors one request names (uploads to resume, copies finished): a vault has a few.
MAX_DIRECT_COPIES: Final = 16


@dataclass(frozen=True, slots=True)
class Planned:
    """What a client asks to upload: the blob, and for an upload in parts, the part size and
    each part's SHA-256, and the uploads to resume (mirror, key, upload id) if any; and on how
    many mirrors it uploads the same bytes."""

    sha256: Digest
    size: int
    parts: tuple[int, Sequence[bytes]] | None = None
    resume: Sequence[tuple[str, str, str]] = ()
    copies: int = 1


class DirectTransfers:
    """The direct transfers of a vault whose content store has mirrors."""

    def __init__(self, content: Content) -> None:
        self.content = content

    def _mirrored(self) -> ReplicatingStore:
        from mirror.store import ReplicatingStore

        store = self.content.store
        if not isinstance(store, ReplicatingStore):
            raise FailedPrecondition(
                "direct transfers go to and from the vault's mirrors, and it has none: "
                "stream the bytes through the vault"
            )
        return store

    @property
    def expires(self) -> int:
        """How long the requests of a plan stay valid (`mirrors.presign_seconds`)."""
        return self._mirrored().presign_seconds

    def plan_put(self, request: Planned) -> StoredBlob | list[tuple[str, DirectUpload]]:
        """The blob as stored already, or the mirrors and presigned uploads to upload it
        with, the first of them the copy the vault reads back."""
        _require_sha256(request.sha256)
        store = self._mirrored()
        found = self.content.find(request.sha256)
        if found is not None and found.info.size == request.size:
            return found
        return store.plan_upload(
            request.sha256,
            request.size,
            store.presign_seconds,
            parts=request.parts,
            resume=request.resume,
            copies=request.copies,
        )

    def finish_put(
        self, sha256: Digest, uploads: Sequence[tuple[str, str, str]], size: int = 0
    ) -> tuple[StoredBlob, bool, tuple[str, ...]]:
        """Adopt the uploads (mirror, key, upload id) of one blob, verified on the way, and
        catalogue it; the blob, whether it is new, and the mirrors holding a copy now."""
        _require_sha256(sha256)
        adopted = self._mirrored().adopt_uploads(sha256, uploads, size)
        stored_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return self.content.adopt(adopted.info, stored_at), adopted.created, adopted.mirrors

    def plan_get(self, digest: Digest) -> tuple[StoredBlob, DirectRead]:
        """The blob and a presigned read of one of its mirror copies."""
        blob = self.content.get(digest)
        store = self._mirrored()
        return blob, store.plan_read(blob.info.sha256, store.presign_seconds)


def _require_sha256(digest: Digest) -> None:
    if digest.algorithm != "sha256":
        raise InvalidArgument(f"a direct upload is named by its SHA-256, not {digest}")
