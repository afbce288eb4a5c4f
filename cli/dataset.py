"""`vault dataset add|checkout|diff`: a folder stored as blobs plus a pinned manifest
(docs/dataset-manifest.md), materialised again verified, and two manifests compared."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from vault.client import VaultClient
from vault.config import Config
from vault.digest import Digest
from vault.runs.dataset import add_dataset, checkout_dataset, diff_datasets
from vault.store.hashcache import HashCache, default_path

Connect = Callable[[Config], VaultClient]


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=None, ensure_ascii=False))


def add_dataset_commands(sub: Any, connect: Connect) -> None:
    """Add `vault dataset …` to the command's subparsers; `connect` makes the client."""
    p = sub.add_parser("dataset", help="store, check out and compare folders by manifest")
    commands = p.add_subparsers(dest="dataset_command", required=True, metavar="COMMAND")

    q = commands.add_parser(
        "add", help="store a folder's files and its manifest, pin it; prints the manifest digest"
    )
    q.add_argument("folder", metavar="DIR")
    q.add_argument("--name", help="the pin's name (default: the folder's name)")
    q.add_argument(
        "--rehash",
        action="store_true",
        help="read and hash every file, even those unchanged since they were last hashed",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_add, connect=connect))

    q = commands.add_parser(
        "checkout", help="write a dataset's files, verified, into an absent or empty folder"
    )
    q.add_argument("digest", metavar="DIGEST")
    q.add_argument("folder", metavar="DIR")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_checkout, connect=connect))

    q = commands.add_parser("diff", help="paths added, removed and changed from A to B")
    q.add_argument("old", metavar="A")
    q.add_argument("new", metavar="B")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_diff, connect=connect))


def _add(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    cache = None if args.rehash else HashCache(default_path())
    try:
        with connect(config) as client:
            result = add_dataset(client, Path(args.folder), name=args.name, cache=cache)
    finally:
        if cache is not None:
            cache.close()
    if args.json:
        _print_json(
            {
                "digest": result.digest,
                "files": len(result.manifest.files),
                "size": result.manifest.size,
                "sent_files": result.sent_files,
                "sent_bytes": result.sent_bytes,
                "index": result.pin.entry.index,
            }
        )
    else:
        print(result.digest)
    return 0


def _checkout(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    digest = str(Digest.parse(args.digest))
    with connect(config) as client:
        manifest = checkout_dataset(client, digest, Path(args.folder))
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
        print(f"{len(manifest.files)} files, {manifest.size} bytes in {args.folder}")
    return 0


def _diff(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    with connect(config) as client:
        diff = diff_datasets(client, args.old, args.new)
    if args.json:
        _print_json(diff.as_json())
        return 0
    for mark, paths in (("+", diff.added), ("-", diff.removed), ("M", diff.changed)):
        for path in paths:
            print(f"{mark} {path}")
    return 0
