"""The tier manager: one BlobStore over an ordered list of tiers that checks every copy it reads,
serves a read on from a good copy when one is damaged, rewrites the damaged copy and journals it
in the placement record (tiers/placements.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiers.hot import HotTier
from tiers.placements import LOST, REWRITE_FAILED, Journal, Placement
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound, Unavailable, VaultError
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList
from vault.store.protocol import (
    BlobStore,
    BlobWriter,
    Closing,
    CommitHook,
    copy_blob,
    require_sha256,
)

log = logging.getLogger("pinvault.tiers")


@dataclass(slots=True)
class RepairStats:
    """Counts since the manager was opened: copies found damaged or missing, copies rewritten
    from a good one, copies with no good copy anywhere, and rewrites that failed."""

    faults: int = 0
    repaired: int = 0
    unrepairable: int = 0
    failed_rewrites: int = 0


@dataclass(frozen=True, slots=True)
class ScrubReport:
    checked: int
    faults: int
    repaired: int
    unrepairable: int


@dataclass(slots=True)
class _Fault:
    tier: int
    offset: int | None
    found: str


@dataclass(slots=True)
class _Outcome:
    info: BlobInfo | None = None
    faults: list[_Fault] = field(default_factory=list)
    repaired: int = 0


class TierManager(Closing):
    """A BlobStore over named tiers, first tier first. Writes go to the first tier; a read is
    served by the first tier holding a copy, and when that copy fails its check (or vanishes)
    the same read goes on, from the exact chunk that failed, out of a good copy elsewhere,
    after the damaged copy has been rewritten from it.

    A damaged copy is deleted only once another tier's copy has passed a full verify, so a
    blob never loses its last copy, even a damaged one, to a repair. The journal also keeps
    the placement record: the copies this manager has made or seen verified, and those mirror
    replication made, so that a copy missing from a tier that should hold it counts as a fault
    rather than as "never there".
    """

    def __init__(
        self,
        tiers: Sequence[tuple[str, BlobStore]],
        *,
        journal: Path | Journal,
        promote: bool = False,
        owned: Sequence[Closing] = (),
    ) -> None:
        if not tiers:
            raise InvalidArgument("a tier manager needs at least one tier")
        names = [name for name, _ in tiers]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must differ, found {names}")
        self.names = names
        self.tiers = [tier for _, tier in tiers]
        # The placement record, given open or as its SQLite file; closed with the manager.
        self.journal = journal if isinstance(journal, Journal) else Journal(journal)
        for name, tier in tiers:
            if isinstance(tier, HotTier):
                tier.rebuilt = functools.partial(self._chunk_list_rebuilt, name)
                tier.repairing = functools.partial(self._repairing, name)
        self.stats = RepairStats()
        self._stats_lock = threading.Lock()
        # Two reads finding the same damage must not both delete and rewrite the copy; the
        # migration worker takes it too, so that a repair never races a move.
        self._repair_lock = threading.RLock()
        # With `promote`, a whole read served from a later tier puts a copy back in the first
        # one, on a thread of its own so that the read does not wait for it.
        self.promote = promote
        # Tiers this manager closes when it is closed.
        self._owned = list(owned)
        self._promotions: set[Digest] = set()
        self._promotion_queue: queue.SimpleQueue[Digest | None] = queue.SimpleQueue()
        self._promoter: threading.Thread | None = None
        self._promoter_lock = threading.Lock()

    @property
    def repair_lock(self) -> threading.RLock:
        """Held by whoever checks, repairs or moves a blob's copies."""
        return self._repair_lock

    def close(self) -> None:
        with self._promoter_lock:
            promoter, self._promoter = self._promoter, None
        if promoter is not None:
            self._promotion_queue.put(None)
            promoter.join()
        self.journal.close()
        for tier in self._owned:
            tier.close()

    # -- the BlobStore protocol --------------------------------------------------------------

    def writer(self) -> BlobWriter:
        return CommitHook(
            self.tiers[0].writer(),
            # The commit hashed every byte as it was written: the copy is verified as of now.
            lambda info: self.journal.place(
                info.sha256, self.names[0], size=info.size, verified=time.time()
            ),
        )

    def info(self, sha256: Digest) -> BlobInfo | None:
        damage: IntegrityError | None = None
        for tier in self.tiers:
            try:
                found = tier.info(sha256)
            except IntegrityError as error:
                damage = damage or error
                continue
            if found is not None:
                return found
        if damage is not None:
            raise damage
        return None

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        missing = list(dict.fromkeys(digests))
        for tier in self.tiers:
            if not missing:
                break
            missing = tier.find_missing(missing)
        return missing

    def chunk_list(self, sha256: Digest) -> ChunkList:
        damage: IntegrityError | None = None
        for tier in self.tiers:
            try:
                return tier.chunk_list(sha256)
            except NotFound:
                continue
            except IntegrityError as error:
                damage = damage or error
        if damage is not None:
            raise damage
        raise NotFound(f"blob {sha256} is on no tier")

    def digests(self) -> Iterator[Digest]:
        seen: set[Digest] = set()
        for tier in self.tiers:
            for digest in tier.digests():
                if digest not in seen:
                    seen.add(digest)
                    yield digest

    def delete(self, sha256: Digest) -> None:
        require_sha256(sha256)
        removed = False
        for tier in self.tiers:
            try:
                tier.delete(sha256)
                removed = True
            except NotFound:
                pass
        self.journal.unplace(sha256)
        if not removed:
            raise NotFound(f"blob {sha256} is on no tier")

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        require_sha256(sha256)
        # Every tier cuts blobs into chunks of CHUNK_SIZE, so this is where the first chunk of
        # the range starts whichever copy serves it.
        first = offset - offset % CHUNK_SIZE if offset >= 0 else offset
        faults: list[_Fault] = []
        chosen: tuple[int, Iterator[Chunk]] | None = None
        placed = self.journal.placed(sha256)
        for index, tier in enumerate(self.tiers):
            try:
                chosen = index, tier.read(sha256, offset, length)
                break
            except NotFound as error:
                if _missing(error) and self.names[index] in placed:
                    faults.append(_Fault(index, first, f"missing: {error}"))
            except IntegrityError as error:
                faults.append(_Fault(index, first, str(error)))
        if faults:
            source = self._recover(sha256, faults, excluded=set())
            chosen = source, self.tiers[source].read(sha256, offset, length)
        if chosen is None:
            raise NotFound(f"blob {sha256} is on no tier")
        self.journal.note_read(sha256, self.names[chosen[0]])
        return self._serve(sha256, offset, length, *chosen)

    def verify(self, sha256: Digest) -> BlobInfo:
        """Verify every copy on every tier and rewrite each damaged or missing one from a good
        one: IntegrityError if no tier has a good copy, NotFound if no tier has any."""
        outcome = self._check(sha256)
        if outcome.info is None:
            if not outcome.faults:
                raise NotFound(f"blob {sha256} is on no tier")
            raise _data_loss(sha256, self.names, outcome.faults)
        return outcome.info

    # -- beyond the protocol -----------------------------------------------------------------

    def scrub(self, progress: Callable[[Digest], None] | None = None) -> ScrubReport:
        """Verify (and repair) every blob on every tier, and every blob this manager placed."""
        checked = faults = repaired = unrepairable = 0
        for sha256 in dict.fromkeys([*self.digests(), *self.journal.placed_digests()]):
            outcome = self._check(sha256)
            checked += 1
            faults += len(outcome.faults)
            repaired += outcome.repaired
            if outcome.info is None:
                unrepairable += len(outcome.faults)
            if progress is not None:
                progress(sha256)
        return ScrubReport(checked, faults, repaired, unrepairable)

    # -- inside ------------------------------------------------------------------------------

    def _serve(
        self,
        sha256: Digest,
        offset: int,
        length: int | None,
        index: int,
        chunks: Iterator[Chunk] | None,
    ) -> Iterator[Chunk]:
        """Yield chunks from `chunks`; when the copy fails, repair it and resume at the chunk
        that failed from the good copy, so each chunk reaches the caller once."""
        end = None if length is None else offset + length
        resume = offset
        served = False
        recoveries = 0
        excluded: set[int] = set()
        while True:
            try:
                if chunks is None:
                    chunks = self.tiers[index].read(
                        sha256, resume, None if end is None else end - resume
                    )
                for chunk in chunks:
                    yield chunk
                    resume = chunk.offset + len(chunk.data)
                    served = True
                if index != 0 and self.promote:
                    self._promote_later(sha256)
                return
            except (IntegrityError, NotFound) as error:
                excluded.add(index)
                recoveries += 1
                if isinstance(error, NotFound) and (
                    not _missing(error) or self.names[index] not in self.journal.placed(sha256)
                ):
                    # The migration worker moved this copy away after the read found it, or
                    # its mirror went out of reach: not damage, so the read goes on from
                    # another copy and nothing is rewritten.
                    if recoveries > 2 * len(self.tiers):
                        raise
                    index = self._next_holder(sha256, excluded)
                    chunks = None
                    continue
                found = str(error) if isinstance(error, IntegrityError) else f"missing: {error}"
                at = resume if served else resume - resume % CHUNK_SIZE
                if recoveries > 2 * len(self.tiers):
                    # Copies that verify yet fail when read (a failing disk): give up rather
                    # than go round the tiers for ever.
                    raise IntegrityError(
                        f"reading {sha256} failed {recoveries} times, last at byte offset "
                        f"{at}: {found}"
                    ) from error
                index = self._recover(sha256, [_Fault(index, at, found)], excluded)
                chunks = None
                if end is not None and resume >= end and served:
                    return

    def _next_holder(self, sha256: Digest, excluded: set[int]) -> int:
        """The first tier not excluded that holds a copy."""
        for index, tier in enumerate(self.tiers):
            if index not in excluded and not tier.find_missing([sha256]):
                return index
        raise NotFound(f"blob {sha256} is on no tier")

    def _promote_later(self, sha256: Digest) -> None:
        with self._promoter_lock:
            if sha256 in self._promotions:
                return
            self._promotions.add(sha256)
            if self._promoter is None:
                self._promoter = threading.Thread(
                    target=self._run_promotions, name="tier-promote", daemon=True
                )
                self._promoter.start()
        self._promotion_queue.put(sha256)

    def _run_promotions(self) -> None:
        while (sha256 := self._promotion_queue.get()) is not None:
            try:
                self.promote_now(sha256)
            except (VaultError, OSError) as error:
                log.warning("could not promote %s to %s: %s", sha256, self.names[0], error)
            finally:
                with self._promoter_lock:
                    self._promotions.discard(sha256)

    def promote_now(self, sha256: Digest) -> bool:
        """Copy a blob into the first tier from the first later tier whose copy reads whole
        (each chunk checked as read, the digest on commit); False if it was already there."""
        first = self.tiers[0]
        if not first.find_missing([sha256]):
            return False
        error: Exception | None = None
        for index in range(1, len(self.tiers)):
            try:
                info, _ = copy_blob(self.tiers[index], first, sha256)
            except (NotFound, IntegrityError) as failed:
                error = error or failed
                continue
            self.journal.place(
                sha256, self.names[0], size=info.size, last_read=time.time(), verified=time.time()
            )
            log.info("promoted %s to %s from %s", sha256, self.names[0], self.names[index])
            return True
        raise error or NotFound(f"blob {sha256} is on no tier")

    def placements(self, sha256: Digest) -> list[Placement]:
        """The blob's copies as journaled: where each is and when it was last verified."""
        self.journal.flush_reads()
        return self.journal.placements(sha256)

    def damaged(self, digests: Iterable[Digest]) -> set[Digest]:
        """Those of these sha256 digests whose every copy is known damaged or missing and not
        repaired since, as the journal records (see Journal.damaged): no tier is read."""
        return self.journal.damaged(digests)

    def repair_count(self, sha256: Digest) -> int:
        """How many damaged or missing copies of the blob the journal records."""
        return len(self.journal.records(sha256))

    def adopt(self, names: Iterable[str] | None = None) -> int:
        """Journal every copy on the named tiers (default: all) that the journal does not
        know, such as blobs stored before the journal kept placements; returns how many."""
        wanted = set(self.names if names is None else names)
        known: dict[str, set[Digest]] = {}
        for placement in self.journal.placements():
            known.setdefault(placement.tier, set()).add(placement.digest)
        adopted = 0
        for name, tier in zip(self.names, self.tiers, strict=True):
            if name not in wanted:
                continue
            for digest in tier.digests():
                if digest in known.get(name, ()):
                    continue
                info = tier.info(digest)
                if info is None:
                    continue
                self.journal.place(digest, name, size=info.size)
                adopted += 1
        return adopted

    def _recover(self, sha256: Digest, faults: list[_Fault], excluded: set[int]) -> int:
        """Rewrite every faulty copy from the first other tier whose copy verifies, and return
        that tier; if none does, journal the loss and raise IntegrityError (DATA_LOSS)."""
        with self._repair_lock:
            # Another read may have found the same damage and rewritten the copy while this
            # one waited for the lock; rewriting it again would only churn.
            rewritten = [fault.tier for fault in faults if self._intact(fault.tier, sha256)]
            for index in rewritten:
                if index not in excluded:
                    return index
            bad = {fault.tier for fault in faults}
            faults = [fault for fault in faults if fault.tier not in rewritten]
            self._count(faults=len(faults))
            placed = self.journal.placed(sha256)
            for index, tier in enumerate(self.tiers):
                if index in bad or index in excluded:
                    continue
                try:
                    tier.verify(sha256)
                except NotFound as error:
                    if not _missing(error) or self.names[index] not in placed:
                        continue
                    fault = _Fault(index, None, f"missing: {error}")
                except IntegrityError as error:
                    fault = _Fault(index, self._first_bad_offset(tier, sha256), str(error))
                else:
                    self._rewrite_all(sha256, faults, index)
                    return index
                faults.append(fault)
                bad.add(index)
                self._count(faults=1)
            if rewritten and not faults:
                return rewritten[0]
            self._record_loss(sha256, faults)
            raise _data_loss(sha256, self.names, faults)

    def _check(self, sha256: Digest) -> _Outcome:
        require_sha256(sha256)
        with self._repair_lock:
            outcome = _Outcome()
            placed = self.journal.placed(sha256)
            good: list[int] = []
            for index, tier in enumerate(self.tiers):
                try:
                    info = tier.verify(sha256)
                except NotFound as error:
                    if _missing(error) and self.names[index] in placed:
                        outcome.faults.append(_Fault(index, None, f"missing: {error}"))
                    continue
                except IntegrityError as error:
                    offset = self._first_bad_offset(tier, sha256)
                    outcome.faults.append(_Fault(index, offset, str(error)))
                    continue
                outcome.info = outcome.info or info
                good.append(index)
                self.journal.place(sha256, self.names[index], size=info.size, verified=time.time())
            self._count(faults=len(outcome.faults))
            if not outcome.faults:
                return outcome
            if not good:
                self._record_loss(sha256, outcome.faults)
                return outcome
            outcome.repaired = self._rewrite_all(sha256, outcome.faults, good[0])
            return outcome

    def _rewrite_all(self, sha256: Digest, faults: list[_Fault], source: int) -> int:
        """Rewrite each faulty copy from `source`, a tier whose copy just verified."""
        repaired = 0
        for fault in faults:
            target, name = self.tiers[fault.tier], self.names[fault.tier]
            log.warning(
                "damaged copy of %s on tier %s, rewritten from %s: %s",
                sha256,
                name,
                self.names[source],
                fault.found,
            )
            # Recorded before the damaged copy is deleted, so that a crash in between leaves
            # a trace of the deletion.
            self.journal.record(
                sha256,
                name,
                fault.offset,
                fault.found,
                f"deleted the damaged copy and rewrote it from {self.names[source]}",
            )
            try:
                with contextlib.suppress(NotFound):
                    target.delete(sha256)
                info, _ = copy_blob(self.tiers[source], target, sha256)
            except (VaultError, OSError) as error:
                self.journal.record(
                    sha256, name, fault.offset, fault.found, f"{REWRITE_FAILED}: {error}"
                )
                self._count(failed_rewrites=1)
                continue
            self.journal.place(sha256, name, size=info.size, verified=time.time())
            self._count(repaired=1)
            repaired += 1
        return repaired

    def _chunk_list_rebuilt(self, name: str, sha256: Digest, found: str) -> None:
        self.journal.record(
            sha256, name, None, found, "chunk list rebuilt from the bytes, which match the digest"
        )
        self._count(faults=1, repaired=1)

    def _repairing(
        self, name: str, sha256: Digest, offset: int | None, found: str, action: str
    ) -> None:
        """A repair a tier makes by itself (a hot copy rewritten from a put's bytes)."""
        self.journal.record(sha256, name, offset, found, action)
        self._count(faults=1, repaired=1)

    def _record_loss(self, sha256: Digest, faults: list[_Fault]) -> None:
        for fault in faults:
            log.warning(
                "damaged copy of %s on tier %s, with no good copy anywhere: %s",
                sha256,
                self.names[fault.tier],
                fault.found,
            )
            self.journal.record(
                sha256,
                self.names[fault.tier],
                fault.offset,
                fault.found,
                LOST,
            )
        self._count(unrepairable=len(faults))

    def _intact(self, index: int, sha256: Digest) -> bool:
        try:
            self.tiers[index].verify(sha256)
        except (IntegrityError, NotFound):
            return False
        return True

    def _first_bad_offset(self, tier: BlobStore, sha256: Digest) -> int | None:
        """The byte offset of the first chunk of a copy that fails its check, if any does."""
        resume = 0
        try:
            for chunk in tier.read(sha256):
                resume = chunk.offset + len(chunk.data)
        except (IntegrityError, NotFound):
            return resume
        return None

    def _count(
        self, *, faults: int = 0, repaired: int = 0, unrepairable: int = 0, failed_rewrites: int = 0
    ) -> None:
        with self._stats_lock:
            self.stats.faults += faults
            self.stats.repaired += repaired
            self.stats.unrepairable += unrepairable
            self.stats.failed_rewrites += failed_rewrites


def _missing(error: NotFound) -> bool:
    """Whether a copy is gone, rather than out of reach (a mirror's NotFound that is also
    Unavailable): only a copy that is gone is a fault to rewrite."""
    return not isinstance(error, Unavailable)


def _data_loss(sha256: Digest, names: list[str], faults: list[_Fault]) -> IntegrityError:
    found = "; ".join(
        f"{names[fault.tier]}"
        + ("" if fault.offset is None else f" (chunk at byte offset {fault.offset})")
        + f": {fault.found}"
        for fault in faults
    )
    return IntegrityError(f"no tier holds a good copy of {sha256}: {found}")
