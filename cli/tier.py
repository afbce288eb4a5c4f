"""`vault tier status|migrate`, `vault scrub` and `vault repair`, run on the vault's host against
its config and data folder like `vault mirror`: the tiers are opened and worked on by
vault/server/tier_admin.py, and the results printed here."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from cli.commands import add_command
from cli.output import print_json, shown

if TYPE_CHECKING:
    from vault.config import Config

# The server's modules (and the tiers under them) load only when a command here runs: every
# other `vault` command, the Slurm plugin's too, starts without them.


def add_tier_commands(sub: Any) -> None:
    """Add `vault tier …`, `vault scrub` and `vault repair` to the command's subparsers."""
    add_command(
        sub, "tier", _tier_arguments, help="tiers: status, migrate by policy (on the vault host)"
    )
    add_command(
        sub,
        "scrub",
        _scrub_arguments,
        help="re-verify every copy on every tier now; repair bad ones",
    )
    add_command(
        sub,
        "repair",
        _repair_arguments,
        help="rewrite a blob's damaged or missing copies from a file that hashes to its digest "
        "(on the vault host)",
    )


def _tier_arguments(p: argparse.ArgumentParser) -> None:
    commands = p.add_subparsers(dest="tier_command", required=True, metavar="COMMAND")
    q = commands.add_parser("status", help="per tier: blobs and bytes; the hot tier's fullness")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_status)
    q = commands.add_parser("migrate", help="move blobs between tiers as [policy] says, now")
    q.add_argument("--dry-run", action="store_true", help="only say what would move and why")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_migrate)


def _scrub_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=0.0, help="MB/s to keep to (default: no limit)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_scrub)


def _repair_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("digest", help="the blob's digest (sha256: or blake3:)")
    p.add_argument(
        "--from", dest="source", required=True, metavar="PATH", help="a file with its bytes"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_repair)


def _status(args: argparse.Namespace, config: Config) -> int:
    from vault.files import size_text
    from vault.server import tier_admin

    report = tier_admin.status(config)
    if args.json:
        print_json(report)
        return 0
    now = time.time()
    oldest = report["oldest_verified"]
    print(f"{'tier':<12} {'blobs':>8} {'bytes':>12}")
    for name, row in report["tiers"].items():
        print(f"{name:<12} {row['blobs']:>8} {size_text(row['bytes']):>12}")
    print(
        f"hot tier {report['hot_full']:.0%} full of {size_text(report['hot_capacity'])} "
        f"(high water {report['hot_high_water']:.0%})"
    )
    print(
        f"scrub: {report['copies']} copies, {report['never_verified']} never verified"
        + ("" if oldest is None else f", oldest check {(now - oldest) / 86_400:.1f} days ago")
    )
    return 0


def _migrate(args: argparse.Namespace, config: Config) -> int:
    from cli.progress import Progress
    from vault.errors import IntegrityError
    from vault.files import size_text
    from vault.server import tier_admin

    bar = Progress("tier migrate", None, unit="blobs")
    try:
        migration = tier_admin.migrate(config, dry_run=args.dry_run, progress=bar.set)
    finally:
        bar.close()
    listed, report = migration.moves, migration.report
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
        print_json(result)
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
                print(f"  failed {digest}: {shown(str(error))}")
    if report is not None and report.failed:
        raise IntegrityError(f"{len(report.failed)} blobs could not be migrated")
    return 0


def _scrub(args: argparse.Namespace, config: Config) -> int:
    from cli.progress import Progress
    from vault.server import tier_admin

    bar = Progress("scrub", None)
    try:
        stats = tier_admin.scrub(
            config,
            rate=args.rate * 1e6 if args.rate > 0 else None,
            progress=lambda done, total: bar.set(done, total),
        )
    except tier_admin.HeldByServer:
        return _scrub_through_server(args, config)
    bar.close()
    return _report_scrub(args, stats)


def _scrub_through_server(args: argparse.Namespace, config: Config) -> int:
    """The tiers are held by a running `vault serve`: it scrubs them (Store.Scrub)."""
    from cli.progress import Progress
    from vault.client.connect import open_client
    from vault.errors import Unavailable
    from vault.server import tier_admin

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
                totals = tier_admin.scrub_totals(update)
            else:
                bar.set(update.done_bytes, update.total_bytes)
    bar.close()
    if totals is None:
        raise Unavailable("the vault's scrub ended without its totals")
    return _report_scrub(args, totals)


def _repair(args: argparse.Namespace, config: Config) -> int:
    from pathlib import Path

    from vault.errors import IntegrityError, Unavailable
    from vault.server import tier_admin

    try:
        sha256, copies = tier_admin.repair(config, args.digest, Path(args.source))
    except tier_admin.HeldByServer:
        raise Unavailable(
            "a running `vault serve` holds the warm tier: `vault scrub` has it rewrite every "
            "damaged copy from a good one on another tier or mirror; if no good copy is left, "
            f"stop the server, run `vault repair {args.digest} --from {args.source}`, then "
            "start it again"
        ) from None
    import logging

    log = logging.getLogger("pinvault.tiers")
    for copy in copies:
        if copy.found:
            log.warning(
                "repair of %s from %s: %s: %s; %s",
                sha256,
                args.source,
                copy.tier,
                copy.found,
                copy.done,
            )
    failed = [copy for copy in copies if copy.good is False]
    rewritten = [copy for copy in copies if copy.found and copy.good]
    if args.json:
        print_json(
            {
                "digest": str(sha256),
                "copies": [
                    {"tier": c.tier, "found": c.found, "done": c.done, "good": c.good}
                    for c in copies
                ],
            }
        )
    else:
        for copy in copies:
            print(f"{copy.tier}: {f'{copy.found}; ' if copy.found else ''}{copy.done}")
        print(f"{sha256}: {len(rewritten)} copies rewritten, {len(failed)} failed")
    if failed:
        raise IntegrityError(
            f"{len(failed)} copies of {sha256} could not be rewritten: "
            + "; ".join(f"{c.tier}: {c.done}" for c in failed)
        )
    unchecked = [copy.tier for copy in copies if copy.good is None]
    if unchecked:
        raise Unavailable(f"not checked, out of reach: {', '.join(unchecked)}")
    return 0


def _report_scrub(args: argparse.Namespace, stats: dict[str, int]) -> int:
    from vault.errors import IntegrityError

    if args.json:
        print_json(stats)
    else:
        print(
            f"{stats['copies']} copies checked ({stats['bytes']} bytes): {stats['faults']} "
            f"faults, {stats['repaired']} repaired, {stats['unrepairable']} unrepairable"
        )
    if stats["unrepairable"]:
        raise IntegrityError(f"{stats['unrepairable']} copies have no good copy anywhere")
    return 0
