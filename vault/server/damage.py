"""The copies the vault knows to be damaged or missing and not repaired since, from the tier
journal (tiers/placements.py), whatever the content store: a tier manager journals what its own
checks find; for a hot tier alone, what `vault verify --blobs` and reads find is journalled (and
logged) here, and the metrics count it from the journal. Admission asks it about a dataset's
files without reading them."""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Final

from vault.digest import Digest
from vault.server.assembly import manager_of
from vault.store.protocol import BlobStore, Closing

if TYPE_CHECKING:
    from tiers.placements import Journal

log = logging.getLogger("pinvault")

# The counts of damage the metrics export (vault/server/metrics.py), as the tier manager keeps
# them in RepairStats: copies found damaged or missing, rewritten from a good copy, with no good
# copy anywhere, and rewrites that failed.
DAMAGE_COUNTS: Final = ("faults", "repaired", "unrepairable", "failed_rewrites")


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
            where, self._tier, host = store.journaled_as
            self._journal = Journal(where, host=host)

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

    def found_damaged(self, sha256: Digest, found: str, *, again: bool = True) -> None:
        """A check found the blob's one copy damaged or missing: for a lone tier, which has no
        other copy to repair it from, journalled as lost and logged (a tier manager journals
        its own). With `again` false (a read), damage already known and not repaired since is
        nothing new: neither journalled nor logged once more."""
        if self._tier is None or self._journal is None:
            return
        from tiers.placements import LOST

        if not again and self._journal.damaged([sha256]):
            return
        log.warning(
            "damaged copy of %s on tier %s, with no other copy to repair it from: %s",
            sha256,
            self._tier,
            found,
        )
        self._journal.record(sha256, self._tier, None, found, LOST)

    def counts(self) -> dict[str, int] | None:
        """For a lone tier, the damage its journal holds, named as DAMAGE_COUNTS: what every
        process working on the tier found (reads, `vault verify --blobs`, `vault scrub`, puts
        that rewrote a damaged copy, `vault repair`), since the journal began. None when the
        store keeps its own counts (a tier manager's RepairStats) or journals nothing."""
        if self._tier is None or self._journal is None:
            return None
        from tiers.placements import LOST, REWRITE_FAILED, unrepaired

        rows = self._journal.query(
            "SELECT action, count(*) FROM damage_journal WHERE tier = :tier GROUP BY action",
            {"tier": self._journal.stored_tier(self._tier)},
        )
        counts = dict.fromkeys(DAMAGE_COUNTS, 0)
        for action, count in rows:
            failed_rewrite = action.startswith(REWRITE_FAILED)
            # A rewrite that failed is journalled beside the fault it tried to repair.
            counts["faults"] += 0 if failed_rewrite else int(count)
            counts["failed_rewrites"] += int(count) if failed_rewrite else 0
            counts["unrepairable"] += int(count) if action == LOST else 0
            counts["repaired"] += 0 if unrepaired(action) else int(count)
        return counts

    def found_intact(self, sha256: Digest, size: int) -> None:
        """A check found the blob's copy intact again (rewritten since it was found damaged):
        for a lone tier, the copy is recorded as verified now, which ends the known damage."""
        if self._tier is not None and self._journal is not None:
            self._journal.place(sha256, self._tier, size=size, verified=time.time())
