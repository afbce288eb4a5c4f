"""The `vault` command: one line of error (one JSON object with `--json`) and the exit status of
its kind (docs/cli.md) for anything that goes wrong; a start that loads only the parser until a
command runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn

from cli.access import add_access_commands
from cli.commands import add_command, add_global_options, lazy
from cli.dataset import add_dataset_commands
from cli.gc import add_gc_commands
from cli.mirror import add_mirror_commands
from cli.output import (
    EXIT_FAILED,
    EXIT_INTEGRITY,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    fail,
    print_json,
    report,
    shown,
)
from cli.run import add_run_commands
from cli.serve import add_serve_command, create_token_offline
from cli.signals import terminable
from cli.tier import add_tier_commands
from cli.times import time_arg

# Only what the parser needs loads before a command runs: each command imports the client
# (gRPC, protobuf), the ledger's signatures (cryptography) or the server inside its handler.
if TYPE_CHECKING:
    from vault.client import BlobInfo, ProvenEntry, VaultClient
    from vault.config import Config
    from vault.ledger.entry import Entry

# Entries a worker of `vault verify` audits at once unless --chunk says otherwise (a power of
# two; vault.client.audit.CHUNK is the library's default, and the same).
AUDIT_CHUNK: Final = 1 << 16


def _client(config: Config) -> VaultClient:
    from vault.client.connect import open_client

    return open_client(config)


def _blob_dict(blob: BlobInfo) -> dict[str, Any]:
    return {
        "sha256": str(blob.sha256),
        "blake3": str(blob.blake3),
        "size": blob.size,
        "stored_at": blob.stored_at,
    }


def _entry_dict(entry: Entry) -> dict[str, Any]:
    return {
        "index": entry.index,
        "kind": entry.kind,
        "subjects": list(entry.subjects),
        "meta": dict(entry.meta),
        "external": entry.external,
        "author": entry.author,
        "time": entry.time,
        "prev": entry.prev.hex(),
    }


def _entry_line(entry: Entry) -> str:
    meta = " ".join(f"{k}={v}" for k, v in entry.meta.items())
    external = " (external)" if entry.external else ""
    return shown(
        f"{entry.index:>8}  {entry.time}  {entry.kind:<10} {' '.join(entry.subjects)}{external}"
        f"  by {entry.author}" + (f"  {meta}" if meta else "")
    )


# ---------------------------------------------------------------------- commands


@terminable
def cmd_put(args: argparse.Namespace, config: Config) -> int:
    import os

    from cli.progress import Progress
    from vault.errors import InvalidArgument

    if args.copies is not None and not args.direct:
        raise InvalidArgument("--copies says how many mirrors a --direct put uploads to")
    results = []
    with _client(config) as client:
        for path in args.paths:
            if path == "-":
                # A reader of its own: the thread that sends the put may be stopped inside a
                # read of it when the command is interrupted, holding the reader's lock, and
                # the interpreter closes sys.stdin on its way out.
                source: Any = open(sys.stdin.fileno(), "rb", closefd=False)  # noqa: SIM115
                total = None
            else:
                source = path
                try:
                    total = os.stat(path).st_size
                except OSError as exc:
                    raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
            if args.direct:
                if source is not path or args.expect:
                    raise InvalidArgument(
                        "--direct uploads files, named by their own digest: not standard "
                        "input, and not with --expect"
                    )
                result = client.put_direct(
                    path, uploads=config.state_folder / "uploads", copies=args.copies
                )
                results.append(
                    {
                        "path": path,
                        "created": result.created,
                        "mirrors": list(result.mirrors),
                        **_blob_dict(result.blob),
                    }
                )
                if not args.json:
                    print(f"{result.blob.sha256}  {result.blob.blake3}  {shown(str(path))}")
                    if result.mirrors:
                        print(
                            f"  verified on mirrors {', '.join(map(shown, result.mirrors))}; "
                            "any other copies follow from the vault's queue",
                            file=sys.stderr,
                        )
                continue
            bar = Progress(f"put {path}", total) if not args.json else None
            try:
                result = client.put(source, expected=args.expect, progress=bar)
            finally:
                if bar:
                    bar.close()
            results.append({"path": path, "created": result.created, **_blob_dict(result.blob)})
            if not args.json:
                print(f"{result.blob.sha256}  {result.blob.blake3}  {shown(str(path))}")
    if args.json:
        print_json(results if len(results) > 1 else results[0])
    return 0


@terminable
def cmd_get(args: argparse.Namespace, config: Config) -> int:
    from cli.progress import Progress

    with _client(config) as client:
        if args.direct:
            if not args.output or args.output == "-" or args.offset or args.length is not None:
                from vault.errors import InvalidArgument

                raise InvalidArgument("--direct fetches a whole blob into a file: give -o PATH")
            info = client.get_direct(args.digest, args.output)
            if args.json:
                print_json({"path": args.output, **_blob_dict(info)})
            return 0
        if args.output and args.output != "-":
            whole = args.offset == 0 and args.length is None
            stat = client.stat(args.digest) if not args.json and whole else None
            # A range moves its own chunks, or the whole blob when no pin records its chunk
            # root: its bar counts bytes without a total.
            total = stat.blob.size if stat else None
            bar = Progress(f"get {args.digest[:19]}…", total) if not args.json else None
            try:
                info = client.get(
                    args.digest, args.output, offset=args.offset, length=args.length, progress=bar
                )
            finally:
                if bar:
                    bar.close()
            if args.json:
                print_json({"path": args.output, **_blob_dict(info)})
            return 0
        # Standard output cannot take bytes back: nothing is written before all is verified.
        sys.stdout.flush()
        client.copy_to(args.digest, sys.stdout.fileno(), offset=args.offset, length=args.length)
    return 0


def cmd_stat(args: argparse.Namespace, config: Config) -> int:
    with _client(config) as client:
        stat = client.stat(args.digest)
    if args.json:
        print_json({**_blob_dict(stat.blob), "pins": [_entry_dict(e) for e in stat.pins]})
        return 0
    print(f"sha256     {stat.blob.sha256}")
    print(f"blake3     {stat.blob.blake3}")
    print(f"size       {stat.blob.size}")
    print(f"stored     {stat.blob.stored_at}")
    if not stat.pins:
        print("pins       none")
    for entry in stat.pins:
        print(f"pin        {_entry_line(entry).strip()}")
    return 0


def cmd_find_missing(args: argparse.Namespace, config: Config) -> int:
    digests = list(args.digests)
    if not digests or digests == ["-"]:
        digests = [line.strip() for line in sys.stdin if line.strip()]
    with _client(config) as client:
        missing = client.find_missing(digests)
    if args.json:
        print_json({"missing": missing})
    else:
        for d in missing:
            print(d)
    # The list is the answer; the status says whether it is empty, as a look-up's does.
    return EXIT_NOT_FOUND if missing else 0


def _parse_meta(items: Sequence[str]) -> dict[str, str]:
    from vault.errors import InvalidArgument

    meta: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--meta {item!r}: expected key=value")
        if key in meta:
            raise InvalidArgument(f"--meta key {key!r} is given twice")
        meta[key] = value
    return meta


def _proven_dict(p: ProvenEntry) -> dict[str, Any]:
    return {
        **_entry_dict(p.entry),
        "leaf_hash": p.leaf_hash.hex(),
        "inclusion": [h.hex() for h in p.proof],
        "checkpoint": {"size": p.checkpoint.size, "root": p.checkpoint.root.hex()},
    }


def cmd_pin(args: argparse.Namespace, config: Config) -> int:
    meta = _parse_meta(args.meta)
    with _client(config) as client:
        # The client has the vault prove itself (its key, a checkpoint consistent with the last
        # one verified) before it asks for the append.
        proven = client.pin(
            args.kind,
            args.digests,
            meta=meta,
            external=args.external,
            chunk_root=True if args.chunk_root else None,
        )
    if args.json:
        print_json(_proven_dict(proven))
    else:
        subjects = " ".join(proven.entry.subjects)
        print(f"pinned as entry {proven.entry.index}: {proven.entry.kind} {subjects}")
        print(f"  included in checkpoint of size {proven.checkpoint.size} (verified)")
    return 0


def cmd_lookup(args: argparse.Namespace, config: Config) -> int:
    import base64

    from vault.errors import NotFound

    try:
        with _client(config) as client:
            found = client.lookup(args.digest)
        if not found:
            raise NotFound(f"no entry pins {args.digest}")
    except NotFound:
        # A digest never pinned: no entries, and the status of a look-up that found none
        # (docs/cli.md); the reason goes to standard error.
        if args.json:
            print_json([])
        raise
    if args.json:
        print_json([_proven_dict(p) for p in found])
        return 0
    checkpoint = found[0].checkpoint
    print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'} pin {args.digest}")
    for p in found:
        print(_entry_line(p.entry))
    root = base64.b64encode(checkpoint.root).decode()
    print(f"verified: inclusion and completeness in checkpoint size {checkpoint.size} root {root}")
    return 0


def cmd_log(args: argparse.Namespace, config: Config) -> int:
    from vault.digest import Digest
    from vault.errors import InvalidArgument
    from vault.ledger.entry import ALL_KINDS

    if args.kind and args.kind not in ALL_KINDS:
        raise InvalidArgument(f"unknown kind {args.kind!r}: expected one of {', '.join(ALL_KINDS)}")
    with _client(config) as client:
        for entry in client.log(
            start=args.start,
            limit=args.limit,
            kind=args.kind or "",
            digest=str(Digest.parse(args.digest)) if args.digest else "",
            author=args.author or "",
            since=args.since or "",
            until=args.until or "",
        ):
            if args.json:
                print_json(_entry_dict(entry))
            else:
                print(_entry_line(entry))
    return 0


def cmd_checkpoint(args: argparse.Namespace, config: Config) -> int:
    import base64

    with _client(config) as client:
        if args.key:
            key = str(client.verifier())
            if args.json:
                print_json({"verifier_key": key})
            else:
                print(key)
            return 0
        note = client.checkpoint_note()
        if args.json:
            checkpoint = client.verifier().open(note)
            print_json(
                {
                    "origin": checkpoint.origin,
                    "size": checkpoint.size,
                    "root": base64.b64encode(checkpoint.root).decode(),
                    "note": note,
                }
            )
        else:
            sys.stdout.write(note)
    return 0


def cmd_proof(args: argparse.Namespace, config: Config) -> int:
    with _client(config) as client:
        if args.proof == "inclusion":
            proof = client.inclusion_proof(args.index, args.size)
            value: dict[str, Any] = {
                "index": proof.index,
                "size": proof.size,
                "leaf_hash": proof.leaf_hash.hex(),
                "hashes": [h.hex() for h in proof.hashes],
            }
        else:
            c = client.consistency_proof(args.old, args.new)
            value = {
                "old_size": c.old_size,
                "new_size": c.new_size,
                "hashes": [h.hex() for h in c.hashes],
            }
    if args.json:
        print_json(value)
    else:
        for key, item in value.items():
            if key == "hashes":
                print("hashes")
                for h in item:
                    print(f"  {h}")
            else:
                print(f"{key:<10} {item}")
    return 0


def cmd_verify(args: argparse.Namespace, config: Config) -> int:
    from cli.progress import Progress
    from cli.verify_tiles import verify_tiles
    from vault import config as config_module
    from vault.client.audit import default_workers

    overrides: dict[str, Any] = {}
    if args.witness:
        overrides["witnesses"] = " ".join(args.witness)
    if args.min_witnesses is not None:
        overrides["min_witnesses"] = args.min_witnesses
    if args.max_witness_age is not None:
        overrides["max_witness_age"] = args.max_witness_age
    if overrides:
        config = config_module.apply(config, {"client": overrides}, "the command line")
    # With --json, one object at the end; the lines a person reads are not printed.
    say: Callable[[str], None] = (lambda line: None) if args.json else print
    result: dict[str, Any] = {}
    with _client(config) as client:
        if client.witnesses is not None:
            # Before the audit, so that it checks the stored entries against this checkpoint.
            checkpoint, cosignatures = client.witnessed()
            names = [c.witness.label for c in cosignatures]
            say(
                f"witnesses: checkpoint of size {checkpoint.size} cosigned by "
                f"{', '.join(names)} ({client.witnesses.required} of "
                f"{len(client.witnesses.witnesses)} required)"
            )
            result["witnesses"] = {"size": checkpoint.size, "cosigned_by": names}
        bar = Progress("verify ledger", None, unit="entries")
        report = client.audit(
            progress=lambda done, total: bar.set(done, total),
            workers=args.workers or default_workers(),
            chunk=args.chunk,
            subject_map=args.subject_map,
        )
        bar.close()
        ok = report.ok
        failures = sorted(report.failures, key=lambda f: f.index)
        result["ledger"] = {
            "ok": report.ok,
            "entries": report.entries,
            "checkpoints": report.checkpoints,
            "workers": report.workers,
            "first_break": report.first.index if report.first else None,
            "failures": [{"index": f.index, "message": f.message} for f in failures],
        }
        say(f"ledger: {report.entries} entries, {report.checkpoints} checkpoints checked")
        for failure in failures[:20]:
            say(f"  FAIL {failure}")
        if len(failures) > 20:
            say(f"  … and {len(failures) - 20} more failures")
        if report.first:
            say(f"ledger verification FAILED: first break at index {report.first.index}")
        else:
            say("ledger OK")
        if args.tiles is not None:
            size, tiles = verify_tiles(client, args.tiles)
            result["tiles"] = {"size": size, "files": tiles.files, "first_bad": tiles.bad}
            if tiles.ok:
                say(f"tiles OK: {tiles.files} files of the checkpoint of size {size}")
            else:
                say(f"tiles verification FAILED: {tiles.bad}: {tiles.reason}")
                ok = False
        if args.blobs:
            bar = Progress("verify blobs", None, unit="blobs")
            checked = 0
            failed: list[dict[str, str]] = []
            for step in client.verify_blobs():
                checked = step.checked
                bar.set(step.checked, step.total)
                if step.failed_digest:
                    failed.append({"digest": step.failed_digest, "failure": step.failure})
                    say(f"  FAIL blob {step.failed_digest}: {step.failure}")
                if step.copies:
                    say(f"  blob {step.digest}: {_copies_line(step)}")
            bar.close()
            say(f"blobs: {checked} pinned blobs checked, {len(failed)} failed")
            result["blobs"] = {"checked": checked, "failed": failed}
            ok = ok and not failed
    result["ok"] = ok
    if args.json:
        print_json(result)
    # What it found is printed above; a break is an integrity failure, as a failed check that
    # stops the audit is (docs/cli.md).
    return 0 if ok else EXIT_INTEGRITY


def _copies_line(step: Any) -> str:
    """Where a blob's copies are and when each was last verified; the repairs recorded."""
    places = ", ".join(
        f"{c.place} (verified {_when(c.last_verified)})"
        if c.last_verified
        else f"{c.place} (never verified)"
        for c in step.copies
    )
    repairs = f"; {step.repairs} repair{'s' if step.repairs != 1 else ''} recorded"
    return f"{len(step.copies)} copies: {places}" + (repairs if step.repairs else "")


def _when(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------- parser


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, found {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, found {value}")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a positive number, found 0")
    return value


def _power_of_two(text: str) -> int:
    value = _positive(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, found {value}")
    return value


def _witness_key(text: str) -> str:
    from vault.errors import InvalidArgument
    from vault.ledger.cosignature import WitnessKey

    try:
        return str(WitnessKey.from_string(text))
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class UsageError(Exception):
    """A command line the parser refuses; `main` reports it as every other error, exit 2."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (one JSON object with --json), as every other error of the
    command; exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{' '.join(message.split())} (see {self.prog} --help)")


def build_parser(*, lazy_commands: bool = False) -> argparse.ArgumentParser:
    """The command's parser; with `lazy_commands`, each command's arguments are added only
    when it is the one run (cli/commands.py), as `main` does."""
    parser = _Parser(
        prog="vault", description="pinvault: a verifiable pin vault and content store."
    )
    add_global_options(parser)
    if lazy_commands:
        lazy(parser)
    parser.epilog = (
        "The options above may also follow the command (vault mirror add --config F). "
        "Exit statuses: docs/cli.md (0 ok, 2 usage, 64-78 by kind of failure)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_serve_command(sub)
    add_command(
        sub,
        "put",
        _put_arguments,
        help="store files (or - for standard input); prints their digests",
    )
    add_command(sub, "get", _get_arguments, help="fetch a blob by digest, verified")
    add_command(sub, "stat", _stat_arguments, help="size, digests, time stored and pins of a blob")
    add_command(
        sub,
        "find-missing",
        _find_missing_arguments,
        help=f"print the digests the store lacks (exit {EXIT_NOT_FOUND} if any)",
    )
    add_command(sub, "pin", _pin_arguments, help="append a pin entry to the ledger")
    add_command(
        sub,
        "lookup",
        _lookup_arguments,
        help="entries pinning a digest, with verified inclusion proofs "
        f"(exit {EXIT_NOT_FOUND} if none)",
    )
    add_command(sub, "log", _log_arguments, help="page through ledger entries")
    add_command(
        sub,
        "checkpoint",
        _checkpoint_arguments,
        help="print the latest signed checkpoint (verified)",
    )
    add_command(sub, "proof", _proof_arguments, help="print an inclusion or consistency proof")
    add_command(
        sub,
        "verify",
        _verify_arguments,
        help="audit the whole ledger (and with --blobs, every pinned blob)",
    )

    add_dataset_commands(sub, _client)
    add_mirror_commands(sub)
    add_tier_commands(sub)
    add_gc_commands(sub, _client)
    add_run_commands(sub, _client)
    add_access_commands(sub, _client, create_token_offline)
    add_command(
        sub,
        "bundle",
        _bundle_arguments,
        help="write a run's, a dataset's or an entry's proof bundle; verify one with no vault",
    )
    # The two servers of the scheduler's side: their modules load only when they run.
    add_command(
        sub,
        "admission-agent",
        _agent_arguments,
        help="answer the Slurm plugin's admissions on a Unix socket, with one warm client",
    )
    add_command(
        sub,
        "k8s-webhook",
        _webhook_arguments,
        help="refuse Kubernetes pods and jobs whose image or dataset is not pinned",
    )
    return parser


def _agent_arguments(p: argparse.ArgumentParser) -> None:
    from cli.agent import agent_arguments

    agent_arguments(p, connect=_client)


def _bundle_arguments(p: argparse.ArgumentParser) -> None:
    from cli.bundle import bundle_arguments

    bundle_arguments(p, _client)


def _webhook_arguments(p: argparse.ArgumentParser) -> None:
    from cli.k8s_webhook import webhook_arguments

    webhook_arguments(p, connect=_client)


def _put_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--expect", metavar="DIGEST", help="refuse unless the bytes hash to DIGEST")
    p.add_argument(
        "--direct",
        action="store_true",
        help="upload straight to the vault's object store (a vault with mirrors); resumable",
    )
    p.add_argument(
        "--copies",
        type=_positive,
        metavar="N",
        help="with --direct: upload to N of the blob's mirrors at once (default: all of them; "
        "the vault's queue makes the rest)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_put, moves_blobs=True)


def _get_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("digest")
    p.add_argument("-o", "--output", help="write to this path (default: standard output)")
    p.add_argument("--offset", type=_non_negative, default=0)
    p.add_argument("--length", type=_non_negative)
    p.add_argument(
        "--direct",
        action="store_true",
        help="read straight from a mirror copy in the vault's object store, verified here",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_get, moves_blobs=True)


def _stat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("digest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stat)


def _find_missing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "digests", nargs="*", metavar="DIGEST", help="digests, or - / none for standard input"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_find_missing)


def _pin_arguments(p: argparse.ArgumentParser) -> None:
    from vault.ledger.entry import KINDS

    p.add_argument("kind", choices=KINDS)
    p.add_argument("digests", nargs="+", metavar="DIGEST")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--external", action="store_true", help="content kept elsewhere (an OCI registry)"
    )
    p.add_argument(
        "--chunk-root",
        action="store_true",
        help="record the first digest's chunk root, so that its ranges are verified alone "
        "(reads the whole blob once, verified, to compute it)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pin)


def _lookup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("digest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lookup)


def _log_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind")
    p.add_argument("--digest")
    p.add_argument("--author")
    p.add_argument(
        "--since", type=time_arg, help="entries from this time: 2h, 3d, 2026-11-24 or RFC 3339"
    )
    p.add_argument("--until", type=time_arg, help="entries before this time (the same forms)")
    p.add_argument("--start", type=_non_negative, default=0, help="first index")
    p.add_argument("--limit", type=_non_negative)
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    p.set_defaults(func=cmd_log)


def _checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", action="store_true", help="print the vault's verifier key instead")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_checkpoint)


def _proof_arguments(p: argparse.ArgumentParser) -> None:
    proofs = p.add_subparsers(dest="proof", required=True, metavar="KIND")
    q = proofs.add_parser("inclusion", help="entry INDEX is in the tree of size --size")
    q.add_argument("index", type=_non_negative)
    q.add_argument("--size", type=_non_negative, default=0, help="default: the latest checkpoint")
    q.add_argument("--json", action="store_true")
    q = proofs.add_parser("consistency", help="tree OLD is a prefix of tree NEW")
    q.add_argument("old", type=_non_negative)
    q.add_argument("new", type=_non_negative)
    q.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_proof)


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    from pathlib import Path

    p.add_argument("--blobs", action="store_true")
    p.add_argument(
        "--tiles",
        type=Path,
        metavar="DIR",
        help="on the vault's host: also check every tile and entry bundle in its tile folder "
        "(DATA/tiles) against the checkpoint published there",
    )
    p.add_argument(
        "--subject-map",
        action="store_true",
        help="also rebuild the subject map that proves look-ups complete and check the newest "
        "index entry's root against it (memory grows with the ledger's distinct digests: "
        "about 150 MiB a million)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object: what was checked")
    p.add_argument(
        "--workers",
        type=_positive,
        metavar="N",
        help="processes that audit chunks of the ledger side by side (default: one a core, "
        "up to 3; 1 audits in this process)",
    )
    p.add_argument(
        "--chunk",
        type=_power_of_two,
        default=AUDIT_CHUNK,
        metavar="ENTRIES",
        help=f"entries a worker audits at once, a power of two (default {AUDIT_CHUNK})",
    )
    p.add_argument(
        "--witness",
        action="append",
        default=[],
        type=_witness_key,
        metavar="KEY",
        help="require the cosignature of this witness (its cosignature/v1 key; repeatable; "
        "default: client.witnesses)",
    )
    p.add_argument(
        "--min-witnesses",
        type=_positive,
        metavar="K",
        help="how many of the witnesses must have cosigned (default: all)",
    )
    p.add_argument(
        "--max-witness-age",
        type=float,
        metavar="SECONDS",
        help="refuse a checkpoint whose newest cosignature is older than this (default: "
        "client.max_witness_age, 86400)",
    )
    p.set_defaults(func=cmd_verify)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # `vault run|replay … -- SBATCH_ARGS`: what follows `--` is passed on untouched.
    passed_on: list[str] | None = None
    if "--" in words:
        cut = words.index("--")
        words, passed_on = words[:cut], words[cut + 1 :]
    # Before the parser has read it: a usage error of a command run with --json is JSON too.
    as_json = "--json" in words
    try:
        args = build_parser(lazy_commands=True).parse_args(words)
        if passed_on is not None and not hasattr(args, "sbatch_args"):
            raise UsageError(f"unrecognized arguments: -- {' '.join(passed_on)} (see vault --help)")
    except UsageError as exc:
        return report("usage", str(exc), EXIT_USAGE, as_json=as_json)
    if passed_on is not None:
        args.sbatch_args = passed_on
    as_json = bool(getattr(args, "json", False))
    import logging

    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _run(args)
    except UsageError as exc:
        return report("usage", str(exc), EXIT_USAGE, as_json=as_json)
    except KeyboardInterrupt:
        return report("interrupted", "interrupted", EXIT_INTERRUPTED, as_json=as_json)
    except BrokenPipeError:
        return EXIT_FAILED
    except OSError as exc:
        # A file or folder the command or server was told to use is unusable.
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        message = f"{exc.strerror or exc}" + (f": {where}" if where else "")
        return report("io", message, EXIT_IO, as_json=as_json)
    except Exception as exc:
        # Imported here, as everything but the parser is: no VaultError is an OSError.
        from vault.errors import VaultError

        if isinstance(exc, VaultError):
            return fail(exc, as_json=as_json)
        raise


def _run(args: argparse.Namespace) -> int:
    from vault import config as config_module

    if getattr(args, "moves_blobs", False):
        from vault.store.allocator import keep_freed_buffers

        keep_freed_buffers()
    config = config_module.load(args.config)
    overrides: dict[str, Any] = {}
    if args.server:
        overrides["client"] = {"server": args.server}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if overrides:
        config = config_module.apply(config, overrides, "the command line")
    return int(args.func(args, config))


if __name__ == "__main__":
    sys.exit(main())
