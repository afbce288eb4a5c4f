"""Datasets by name: a `dataset` pin's `name` (and optional `tag`) metadata, read back from the
ledger. A name is a convenience for people; jobs are pinned by the digest it resolves to, and
a resolution is verified against the signed ledger before it is used.

Anyone who may pin can pin a dataset under any name, so a name pinned by more than one author
is refused as ambiguous rather than resolved to whoever pinned last (`--author` picks one)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from vault.client import ProvenEntry, VaultClient
from vault.digest import Digest
from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument, NotFound
from vault.ledger.entry import Entry

DATASET: Final = "dataset"
MAX_NAME: Final = 200


def check_name(value: str, what: str = "dataset name") -> str:
    """A dataset's name or tag: non-empty, at most MAX_NAME characters, without `@` (which
    separates a name from its tag) or white space at either end."""
    if not value or len(value) > MAX_NAME:
        raise InvalidArgument(f"{what} {value[:80]!r}: expected 1 to {MAX_NAME} characters")
    if "@" in value or value != value.strip():
        raise InvalidArgument(f"{what} {value!r}: no '@' and no white space at either end")
    return value


def parse_reference(reference: str) -> tuple[str, str]:
    """`NAME` or `NAME@TAG`, checked."""
    name, _, tag = reference.partition("@")
    check_name(name)
    if tag:
        check_name(tag, "dataset tag")
    elif reference.endswith("@"):
        raise InvalidArgument(f"dataset {reference!r}: a tag after '@' is missing")
    return name, tag


def is_digest(reference: str) -> bool:
    return reference.startswith(("sha256:", "blake3:"))


@dataclass(frozen=True, slots=True)
class NamedDataset:
    """The pin that gives a dataset its name: the manifest's digest and the entry."""

    name: str
    tag: str
    digest: str
    entry: Entry

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "tag": self.tag,
            "digest": self.digest,
            "files": int(self.entry.meta.get("files", "0") or 0),
            "author": self.entry.author,
            "time": self.entry.time,
            "index": self.entry.index,
        }


def _named(entry: Entry) -> NamedDataset | None:
    name = entry.meta.get("name", "")
    if entry.kind != DATASET or not name or not entry.subjects:
        return None
    return NamedDataset(name, entry.meta.get("tag", ""), entry.subjects[0], entry)


def list_datasets(client: VaultClient, *, author: str = "") -> list[NamedDataset]:
    """The newest pin of each name and tag (by `author`, if given), by name then tag."""
    newest: dict[tuple[str, str], NamedDataset] = {}
    for entry in client.log(kind=DATASET, author=author):
        named = _named(entry)
        if named is not None:
            newest[(named.name, named.tag)] = named
    return [newest[key] for key in sorted(newest)]


def resolve_dataset(client: VaultClient, reference: str, *, author: str = "") -> NamedDataset:
    """The newest pin of `NAME[@TAG]` (by `author`, if given), verified: its entry is proven to
    be in the signed ledger and to say what the listing said. Refused when no pin has the
    name, or when pins of it come from more than one author and none was chosen."""
    name, tag = parse_reference(reference)
    found = [
        named
        for entry in client.log(kind=DATASET, author=author)
        if (named := _named(entry)) is not None
        and named.name == name
        and (not tag or named.tag == tag)
    ]
    what = f"{name}@{tag}" if tag else name
    if not found:
        by = f" by {author}" if author else ""
        raise NotFound(f"no dataset is pinned under the name {what!r}{by}")
    authors = sorted({n.entry.author for n in found})
    if len(authors) > 1:
        raise FailedPrecondition(
            f"dataset name {what!r} is pinned by {len(authors)} authors ({', '.join(authors)}): "
            "choose one with --author"
        )
    chosen = max(found, key=lambda n: n.entry.index)
    _check_proven(client, chosen)
    return chosen


def _check_proven(client: VaultClient, named: NamedDataset) -> None:
    """Refuse a listed entry that the vault cannot prove, or proves to be something else."""
    try:
        proven: list[ProvenEntry] = client.lookup(str(Digest.parse(named.digest)))
    except NotFound:
        proven = []
    if not any(p.entry == named.entry for p in proven):
        raise IntegrityError(
            f"the vault listed entry {named.entry.index} as dataset {named.name!r} "
            f"({named.digest}) but gives no proof of that entry"
        )


# The names a job's inputs may give instead of a digest: anything else is passed on as it is,
# for the vault to refuse in its own words (a floating tag, a malformed digest).
_JOB_REFERENCE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*(@[A-Za-z0-9][A-Za-z0-9._+-]*)?")


def resolve_input(client: VaultClient, reference: str, *, author: str = "") -> str:
    """A dataset given by `NAME[@TAG]` (letters, digits, `.`, `_`, `+`, `-`), resolved and
    verified; anything else (a digest, or something the vault will refuse) as it is."""
    if is_digest(reference) or not _JOB_REFERENCE.fullmatch(reference):
        return reference
    return resolve_dataset(client, reference, author=author).digest
