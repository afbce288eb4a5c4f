"""What a repository of the vault's registry holds, read from the ledger: a pushed manifest is an
`image` entry (metadata `repository`, `tag` when pushed by tag); a deleted manifest or tag is a
`withdraw` entry (`repository`, and `tag` for a tag). Nothing is ever removed, so every answer
is the newest entries' word: a manifest is in a repository while its newest `image` entry there
is newer than any untagged `withdraw` of it there; a tag names the manifest of its newest
`image` entry unless a newer `withdraw` names that tag or (untagged) that manifest.

Every read goes to the ledger's database as it is (not to this server's copy of the tree), so a
push or delete on any server of the vault is seen by every other at once."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Final

from sqlalchemy import select

from vault.ledger import db as tables
from vault.ledger.entry import WITHDRAW, Entry
from vault.ledger.log import Ledger

# The kind of entry a pushed manifest is pinned as, and its metadata keys.
KIND: Final = "image"
REPOSITORY: Final = "repository"
TAG: Final = "tag"
MEDIA_TYPE: Final = "media-type"
SUBJECT: Final = "subject"
# Entries of one kind read in one query while walking a repository's history.
_SCAN_BATCH: Final = 1000


class RepositoryNames:
    """The manifests and tags of the registry's repositories, from `ledger`."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def by_digest(self, name: str, digest: str) -> Entry | None:
        """The newest `image` entry of manifest `digest` in repository `name`, unless an
        untagged `withdraw` of it there is newer."""
        newest: Entry | None = None
        for stored, external in self.ledger.pins_of_kind(digest, KIND):
            entry = Entry.decode(stored.body)
            if not external and entry.subjects[0] == digest and _in(entry, name, KIND):
                newest = entry
        if newest is None:
            return None
        for stored, _ in self.ledger.pins_of_kind(digest, WITHDRAW):
            if stored.index > newest.index:
                entry = Entry.decode(stored.body)
                if _in(entry, name, WITHDRAW) and TAG not in entry.meta:
                    return None
        return newest

    def by_tag(self, name: str, tag: str) -> Entry | None:
        """The `image` entry whose manifest `tag` names in repository `name`, if any."""
        withdrawn: set[str] = set()
        for entry in self.history(name):
            digest = entry.subjects[0]
            if entry.kind == WITHDRAW:
                if TAG not in entry.meta:
                    withdrawn.add(digest)
                elif entry.meta[TAG] == tag:
                    return None
            elif entry.meta.get(TAG) == tag:
                return None if digest in withdrawn else entry
        return None

    def tags(self, name: str) -> list[str] | None:
        """The tags of repository `name` that name a manifest, sorted; None when nothing was
        ever pushed there."""
        # Newest first: a tag is decided by the first entry naming it.
        decided: dict[str, bool] = {}
        withdrawn: set[str] = set()
        seen = False
        for entry in self.history(name):
            tag = entry.meta.get(TAG)
            if entry.kind == WITHDRAW:
                if tag is None:
                    withdrawn.add(entry.subjects[0])
                else:
                    decided.setdefault(tag, False)
                continue
            seen = True
            if tag is not None:
                decided.setdefault(tag, entry.subjects[0] not in withdrawn)
        if not seen:
            return None
        return sorted(tag for tag, names in decided.items() if names)

    def manifests(self, name: str) -> Iterator[Entry]:
        """The newest `image` entry of each manifest in repository `name`, newest first."""
        withdrawn: set[str] = set()
        listed: set[str] = set()
        for entry in self.history(name):
            digest = entry.subjects[0]
            if entry.kind == WITHDRAW:
                if TAG not in entry.meta:
                    withdrawn.add(digest)
            elif digest not in listed and digest not in withdrawn:
                listed.add(digest)
                yield entry

    def history(self, name: str) -> Iterator[Entry]:
        """The `image` and `withdraw` entries of repository `name`, newest first."""
        return heapq.merge(
            self._newest(name, KIND), self._newest(name, WITHDRAW), key=lambda e: -e.index
        )

    def _newest(self, name: str, kind: str) -> Iterator[Entry]:
        """The entries of `kind` of repository `name`, newest first. The first read has no
        upper bound: an entry another server of the vault appended a moment ago counts."""
        e = tables.entries
        before: int | None = None
        while before is None or before > 0:
            query = select(e.c.idx, e.c.body).where(e.c.kind == kind)
            if before is not None:
                query = query.where(e.c.idx < before)
            query = query.order_by(e.c.idx.desc()).limit(_SCAN_BATCH)
            with self.ledger.db.read.connect() as conn:
                rows = [(idx, bytes(body)) for idx, body in conn.execute(query)]
            for _, body in rows:
                entry = Entry.decode(body)
                if _in(entry, name, kind):
                    yield entry
            if len(rows) < _SCAN_BATCH:
                return
            before = rows[-1][0]


def _in(entry: Entry, name: str, kind: str) -> bool:
    return entry.kind == kind and entry.meta.get(REPOSITORY) == name


__all__ = ["KIND", "MEDIA_TYPE", "REPOSITORY", "SUBJECT", "TAG", "RepositoryNames"]
