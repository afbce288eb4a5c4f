"""`vault tier status|migrate` and `vault scrub`, run on the vault's host against its config and
data folder like `vault mirror`, and the composition of the warm tier, the migration worker
and the background scrubber into `vault serve`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vault.config import Config
from vault.errors import IntegrityError, Unavailable
from vault.store.protocol import BlobStore

# The tier modules load only when a tier command or a server with tiers needs them: every
# `vault` command, the Slurm plugin's too, starts quicker.
if TYPE_CHECKING:
    from tiers.hot import HotTier
    from tiers.manager import TierManager
    from tiers.migrate import Migrator, MirrorCopies
    from vault.digest import Digest
    from vault.ledger.db import Database
    from vault.server.service import ScrubRunner

TIER_JOURNAL = "tiers.db"


class HeldByServer(Unavailable):
    """The warm tier is open in a running `vault serve`, which owns it."""


class Worker(Protocol):
    def close(self) -> None: ...


def warm_configured(config: Config) -> bool:
    return bool(config.store.warm_dir.strip())


def warm_path(config: Config) -> Path:
    return Path(config.store.warm_dir).expanduser()


def hot_capacity(config: Config) -> Callable[[], int]:
    """policy.hot_capacity_bytes, or the size of the file system the hot tier is on."""

    def capacity() -> int:
        return config.policy.hot_capacity_bytes or shutil.disk_usage(config.hot_path).total

    return capacity


# -- vault serve -------------------------------------------------------------------------------


def open_tiered_store(config: Config, hot: HotTier) -> BlobStore:
    """For `vault serve` with a warm tier: hot, warm, then the mirrors if configured, under
    one tier manager (with every put queued for its mirror copies, as cli/mirror.py does)."""
    from cli.mirror import mirrors_configured, open_replicating_store
    from tiers.manager import TierManager
    from tiers.warm import WarmTier

    warm = WarmTier(warm_path(config))
    promote = config.policy.promote_on_read
    if mirrors_configured(config):
        return open_replicating_store(
            config, hot, extra_tiers=[("warm", warm)], promote=promote, owned=[warm]
        )
    return TierManager(
        [("hot", hot), ("warm", warm)],
        journal=config.data_path / TIER_JOURNAL,
        promote=promote,
        owned=[warm],
    )


def scrub_runner(store: BlobStore) -> ScrubRunner | None:
    """What Store.Scrub runs in `vault serve`: every copy on every tier checked now, as
    `vault scrub` does on a stopped vault; None when the store has no tiers to manage."""
    from tiers.scrub import Scrubber

    manager = manager_of(store)
    if manager is None:
        return None

    def run(
        rate: float | None, progress: Callable[[int, int], None], stop: threading.Event
    ) -> dict[str, int]:
        stats = Scrubber(manager, rate=rate).scrub_all(progress=progress, stop=stop)
        return dataclasses.asdict(stats)

    return run


def manager_of(store: BlobStore) -> TierManager | None:
    from tiers.manager import TierManager

    inner = getattr(store, "inner", store)
    return inner if isinstance(inner, TierManager) else None


def start_tier_workers(config: Config, store: BlobStore, db: Database) -> list[Worker]:
    """The migration worker and the background scrubber, when the store has tiers to manage
    and the policy asks for them."""
    from tiers.migrate import MigrationWorker
    from tiers.scrub import Scrubber, ScrubWorker

    manager = manager_of(store)
    if manager is None:
        return []
    manager.promote = config.policy.promote_on_read
    policy = config.policy
    workers: list[Any] = []
    if policy.migrate_interval > 0:
        queue = getattr(store, "queue", None)
        migrator = _migrator(
            config, manager, db, None if queue is None else queue.copies, warm_configured(config)
        )
        workers.append(MigrationWorker(migrator, policy.migrate_interval))
    if policy.scrub_window_days > 0:
        scrubber = Scrubber(
            manager,
            rate=policy.scrub_rate_mb_s * 1e6 if policy.scrub_rate_mb_s > 0 else None,
            window=policy.scrub_window_days * 86_400,
        )
        workers.append(ScrubWorker(scrubber))
    for worker in workers:
        worker.start()
    return list(workers)


def _migrator(
    config: Config,
    manager: TierManager,
    db: Database | None,
    mirror_copies: MirrorCopies | None,
    warm: bool,
) -> Migrator:
    from tiers.migrate import Migrator

    return Migrator(
        manager,
        config.policy,
        hot_capacity=hot_capacity(config),
        warm_configured=warm,
        kinds_of=None if db is None else _kinds_of(db),
        mirror_copies=mirror_copies,
    )


def _kinds_of(db: Database) -> Callable[[list[Digest]], dict[Digest, set[str]]]:
    """The kinds each blob is pinned as, by either of its digests, from the ledger."""
    from vault.digest import Digest
    from vault.ledger.db import placeholders

    def kinds(digests: list[Digest]) -> dict[Digest, set[str]]:
        found: dict[Digest, set[str]] = {}
        for start in range(0, len(digests), 400):
            part = [str(d) for d in digests[start : start + 400]]
            marks = placeholders(len(part))
            for column in ("sha256", "blake3"):
                sql = (
                    f"SELECT b.sha256, e.kind FROM blobs b JOIN entry_subjects s "
                    f"ON s.digest = b.{column} JOIN entries e ON e.idx = s.idx "
                    f"WHERE b.sha256 IN ({marks})"
                )
                for sha, kind in db.fetch(sql, part):
                    found.setdefault(Digest.parse(sha), set()).add(str(kind))
        return found

    return kinds


# -- the commands ------------------------------------------------------------------------------


def add_tier_commands(sub: Any) -> None:
    """Add `vault tier …` and `vault scrub` to the command's subparsers."""
    p = sub.add_parser("tier", help="tiers: status, migrate by policy (on the vault host)")
    commands = p.add_subparsers(dest="tier_command", required=True, metavar="COMMAND")
    q = commands.add_parser("status", help="per tier: blobs and bytes; the hot tier's fullness")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_status)
    q = commands.add_parser("migrate", help="move blobs between tiers as [policy] says, now")
    q.add_argument("--dry-run", action="store_true", help="only say what would move and why")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_migrate)

    p = sub.add_parser("scrub", help="re-verify every copy on every tier now; repair bad ones")
    p.add_argument("--rate", type=float, default=0.0, help="MB/s to keep to (default: no limit)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_scrub)


class _Tiers:
    """What a command opens: the hot tier, the warm tier if configured (and `need_warm`, or
    it is free: a running server holds it), and the journal under a tier manager."""

    def __init__(self, config: Config, *, need_warm: bool, mirrors: bool = False) -> None:
        from cli.mirror import mirrors_configured
        from tiers.hot import HotTier
        from tiers.manager import TierManager
        from tiers.warm import WarmTier

        config.data_path.mkdir(parents=True, exist_ok=True)
        self.closers: list[Callable[[], None]] = []
        tiers: list[tuple[str, BlobStore]] = [("hot", HotTier(config.hot_path))]
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
        self.mirror_copies: MirrorCopies | None = None
        if mirrors_configured(config):
            from cli.mirror import open_mirror_set, queue_path
            from mirror.queue import ReplicationQueue

            self.queue = ReplicationQueue(queue_path(config))
            self.closers.append(self.queue.close)
            self.mirror_copies = self.queue.copies
            if mirrors:
                from mirror.store import MirrorReads

                mirror_set = open_mirror_set(config)
                self.closers.append(mirror_set.close)
                tiers += [(f"mirror-{m.name}", MirrorReads(m)) for m in mirror_set]
        self.manager = TierManager(tiers, journal=config.data_path / TIER_JOURNAL)
        self.closers.append(self.manager.close)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False))


def _status(args: argparse.Namespace, config: Config) -> int:
    from tiers.policy import size_text

    opened = _Tiers(config, need_warm=False)
    try:
        journal = opened.manager.journal
        totals = journal.totals()
        placements = journal.placements()
        mirrors = opened.queue.counts() if opened.mirror_copies is not None else {}
    finally:
        opened.close()
    rows = {
        name: {"blobs": totals.get(name, (0, 0))[0], "bytes": totals.get(name, (0, 0))[1]}
        for name in ["hot", *(["warm"] if warm_configured(config) else [])]
    }
    for name, counts in sorted(mirrors.items()):
        rows[f"mirror-{name}"] = {"blobs": counts.objects, "bytes": counts.bytes}
    capacity = hot_capacity(config)()
    verified = [p.last_verified for p in placements if p.last_verified is not None]
    now = time.time()
    oldest = min(verified, default=None)
    report: dict[str, Any] = {
        "tiers": rows,
        "hot_capacity": capacity,
        "hot_full": rows["hot"]["bytes"] / capacity if capacity else 0.0,
        "hot_high_water": config.policy.hot_high_water,
        "copies": len(placements),
        "never_verified": len(placements) - len(verified),
        "oldest_verified": oldest,
    }
    if args.json:
        _print_json(report)
        return 0
    print(f"{'tier':<12} {'blobs':>8} {'bytes':>12}")
    for name, row in rows.items():
        print(f"{name:<12} {row['blobs']:>8} {size_text(row['bytes']):>12}")
    print(
        f"hot tier {report['hot_full']:.0%} full of {size_text(capacity)} "
        f"(high water {config.policy.hot_high_water:.0%})"
    )
    print(
        f"scrub: {len(placements)} copies, {report['never_verified']} never verified"
        + ("" if oldest is None else f", oldest check {(now - oldest) / 86_400:.1f} days ago")
    )
    return 0


def _migrate(args: argparse.Namespace, config: Config) -> int:
    from cli.serve import connect
    from tiers.policy import size_text

    opened = _Tiers(config, need_warm=not args.dry_run)
    db = connect(config.database_url)
    try:
        migrator = _migrator(
            config, opened.manager, db, opened.mirror_copies, warm_configured(config)
        )
        if not args.dry_run:
            opened.manager.adopt(["hot", *(["warm"] if warm_configured(config) else [])])
        moves = [d for d in migrator.plan() if d.moves]
        notes = {d.facts.digest: migrator.copies_note(d) for d in moves}
        report = None if args.dry_run else migrator.apply(moves)
    finally:
        db.dispose()
        opened.close()
    listed: list[dict[str, Any]] = [
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
    if args.json:
        result: dict[str, Any] = {"dry_run": args.dry_run, "moves": listed}
        if report is not None:
            result.update(
                copied=report.copied,
                copied_bytes=report.copied_bytes,
                removed=report.removed,
                removed_bytes=report.removed_bytes,
                kept=[{"digest": str(d), "reason": r} for d, r in report.kept],
                failed=[{"digest": str(d), "error": e} for d, e in report.failed],
            )
        _print_json(result)
    else:
        for move in listed:
            note = f" [{move['note']}]" if move["note"] else ""
            print(
                f"{move['digest']}  {size_text(move['size'])}  {move['from']} -> {move['to']}: "
                f"{move['reason']}{note}"
            )
        verb = "would move" if args.dry_run else "to move"
        print(f"{len(listed)} blobs {verb}")
        if report is not None:
            print(
                f"copied {report.copied} ({size_text(report.copied_bytes)}), removed "
                f"{report.removed} ({size_text(report.removed_bytes)}), kept "
                f"{len(report.kept)}, failed {len(report.failed)}"
            )
            for digest, error in report.failed:
                print(f"  failed {digest}: {error}")
    if report is not None and report.failed:
        raise IntegrityError(f"{len(report.failed)} blobs could not be migrated")
    return 0


def _scrub(args: argparse.Namespace, config: Config) -> int:
    from cli.progress import Progress
    from tiers.scrub import Scrubber

    try:
        opened = _Tiers(config, need_warm=True, mirrors=True)
    except HeldByServer:
        return _scrub_through_server(args, config)
    try:
        bar = Progress("scrub", None)
        scrubber = Scrubber(opened.manager, rate=args.rate * 1e6 if args.rate > 0 else None)
        stats = scrubber.scrub_all(progress=lambda done, total: bar.set(done, total))
        bar.close()
    finally:
        opened.close()
    return _report_scrub(args, dataclasses.asdict(stats))


def _scrub_through_server(args: argparse.Namespace, config: Config) -> int:
    """The tiers are held by a running `vault serve`: it scrubs them (Store.Scrub)."""
    from cli.progress import Progress
    from tiers.scrub import ScrubStats
    from vault.client.connect import open_client

    print(
        f"the tiers are held by a running vault serve: scrubbing through it "
        f"({config.client.server})",
        file=sys.stderr,
    )
    totals: dict[str, int] | None = None
    bar = Progress("scrub", None)
    with open_client(config) as client:
        for update in client.scrub(rate_mb_s=max(args.rate, 0.0)):
            if update.finished:
                totals = {f.name: getattr(update, f.name) for f in dataclasses.fields(ScrubStats)}
            else:
                bar.set(update.done_bytes, update.total_bytes)
    bar.close()
    if totals is None:
        raise Unavailable("the vault's scrub ended without its totals")
    return _report_scrub(args, totals)


def _report_scrub(args: argparse.Namespace, stats: dict[str, int]) -> int:
    if args.json:
        _print_json(stats)
    else:
        print(
            f"{stats['copies']} copies checked ({stats['bytes']} bytes): {stats['faults']} "
            f"faults, {stats['repaired']} repaired, {stats['unrepairable']} unrepairable"
        )
    if stats["unrepairable"]:
        raise IntegrityError(f"{stats['unrepairable']} copies have no good copy anywhere")
    return 0
