"""`vault dataset add|ls|show|checkout|diff`: a folder stored as blobs plus a pinned manifest
(docs/dataset-manifest.md) under a name, the names listed and resolved (verified), a dataset
materialised again verified, and two manifests compared."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from cli.commands import add_command
from cli.output import print_json as _print_json
from cli.output import shown
from cli.progress import Progress

# The run library and the client load when a command here runs, not for `vault --help`.
if TYPE_CHECKING:
    from vault.client import VaultClient
    from vault.config import Config

    Connect = Callable[[Config], VaultClient]


def add_dataset_commands(sub: Any, connect: Connect) -> None:
    """Add `vault dataset …` to the command's subparsers; `connect` makes the client."""
    add_command(
        sub,
        "dataset",
        partial(_arguments, connect=connect),
        help="store, check out and compare folders by manifest",
    )


def _arguments(p: argparse.ArgumentParser, *, connect: Connect) -> None:
    commands = p.add_subparsers(dest="dataset_command", required=True, metavar="COMMAND")

    q = commands.add_parser(
        "add",
        help="store a folder's files and its manifest, pin it under a name; prints the digest",
        description="Adding a folder that is unchanged since it was pinned under the same name "
        "and tag appends nothing, and says which entry pins it.",
    )
    q.add_argument("items", nargs="+", metavar="[NAME] DIR")
    q.add_argument("--name", help="the dataset's name (default: NAME, or the folder's name)")
    q.add_argument("--tag", default="", help="a tag the name is pinned with (NAME@TAG)")
    q.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out files and folders matching GLOB (repeatable; also read from the "
        "folder's .vaultignore)",
    )
    q.add_argument(
        "--rehash",
        action="store_true",
        help="read and hash every file, even those unchanged since they were last hashed",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_add, connect=connect), moves_blobs=True)

    q = commands.add_parser("ls", help="every dataset name and tag, with the digest it names")
    q.add_argument("--author", default="", help="only the names this author pinned")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_ls, connect=connect))

    q = commands.add_parser("show", help="what a dataset name resolves to, verified")
    q.add_argument("reference", metavar="NAME[@TAG]")
    q.add_argument("--author", default="", help="whose pin of the name (when several pinned it)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_show, connect=connect))

    q = commands.add_parser(
        "checkout", help="write a dataset's files, verified, into an absent or empty folder"
    )
    q.add_argument("digest", metavar="DIGEST|NAME[@TAG]")
    q.add_argument("folder", metavar="DIR")
    q.add_argument("--author", default="", help="whose pin of the name (when several pinned it)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_checkout, connect=connect), moves_blobs=True)

    q = commands.add_parser("diff", help="paths added, removed and changed from A to B")
    q.add_argument("old", metavar="A")
    q.add_argument("new", metavar="B")
    q.add_argument("--author", default="", help="whose pins of names (when several pinned them)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_diff, connect=connect))


def _add(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from pathlib import Path

    from vault.errors import InvalidArgument
    from vault.runs.dataset import add_dataset
    from vault.store.hashcache import HashCache, default_path

    if len(args.items) > 2:
        raise InvalidArgument("dataset add takes [NAME] DIR")
    name, folder = args.items if len(args.items) == 2 else (None, args.items[0])
    if name and args.name and name != args.name:
        raise InvalidArgument(f"two names given: {name!r} and --name {args.name!r}")
    cache = None if args.rehash else HashCache(default_path())
    bar = Progress(f"dataset add {folder}", None)
    try:
        with connect(config) as client:
            result = add_dataset(
                client,
                Path(folder),
                name=name or args.name,
                tag=args.tag,
                exclude=args.exclude,
                cache=cache,
                progress=bar,
            )
    finally:
        bar.close()
        if cache is not None:
            cache.close()
    entry = result.pin.entry
    if args.json:
        _print_json(
            {
                "digest": result.digest,
                "name": entry.meta.get("name", ""),
                "tag": entry.meta.get("tag", ""),
                "files": len(result.manifest.files),
                "size": result.manifest.size,
                "sent_files": result.sent_files,
                "sent_bytes": result.sent_bytes,
                "index": entry.index,
                "new": result.new,
            }
        )
    elif result.new:
        print(result.digest)
    else:
        print(
            f"{result.digest}  unchanged: already pinned as entry {entry.index} "
            f"({shown(_reference(entry.meta))}); nothing appended"
        )
    return 0


def _reference(meta: Any) -> str:
    name, tag = meta.get("name", ""), meta.get("tag", "")
    return f"{name}@{tag}" if tag else name


def _ls(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from vault.runs.names import list_datasets

    with connect(config) as client:
        names = list_datasets(client, author=args.author)
    if args.json:
        _print_json([n.as_json() for n in names])
        return 0
    for n in names:
        line = n.as_json()
        print(
            f"{shown(_reference(n.entry.meta)):<32} {n.digest}  {line['files']:>9} files  "
            f"entry {n.entry.index}  by {shown(n.entry.author)}  {n.entry.time}"
        )
    return 0


def _show(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from vault.runs.dataset import fetch_manifest
    from vault.runs.names import resolve_dataset

    with connect(config) as client:
        named = resolve_dataset(client, args.reference, author=args.author)
        manifest = fetch_manifest(client, named.digest)
    if args.json:
        _print_json({**named.as_json(), "files": len(manifest.files), "size": manifest.size})
        return 0
    print(f"{shown(_reference(named.entry.meta))}  {named.digest}")
    print(f"  {len(manifest.files)} files, {manifest.size} bytes (manifest verified)")
    print(
        f"  pinned as entry {named.entry.index} by {shown(named.entry.author)} at "
        f"{named.entry.time} (inclusion verified)"
    )
    return 0


def _checkout(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from pathlib import Path

    from vault.digest import Digest
    from vault.runs.dataset import checkout_dataset
    from vault.runs.names import resolve_input

    with connect(config) as client:
        digest = str(Digest.parse(resolve_input(client, args.digest, author=args.author)))
        bar = Progress(f"dataset checkout {args.folder}", None)
        try:
            manifest = checkout_dataset(client, digest, Path(args.folder), progress=bar)
        finally:
            bar.close()
    if args.json:
        _print_json(
            {
                "digest": digest,
                "path": args.folder,
                "files": len(manifest.files),
                "size": manifest.size,
            }
        )
    else:
        print(f"{len(manifest.files)} files, {manifest.size} bytes in {shown(args.folder)}")
    return 0


def _diff(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from vault.runs.dataset import diff_datasets
    from vault.runs.names import resolve_input

    with connect(config) as client:
        old = resolve_input(client, args.old, author=args.author)
        new = resolve_input(client, args.new, author=args.author)
        diff = diff_datasets(client, old, new)
    if args.json:
        _print_json(diff.as_json())
        return 0
    for mark, paths in (("+", diff.added), ("-", diff.removed), ("M", diff.changed)):
        for path in paths:
            # A path is a writer's text: escaped, it cannot pass for another line.
            print(f"{mark} {shown(path)}")
    return 0
