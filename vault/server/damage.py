"""The copies the vault knows to be damaged or missing and not repaired since, from the tier
journal (tiers/placements.py), whatever the content store: a tier manager journals what its own
checks find; for a hot tier alone, what `vault verify --blobs` finds is journalled here. Admission
asks it about a dataset's files without reading them."""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from vault.digest import Digest
from vault.server.assembly import manager_of
from vault.store.protocol import BlobStore, Closing

if TYPE_CHECKING:
    from tiers.placements import Journal


class KnownDamage(Closing):
    """The tier journal of `store`: its tier manager's, or the one a lone hot tier journals its
    repairs in (then opened here, and closed with this); with neither, nothing is known."""

    def __init__(self, store: BlobStore) -> None:
        from tiers.hot import HotTier
        from tiers.placements import Journal

        self._journal: Journal | None = None
        # The lone tier whose checks are journalled here; None when the store journals its own.
        self._tier: str | None = None
        manager = manager_of(store)
        if manager is not None:
            self._journal = manager.journal
        elif isinstance(store, HotTier) and store.journaled_as is not None:
            path, self._tier = store.journaled_as
            self._journal = Journal(path)

    def close(self) -> None:
        if self._tier is not None and self._journal is not None:
            self._journal.close()

    def damaged(self, digests: Iterable[Digest]) -> set[Digest]:
        """Those of these sha256 digests whose every copy is known damaged or missing and not
        repaired since (see Journal.damaged); cheap, and no copy is read."""
        return set() if self._journal is None else self._journal.damaged(digests)

    def damaged_among(self, sha256s: Container[bytes]) -> set[bytes]:
        """`damaged` of SHA-256 digests given raw (a manifest's million files): only the few
        the journal suspects are looked for among them and checked."""
        if self._journal is None:
            return set()
        suspects = [
            digest
            for text in self._journal.suspected()
            if (digest := Digest.parse(text)).algorithm == "sha256" and digest.raw in sha256s
        ]
        return {d.raw for d in self.damaged(suspects)} if suspects else set()

    def found_damaged(self, sha256: Digest, found: str) -> None:
        """A check found the blob's one copy damaged or missing: journalled as lost for a lone
        tier, which has no other copy to repair it from (a tier manager journals its own)."""
        if self._tier is not None and self._journal is not None:
            from tiers.placements import LOST

            self._journal.record(sha256, self._tier, None, found, LOST)

    def found_intact(self, sha256: Digest, size: int) -> None:
        """A check found the blob's copy intact again (rewritten since it was found damaged):
        for a lone tier, the copy is recorded as verified now, which ends the known damage."""
        if self._tier is not None and self._journal is not None:
            self._journal.place(sha256, self._tier, size=size, verified=time.time())
