"""The subject map in the ledger's database (`vault.ledger.subject_map`): the writer brings it
up to the head inside an append's own transaction and appends the `index` entry that commits
its root, and each server answers proofs from it.

`subject_map_buckets` holds one row a non-empty bucket: its sorted records, its root, and the
`epoch` (the index of the `index` entry) that last changed it. The rows change, but they are
derived: anyone rebuilds them from `entry_subjects`, and `vault verify` checks the newest
`index` entry's root against that rebuild. An `index` entry and the rows it commits to are
written in one transaction, so a reader that sees one sees the other."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from hashlib import sha256
from typing import TYPE_CHECKING, Any, Final

from vault.errors import Unavailable
from vault.ledger.entry import INDEX, Entry
from vault.ledger.subject_map import (
    MAP_FORMAT,
    KeyProof,
    TopTree,
    bucket_of,
    bucket_root,
    merge,
    prove,
)

if TYPE_CHECKING:
    from vault.ledger.db import Transaction

BUCKETS_TABLE: Final = "subject_map_buckets"
# Who the ledger names as the author of an `index` entry.
AUTHOR: Final = "vault-index"
# A commit brings the map up to date once this many entries are not covered: a look-up's
# answer then carries fewer entries than this after what the map covers (its tail), and the
# map's step costs the writer about a key's hashes and a bucket row a subject.
INDEX_EVERY: Final = 64
# The most entries one commit adds to the map (an upgraded ledger catches up in steps).
MAX_STEP: Final = 200_000
# The bucket records a writer keeps between its steps.
HELD_BYTES: Final = 32 << 20
# Buckets read a statement.
_PER_STATEMENT: Final = 500

LATEST_INDEX: Final = (
    f"SELECT idx, body FROM entries WHERE kind = '{INDEX}' ORDER BY idx DESC LIMIT 1"
)
SUBJECT_ROWS: Final = (
    "SELECT digest, idx FROM entry_subjects WHERE idx >= ? AND idx < ? ORDER BY idx"
)
_CHANGED: Final = f"SELECT bucket, root FROM {BUCKETS_TABLE} WHERE epoch > ?"
_BUCKET_COLUMNS: Final = ("bucket", "records", "root", "epoch")


def index_meta(covers: int, root: bytes) -> dict[str, str]:
    return {"covers": str(covers), "map": MAP_FORMAT, "map-root": root.hex()}


def read_index(body: bytes) -> tuple[int, bytes]:
    """What an `index` entry's body commits to: the entries it covers, and the map's root."""
    entry = Entry.decode(body)
    return int(entry.meta["covers"]), bytes.fromhex(entry.meta["map-root"])


def _buckets_query(count: int) -> str:
    return f"SELECT bucket, records FROM {BUCKETS_TABLE} WHERE bucket IN ({','.join('?' * count)})"


class MapWriter:
    """The writer's half: its own tree of bucket roots, kept as of the `index` entry it last
    wrote or read."""

    def __init__(self, every: int | None = INDEX_EVERY) -> None:
        self._every = every
        self._top = TopTree()
        self._epoch: int | None = None  # None: the tree must be read again
        # The size up to which the map was last known current: the newest `index` entry's
        # own index and one, when it covers every entry before it (a hint, read again in
        # `step` under the head's lock).
        self._current = 0
        self._pending: tuple[int, int] | None = None
        # The records of buckets this writer read or wrote (up to about HELD_BYTES), as the
        # database holds them once its commit is durable: a small map is read once.
        self._held: dict[int, bytes] = {}
        self._held_bytes = 0

    def due(self, size: int) -> bool:
        """Whether a commit that leaves the ledger at `size` should bring the map up to it."""
        return self._every is not None and size - self._current >= self._every

    def step(self, tx: Transaction, size: int) -> dict[str, str] | None:
        """In the writer's open transaction `tx`, with the head at `size`: bring the map's
        rows up to cover every entry, and return the meta of the `index` entry to append at
        `size`; None if the newest entry is already an `index` entry covering all before it."""
        latest = tx.all(LATEST_INDEX)
        if latest:
            epoch = int(latest[0][0])
            covers, _ = read_index(bytes(latest[0][1]))
        else:
            epoch, covers = -1, 0
        self._current = epoch + 1 if covers == epoch else covers
        if self._current == size:
            return None
        if self._epoch is None or self._epoch > epoch:
            self._top = TopTree()
            self._top.set((int(b), bytes(r)) for b, r in tx.all(_CHANGED, (-2,)))
            self._held.clear()
        elif self._epoch < epoch:  # another server's writer moved the map on
            self._top.set((int(b), bytes(r)) for b, r in tx.all(_CHANGED, (self._epoch,)))
            self._held.clear()
        self._epoch = None  # until the transaction is known committed
        end = min(size, covers + MAX_STEP)
        changes: dict[int, dict[bytes, list[int]]] = {}
        for raw, index in tx.all(SUBJECT_ROWS, (covers, end)):
            key = sha256(raw).digest()
            named = changes.setdefault((key[0] << 8) | key[1], {})
            if key in named:
                named[key].append(index)
            else:
                named[key] = [index]
        held = self._held
        touched = sorted(changes)
        unread = [b for b in touched if b not in held]
        for start in range(0, len(unread), _PER_STATEMENT):
            part = unread[start : start + _PER_STATEMENT]
            held.update((int(b), bytes(r)) for b, r in tx.all(_buckets_query(len(part)), part))
        rows = []
        roots = []
        grown = 0
        for bucket in touched:
            before = held.get(bucket, b"")
            records = merge(before, changes[bucket])
            root = bucket_root(records)
            rows.append((bucket, records, root, size))
            roots.append((bucket, root))
            held[bucket] = records
            grown += len(records) - len(before)
        tx.upsert(BUCKETS_TABLE, _BUCKET_COLUMNS, rows)
        self._held_bytes += grown
        if self._held_bytes > HELD_BYTES:  # a large map: keep the next step's buckets only
            held.clear()
            self._held_bytes = 0
        self._top.set(roots)
        self._pending = (size, end)
        return index_meta(end, self._top.root())

    def committed(self) -> None:
        """The transaction of the last `step` is durable: its tree is the map's."""
        if self._pending is not None:
            self._epoch, covers = self._pending
            self._current = self._epoch + 1 if covers == self._epoch else covers
            self._pending = None

    def failed(self) -> None:
        self._pending = None
        self._epoch = None
        self._held.clear()
        self._held_bytes = 0


class MapReader:
    """A server's half: proofs from the map as of the newest `index` entry, through a tree of
    bucket roots of its own, brought up to that entry by the rows changed since."""

    def __init__(self, fetch: Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]) -> None:
        self._fetch = fetch
        self._top = TopTree()
        self._epoch = -2
        self._covers = 0
        self._lock = threading.Lock()

    def prove(self, keys: Sequence[bytes]) -> tuple[int, int, list[KeyProof], list[bytes]] | None:
        """The newest `index` entry (its index and what it covers), each key's proof in its
        bucket and the nodes that prove the buckets' places under the entry's root together
        (`TopTree.multiproof`), or None if the ledger has no `index` entry yet. One
        statement reads the entry, the rows changed since this reader's tree and the keys'
        buckets, so all are of one moment of the database."""
        buckets = sorted({bucket_of(k) for k in keys})
        with self._lock:
            for _ in range(4):
                rows = self._fetch(*self._statement(buckets))
                latest = [r for r in rows if r[0] == 0]
                if not latest:
                    return None
                epoch = int(latest[0][1])
                if epoch < self._epoch:
                    continue  # a snapshot older than this tree: read again
                if epoch != self._epoch:
                    self._top.set((int(r[1]), bytes(r[3])) for r in rows if r[0] == 1)
                    self._epoch = epoch
                    self._covers = read_index(bytes(latest[0][4]))[0]
                held = {int(r[1]): bytes(r[4]) for r in rows if r[0] == 2}
                proofs = [prove(k, held.get(bucket_of(k), b"")) for k in keys]
                return epoch, self._covers, proofs, self._top.multiproof(buckets)
        raise Unavailable("the ledger's subject map changed while it was read: retry")

    def _statement(self, buckets: Sequence[int]) -> tuple[str, list[Any]]:
        marks = ",".join("?" * len(buckets))
        sql = (
            f"SELECT 0, idx, NULL, NULL, body FROM ({LATEST_INDEX}) AS latest "
            f"UNION ALL SELECT 1, bucket, epoch, root, NULL FROM {BUCKETS_TABLE} WHERE epoch > ? "
            f"UNION ALL SELECT 2, bucket, epoch, NULL, records FROM {BUCKETS_TABLE} "
            f"WHERE bucket IN ({marks})"
        )
        return sql, [self._epoch, *buckets]
