"""What `vault tier status|migrate`, `vault scrub` and `vault repair` do on the vault's host: its
tiers opened from the config as a command may open them beside a running server, then reported
on, migrated by [policy], scrubbed, or repaired from a file, now."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vault.config import Config
from vault.digest import Digest
from vault.errors import Unavailable
from vault.server.assembly import (
    hot_capacity,
    mirrors_configured,
    open_hot_tier,
    open_mirror_set,
    open_placement_record,
    open_replication_queue,
    warm_configured,
    warm_path,
)
from vault.server.database import open_ledger_database
from vault.server.workers import build_migrator
from vault.store.protocol import BlobStore

if TYPE_CHECKING:
    from mirror.queue import ReplicationQueue
    from tiers.migrate import MigrationReport, MirrorCopies
    from tiers.restore import CopyRestore


class HeldByServer(Unavailable):
    """The warm tier is open in a running `vault serve`, which owns it."""


class _HostTiers:
    """What a command opens: the hot tier, the warm tier if configured (and `need_warm`, or
    it is free: a running server holds it), the mirrors' copies if there are mirrors (read
    through them with `mirrors`), and the journal under a tier manager."""

    def __init__(self, config: Config, *, need_warm: bool, mirrors: bool = False) -> None:
        from tiers.manager import TierManager
        from tiers.warm import WarmTier

        config.data_path.mkdir(parents=True, exist_ok=True)
        self.closers: list[Callable[[], None]] = []
        tiers: list[tuple[str, BlobStore]] = [("hot", open_hot_tier(config))]
        if warm_configured(config):
            try:
                warm = WarmTier(warm_path(config))
            except Unavailable as error:
                if need_warm:
                    raise HeldByServer(
                        f"{error}: a running `vault serve` migrates and scrubs by itself; "
                        "stop it to run this command"
                    ) from None
            else:
                self.closers.append(warm.close)
                tiers.append(("warm", warm))
        self.queue: ReplicationQueue | None = None
        self.mirror_copies: MirrorCopies | None = None
        if mirrors_configured(config):
            self.queue = open_replication_queue(config)
            self.closers.append(self.queue.close)
            self.mirror_copies = self.queue.copies
            if mirrors:
                from mirror.store import MirrorReads

                mirror_set = open_mirror_set(config)
                self.closers.append(mirror_set.close)
                tiers += [(f"mirror-{m.name}", MirrorReads(m)) for m in mirror_set]
        self.manager = TierManager(tiers, journal=open_placement_record(config))
        self.closers.append(self.manager.close)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def status(config: Config) -> dict[str, Any]:
    """Per tier (and mirror) its blobs and bytes; how full the hot tier is; and how recently
    the copies were verified (times as Unix seconds)."""
    opened = _HostTiers(config, need_warm=False)
    try:
        journal = opened.manager.journal
        totals = journal.totals()
        placements = journal.placements()
        mirrors = opened.queue.counts() if opened.queue is not None else {}
    finally:
        opened.close()
    rows = {
        name: {"blobs": totals.get(name, (0, 0))[0], "bytes": totals.get(name, (0, 0))[1]}
        for name in ["hot", *(["warm"] if warm_configured(config) else [])]
    }
    if not warm_configured(config) and not mirrors_configured(config):
        # A vault of one tier journals no placements (no tier manager moves its copies), so
        # its tier is counted itself, as it is now.
        rows["hot"] = _count(open_hot_tier(config))
    for name, counts in sorted(mirrors.items()):
        rows[f"mirror-{name}"] = {"blobs": counts.objects, "bytes": counts.bytes}
    capacity = hot_capacity(config)()
    verified = [p.last_verified for p in placements if p.last_verified is not None]
    return {
        "tiers": rows,
        "hot_capacity": capacity,
        "hot_full": rows["hot"]["bytes"] / capacity if capacity else 0.0,
        "hot_high_water": config.policy.hot_high_water,
        "copies": len(placements),
        "never_verified": len(placements) - len(verified),
        "oldest_verified": min(verified, default=None),
    }


def _count(tier: BlobStore) -> dict[str, int]:
    blobs = size = 0
    for digest in tier.digests():
        info = tier.info(digest)
        if info is not None:  # removed meanwhile
            blobs += 1
            size += info.size
    return {"blobs": blobs, "bytes": size}


@dataclass(frozen=True, slots=True)
class Migration:
    """The blobs [policy] moves, each with where from and to and why; and, unless it was a dry
    run, what moving them did."""

    moves: list[dict[str, Any]]
    report: MigrationReport | None


def migrate(
    config: Config, *, dry_run: bool, progress: Callable[[int, int], None] | None = None
) -> Migration:
    """Plan the moves [policy] asks for now and, unless `dry_run`, make them; `progress` is
    told the blobs moved of all to move."""
    opened = _HostTiers(config, need_warm=not dry_run)
    try:
        db = open_ledger_database(config)
        try:
            migrator = build_migrator(config, opened.manager, db, opened.mirror_copies)
            if not dry_run:
                opened.manager.adopt(["hot", *(["warm"] if warm_configured(config) else [])])
            moves = [d for d in migrator.plan() if d.moves]
            notes = {d.facts.digest: migrator.copies_note(d) for d in moves}
            report = None if dry_run else migrator.apply(moves, progress=progress)
        finally:
            db.dispose()
    finally:
        opened.close()
    listed = [
        {
            "digest": str(d.facts.digest),
            "size": d.facts.size,
            "from": d.origin,
            "to": d.target,
            "reason": d.reason,
            "note": notes[d.facts.digest],
        }
        for d in moves
    ]
    return Migration(listed, report)


def scrub(
    config: Config, *, rate: float | None, progress: Callable[[int, int], None]
) -> dict[str, int]:
    """Every copy on every tier and mirror checked now, at most `rate` bytes a second, bad ones
    repaired; the totals, named as in ScrubProgress. HeldByServer when a running server holds
    the tiers: it scrubs them itself (Store.Scrub)."""
    from tiers.scrub import Scrubber

    opened = _HostTiers(config, need_warm=True, mirrors=True)
    try:
        stats = Scrubber(opened.manager, rate=rate).scrub_all(progress=progress)
    finally:
        opened.close()
    return dataclasses.asdict(stats)


def repair(config: Config, digest: str, path: Path) -> tuple[Digest, list[CopyRestore]]:
    """Rewrite every damaged or missing copy of a blob, on every tier and mirror that holds
    it, from the file at `path`, which must hash to `digest`; the blob's sha256 and what
    became of each copy. HeldByServer when a running server holds the warm tier."""
    from tiers.restore import restore_from_file

    wanted = Digest.parse(digest)
    db = open_ledger_database(config)
    try:
        # The column is named by the algorithm, which Digest.parse allows only two of.
        rows = db.fetch(f"SELECT 1 FROM blobs WHERE {wanted.algorithm} = ?", (str(wanted),))
    finally:
        db.dispose()
    opened = _HostTiers(config, need_warm=True, mirrors=True)
    try:
        return restore_from_file(opened.manager, wanted, path, catalogued=bool(rows))
    finally:
        opened.close()


def scrub_totals(update: Any) -> dict[str, int]:
    """The totals a server's last ScrubProgress message carries, named as `scrub` names them."""
    from tiers.scrub import ScrubStats

    return {f.name: getattr(update, f.name) for f in dataclasses.fields(ScrubStats)}
