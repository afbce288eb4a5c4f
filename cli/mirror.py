"""`vault mirror status|sync|repair`, run on the vault's host against its config and data folder
(the replication queue is a SQLite file there, safe to share with a running `vault serve`),
and the composition of mirrors into the content store for `vault serve`."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiers.policy import size_text
from vault.config import Config
from vault.errors import IntegrityError, InvalidArgument, Unavailable
from vault.store.protocol import BlobStore, Closing

# The mirror modules (and botocore under them) load only when a mirror command or a server
# with mirrors needs them: every `vault` command, the Slurm plugin's too, starts quicker.
if TYPE_CHECKING:
    from mirror.mirrors import MirrorSet
    from mirror.store import ReplicatingStore
    from tiers.hot import HotTier

TIER_JOURNAL = "tiers.db"
# `vault mirror status` must answer promptly even when a mirror hangs.
_PROBE_TIMEOUT = 5.0


def mirrors_configured(config: Config) -> bool:
    return bool(config.mirrors.endpoints.strip())


def open_mirror_set(config: Config, *, probe: bool = False) -> MirrorSet:
    """The configured mirrors; with `probe`, with timeouts short enough for a status report."""
    from mirror.mirrors import open_mirrors, parse_endpoints

    settings = config.mirrors
    endpoints = parse_endpoints(
        settings.endpoints,
        environ=os.environ,
        credentials_prefix=settings.credentials_prefix,
        region=settings.region,
    )
    if not endpoints:
        raise InvalidArgument("no mirrors configured: set mirrors.endpoints")
    limit = _PROBE_TIMEOUT if probe else float("inf")
    return open_mirrors(
        endpoints,
        replicas=settings.replicas,
        connect_timeout=min(settings.connect_timeout, limit),
        read_timeout=min(settings.read_timeout, limit),
        attempts=1 if probe else settings.attempts,
    )


def queue_path(config: Config) -> Path:
    from mirror.queue import FILE_NAME

    return config.data_path / FILE_NAME


def open_replicating_store(
    config: Config,
    hot: HotTier,
    *,
    extra_tiers: Sequence[tuple[str, BlobStore]] = (),
    promote: bool = False,
    owned: Sequence[Closing] = (),
) -> ReplicatingStore:
    """For `vault serve`: the hot tier first, then `extra_tiers` (the warm tier), then the
    mirrors, under one tier manager (so a read a copy fails is served and repaired from
    another), with every put queued for its mirror copies and the replication worker
    started. `owned` are closed with the manager."""
    from mirror.queue import ReplicationQueue
    from mirror.replicate import Replicator
    from mirror.store import MirrorReads, ReplicatingStore
    from tiers.manager import TierManager

    mirrors = open_mirror_set(config)
    queue = ReplicationQueue(queue_path(config))
    manager = TierManager(
        [
            ("hot", hot),
            *extra_tiers,
            *((f"mirror-{m.name}", MirrorReads(m)) for m in mirrors),
        ],
        journal=config.data_path / TIER_JOURNAL,
        promote=promote,
        owned=list(owned),
    )
    replicator = Replicator(
        manager,
        mirrors,
        queue,
        retry_min=config.mirrors.retry_min,
        retry_max=config.mirrors.retry_max,
    )
    replicator.start()
    # Copies queued before a restart are due at once: the mirror may well be back.
    queue.retry_now()
    replicator.notify()
    return ReplicatingStore(manager, mirrors, queue, replicator)


# -- the commands ------------------------------------------------------------------------------


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


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False))


def _status(args: argparse.Namespace, config: Config) -> int:
    from mirror.queue import ReplicationQueue
    from mirror.status import mirror_status

    with open_mirror_set(config, probe=True) as mirrors:
        queue = ReplicationQueue(queue_path(config))
        try:
            found = mirror_status(mirrors, queue)
        finally:
            queue.close()
    if args.json:
        _print_json([status.as_json() for status in found])
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
    from mirror.queue import ReplicationQueue
    from mirror.repair import queue_missing
    from mirror.replicate import DrainReport, Replicator
    from tiers.hot import HotTier

    hot = HotTier(config.hot_path)
    with open_mirror_set(config) as mirrors:
        queue = ReplicationQueue(queue_path(config))
        try:
            queued = queue_missing(hot, mirrors, queue)
            reports: dict[str, DrainReport] = {}
            if not args.queue_only:
                queue.retry_now()
                replicator = Replicator(hot, mirrors, queue)
                reports = {mirror.name: replicator.drain(mirror) for mirror in mirrors}
            left = {name: counts.queued for name, counts in queue.counts().items()}
        finally:
            queue.close()
    if args.json:
        _print_json(
            {
                "queued": queued,
                "mirrors": {
                    name: {
                        "copied": r.copied,
                        "copied_bytes": r.copied_bytes,
                        "failed": r.failed,
                        "left": left.get(name, 0),
                    }
                    for name, r in reports.items()
                },
            }
        )
    else:
        print(f"queued {queued} copies")
        for name, r in reports.items():
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
    from mirror.queue import ReplicationQueue
    from mirror.repair import repair
    from tiers.hot import HotTier

    hot: BlobStore = HotTier(config.hot_path)
    with open_mirror_set(config) as mirrors:
        queue = ReplicationQueue(queue_path(config))
        try:
            report = repair(hot, mirrors, queue)
        finally:
            queue.close()
    if args.json:
        _print_json(
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
