"""The subject map: a verifiable map from every subject digest to the entries that name it, so
that a look-up proves its list complete, and a digest never pinned is proven so
(docs/ledger-format.md, "Index entries").

The map is rebuilt by anyone from the ledger alone. Its key for a digest is the SHA-256 of the
digest's index key (`vault.digest.digest_key`); its value is the chain of the indexes of the
entries naming the digest, in order: `v = SHA-256(v || index as 8 bytes big-endian)` from 32
zero bytes. A record is the key and the value (64 bytes). The records fall into 65,536 buckets
by the first two bytes of their key; a bucket's root is the RFC 9162 tree hash of its records
sorted by key (each hashed as a leaf), and the map's root is the RFC 9162 tree hash of the
65,536 bucket roots, in order, each hashed as a leaf. The vault commits the root in `index`
entries of the ledger itself, so that witnesses cosign it with everything else.

A proof for a key is its bucket's size, the position the key holds or would hold, the record
there or the records on either side, each with its path in the bucket, and the bucket's path
to the map root. Everything here is pure: the server, the client and `vault verify` share it."""

from __future__ import annotations

import hashlib
import re
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple

from vault.digest import digest_key
from vault.errors import VerificationError
from vault.ledger.merkle import (
    MerkleTree,
    items_root,
    leaf_hash,
    node_hash,
    root_from_inclusion,
)

BUCKET_BITS: Final = 16
BUCKETS: Final = 1 << BUCKET_BITS
KEY_SIZE: Final = 32
RECORD_SIZE: Final = 64
ZERO_VALUE: Final = bytes(32)
_sha256 = hashlib.sha256
# The root of a bucket with no records: RFC 9162's hash of the empty tree.
EMPTY_BUCKET: Final = hashlib.sha256(b"").digest()
# What an `index` entry's meta says of its map.
MAP_FORMAT: Final = "pinvault-subject-map/v1"
_COUNT: Final = re.compile(r"0|[1-9][0-9]{0,18}")
_ROOT: Final = re.compile(r"[0-9a-f]{64}")


def key_of(digest: str) -> bytes:
    """The map's key for a well-formed digest."""
    return hashlib.sha256(digest_key(digest)).digest()


def bucket_of(key: bytes) -> int:
    return (key[0] << 8) | key[1]


def next_value(value: bytes, index: int) -> bytes:
    """The value once entry `index` also names the key."""
    return hashlib.sha256(value + index.to_bytes(8, "big")).digest()


def value_of(indexes: Iterable[int]) -> bytes:
    """The value of a key named by the entries at `indexes`, in ascending order."""
    value = ZERO_VALUE
    for index in indexes:
        value = next_value(value, index)
    return value


def records_of(records: bytes) -> list[bytes]:
    return [records[i : i + RECORD_SIZE] for i in range(0, len(records), RECORD_SIZE)]


def bucket_root(records: bytes) -> bytes:
    """The root of a bucket whose sorted records are `records`, joined."""
    count = len(records) // RECORD_SIZE
    if count == 1:  # most buckets, until the map holds some millions of digests
        return _sha256(b"\x00" + records).digest()
    if count == 2:
        return _sha256(
            b"\x01"
            + _sha256(b"\x00" + records[:RECORD_SIZE]).digest()
            + _sha256(b"\x00" + records[RECORD_SIZE:]).digest()
        ).digest()
    return items_root(records_of(records)) if records else EMPTY_BUCKET


def merge(records: bytes, changes: dict[bytes, list[int]]) -> bytes:
    """The bucket `records` (sorted, joined) with each key of `changes` also named by its
    entries (ascending, all newer than what the bucket holds)."""
    merged = bytearray(records)
    keys = [records[i : i + KEY_SIZE] for i in range(0, len(records), RECORD_SIZE)]
    for key in sorted(changes):
        at = bisect_left(keys, key)
        start = at * RECORD_SIZE
        known = at < len(keys) and keys[at] == key
        value = bytes(merged[start + KEY_SIZE : start + RECORD_SIZE]) if known else ZERO_VALUE
        for index in changes[key]:
            value = next_value(value, index)
        if known:
            merged[start + KEY_SIZE : start + RECORD_SIZE] = value
        else:
            keys.insert(at, key)
            merged[start:start] = key + value
    return bytes(merged)


class TopTree:
    """The tree over the 65,536 bucket roots: every level kept (about 8 MiB, whatever the
    number of records), so that a bucket's change re-hashes its 16 ancestors."""

    def __init__(self) -> None:
        empty = leaf_hash(EMPTY_BUCKET)
        self.levels: list[list[bytes]] = []
        width = BUCKETS
        while width >= 1:
            self.levels.append([empty] * width)
            empty = node_hash(empty, empty)
            width //= 2

    def set(self, roots: Iterable[tuple[int, bytes]]) -> None:
        """Put each bucket's root, then re-hash the ancestors of those that changed."""
        sha256 = _sha256
        dirty = set()
        levels = self.levels
        bottom = levels[0]
        for bucket, root in roots:
            bottom[bucket] = sha256(b"\x00" + root).digest()
            dirty.add(bucket >> 1)
        for level in range(1, len(levels)):
            below, here = levels[level - 1], levels[level]
            for at in dirty:
                here[at] = sha256(b"\x01" + below[2 * at] + below[2 * at + 1]).digest()
            dirty = {at >> 1 for at in dirty}

    def root(self) -> bytes:
        return self.levels[-1][0]

    def multiproof(self, buckets: Iterable[int]) -> list[bytes]:
        """What proves the roots of `buckets` together (`root_of_buckets`): the nodes their
        roots do not determine, level by level from the bottom, each level left to right. Of
        one bucket, its path; of 1,000, about 5,300 nodes rather than 16,000."""
        nodes: list[bytes] = []
        here = sorted(set(buckets))
        for level in self.levels[:BUCKET_BITS]:
            # `here` is sorted: a node's sibling is in it only as its neighbour.
            last = len(here) - 1
            nodes += [
                level[at ^ 1]
                for i, at in enumerate(here)
                if not (
                    (at & 1 == 0 and i < last and here[i + 1] == at + 1)
                    or (at & 1 and i and here[i - 1] == at - 1)
                )
            ]
            here = list(dict.fromkeys([at >> 1 for at in here]))
        return nodes


class KeyProof(NamedTuple):
    """What proves a key's value, or its absence, in its bucket."""

    bucket_size: int
    position: int
    # (position, record, path) of the key's record, or of its neighbours in the bucket.
    records: tuple[tuple[int, bytes, tuple[bytes, ...]], ...]


def prove(key: bytes, records: bytes) -> KeyProof:
    """The proof for `key` in its bucket, from the bucket's sorted `records`; the bucket's
    place in the map is proven with the others' (`TopTree.multiproof`)."""
    size = len(records) // RECORD_SIZE
    # Most buckets hold one record or two until the map holds some millions of digests: they
    # are proven without building the bucket's tree.
    if size == 0:
        return KeyProof(0, 0, ())
    if size == 1:  # the record is the key's, or its one neighbour
        return KeyProof(1, 0 if key <= records[:KEY_SIZE] else 1, ((0, records, ()),))
    if size == 2:
        first, second = records[:RECORD_SIZE], records[RECORD_SIZE:]
        if key <= first[:KEY_SIZE]:  # the key's record, or its right neighbour
            return KeyProof(2, 0, ((0, first, (_sha256(b"\x00" + second).digest(),)),))
        if key >= second[:KEY_SIZE]:  # the key's record, or its left neighbour
            at = 1 if key == second[:KEY_SIZE] else 2
            return KeyProof(2, at, ((1, second, (_sha256(b"\x00" + first).digest(),)),))
        return KeyProof(
            2,
            1,
            (
                (0, first, (_sha256(b"\x00" + second).digest(),)),
                (1, second, (_sha256(b"\x00" + first).digest(),)),
            ),
        )
    return prove_in_tree(key, records)


def prove_in_tree(key: bytes, records: bytes) -> KeyProof:
    """`prove` for a bucket of any size, from the bucket's whole tree."""
    rows = records_of(records)
    keys = [r[:KEY_SIZE] for r in rows]
    at = bisect_left(keys, key)
    found = at < len(keys) and keys[at] == key
    wanted = [at] if found else [p for p in (at - 1, at) if 0 <= p < len(rows)]
    tree = MerkleTree(leaf_hash(r) for r in rows)
    return KeyProof(
        len(rows),
        at,
        tuple((p, rows[p], tuple(tree.inclusion_proof(p, len(rows)))) for p in wanted),
    )


def check_bucket(key: bytes, proof: KeyProof, what: str) -> tuple[bytes, bytes | None]:
    """The root of `key`'s bucket that `proof` shows, and the value it shows the key has there
    (None: absent); VerificationError naming `what` if it shows neither. The root is then
    checked against the map's (`root_of_buckets`)."""
    size, at = proof.bucket_size, proof.position
    if size < 0 or not 0 <= at <= size:
        raise VerificationError(f"the subject map's proof for {what} is malformed")
    root = EMPTY_BUCKET
    roots = set()
    value = None
    expected: list[int]
    by_position = {p: r for p, r, _ in proof.records}
    if at < size and by_position.get(at, b"")[:KEY_SIZE] == key:
        expected = [at]
        value = by_position[at][KEY_SIZE:]
    else:
        expected = [p for p in (at - 1, at) if 0 <= p < size]
    if sorted(by_position) != expected or len(proof.records) != len(expected):
        raise VerificationError(
            f"the subject map's proof for {what} shows records {sorted(by_position)} of a "
            f"bucket of {size}, not those around position {at}"
        )
    for position, record, path in proof.records:
        if len(record) != RECORD_SIZE:
            raise VerificationError(f"the subject map's proof for {what} has a malformed record")
        if position == at - 1 and not record[:KEY_SIZE] < key:
            raise VerificationError(f"the subject map's proof for {what} is out of order")
        if position == at and value is None and not record[:KEY_SIZE] > key:
            raise VerificationError(f"the subject map's proof for {what} is out of order")
        roots.add(root_from_inclusion(leaf_hash(record), position, size, path))
    if size:
        if len(roots) != 1:
            raise VerificationError(
                f"the subject map's proof for {what} shows records of two different buckets"
            )
        (root,) = roots
    return root, value


def root_of_buckets(roots: Mapping[int, bytes], nodes: Sequence[bytes]) -> bytes:
    """The map root that the bucket roots `roots` and the other nodes `nodes` of the tree of
    bucket roots lead to (`TopTree.multiproof`); VerificationError if `nodes` are too few or
    too many for those buckets."""
    if not roots or not all(0 <= b < BUCKETS for b in roots):
        raise VerificationError("the subject map's proof names no bucket, or one out of range")
    positions = sorted(roots)
    hashes = [_sha256(b"\x00" + roots[b]).digest() for b in positions]
    if len(nodes) > len(positions) * BUCKET_BITS or not all(len(n) == 32 for n in nodes):
        raise VerificationError(
            f"the subject map's proof has {len(nodes)} nodes, or a malformed one, for the "
            f"{len(roots)} buckets it proves"
        )
    given = list(nodes)
    taken = 0
    sha256 = _sha256
    for _ in range(BUCKET_BITS):
        up_positions: list[int] = []
        up_hashes: list[bytes] = []
        i, count = 0, len(positions)
        while i < count:
            at, here = positions[i], hashes[i]
            if at & 1 == 0 and i + 1 < count and positions[i + 1] == at + 1:
                up_hashes.append(sha256(b"\x01" + here + hashes[i + 1]).digest())
                i += 2
            else:
                if taken == len(given):
                    raise VerificationError(
                        f"the subject map's proof has too few nodes for the {len(roots)} "
                        "buckets it proves"
                    )
                sibling = given[taken]
                taken += 1
                pair = here + sibling if at & 1 == 0 else sibling + here
                up_hashes.append(sha256(b"\x01" + pair).digest())
                i += 1
            up_positions.append(at >> 1)
        positions, hashes = up_positions, up_hashes
    if taken != len(given):
        raise VerificationError(
            f"the subject map's proof has {len(given)} nodes, not the {taken} its "
            f"{len(roots)} buckets need"
        )
    return hashes[0]


def check_keys(
    keys: Sequence[tuple[bytes, KeyProof, str]], nodes: Sequence[bytes], map_root: bytes
) -> list[bytes | None]:
    """The value each (key, proof, what) shows its key has under `map_root`, or None if absent,
    the buckets' places in the map proven together by `nodes`; VerificationError naming the
    key's `what` if a proof shows neither, or two proofs show one bucket with two roots."""
    if not keys:
        return []
    roots: dict[int, bytes] = {}
    values: list[bytes | None] = []
    for key, proof, what in keys:
        root, value = check_bucket(key, proof, what)
        if roots.setdefault(bucket_of(key), root) != root:
            raise VerificationError(
                f"the subject map's proof for {what} shows its bucket {bucket_of(key)} with "
                "another root than the proof of another digest in it"
            )
        values.append(value)
    got = root_of_buckets(roots, nodes)
    if got != map_root:
        raise VerificationError(
            f"the subject map's proof for {', '.join(w for _, _, w in keys[:3])}"
            f"{' and others' if len(keys) > 3 else ''} leads to root {got.hex()}, "
            f"not the {map_root.hex()} the ledger's index entry commits to"
        )
    return values


def root_of(chains: dict[bytes, bytes]) -> bytes:
    """The map root of the records `chains` (key to value), built from nothing."""
    buckets: dict[int, list[bytes]] = {}
    for key in sorted(chains):
        buckets.setdefault(bucket_of(key), []).append(key + chains[key])
    top = TopTree()
    top.set((b, bucket_root(b"".join(rows))) for b, rows in buckets.items())
    return top.root()


def rebuild(pairs: Iterable[tuple[bytes, int]]) -> bytes:
    """The map root of the (digest key, index) pairs, in ascending index order, from nothing."""
    chains: dict[bytes, bytes] = {}
    for raw, index in pairs:
        key = hashlib.sha256(raw).digest()
        chains[key] = next_value(chains.get(key, ZERO_VALUE), index)
    return root_of(chains)


class MapPart:
    """What `vault verify` gathers of the subject map from a run of entries, in index order
    (a chunk's worker gathers its own): the `index` entries met, as (index, covers, root) or
    (index, None, None) if malformed, and, if asked (`keys`), each subject's key and entry
    index, packed."""

    def __init__(self, keys: bool = True) -> None:
        self.gathers_keys = keys
        self.keys = bytearray()
        self.indexes = array("q")
        self.index_entries: list[tuple[int, int | None, bytes | None]] = []

    def add(self, index: int, subjects: Iterable[str]) -> None:
        if not self.gathers_keys:
            return
        for subject in subjects:
            self.keys += hashlib.sha256(digest_key(subject)).digest()
            self.indexes.append(index)

    def add_index_entry(self, index: int, meta: Mapping[str, str]) -> None:
        covers, root = meta.get("covers", ""), meta.get("map-root", "")
        if (
            meta.get("map") != MAP_FORMAT
            or not _COUNT.fullmatch(covers)
            or not _ROOT.fullmatch(root)
        ):
            self.index_entries.append((index, None, None))
        else:
            self.index_entries.append((index, int(covers), bytes.fromhex(root)))


def audit_map(parts: Sequence[MapPart]) -> list[tuple[int, str]]:
    """`vault verify`'s check of the subject map from the parts of the whole ledger, in index
    order: each `index` entry covers no entry after it and no fewer than the one before, and,
    if the parts gathered the keys, the newest one's root is the root of the map rebuilt from
    the entries it covers. The failures, as (index, message)."""
    failures: list[tuple[int, str]] = []
    covered = 0
    newest: tuple[int, int, bytes] | None = None
    for part in parts:
        for index, covers, root in part.index_entries:
            if covers is None or root is None:
                failures.append((index, f"index entry {index} is malformed: {MAP_FORMAT} meta"))
            elif not covered <= covers <= index:
                failures.append(
                    (
                        index,
                        f"index entry {index} covers {covers} entries: not between the "
                        f"{covered} an earlier one covers and its own index",
                    )
                )
            else:
                covered = covers
                newest = (index, covers, root)
    if newest is None or not all(part.gathers_keys for part in parts):
        return failures
    index, covers, root = newest
    chains: dict[bytes, bytes] = {}
    sha256 = hashlib.sha256
    get = chains.get
    for part in parts:
        keys, indexes = part.keys, part.indexes
        for i, at in enumerate(indexes):
            if at >= covers:
                break
            key = bytes(keys[32 * i : 32 * i + 32])
            chains[key] = sha256(get(key, ZERO_VALUE) + at.to_bytes(8, "big")).digest()
    rebuilt = root_of(chains)
    if rebuilt != root:
        failures.append(
            (
                index,
                f"index entry {index} commits to subject map root {root.hex()}, but the map of "
                f"the {covers} entries it covers has root {rebuilt.hex()}",
            )
        )
    return failures
