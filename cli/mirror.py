"""`vault mirror add|status|sync|repair|rekey`, run on the vault's host against its config and data
folder (the replication queue is a SQLite file there, safe to share with a running `vault
serve`): the mirrors are checked, opened and worked on by vault/server/mirror_admin.py, and the
results printed here."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from cli.commands import add_command
from cli.output import print_json, shown

# The server's modules (and the mirrors and botocore under them) load only when a command here
# runs: every other `vault` command, the Slurm plugin's too, starts without them.
if TYPE_CHECKING:
    from vault.config import Config
    from vault.server.mirror_admin import MirrorAdded


def add_mirror_commands(sub: Any) -> None:
    """Add `vault mirror …` to the command's subparsers."""
    add_command(
        sub,
        "mirror",
        _arguments,
        help="S3 peer mirrors: add, status, sync, repair (on the vault host)",
    )


def _arguments(p: argparse.ArgumentParser) -> None:
    commands = p.add_subparsers(dest="mirror_command", required=True, metavar="COMMAND")

    q = commands.add_parser(
        "add",
        help="check an S3 bucket with its keys (PVMIRROR_<NAME>_ACCESS_KEY_ID and "
        "_SECRET_ACCESS_KEY) and add it to the config file as a mirror",
    )
    q.add_argument("name", metavar="NAME", help="lowercase letters, digits and dashes")
    q.add_argument("--endpoint", required=True, metavar="URL", help="http(s)://HOST[:PORT]")
    q.add_argument("--bucket", required=True)
    q.add_argument("--prefix", default="", help="keep the vault's objects under this prefix")
    q.add_argument(
        "--create-bucket", action="store_true", help="create the bucket if it does not exist"
    )
    q.add_argument(
        "--replicas", type=int, metavar="N", help="set mirrors.replicas: copies of each blob"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_add)

    q = commands.add_parser(
        "status",
        help="per mirror: reachable, verified objects and bytes, queued copies, lag, last "
        "verified (exit 69, unavailable, if any mirror is down)",
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

    q = commands.add_parser(
        "rekey",
        help="seal every copy on the encrypted mirrors anew under the key ring's first key, "
        "so that older keys can be dropped (docs/encryption.md)",
    )
    q.add_argument(
        "--mirror", metavar="NAME", help="only this mirror (default: every encrypted one)"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_rekey)


def _add(args: argparse.Namespace, config: Config) -> int:
    from vault.config import file_path
    from vault.server import mirror_admin

    added = mirror_admin.add(
        config,
        file_path(args.config),
        name=args.name,
        url=args.endpoint,
        bucket=args.bucket,
        prefix=args.prefix,
        create_bucket=args.create_bucket,
        replicas=args.replicas,
    )
    short = len(added.mirrors) < added.replicas
    if args.json:
        print_json(
            {
                "name": added.location.name,
                "endpoint": added.location.url,
                "bucket": added.location.bucket,
                "prefix": added.location.prefix,
                "bucket_created": added.bucket_created,
                "credentials": list(added.credentials),
                "config": str(added.config_file),
                "mirrors": added.mirrors,
                "replicas": added.replicas,
                "ready": not short,
            }
        )
        return 0
    _print_added(added, short)
    return 0


def _print_added(added: MirrorAdded, short: bool) -> None:
    where = added.location.item.partition("=")[2]
    print(f"mirror {added.location.name}: {where}")
    if added.bucket_created:
        print(f"  created bucket {added.location.bucket}")
    print(f"  keys {' and '.join(added.credentials)}: a test object written, read back, deleted")
    count = len(added.mirrors)
    print(
        f"added to {added.config_file}: {_count(count, 'mirror')} ({', '.join(added.mirrors)}), "
        f"{_count(added.replicas, 'copy', 'copies')} of each blob"
    )
    if short:
        print(
            f"  mirrors.replicas is {added.replicas}: `vault serve` refuses to start with "
            f"fewer mirrors (add {added.replicas - count} more, or lower it with --replicas)"
        )
    print(
        "`vault serve` uses it from its next start (restart a running one, with the keys in "
        "its environment); `vault mirror sync` then copies the blobs stored before"
    )


def _status(args: argparse.Namespace, config: Config) -> int:
    from vault.errors import Unavailable
    from vault.files import size_text
    from vault.server import mirror_admin

    found = mirror_admin.status(config)
    if args.json:
        print_json([status.as_json() for status in found])
    else:
        print(
            f"{'mirror':<12} {'reachable':<9} {'objects':>8} {'bytes':>10} {'queued':>7} "
            f"{'lag':>6}  last verified"
        )
        now = time.time()
        for s in found:
            verified = "never" if s.last_verified is None else _ago(now - s.last_verified)
            print(
                f"{s.name:<12} {'yes' if s.reachable else 'NO':<9} {s.objects:>8} "
                f"{size_text(s.bytes):>10} {s.queued:>7} {s.lag_seconds:>5.0f}s  {verified}"
            )
            if not s.reachable:
                print(f"  unreachable: {shown(' '.join(s.error.split()))}")
            if s.queued and s.last_error:
                print(f"  last error: {shown(' '.join(s.last_error.split()))}")
    down = [f"{s.name} ({' '.join(s.error.split())})" for s in found if not s.reachable]
    if down:
        raise Unavailable("mirrors down: " + "; ".join(down))
    return 0


def _count(number: int, one: str, many: str = "") -> str:
    return f"{number} {one if number == 1 else many or one + 's'}"


def _ago(seconds: float) -> str:
    """An age as people read it: 40s ago, 5m ago, 3h ago, 2d ago."""
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def _sync(args: argparse.Namespace, config: Config) -> int:
    from vault.errors import Unavailable
    from vault.files import size_text
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
    from cli.progress import Progress
    from vault.errors import IntegrityError, Unavailable
    from vault.server import mirror_admin

    bar = Progress("mirror repair", None, unit="blobs")
    try:
        report = mirror_admin.repair(config, progress=lambda _: bar.advance(1))
    finally:
        bar.close()
    # Every copy found bad and what became of it goes to the log too (the journal of the
    # host's service manager), as the server logs the repairs it makes itself.
    import logging

    log = logging.getLogger("pinvault.mirror")
    for event in report.events:
        log.log(logging.ERROR if "data loss" in event else logging.WARNING, "repair: %s", event)
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


def _rekey(args: argparse.Namespace, config: Config) -> int:
    from cli.progress import Progress
    from vault.errors import FailedPrecondition, IntegrityError
    from vault.server.assembly import open_mirror_set

    with open_mirror_set(config) as mirrors:
        chosen = [mirrors.get(args.mirror)] if args.mirror else [m for m in mirrors if m.encrypted]
        if not chosen or not all(mirror.encrypted for mirror in chosen):
            raise FailedPrecondition(
                f"mirror {args.mirror} is not encrypted (mirrors.encrypted)"
                if args.mirror
                else "no mirror is encrypted (mirrors.encrypted): nothing to rekey"
            )
        reports = {}
        bar = Progress("mirror rekey", None, unit="blobs")
        try:
            for mirror in chosen:
                reports[mirror.name] = mirror.rekey(progress=lambda _: bar.advance(1))
        finally:
            bar.close()
    if args.json:
        print_json(
            {
                "mirrors": {
                    name: {
                        "rewritten": r.rewritten,
                        "current": r.current,
                        "unreadable": r.unreadable,
                    }
                    for name, r in reports.items()
                }
            }
        )
    else:
        for name, r in reports.items():
            for error in r.unreadable:
                print(f"{name}: {error}")
            print(
                f"{name}: {r.rewritten} copies sealed anew, {r.current} already under the "
                f"current key, {len(r.unreadable)} unreadable"
            )
    unreadable = sum(len(r.unreadable) for r in reports.values())
    if unreadable:
        raise IntegrityError(
            f"{unreadable} copies could not be read to rekey: `vault mirror repair` rewrites "
            "them from a good copy"
        )
    return 0
