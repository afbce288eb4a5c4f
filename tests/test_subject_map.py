"""The subject map's proofs on their own (vault.ledger.subject_map): a key's value or its absence
is proven under the map's root, every altered proof is refused, and the map the writer keeps
step by step is the map anyone rebuilds from the same pairs."""

from __future__ import annotations

import hashlib
import random

import pytest

from vault.digest import digest_key
from vault.errors import VerificationError
from vault.ledger.merkle import leaf_hash, root_from_inclusion
from vault.ledger.subject_map import (
    BUCKET_BITS,
    BUCKETS,
    KeyProof,
    TopTree,
    bucket_of,
    bucket_root,
    check_keys,
    key_of,
    merge,
    prove,
    prove_in_tree,
    rebuild,
    records_of,
    value_of,
)


def _digest(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def _map(named: dict[str, list[int]]) -> tuple[dict[int, bytes], TopTree]:
    """Buckets and tree of a map in which each digest is named by its entries."""
    changes: dict[int, dict[bytes, list[int]]] = {}
    for digest, indexes in named.items():
        key = key_of(digest)
        changes.setdefault(bucket_of(key), {})[key] = indexes
    buckets = {b: merge(b"", c) for b, c in changes.items()}
    top = TopTree()
    top.set((b, bucket_root(r)) for b, r in buckets.items())
    return buckets, top


def _check(key: bytes, proof: KeyProof, top: TopTree, what: str) -> bytes | None:
    """A key's value, checked as a one-digest look-up's client checks it."""
    (value,) = check_keys([(key, proof, what)], top.multiproof([bucket_of(key)]), top.root())
    return value


def _colliding(count: int) -> list[str]:
    """Digests whose keys share one bucket, so that proofs have neighbours on both sides."""
    found: list[str] = []
    n = 0
    while len(found) < count:
        d = _digest(n)
        if bucket_of(key_of(d)) == 7:
            found.append(d)
        n += 1
    return found


def test_a_named_digest_proves_its_value_and_an_unnamed_one_its_absence() -> None:
    named = {d: [i, i + 100] for i, d in enumerate(_colliding(5))}
    absent = _colliding(6)[5]
    buckets, top = _map(named)
    for digest, indexes in named.items():
        key = key_of(digest)
        proof = prove(key, buckets[bucket_of(key)])
        assert _check(key, proof, top, digest) == value_of(indexes)
    key = key_of(absent)
    proof = prove(key, buckets[bucket_of(key)])
    assert _check(key, proof, top, absent) is None
    # A digest whose bucket is empty is proven absent by the bucket's path alone.
    lonely = next(d for d in map(_digest, range(10**6)) if bucket_of(key_of(d)) not in buckets)
    key = key_of(lonely)
    assert _check(key, prove(key, b""), top, lonely) is None


@pytest.mark.parametrize(
    "alter",
    [
        "a named key shown absent",
        "an absent key shown named",
        "a neighbour left out",
        "a record's value changed",
        "the bucket's size changed",
        "the position moved",
    ],
)
def test_every_altered_proof_is_refused(alter: str) -> None:
    # In key order: the last one, never named, would come after every record of its bucket.
    digests = sorted(_colliding(6), key=key_of)
    if alter == "a neighbour left out":  # a key in the middle, never named
        digests = [*digests[:2], *digests[3:], digests[2]]
    named = {d: [i] for i, d in enumerate(digests[:5])}
    buckets, top = _map(named)
    shows_absence = alter in ("an absent key shown named", "a neighbour left out")
    asked = digests[5] if shows_absence or alter == "the bucket's size changed" else digests[2]
    key = key_of(asked)
    proof = prove(key, buckets[bucket_of(key)])
    if alter == "a named key shown absent":
        # The records on either side of it, with their true paths: their positions are not
        # adjacent to where the key would be.
        honest = prove(key_of(asked), buckets[7])
        records = [
            prove(key_of(digests[j]), buckets[7]).records[0]
            for j in range(5)
            if digests[j] != asked
        ]
        around = [r for r in records if r[0] in (honest.position - 1, honest.position + 1)]
        proof = proof._replace(records=tuple(around))
    elif alter == "an absent key shown named":
        other = prove(key_of(digests[0]), buckets[7])
        proof = other._replace(position=other.position)
    elif alter == "a neighbour left out":
        proof = proof._replace(records=proof.records[:1])
    elif alter == "a record's value changed":
        position, record, path = proof.records[0]
        proof = proof._replace(records=((position, record[:32] + bytes(32), path),))
    elif alter == "the bucket's size changed":
        # The last key's absence told of a bucket one record larger: its right neighbour is
        # missing.
        proof = proof._replace(bucket_size=proof.bucket_size + 1)
    elif alter == "the position moved":
        proof = proof._replace(position=proof.position + 1)
    with pytest.raises(VerificationError, match="subject map"):
        value = _check(key, proof, top, asked)
        # An absent key "shown named" by another key's record proves that key, not this one.
        assert value is not None and alter != "an absent key shown named"


def test_a_map_kept_step_by_step_is_the_map_rebuilt_from_nothing() -> None:
    rng = random.Random(5)
    digests = [_digest(n) for n in range(400)]
    pairs: list[tuple[bytes, int]] = []
    buckets: dict[int, bytes] = {}
    top = TopTree()
    index = 0
    for _ in range(20):
        step: dict[int, dict[bytes, list[int]]] = {}
        for _ in range(rng.randrange(1, 60)):
            for d in rng.sample(digests, rng.randrange(1, 4)):
                pairs.append((digest_key(d), index))
                key = key_of(d)
                step.setdefault(bucket_of(key), {}).setdefault(key, []).append(index)
            index += 1
        for b, changes in step.items():
            buckets[b] = merge(buckets.get(b, b""), changes)
        top.set((b, bucket_root(buckets[b])) for b in step)
        assert rebuild(pairs) == top.root()
    # Every record's key sorts within its bucket, and the bucket is the key's own.
    for b, records in buckets.items():
        keys = [r[:32] for r in records_of(records)]
        assert keys == sorted(keys) and {bucket_of(k) for k in keys} == {b}


def test_a_proof_is_the_size_of_a_path_not_of_the_map() -> None:
    named = {_digest(n): [n] for n in range(3000)}
    buckets, top = _map(named)
    key = key_of(_digest(17))
    proof: KeyProof = prove(key, buckets[bucket_of(key)])
    assert len(top.multiproof([bucket_of(key)])) == BUCKET_BITS and len(proof.records) == 1
    assert sum(len(p) for _, _, p in proof.records) <= 4
    # Buckets of one record, of two and of more all prove their keys.
    sizes = set()
    for digest, indexes in named.items():
        key = key_of(digest)
        proof = prove(key, buckets[bucket_of(key)])
        sizes.add(min(proof.bucket_size, 3))
        assert _check(key, proof, top, digest) == value_of(indexes)
    assert sizes == {1, 2, 3}


def test_many_keys_are_proven_together_by_fewer_nodes_than_their_paths() -> None:
    named = {_digest(n): [n] for n in range(20_000)}
    buckets, top = _map(named)
    asked = [_digest(n) for n in range(0, 20_000, 20)] + [_digest(n) for n in range(-1, -11, -1)]
    keys = [(key_of(d), prove(key_of(d), buckets.get(bucket_of(key_of(d)), b"")), d) for d in asked]
    nodes = top.multiproof(bucket_of(k) for k, _, _ in keys)
    assert len(nodes) < len(asked) * BUCKET_BITS * 0.45
    values = check_keys(keys, nodes, top.root())
    assert values == [value_of(named[d]) if d in named else None for d in asked]
    # The nodes of one bucket are its RFC 9162 inclusion proof in the tree of bucket roots.
    (bucket, records), *_ = buckets.items()
    path = top.multiproof([bucket])
    assert len(path) == BUCKET_BITS
    assert root_from_inclusion(leaf_hash(bucket_root(records)), bucket, BUCKETS, path) == top.root()


@pytest.mark.parametrize(
    "alter",
    ["a node changed", "a node left out", "a node added", "a bucket's nodes for another's"],
)
def test_an_altered_shared_proof_is_refused(alter: str) -> None:
    named = {_digest(n): [n] for n in range(2000)}
    buckets, top = _map(named)
    asked = [_digest(n) for n in range(0, 2000, 100)]
    keys = [(key_of(d), prove(key_of(d), buckets[bucket_of(key_of(d))]), d) for d in asked]
    nodes = top.multiproof(bucket_of(k) for k, _, _ in keys)
    if alter == "a node changed":
        nodes[len(nodes) // 2] = bytes(32)
    elif alter == "a node left out":
        del nodes[-1]
    elif alter == "a node added":
        nodes.append(nodes[0])
    else:  # the nodes that would prove the bucket beside the first digest's
        nodes = top.multiproof([bucket_of(k) for k, _, _ in keys[1:]] + [bucket_of(keys[0][0]) ^ 1])
    with pytest.raises(VerificationError, match="subject map"):
        check_keys(keys, nodes, top.root())


def test_two_proofs_of_one_bucket_with_two_roots_are_refused() -> None:
    digests = sorted(_colliding(4), key=key_of)
    named = {d: [i] for i, d in enumerate(digests[:3])}
    buckets, top = _map(named)
    first = prove(key_of(digests[0]), buckets[7])
    # The second digest's record with another value: its bucket's root differs from the first's.
    position, record, path = prove(key_of(digests[1]), buckets[7]).records[0]
    second = prove(key_of(digests[1]), buckets[7])._replace(
        records=((position, record[:32] + bytes(32), path),)
    )
    with pytest.raises(VerificationError, match="another root"):
        check_keys(
            [(key_of(digests[0]), first, digests[0]), (key_of(digests[1]), second, digests[1])],
            top.multiproof([7]),
            top.root(),
        )


def test_small_buckets_are_proven_as_their_tree_proves_them() -> None:
    digests = sorted(_colliding(9), key=key_of)
    for size in range(4):
        named = digests[1 : 2 * size : 2]  # the digests between them are never named
        records = merge(b"", {key_of(d): [i] for i, d in enumerate(named)})
        for digest in digests:
            key = key_of(digest)
            assert prove(key, records) == prove_in_tree(key, records), (size, digest)
