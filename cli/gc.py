"""`vault gc` (on the vault's host, its server stopped: a running server runs its own passes)
and `vault hold` (from anywhere: a hold entry, which the gc never releases past)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cli.commands import add_command
from cli.output import print_json, shown

if TYPE_CHECKING:
    from vault.client import VaultClient
    from vault.config import Config

# The server's modules load only when `vault gc` runs.


def add_gc_commands(sub: Any, client: Callable[[Config], VaultClient]) -> None:
    """Add `vault gc` and `vault hold` to the command's subparsers."""
    add_command(
        sub,
        "gc",
        _gc_arguments,
        help="release the bytes [retention] lets go, each by a release entry (on the vault host)",
    )

    def hold_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("digests", nargs="+", metavar="DIGEST", help="blobs the gc must keep")
        p.add_argument("--reason", default="", help="why, recorded in the hold entry")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=lambda args, config: _hold(args, config, client))

    add_command(sub, "hold", hold_arguments, help="keep blobs from the gc, by a hold entry")


def _gc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run", action="store_true", help="only say what would be released, and why"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_gc)


def _gc(args: argparse.Namespace, config: Config) -> int:
    from vault.files import size_text
    from vault.server import gc_admin
    from vault.server.retention import Plan

    result = gc_admin.gc(config, dry_run=args.dry_run)
    if args.json:
        print_json({"dry_run": args.dry_run, **result.as_json()})
        return 0
    if isinstance(result, Plan):
        for planned in result.releases:
            print(
                f"{planned.digest}  {size_text(planned.size)}  {planned.rule}: "
                f"{shown(planned.reason)}"
            )
        for planned in result.finishes:
            print(f"{planned.digest}  released by entry {planned.released}: bytes left to remove")
        print(
            f"{len(result.releases)} blobs ({size_text(result.release_bytes)}) would be "
            f"released; {len(result.finishes)} earlier releases would be finished"
        )
        return 0
    if result.skipped:
        print(f"nothing done: {result.skipped}")
        return 0
    for planned in result.released:
        print(f"{planned.digest}  {size_text(planned.size)}  released: {planned.rule}")
    print(
        f"released {len(result.released)} blobs ({size_text(result.released_bytes)}); "
        f"finished {len(result.finished)} earlier releases; kept {len(result.kept)} pinned "
        f"meanwhile; {len(result.failed)} copies left for the next pass"
    )
    if result.freed:
        print(f"the warm tier's packs of released blobs alone removed: {size_text(result.freed)}")
    if result.reclaimable:
        print(
            f"the warm tier's shared packs still hold {size_text(result.reclaimable)} of "
            "deleted blobs beside live ones"
        )
    return 0


def _hold(args: argparse.Namespace, config: Config, client: Callable[[Config], VaultClient]) -> int:
    meta = {"reason": args.reason} if args.reason else None
    with client(config) as connected:
        proven = [connected.pin("hold", digest, meta=meta) for digest in args.digests]
    if args.json:
        print_json([{"index": p.entry.index, "digest": p.entry.subjects[0]} for p in proven])
        return 0
    for p in proven:
        print(f"held as entry {p.entry.index}: {p.entry.subjects[0]}")
    return 0
