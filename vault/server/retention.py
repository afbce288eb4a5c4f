"""Retention (docs/retention.md): which blobs' bytes the [retention] policy lets the vault
release, and the gc pass that releases them: a `release` entry for each, durable before any
byte is removed, then its bytes removed from every tier and mirror.

What is released: the files of a run's intermediate checkpoints (not among its last
`keep_last`, and older than `release_after_days`), except any file that a kept checkpoint, a
pinned dataset, image, config, run or artefact, or a hold names, directly or through the
documents they pin (a sealed run's manifest names its checkpoints, a checkpoint's manifest
its files, an image's manifest its layers). A checkpoint's manifest itself is kept: it is
small, and says what the checkpoint was.

Crash safety: a blob is released by its entry, whatever happens after; a pass removes the
bytes of every released blob it finds still held, so that a pass cut short (the server
killed) is finished by the next one, which `vault serve` runs at start."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from sqlalchemy import text

from tiers.placements import MIRROR_TIER_PREFIX
from vault.config import Config, RetentionConfig
from vault.digest import Digest
from vault.errors import FailedPrecondition, IntegrityError, NotFound, VaultError
from vault.ledger.db import Database
from vault.ledger.entry import RELEASE, VAULT_KINDS, check_meta
from vault.ledger.records import PinSpec
from vault.ledger.sequencer import MAX_BATCH
from vault.server.assembly import manager_of
from vault.server.released import ReleasingContent
from vault.store.protocol import BlobStore

if TYPE_CHECKING:
    from tiers.manager import TierManager
    from vault.ledger.log import Ledger

log = logging.getLogger("pinvault.retention")

# The author of every release entry.
AUTHOR: Final = "vault-gc"
# Kinds whose pinned blob is a document naming other blobs, read for the digests it names.
_DOCUMENT_KINDS: Final = frozenset({"dataset", "image", "run", "config", "hold"})
# An image's manifest names manifests (an index) or layers: read one level further, for
# documents up to this size.
_NESTED_DOCUMENT_BYTES: Final = 4 << 20
# A blob read for the digests it names only if it opens as JSON does.
_DOCUMENT_START: Final = (b"{", b"[")
_SHA256: Final = re.compile(rb"sha256:[0-9a-f]{64}")
# The most characters a digest may straddle two chunks by.
_OVERLAP: Final = 70
# Entries read from the ledger in one query.
_READ_BATCH: Final = 20_000
# Release entries appended in one append (one group commit), then their bytes removed.
RELEASE_BATCH: Final = min(1000, MAX_BATCH)
# Copies removed side by side.
REMOVERS: Final = 8
# Placements looked up in one query.
_PLACED_BATCH: Final = 500
# Several servers sharing one PostgreSQL ledger run one gc pass at a time: the one holding
# this advisory lock (released by PostgreSQL if its server dies).
_PG_LEASE: Final = 7302017


@dataclass(frozen=True, slots=True)
class Policy:
    """The [retention] rules; `keep_last` 0 means no policy: nothing is released."""

    keep_last: int = 0
    release_after_days: float = 0.0

    @classmethod
    def from_config(cls, settings: RetentionConfig) -> Policy:
        return cls(settings.keep_last, settings.release_after_days)

    @property
    def enabled(self) -> bool:
        return self.keep_last > 0

    @property
    def rule(self) -> str:
        """The rule as its settings say it, recorded in each release entry."""
        rule = f"keep_last={self.keep_last}"
        if self.release_after_days > 0:
            rule += f",release_after_days={self.release_after_days:g}"
        return rule


@dataclass(frozen=True, slots=True)
class Planned:
    """One blob a pass releases (or, `released` set, finishes: its release entry is in the
    ledger and bytes of it are still held)."""

    digest: str
    size: int
    rule: str
    reason: str
    checkpoint: int
    run: str
    step: int
    released: int | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "digest": self.digest,
            "size": self.size,
            "rule": self.rule,
            "reason": self.reason,
            "checkpoint_entry": self.checkpoint,
            "run": self.run,
            "step": self.step,
            **({} if self.released is None else {"release_entry": self.released}),
        }


@dataclass(slots=True)
class Plan:
    """What a pass would do, as of the ledger's first `size` entries."""

    size: int
    policy: Policy
    releases: list[Planned] = field(default_factory=list)
    finishes: list[Planned] = field(default_factory=list)

    @property
    def release_bytes(self) -> int:
        return sum(p.size for p in self.releases)

    def as_json(self) -> dict[str, object]:
        return {
            "ledger_size": self.size,
            "rule": self.policy.rule if self.policy.enabled else "",
            "release": [p.as_json() for p in self.releases],
            "release_bytes": self.release_bytes,
            "finish": [p.as_json() for p in self.finishes],
        }


@dataclass(slots=True)
class Report:
    """What a pass did: the blobs it released (entries appended), those whose release it
    finished, those it found protected after all, copies it could not remove (left for the
    next pass), the warm tier's bytes its compaction freed, and those still waiting in packs
    beside live blobs."""

    released: list[Planned] = field(default_factory=list)
    finished: list[Planned] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    reclaimable: int = 0
    freed: int = 0
    skipped: str = ""

    @property
    def released_bytes(self) -> int:
        return sum(p.size for p in self.released)

    def as_json(self) -> dict[str, object]:
        return {
            "released": [p.as_json() for p in self.released],
            "released_bytes": self.released_bytes,
            "finished": [p.as_json() for p in self.finished],
            "kept": self.kept,
            "failed": self.failed,
            "warm_freed_bytes": self.freed,
            "warm_reclaimable_bytes": self.reclaimable,
            "skipped": self.skipped,
        }


@dataclass(frozen=True, slots=True)
class _Checkpoint:
    index: int
    time: str
    manifest: str
    group: tuple[str, str, str]
    step: int


class _LedgerView:
    """What retention needs of the ledger, read incrementally: the checkpoints, the digests
    other entries name, the documents to read, and the latest release of each digest."""

    def __init__(self) -> None:
        self.size = 0
        self.checkpoints: list[_Checkpoint] = []
        self.named: set[str] = set()
        self.documents: dict[str, str] = {}
        self.releases: dict[str, int] = {}
        # The last entry other than a release naming each digest: a blob pinned again after
        # its release (its bytes put again) is released again only by a new entry.
        self.last_named: dict[str, int] = {}

    def catch_up(self, db: Database) -> list[tuple[int, str, list[str]]]:
        """Read the entries appended since; returns each new one's index, kind and
        subjects."""
        new: list[tuple[int, str, list[str]]] = []
        while True:
            rows = db.fetch(
                "SELECT idx, body FROM entries WHERE idx >= ? ORDER BY idx LIMIT ?",
                (self.size, _READ_BATCH),
            )
            for index, body in rows:
                entry = json.loads(bytes(body))
                kind, subjects = entry["kind"], entry["subjects"]
                self._add(index, kind, subjects, entry["meta"], entry["time"])
                new.append((index, kind, subjects))
                self.size = index + 1
            if len(rows) < _READ_BATCH:
                return new

    def _add(
        self, index: int, kind: str, subjects: list[str], meta: dict[str, str], when: str
    ) -> None:
        if kind == RELEASE:
            for subject in subjects:
                self.releases[subject] = index
            return
        if kind in VAULT_KINDS:
            # A registry's withdraw names a manifest that its `image` entry pins: it pins
            # nothing itself.
            return
        for subject in subjects:
            self.last_named[subject] = index
        if kind == "checkpoint" and len(subjects) == 2:
            try:
                step = int(meta.get("step", ""))
            except ValueError:
                step = -1
            group = (subjects[1], meta.get("replay", ""), meta.get("task", ""))
            self.checkpoints.append(_Checkpoint(index, when, subjects[0], group, step))
            return
        self.named.update(subjects)
        if kind in _DOCUMENT_KINDS:
            for subject in subjects:
                if subject.startswith("sha256:"):
                    self.documents.setdefault(subject, kind)


class Retention:
    """The gc of one vault server: plans by its policy over the ledger, and releases."""

    def __init__(
        self,
        policy: Policy,
        db: Database,
        content: ReleasingContent,
        store: BlobStore,
        ledger: Ledger | None = None,
    ) -> None:
        """`ledger`: where release entries are appended (None: plans only)."""
        self.policy = policy
        self.db = db
        self.content = content
        self.store = store
        self.ledger = ledger
        self._view = _LedgerView()
        # What each document names, by its digest (blobs never change).
        self._names: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()

    # -- planning ----------------------------------------------------------------------------

    def plan(self, now: float | None = None) -> Plan:
        """What a pass would release now, and which releases it would finish."""
        with self._lock:
            return self._plan(time.time() if now is None else now)

    def _plan(self, now: float) -> Plan:
        view = self._view
        view.catch_up(self.db)
        plan = Plan(view.size, self.policy)
        if not self.policy.enabled:
            return plan
        protected = self._protected(view.named, view.documents)
        groups: dict[tuple[str, str, str], list[_Checkpoint]] = defaultdict(list)
        for checkpoint in view.checkpoints:
            groups[checkpoint.group].append(checkpoint)
        kept: set[str] = set()
        intermediate: list[_Checkpoint] = []
        oldest = now - self.policy.release_after_days * 86_400
        for checkpoints in groups.values():
            checkpoints.sort(key=lambda c: (c.step, c.index))
            cut = len(checkpoints) - self.policy.keep_last
            for place, checkpoint in enumerate(checkpoints):
                if (
                    place >= cut
                    or checkpoint.manifest in protected
                    or _epoch(checkpoint.time) > oldest
                ):
                    kept.add(checkpoint.manifest)
                else:
                    intermediate.append(checkpoint)
        # Every checkpoint's manifest and run stay, and every file a kept one names.
        protected |= {c.manifest for c in view.checkpoints}
        protected |= {c.group[0] for c in view.checkpoints}
        for manifest in kept:
            protected |= self._named_by(manifest)
        wanted: dict[str, _Checkpoint] = {}
        for checkpoint in sorted(intermediate, key=lambda c: -c.index):
            if checkpoint.manifest in kept:
                continue
            for digest in sorted(self._named_by(checkpoint.manifest)):
                if digest not in protected and digest not in wanted:
                    wanted[digest] = checkpoint
        stored = self.content.catalogued(wanted) if wanted else {}
        released = {
            d: view.releases[d]
            for d in wanted
            if d in view.releases and view.last_named.get(d, -1) < view.releases[d]
        }
        held = self._held(sorted(released))
        for digest, checkpoint in wanted.items():
            release = released.get(digest)
            if release is not None and digest not in held:
                continue
            found = stored.get(digest)
            size = found.info.size if found is not None else 0
            if release is None and found is None:
                continue  # never stored here, or its bytes gone unreleased: nothing to free
            planned = Planned(
                digest,
                size,
                self.policy.rule,
                f"a file of checkpoint step {checkpoint.step} (entry {checkpoint.index}) of "
                f"run {checkpoint.group[0]}, not among the run's last {self.policy.keep_last}"
                + (
                    f" and older than {self.policy.release_after_days:g} days"
                    if self.policy.release_after_days > 0
                    else ""
                ),
                checkpoint.index,
                checkpoint.group[0],
                checkpoint.step,
                release,
            )
            (plan.releases if release is None else plan.finishes).append(planned)
        return plan

    def _protected(self, named: set[str], documents: dict[str, str]) -> set[str]:
        """The digests the ledger's pins name, directly or in the documents they pin."""
        protected = set(named)
        for document, kind in documents.items():
            names = self._named_by(document)
            protected |= names
            if kind == "image":
                for name in names:
                    protected |= self._named_by(name, limit=_NESTED_DOCUMENT_BYTES)
        return protected

    def _named_by(self, document: str, *, limit: int | None = None) -> frozenset[str]:
        """The sha256 digests a stored JSON document names (none for any other blob)."""
        known = self._names.get(document)
        if known is not None:
            return known
        if not document.startswith("sha256:"):
            return frozenset()
        found = self.content.catalogued([document]).get(document)
        if found is None:
            return frozenset()  # not stored (or released): asked again next pass
        if limit is not None and found.info.size > limit:
            return frozenset()
        names: set[str] = set()
        tail = b""
        try:
            _, chunks = self.content.read(found)
            for number, chunk in enumerate(chunks):
                if number == 0 and not chunk.data.lstrip().startswith(_DOCUMENT_START):
                    break
                data = tail + chunk.data
                names.update(m.decode() for m in _SHA256.findall(data))
                tail = data[-_OVERLAP:]
        except (NotFound, IntegrityError) as error:
            # What it names is not known, so nothing it might name may go: no pass releases
            # anything until it reads again (repaired, or its mirror back).
            raise FailedPrecondition(
                f"gc: cannot read {document}, which may name blobs the policy keeps, so "
                f"nothing is released: {error}"
            ) from None
        named = frozenset(names)
        self._names[document] = named
        return named

    # -- where bytes are ---------------------------------------------------------------------

    def _held(self, digests: Sequence[str]) -> set[str]:
        """Those of these digests of which this server's tiers or the mirrors hold a copy,
        as the placement record and the hot tier say."""
        if not digests:
            return set()
        manager = manager_of(self.store)
        hot = manager.tiers[0] if manager is not None else self.store
        parsed = [Digest.parse(d) for d in digests]
        held = {str(d) for d in parsed} - {str(d) for d in hot.find_missing(parsed)}
        if manager is not None:
            journal = manager.journal
            for start in range(0, len(digests), _PLACED_BATCH):
                part = list(digests[start : start + _PLACED_BATCH])
                rows = journal.query(
                    "SELECT digest, tier FROM placements WHERE digest IN :digests",
                    {"digests": part},
                )
                held |= {d for d, tier in rows if "@" not in journal.shown_tier(tier)}
        return held

    # -- releasing ---------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> Report:
        """One gc pass: release what the policy lets go, finish earlier releases."""
        if self.ledger is None:
            raise VaultError("this retention plans only: it has no ledger to append to")
        with self._lock, self._lease() as held:
            if not held:
                return Report(skipped="another server's gc pass holds the lease")
            plan = self._plan(time.time())
            return self._carry_out(plan, stop or threading.Event())

    def _carry_out(self, plan: Plan, stop: threading.Event) -> Report:
        assert self.ledger is not None
        report = Report()
        for start in range(0, len(plan.releases), RELEASE_BATCH):
            if stop.is_set():
                break
            batch = self._still_releasable(plan.releases[start : start + RELEASE_BATCH], report)
            if not batch:
                continue
            with self.content.releasing([p.digest for p in batch]):
                entries = self.ledger.append([self._spec(p) for p in batch])
                self.content.releases.refresh(now=True)
                # Pins appended up to now (the release entries among them) are in the ledger:
                # a blob one of them names after all keeps its bytes.
                done = set(self._still_releasable(batch, report))
                self._remove([p.digest for p in batch if p in done], report)
                for planned, entry in zip(batch, entries, strict=True):
                    if planned in done:
                        report.released.append(planned)
                    else:
                        log.warning(
                            "gc: %s, released by entry %d, was pinned meanwhile: its bytes stay",
                            planned.digest,
                            entry.index,
                        )
        for start in range(0, len(plan.finishes), RELEASE_BATCH):
            if stop.is_set():
                break
            batch = plan.finishes[start : start + RELEASE_BATCH]
            with self.content.releasing([p.digest for p in batch]):
                finishing = self._still_releasable(batch, report)
                self._remove([p.digest for p in finishing], report)
                report.finished += finishing
        report.freed, report.reclaimable = self._compact_warm()
        if report.released or report.finished or report.failed:
            log.info(
                "gc: released %d blobs (%d bytes), finished %d earlier releases, %d copies "
                "left for the next pass",
                len(report.released),
                report.released_bytes,
                len(report.finished),
                len(report.failed),
            )
        return report

    def _still_releasable(self, batch: list[Planned], report: Report) -> list[Planned]:
        """The batch less any blob an entry appended since the plan names (or names through
        a document it pins; a new checkpoint is taken as kept)."""
        new = self._view.catch_up(self.db)
        if not new:
            return batch
        named: set[str] = set()
        documents: dict[str, str] = {}
        for _, kind, subjects in new:
            if kind in VAULT_KINDS:
                continue
            named.update(subjects)
            if kind in _DOCUMENT_KINDS or kind == "checkpoint":
                documents.update((s, kind) for s in subjects if s.startswith("sha256:"))
        protected = self._protected(named, documents)
        kept = [p.digest for p in batch if p.digest in protected]
        report.kept += kept
        return [p for p in batch if p.digest not in protected]

    def _spec(self, planned: Planned) -> PinSpec:
        meta = check_meta(
            {
                "rule": planned.rule,
                "reason": planned.reason,
                "checkpoint": str(planned.checkpoint),
                "run": planned.run,
                "step": str(planned.step),
                "size": str(planned.size),
            }
        )
        return PinSpec(RELEASE, (planned.digest,), AUTHOR, meta)

    def _remove(self, digests: Sequence[str], report: Report) -> None:
        """Remove released blobs' bytes from every tier and mirror this server reaches and
        drop their placements; a copy that cannot be removed now stays placed, for the next
        pass to finish. Copies are removed side by side (each removal syncs a folder or asks
        a mirror); the placements go in one transaction."""
        if not digests:
            return
        manager = manager_of(self.store)
        parsed = [Digest.parse(d) for d in digests]
        if manager is None:
            with ThreadPoolExecutor(REMOVERS, thread_name_prefix="gc-remove") as pool:
                list(pool.map(lambda sha256: self._delete(self.store, sha256), parsed))
            return
        journal = manager.journal
        placed: dict[str, set[str]] = defaultdict(set)
        for start in range(0, len(digests), _PLACED_BATCH):
            rows = journal.query(
                "SELECT digest, tier FROM placements WHERE digest IN :digests",
                {"digests": list(digests[start : start + _PLACED_BATCH])},
            )
            for digest, tier in rows:
                placed[digest].add(journal.shown_tier(tier))

        def remove(sha256: Digest) -> list[str]:
            """The tiers whose copy is gone now."""
            gone = []
            for name, tier in zip(manager.names, manager.tiers, strict=True):
                # A mirror is asked only for a copy recorded there: a mirror's removal costs
                # requests, and replication records every copy it makes.
                if name.startswith(MIRROR_TIER_PREFIX) and name not in placed[str(sha256)]:
                    continue
                try:
                    self._delete(tier, sha256)
                except (VaultError, OSError) as error:
                    log.warning("gc: could not remove %s from %s: %s", sha256, name, error)
                    report.failed.append(f"{sha256} on {name}: {error}")
                    continue
                gone.append(name)
            return gone

        with (
            manager.repair_lock,
            ThreadPoolExecutor(REMOVERS, thread_name_prefix="gc-remove") as pool,
        ):
            removed = list(pool.map(remove, parsed))
        rows = [
            {"digest": str(sha256), "tier": journal.stored_tier(name)}
            for sha256, names in zip(parsed, removed, strict=True)
            for name in names
        ]
        if rows:
            with journal.writing() as conn:
                conn.execute(
                    text("DELETE FROM placements WHERE digest = :digest AND tier = :tier"), rows
                )

    @staticmethod
    def _delete(tier: BlobStore, sha256: Digest) -> None:
        with contextlib.suppress(NotFound):
            tier.delete(sha256)

    def _compact_warm(self) -> tuple[int, int]:
        """Compact the warm tier (its packs left with released blobs' records alone are
        removed); the bytes freed, and those of deleted blobs still in packs beside live ones."""
        from tiers.warm import WarmTier

        manager: TierManager | None = manager_of(self.store)
        if manager is None:
            return 0, 0
        for tier in manager.tiers:
            if isinstance(tier, WarmTier):
                return tier.compact(), sum(tier.reclaimable().values())
        return 0, 0

    @contextlib.contextmanager
    def _lease(self) -> Iterator[bool]:
        """Whether this server may run a pass: on PostgreSQL, the one that holds the gc's
        advisory lock; on SQLite, the data folder's one server."""
        if self.db.is_sqlite:
            yield True
            return
        with self.db.write.connect() as conn:
            held = bool(conn.execute(text(f"SELECT pg_try_advisory_lock({_PG_LEASE})")).scalar())
            conn.commit()
            try:
                yield held
            finally:
                if held:
                    conn.execute(text(f"SELECT pg_advisory_unlock({_PG_LEASE})"))
                    conn.commit()


def _epoch(when: str) -> float:
    try:
        return datetime.strptime(when, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return float("inf")  # a time not understood: the checkpoint is taken as new


def retention_of(
    config: Config, db: Database, content: ReleasingContent, store: BlobStore, ledger: Ledger
) -> Retention:
    return Retention(Policy.from_config(config.retention), db, content, store, ledger)
