"""`vault bundle RUN_ID|DATASET|#INDEX -o FILE` writes what proves a run, a digest's pins or one
entry into one file (docs/bundle.md), verified before it is written; `vault bundle verify FILE`
checks such a file with no vault."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.output import print_json, shown

# The client and the run library load when the command runs, not for `vault --help`.
if TYPE_CHECKING:
    from vault.client import ProvenEntry, VaultClient
    from vault.client.bundle import Bundle, ProvenBundle
    from vault.client.trust import TrustedLog
    from vault.config import Config
    from vault.ledger.checkpoint import Verifier
    from vault.ledger.entry import Entry

    Connect = Callable[[Config], VaultClient]

# How many ledgers' state files `verify` reads, at most, looking for the bundle's.
_MAX_STATE_FILES = 1000

USAGE = (
    "vault bundle RUN_ID|DATASET|#INDEX -o FILE\n"
    "       vault bundle verify FILE [--key VERIFIER_KEY] [--witness KEY ...] "
    "[--min-witnesses K] [--json]"
)


def bundle_arguments(p: argparse.ArgumentParser, connect: Connect) -> None:
    p.usage = USAGE
    p.description = (
        "A bundle holds a run's entries (or a digest's, or one entry), an inclusion proof of "
        "each in one signed checkpoint, the checkpoint with its cosignatures, the keys, and "
        "the run's inputs document, manifest and replicate.sh. `verify` needs no vault: name "
        "the vault's key with --key (or client.verifier_key), or the bundle vouches for itself. "
        "Quote #INDEX: a shell reads # as a comment."
    )
    p.add_argument("items", nargs="+", metavar="RUN_ID|DATASET|#INDEX", help=argparse.SUPPRESS)
    p.add_argument(
        "-o", "--output", metavar="FILE", help="where to write the bundle (- for stdout)"
    )
    p.add_argument(
        "--key",
        metavar="VERIFIER_KEY",
        help="verify: the vault's checkpoint key, or a file holding it (default: "
        "client.verifier_key; without either, the bundle's own key, with a warning)",
    )
    p.add_argument(
        "--witness",
        action="append",
        default=[],
        metavar="KEY",
        help="verify: a witness whose cosignature is required (repeatable; default: "
        "client.witnesses)",
    )
    p.add_argument(
        "--min-witnesses",
        type=int,
        default=0,
        metavar="K",
        help="verify: how many of the witnesses must have cosigned (default: all)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=partial(cmd_bundle, connect=connect))


def cmd_bundle(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from vault.errors import InvalidArgument

    items: list[str] = args.items
    if items[0] == "verify":
        if len(items) != 2:
            raise InvalidArgument(f"`vault bundle verify` takes one FILE; usage: {USAGE}")
        if args.output:
            raise InvalidArgument("-o is for writing a bundle, not for `vault bundle verify`")
        return _verify(args, config, items[1])
    if len(items) != 1:
        raise InvalidArgument(f"`vault bundle` takes one RUN_ID, DATASET or #INDEX; usage: {USAGE}")
    if not args.output:
        raise InvalidArgument(f"say where to write the bundle with -o FILE; usage: {USAGE}")
    if args.key or args.witness or args.min_witnesses:
        raise InvalidArgument(
            "--key, --witness and --min-witnesses are for `vault bundle verify`: a bundle is "
            "written with the client's own keys (client.verifier_key, client.witnesses)"
        )
    with connect(config) as client:
        proven = _collect(client, items[0])
    data = proven.bundle.encode()
    if args.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        _write(Path(args.output), data)
    summary = {"file": args.output, **_as_json(proven)}
    if args.json and args.output != "-":
        print_json(summary)
    else:
        where = sys.stderr if args.output == "-" else sys.stdout
        print(shown(f"wrote {args.output}: {proven.summary()}"), file=where)
    return 0


def _collect(client: VaultClient, target: str) -> ProvenBundle:
    """The bundle `target` names: `#INDEX` one entry, a run id its run, a dataset name or any
    other digest the entries naming it."""
    from vault.client.bundle import Subject, collect, entry_subject
    from vault.digest import Digest
    from vault.errors import InvalidArgument, NotFound
    from vault.runs.manifest import entries_naming, first_admission
    from vault.runs.names import is_digest, resolve_dataset

    subject = entry_subject(target)
    if subject is not None:
        found = list(client.log(start=subject.index, limit=1))
        if not found or found[0].index != subject.index:
            raise NotFound(f"no entry {subject.index}: the ledger holds no entry at that index")
        entry = found[0]
        return collect(client, subject, [client.prove(entry.index, entry.encode())])
    if is_digest(target):
        digest = Digest.parse(target)
        if digest.algorithm != "sha256":
            raise InvalidArgument(
                f"{target[:80]}: a bundle names its subject by its sha256 digest, as entries do"
            )
        wanted = str(digest)
    else:
        wanted = resolve_dataset(client, target).digest
    entries = entries_naming(client, wanted)
    if not entries:
        raise NotFound(f"the vault holds no entry naming {wanted}")
    admission = first_admission(entries, wanted)
    if admission is not None:
        documents = _run_documents(client, wanted, entries, admission)
        return collect(client, Subject("run", digest=wanted), entries, documents)
    documents = {}
    if any(
        p.entry.kind == "dataset" and p.entry.subjects[0] == wanted and not p.entry.external
        for p in entries
    ):
        from vault.runs.manifest import read_bounded
        from vault.store.manifest import MAX_MANIFEST_BYTES

        documents["datasetManifest"] = read_bounded(
            client, wanted, "dataset manifest", MAX_MANIFEST_BYTES
        )
    return collect(client, Subject("digest", digest=wanted), entries, documents)


def _run_documents(
    client: VaultClient, run_id: str, entries: list[ProvenEntry], admission: Entry
) -> dict[str, bytes]:
    """The run's inputs document and, once its own team sealed it, its manifest (the one
    `vault replay` would replay) and replicate.sh, each fetched verified."""
    from vault.client.bundle import MAX_RUN_MANIFEST_BYTES, replicate_script
    from vault.ledger.runid import MAX_INPUTS_BYTES
    from vault.runs.manifest import read_bounded
    from vault.runs.sealed import find_sealed_run

    documents = {"runInputs": read_bounded(client, run_id, "run inputs document", MAX_INPUTS_BYTES)}
    team = admission.meta.get("team", "")
    if any(
        p.entry.kind == "run"
        and p.entry.meta.get("stage") == "manifest"
        and run_id in p.entry.subjects[1:]
        and p.entry.meta.get("team") == team
        and "replay" not in p.entry.meta
        for p in entries
    ):
        sealed = find_sealed_run(client, run_id, purpose="bundle")
        documents["runManifest"] = read_bounded(
            client, sealed.digest, "run manifest", MAX_RUN_MANIFEST_BYTES
        )
        documents["replicateScript"] = replicate_script(sealed.digest)
    return documents


def _verify(args: argparse.Namespace, config: Config, path: str) -> int:
    from vault.client.bundle import MAX_BUNDLE_BYTES, Bundle, verify_bundle
    from vault.errors import InvalidArgument
    from vault.files import read_upto
    from vault.ledger.checkpoint import Checkpoint, Verifier
    from vault.ledger.cosignature import WitnessPolicy, split_witness_keys

    key = args.key or config.client.verifier_key
    if key and os.path.isfile(key):
        key = Path(key).read_text(encoding="utf-8", errors="replace").strip()
    verifier = Verifier.from_string(key) if key else None
    witnesses = args.witness or split_witness_keys(config.client.witnesses)
    required = args.min_witnesses or config.client.min_witnesses or None
    if required and not witnesses:
        raise InvalidArgument(f"{required} cosignatures required of no witness keys: add --witness")
    policy = WitnessPolicy.from_strings(witnesses, required) if witnesses else None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = read_upto(fd, MAX_BUNDLE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        bundle = Bundle.decode(data)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{path}: {exc}") from None
    trusted = _trusted(config, bundle, verifier)
    if verifier is None and trusted is not None:
        verifier = trusted.verifier
    proven = verify_bundle(
        bundle,
        verifier=verifier,
        witnesses=policy,
        trusted=None if trusted is None else Checkpoint(trusted.origin, trusted.size, trusted.root),
    )
    if args.json:
        print_json(_as_json(proven))
    else:
        print(shown(proven.summary()))
        for warning in proven.warnings():
            print(shown(f"vault: warning: {warning}"), file=sys.stderr)
    return 0


def _trusted(config: Config, bundle: Bundle, verifier: Verifier | None) -> TrustedLog | None:
    """The checkpoint of the bundle's ledger that the client's trust state holds (its key the
    one named, if one is, else the bundle's own if the state holds it, else the one the state
    holds for the ledger), read only; None when it holds none."""
    import json

    from vault.client.trust import TrustedLog
    from vault.errors import VaultError
    from vault.ledger.checkpoint import Checkpoint
    from vault.ledger.cosignature import split_note

    try:
        origin = Checkpoint.parse_body(split_note(bundle.checkpoint)[0]).origin
    except VaultError:
        return None  # the verification says what is wrong with it
    files = [config.state_path] if config.state_path else []
    if not files and config.state_folder.is_dir():
        files = sorted(config.state_folder.glob("trust-*.json"))[:_MAX_STATE_FILES]
    held: list[TrustedLog] = []
    for file in files:
        try:
            log = TrustedLog.from_dict(json.loads(file.read_bytes()))
        except (OSError, ValueError, VaultError):
            continue
        if log.origin == origin:
            held.append(log)
    wanted = str(verifier) if verifier is not None else bundle.verifier_key
    for log in held:
        if str(log.verifier) == wanted:
            return log
    return held[0] if held and verifier is None else None


def _as_json(proven: ProvenBundle) -> dict[str, Any]:
    checkpoint = proven.checkpoint
    return {
        "subject": proven.bundle.subject.as_json(),
        "entries": [e.index for e in proven.entries],
        "checkpoint": {"origin": checkpoint.origin, "size": checkpoint.size},
        "signed_by": proven.signer.label,
        "cosigned_by": [c.witness.label for c in proven.cosignatures],
        "documents": list(proven.documents),
        "key_from_bundle": not proven.key_given,
        "witnesses_from_bundle": bool(proven.cosignatures) and not proven.witnesses_given,
        "summary": proven.summary(),
    }


def _write(target: Path, data: bytes) -> None:
    """Write the bundle whole or not at all: a new file of a random name beside it (O_EXCL|
    O_NOFOLLOW: nothing planted there is followed), synced, renamed over `target`, the folder
    synced; the new file removed if anything fails."""
    from vault.files import fsync_dir, write_all

    folder = target.parent
    temp = folder / f".{target.name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o644)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_dir(folder)
