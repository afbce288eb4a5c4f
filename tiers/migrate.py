"""The migration worker: applies the policy's decisions to the tier manager's copies, copying and
verifying before it removes anything, so that a crash at any step leaves every blob with at
least policy.min_copies verified copies elsewhere than the one removed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiers.manager import TierManager
from tiers.placements import MIRROR_TIER_PREFIX, mirror_tier
from tiers.policy import COLD, HOT, WARM, BlobFacts, Decision, plan
from tiers.worker import Worker
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound, VaultError
from vault.store.protocol import BlobStore, copy_blob

if TYPE_CHECKING:
    from vault.config import PolicyConfig

log = logging.getLogger("pinvault.tiers")

# Named steps, in order, for tests that crash the worker between them.
COPIED = "copied"
VERIFIED = "verified"
RECORDED = "recorded"
UNPLACED = "unplaced"
DELETED = "deleted"

Kinds = Callable[[list[Digest]], dict[Digest, set[str]]]
MirrorCopies = Callable[[Digest], set[str]]


@dataclass(slots=True)
class MigrationReport:
    """One pass: copies made (and their bytes), copies removed, blobs left where they are
    for want of verified copies elsewhere, and blobs that failed."""

    copied: int = 0
    copied_bytes: int = 0
    removed: int = 0
    removed_bytes: int = 0
    kept: list[tuple[Digest, str]] = field(default_factory=list)
    failed: list[tuple[Digest, str]] = field(default_factory=list)


class Migrator:
    """Moves blobs between the manager's tiers named `hot` and `warm`; mirrors (tiers named
    `mirror-…`) are the cold tier, filled by replication and counted through `mirror_copies`
    (the mirrors the placement record has a copy on: `ReplicationQueue.copies`).

    For each blob that moves, under the manager's repair lock: copy to the target (every
    chunk checked as read, the digest on commit), verify the target's copy whole, journal it,
    and only then, if at least min_copies verified copies exist besides it, journal the
    removal, forget the placement and delete the source copy. A crash between any two steps
    leaves an extra copy at worst, which the next pass finds and finishes; `adopt` at the
    start of a pass journals copies made by a pass that crashed before journaling them.
    """

    def __init__(
        self,
        manager: TierManager,
        rules: PolicyConfig,
        *,
        hot_capacity: Callable[[], int],
        warm_configured: bool | None = None,
        kinds_of: Kinds | None = None,
        mirror_copies: MirrorCopies | None = None,
        on_step: Callable[[str, Digest], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.manager = manager
        self.rules = rules
        self.hot_capacity = hot_capacity
        self.warm_configured = WARM in manager.names if warm_configured is None else warm_configured
        self.kinds_of = kinds_of
        self.mirror_copies = mirror_copies
        self.on_step = on_step
        self.clock = clock
        # Moves the pass under way (or the last one) planned and has not made yet.
        self.pending = 0

    # -- planning ----------------------------------------------------------------------------

    def facts(self) -> list[BlobFacts]:
        """Every blob with a hot or warm copy, as the journal knows it."""
        self.manager.journal.flush_reads()
        grouped: dict[Digest, list[tuple[str, int | None, float | None, float | None]]] = {}
        for p in self.manager.journal.placements():
            grouped.setdefault(p.digest, []).append(
                (_class_of(p.tier), p.size, p.stored, p.last_read)
            )
        local = [d for d, rows in grouped.items() if any(r[0] in (HOT, WARM) for r in rows)]
        kinds = self.kinds_of(local) if self.kinds_of is not None and local else {}
        now = self.clock()
        found = []
        for digest in local:
            rows = grouped[digest]
            where = {r[0] for r in rows}
            if self.mirror_copies is not None and self.mirror_copies(digest):
                where.add(COLD)
            found.append(
                BlobFacts(
                    digest=digest,
                    size=max((r[1] or 0 for r in rows), default=0),
                    stored=min((r[2] for r in rows if r[2] is not None), default=now),
                    last_read=max((r[3] for r in rows if r[3] is not None), default=None),
                    where=frozenset(where),
                    kinds=frozenset(kinds.get(digest, ())),
                )
            )
        return found

    def plan(self) -> list[Decision]:
        return plan(
            self.facts(),
            now=self.clock(),
            rules=self.rules,
            hot_capacity=self.hot_capacity(),
            has_warm=self.warm_configured,
            has_cold=self.mirror_copies is not None,
        )

    def copies_note(self, decision: Decision) -> str:
        """Why a move will leave a copy where it is, or "" if it will not."""
        mirrors = self._mirrors(decision.facts.digest)
        if decision.target == WARM and HOT in decision.facts.where:
            elsewhere = ["warm", *mirrors]
        elif decision.target == COLD and decision.facts.where & {HOT, WARM}:
            elsewhere = mirrors
        else:
            return ""
        if len(elsewhere) >= self.rules.min_copies:
            return ""
        return f"{decision.origin} copy kept: {_copies(elsewhere, self.rules.min_copies)}"

    # -- applying ----------------------------------------------------------------------------

    def run_once(self, stop: threading.Event | None = None) -> MigrationReport:
        """Journal unknown local copies, plan, and apply every move."""
        self.manager.adopt([name for name in self.manager.names if _class_of(name) != COLD])
        return self.apply(self.plan(), stop)

    def apply(
        self,
        decisions: Iterable[Decision],
        stop: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> MigrationReport:
        """Make the moves `decisions` ask for, one blob at a time; `progress` is told the blobs
        done of all to move after each."""
        report = MigrationReport()
        moves = [decision for decision in decisions if decision.moves]
        self.pending = len(moves)
        for done, decision in enumerate(moves):
            if progress is not None:
                progress(done, len(moves))
            if stop is not None and stop.is_set():
                break
            digest = decision.facts.digest
            try:
                with self.manager.repair_lock:
                    self._move(decision, report)
            except (VaultError, OSError) as error:
                log.warning("migrating %s to %s failed: %s", digest, decision.target, error)
                report.failed.append((digest, str(error)))
            finally:
                self.pending -= 1
        if progress is not None:
            progress(len(moves) - self.pending, len(moves))
        return report

    def _move(self, decision: Decision, report: MigrationReport) -> None:
        digest = decision.facts.digest
        if decision.target == HOT:
            if self.manager.promote_now(digest):
                self._copied(report, decision.facts.size, digest)
            return
        if decision.target == WARM:
            self._ensure(digest, WARM, report)
            self._remove(digest, HOT, [WARM, *self._mirrors(digest)], decision.reason, report)
            return
        # Cold: only mirror copies count, as the warm copy is about to go too.
        for source in (HOT, WARM):
            self._remove(digest, source, self._mirrors(digest), decision.reason, report)

    def _ensure(self, digest: Digest, name: str, report: MigrationReport) -> None:
        """Make sure tier `name` holds a copy verified in this pass, and journal it."""
        target = self._tier(name)
        if target.find_missing([digest]):
            source = self._holder(digest, exclude=name)
            info, _ = copy_blob(source, target, digest)
            self._copied(report, info.size, digest)
        info = target.verify(digest)
        self.manager.journal.place(digest, name, size=info.size, verified=self.clock())
        self._step(VERIFIED, digest)

    def _remove(
        self,
        digest: Digest,
        name: str,
        elsewhere: list[str],
        reason: str,
        report: MigrationReport,
    ) -> None:
        if name not in self.manager.names:
            return
        tier = self._tier(name)
        if tier.find_missing([digest]):
            self.manager.journal.unplace(digest, name)
            return
        if len(elsewhere) < self.rules.min_copies:
            report.kept.append(
                (digest, f"{name} copy kept: {_copies(elsewhere, self.rules.min_copies)}")
            )
            return
        info = tier.info(digest)
        size = 0 if info is None else info.size
        # Journaled first, so that a crash before the delete leaves a trace of the intent.
        self.manager.journal.record(
            digest,
            name,
            None,
            f"policy: {reason}",
            f"removed the copy: {len(elsewhere)} verified copies elsewhere "
            f"({', '.join(elsewhere)})",
        )
        self._step(RECORDED, digest)
        # Forgotten before it is deleted: a read that meets the copy gone then goes on to
        # another copy instead of taking it for damage and writing it back.
        self.manager.journal.unplace(digest, name)
        self._step(UNPLACED, digest)
        with contextlib.suppress(NotFound):
            tier.delete(digest)
        self._step(DELETED, digest)
        report.removed += 1
        report.removed_bytes += size

    def _copied(self, report: MigrationReport, size: int, digest: Digest) -> None:
        report.copied += 1
        report.copied_bytes += size
        self._step(COPIED, digest)

    def _holder(self, digest: Digest, *, exclude: str) -> BlobStore:
        """The fastest other tier whose copy is intact (checked whole: a damaged source is
        left to repair, not copied from)."""
        for name, tier in zip(self.manager.names, self.manager.tiers, strict=True):
            if name == exclude:
                continue
            try:
                tier.verify(digest)
            except (NotFound, IntegrityError):
                continue
            return tier
        raise IntegrityError(f"no tier holds a good copy of {digest} to migrate from")

    def _tier(self, name: str) -> BlobStore:
        return self.manager.tiers[self.manager.names.index(name)]

    def _mirrors(self, digest: Digest) -> list[str]:
        if self.mirror_copies is None:
            return []
        return [mirror_tier(name) for name in sorted(self.mirror_copies(digest))]

    def _step(self, step: str, digest: Digest) -> None:
        if self.on_step is not None:
            self.on_step(step, digest)


class MigrationWorker(Worker):
    """A thread of `vault serve` that runs a migration pass every `interval` seconds."""

    name = "tier-migrate"

    def __init__(self, migrator: Migrator, interval: float) -> None:
        self.migrator = migrator
        self.pause = interval
        super().__init__()

    def run_pass(self, stop: threading.Event) -> None:
        report = self.migrator.run_once(stop)
        if report.copied or report.removed or report.failed:
            log.info(
                "migration: %d copies made, %d removed, %d kept, %d failed",
                report.copied,
                report.removed,
                len(report.kept),
                len(report.failed),
            )


def _class_of(tier: str) -> str:
    return COLD if tier.startswith(MIRROR_TIER_PREFIX) else tier


def _copies(elsewhere: list[str], required: int) -> str:
    where = f" ({', '.join(elsewhere)})" if elsewhere else ""
    return f"{len(elsewhere)} verified copies elsewhere{where}, policy.min_copies is {required}"
