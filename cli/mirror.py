"""`vault mirror status|sync|repair`, run on the vault's host against its config and data folder
(the replication queue is a SQLite file there, safe to share with a running `vault serve`): the
mirrors are opened and worked on by vault/server/mirror_admin.py, and the results printed here."""

from __future__ import annotations

import argparse
from typing import Any

from cli.output import print_json
from vault.config import Config
from vault.errors import IntegrityError, Unavailable
from vault.files import size_text

# The server's modules (and the mirrors and botocore under them) load only when a command here
# runs: every other `vault` command, the Slurm plugin's too, starts without them.


def add_mirror_commands(sub: Any) -> None:
    """Add `vault mirror …` to the command's subparsers."""

    p = sub.add_parser("mirror", help="S3 peer mirrors: status, sync, repair (on the vault host)")
    commands = p.add_subparsers(dest="mirror_command", required=True, metavar="COMMAND")

    q = commands.add_parser(
        "status", help="per mirror: reachable, verified objects and bytes, queued copies, lag"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_status)

    q = commands.add_parser(
        "sync", help="queue every copy a blob lacks, then copy what is queued (verified)"
    )
    q.add_argument(
        "--queue-only", action="store_true", help="only queue; leave the copying to `vault serve`"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_sync)

    q = commands.add_parser(
        "repair", help="read back every copy on every mirror; rewrite bad or missing ones"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_repair)


def _status(args: argparse.Namespace, config: Config) -> int:
    from vault.server import mirror_admin

    found = mirror_admin.status(config)
    if args.json:
        print_json([status.as_json() for status in found])
        return 0
    print(f"{'mirror':<12} {'reachable':<9} {'objects':>8} {'bytes':>10} {'queued':>7} lag")
    for s in found:
        print(
            f"{s.name:<12} {'yes' if s.reachable else 'NO':<9} {s.objects:>8} "
            f"{size_text(s.bytes):>10} {s.queued:>7} {s.lag_seconds:.0f}s"
        )
        if not s.reachable:
            print(f"  unreachable: {' '.join(s.error.split())}")
        if s.queued and s.last_error:
            print(f"  last error: {' '.join(s.last_error.split())}")
    return 0


def _sync(args: argparse.Namespace, config: Config) -> int:
    from vault.server import mirror_admin

    synced = mirror_admin.sync(config, queue_only=args.queue_only)
    queued, drained, left = synced.queued, synced.drained, synced.left
    if args.json:
        print_json(
            {
                "queued": queued,
                "mirrors": {
                    name: {
                        "copied": r.copied,
                        "copied_bytes": r.copied_bytes,
                        "failed": r.failed,
                        "left": left.get(name, 0),
                    }
                    for name, r in drained.items()
                },
            }
        )
    else:
        print(f"queued {queued} copies")
        for name, r in drained.items():
            print(
                f"{name}: copied {r.copied} ({size_text(r.copied_bytes)}), failed {r.failed}, "
                f"{left.get(name, 0)} left"
            )
    behind = {name: count for name, count in left.items() if count}
    if behind and not args.queue_only:
        raise Unavailable(
            "copies still queued: "
            + ", ".join(f"{count} for {name}" for name, count in sorted(behind.items()))
            + " (the vault retries them; `vault mirror status` shows why)"
        )
    return 0


def _repair(args: argparse.Namespace, config: Config) -> int:
    from vault.server import mirror_admin

    report = mirror_admin.repair(config)
    if args.json:
        print_json(
            {
                "checked": report.checked,
                "verified": report.verified,
                "rewritten": report.rewritten,
                "queued": report.queued,
                "lost": report.lost,
                "unreachable": report.unreachable,
                "events": report.events,
            }
        )
    else:
        for event in report.events:
            print(event)
        print(
            f"{report.checked} blobs checked: {report.verified} mirror copies verified, "
            f"{report.rewritten} rewritten, {report.queued} queued, {report.lost} lost"
        )
    if report.lost:
        raise IntegrityError(f"{report.lost} copies have no good copy anywhere to repair from")
    if report.unreachable:
        raise Unavailable(
            "not checked, unreachable: "
            + "; ".join(f"{name} ({error})" for name, error in report.unreachable.items())
        )
    return 0
