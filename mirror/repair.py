"""`vault mirror sync` and `vault mirror repair`: queue every copy a blob lacks, and re-verify
every copy on every mirror, rewriting a damaged or missing one from a copy that verifies; what
is found is written to the placement record (through the queue)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import ReplicationQueue
from mirror.replicate import copy_to_mirror
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound, Unavailable, VaultError
from vault.store.protocol import BlobStore, copy_blob

LOCAL = "local"


def queue_missing(local: BlobStore, mirrors: MirrorSet, queue: ReplicationQueue) -> int:
    """Queue a copy of every local blob on each mirror it is assigned to on which the
    placement record has no copy; returns how many copies were queued."""
    blobs: list[tuple[Digest, int, list[str]]] = []
    for digest in local.digests():
        info = local.info(digest)
        if info is not None:
            blobs.append((digest, info.size, [m.name for m in mirrors.assigned(digest)]))
    return queue.enqueue(blobs)


@dataclass(slots=True)
class RepairReport:
    checked: int = 0
    verified: int = 0
    rewritten: int = 0
    queued: int = 0
    lost: int = 0
    # Mirrors that could not be reached, and why: their copies were not checked.
    unreachable: dict[str, str] = field(default_factory=dict)
    skipped: int = 0
    events: list[str] = field(default_factory=list)


def repair(
    local: BlobStore,
    mirrors: MirrorSet,
    queue: ReplicationQueue,
    *,
    progress: Callable[[Digest], None] | None = None,
) -> RepairReport:
    """Verify every blob's local copy and each assigned mirror's copy (read back whole), of
    every blob held locally, placed on a mirror or queued, and rewrite every damaged or missing
    copy, local one included, from one that verified; each mirror copy verified or rewritten is
    recorded as a placement, each bad one forgotten until rewritten. A mirror that cannot be
    reached is skipped for the rest of the run and its copies queued."""
    report = RepairReport()
    for digest in dict.fromkeys([*local.digests(), *queue.known_digests()]):
        _repair_blob(digest, local, mirrors, queue, report)
        report.checked += 1
        if progress is not None:
            progress(digest)
    return report


def _repair_blob(
    digest: Digest,
    local: BlobStore,
    mirrors: MirrorSet,
    queue: ReplicationQueue,
    report: RepairReport,
) -> None:
    good: list[tuple[str, BlobStore]] = []
    local_fault: str | None = None
    size: int | None = None
    try:
        size = local.verify(digest).size
        good.append((LOCAL, local))
    except NotFound:
        # Not kept here (or never was): the mirrors' copies are all there is.
        pass
    except IntegrityError as error:
        local_fault = str(error)
    faults: list[tuple[Mirror, str, bool]] = []
    for mirror in mirrors.assigned(digest):
        if mirror.name in report.unreachable:
            report.skipped += 1
            continue
        try:
            info = mirror.tier.verify(digest)
        except NotFound:
            faults.append((mirror, "missing", False))
        except IntegrityError as error:
            faults.append((mirror, str(error), True))
        except Unavailable as error:
            _unreachable(mirror, error, report)
            report.skipped += 1
        else:
            size = info.size
            queue.done(digest, mirror.name, info.size)
            good.append((mirror.name, mirror.tier))
            report.verified += 1
    if local_fault is not None:
        _repair_local(digest, local, local_fault, good, report)
    for mirror, found, damaged in faults:
        queue.forget_copy(digest, mirror.name)
        if not good:
            report.lost += 1
            report.events.append(
                f"{mirror.name}: {digest}: {found}; no copy verifies anywhere (data loss)"
            )
            continue
        source_name, source = good[0]
        try:
            if damaged:
                with contextlib.suppress(NotFound):
                    mirror.tier.delete(digest)
            written = copy_to_mirror(source, mirror, digest)
        except VaultError as error:
            if isinstance(error, Unavailable):
                _unreachable(mirror, error, report)
            if size is not None:
                report.queued += queue.enqueue([(digest, size, [mirror.name])])
            report.events.append(
                f"{mirror.name}: {digest}: {found}; rewrite failed ({error}), copy queued"
            )
            continue
        queue.done(digest, mirror.name, written)
        report.rewritten += 1
        report.events.append(f"{mirror.name}: {digest}: {found}; rewrote it from {source_name}")


def _repair_local(
    digest: Digest,
    local: BlobStore,
    found: str,
    good: list[tuple[str, BlobStore]],
    report: RepairReport,
) -> None:
    if not good:
        report.lost += 1
        report.events.append(f"{LOCAL}: {digest}: {found}; no copy verifies anywhere (data loss)")
        return
    source_name, source = good[0]
    try:
        local.delete(digest)
        copy_blob(source, local, digest)
    except VaultError as error:
        report.events.append(f"{LOCAL}: {digest}: {found}; rewrite failed ({error})")
        return
    report.rewritten += 1
    report.events.append(f"{LOCAL}: {digest}: {found}; rewrote it from {source_name}")


def _unreachable(mirror: Mirror, error: Unavailable, report: RepairReport) -> None:
    mirror.seen_down(str(error))
    report.unreachable.setdefault(mirror.name, str(error))
