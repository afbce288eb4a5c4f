"""The Merkle tree and proof verifiers against published RFC 6962 vectors and against a naive
implementation written straight from the RFC 9162 §2.1 definitions."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from vault.errors import VerificationError
from vault.ledger import merkle
from vault.ledger.merkle import (
    EMPTY_ROOT,
    CompactRange,
    MerkleTree,
    items_root,
    leaf_hash,
    node_hash,
    root_from_inclusion,
    verify_consistency,
    verify_inclusion,
    verify_multiproof,
)

MAX_SIZE = 40

# The certificate-transparency reference test corpus (RFC 6962 trees of 1 to 8 leaves).
CT_LEAVES = [
    bytes.fromhex(h)
    for h in (
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    )
]
CT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
# (index, size) -> path, as published with that corpus.
CT_INCLUSION = {
    (0, 8): [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (5, 8): [
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
    (2, 3): ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"],
    (1, 5): [
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    ],
}
CT_CONSISTENCY = {
    (1, 8): [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (6, 8): [
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
    (2, 5): [
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    ],
}


def _split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(leaves: list[bytes]) -> bytes:
    """MTH(D[n]) of RFC 9162 §2.1.1, over leaf hashes."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return hashlib.sha256(b"\x01" + ref_mth(leaves[:k]) + ref_mth(leaves[k:])).digest()


def ref_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]) of RFC 9162 §2.1.3.1."""
    if len(leaves) == 1:
        return []
    k = _split(len(leaves))
    if m < k:
        return [*ref_path(m, leaves[:k]), ref_mth(leaves[k:])]
    return [*ref_path(m - k, leaves[k:]), ref_mth(leaves[:k])]


def ref_subproof(m: int, leaves: list[bytes], whole: bool) -> list[bytes]:
    """SUBPROOF(m, D[n], b) of RFC 9162 §2.1.4.1."""
    if m == len(leaves):
        return [] if whole else [ref_mth(leaves)]
    k = _split(len(leaves))
    if m <= k:
        return [*ref_subproof(m, leaves[:k], whole), ref_mth(leaves[k:])]
    return [*ref_subproof(m - k, leaves[k:], False), ref_mth(leaves[:k])]


def ref_proof(m: int, leaves: list[bytes]) -> list[bytes]:
    return ref_subproof(m, leaves, True)


LEAVES = [leaf_hash(f"entry {i}".encode()) for i in range(MAX_SIZE)]
REF_ROOTS = [ref_mth(LEAVES[:n]) for n in range(MAX_SIZE + 1)]


@pytest.fixture(scope="module")
def tree() -> MerkleTree:
    return MerkleTree(LEAVES)


def _flip(value: bytes, position: int = 0) -> bytes:
    changed = bytearray(value)
    changed[position] ^= 0x01
    return bytes(changed)


def test_hashing_uses_rfc_6962_prefixes() -> None:
    assert leaf_hash(b"abc") == hashlib.sha256(b"\x00abc").digest()
    assert (
        node_hash(b"l" * 32, b"r" * 32) == hashlib.sha256(b"\x01" + b"l" * 32 + b"r" * 32).digest()
    )
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_known_roots_of_the_reference_corpus() -> None:
    hashes = [leaf_hash(data) for data in CT_LEAVES]
    tree = MerkleTree(hashes)
    assert [tree.root(n).hex() for n in range(1, 9)] == CT_ROOTS
    assert tree.root(0) == EMPTY_ROOT


def test_the_root_of_items_is_the_reference_tree_hash_at_every_size() -> None:
    # items_root builds the tree level by level; RFC 9162 defines it by splitting at the
    # largest power of two: both give the reference roots, and the same root at every size.
    assert [items_root(CT_LEAVES[:n]).hex() for n in range(1, 9)] == CT_ROOTS
    assert items_root([]) == EMPTY_ROOT
    items = [i.to_bytes(4, "big") for i in range(300)]
    tree = MerkleTree(leaf_hash(item) for item in items)
    for size in range(1, 301):
        assert items_root(items[:size]) == tree.root(size), size


@pytest.mark.parametrize(("index", "size"), sorted(CT_INCLUSION))
def test_known_inclusion_proofs(index: int, size: int) -> None:
    hashes = [leaf_hash(data) for data in CT_LEAVES]
    tree = MerkleTree(hashes)
    proof = tree.inclusion_proof(index, size)
    assert [p.hex() for p in proof] == CT_INCLUSION[index, size]
    verify_inclusion(hashes[index], index, size, proof, bytes.fromhex(CT_ROOTS[size - 1]))


@pytest.mark.parametrize(("old", "new"), sorted(CT_CONSISTENCY))
def test_known_consistency_proofs(old: int, new: int) -> None:
    tree = MerkleTree([leaf_hash(data) for data in CT_LEAVES])
    proof = tree.consistency_proof(old, new)
    assert [p.hex() for p in proof] == CT_CONSISTENCY[old, new]
    verify_consistency(
        old, new, bytes.fromhex(CT_ROOTS[old - 1]), bytes.fromhex(CT_ROOTS[new - 1]), proof
    )


def test_roots_at_every_size_match_the_reference(tree: MerkleTree) -> None:
    assert tree.size == MAX_SIZE
    assert [tree.root(n) for n in range(MAX_SIZE + 1)] == REF_ROOTS
    assert tree.root() == REF_ROOTS[-1]


def test_append_and_extend_build_the_same_tree() -> None:
    appended = MerkleTree()
    for n, h in enumerate(LEAVES, start=1):
        appended.append(h)
        assert appended.root() == REF_ROOTS[n]
    # Extending in uneven chunks crosses every kind of level boundary.
    chunked = MerkleTree()
    start = 0
    for chunk in (1, 2, 3, 5, 7, 11, 11):
        chunked.extend(LEAVES[start : start + chunk])
        start += chunk
        assert chunked.root() == REF_ROOTS[start]
    assert [chunked.leaf(i) for i in range(MAX_SIZE)] == LEAVES
    for size in range(1, MAX_SIZE + 1):
        for index in range(size):
            assert appended.inclusion_proof(index, size) == chunked.inclusion_proof(index, size)


def test_every_inclusion_proof_matches_the_reference_and_verifies(tree: MerkleTree) -> None:
    for size in range(1, MAX_SIZE + 1):
        for index in range(size):
            proof = tree.inclusion_proof(index, size)
            assert proof == ref_path(index, LEAVES[:size]), (index, size)
            verify_inclusion(LEAVES[index], index, size, proof, REF_ROOTS[size])
            assert root_from_inclusion(LEAVES[index], index, size, proof) == REF_ROOTS[size]


def test_every_consistency_proof_matches_the_reference_and_verifies(tree: MerkleTree) -> None:
    for new in range(0, MAX_SIZE + 1):
        for old in range(0, new + 1):
            proof = tree.consistency_proof(old, new)
            expected = [] if old == 0 else ref_proof(old, LEAVES[:new])
            assert proof == expected, (old, new)
            verify_consistency(old, new, REF_ROOTS[old], REF_ROOTS[new], proof)


def test_a_tampered_inclusion_proof_fails(tree: MerkleTree) -> None:
    for size in range(1, MAX_SIZE + 1):
        for index in range(size):
            proof = tree.inclusion_proof(index, size)
            for position in range(len(proof)):
                bad = list(proof)
                bad[position] = _flip(bad[position], position % 32)
                with pytest.raises(VerificationError) as caught:
                    verify_inclusion(LEAVES[index], index, size, bad, REF_ROOTS[size])
                assert caught.value.index == index
            with pytest.raises(VerificationError):
                verify_inclusion(_flip(LEAVES[index]), index, size, proof, REF_ROOTS[size])
            with pytest.raises(VerificationError):
                verify_inclusion(LEAVES[index], index, size, proof, _flip(REF_ROOTS[size]))
            if proof:
                with pytest.raises(VerificationError, match="too few"):
                    verify_inclusion(LEAVES[index], index, size, proof[:-1], REF_ROOTS[size])
            with pytest.raises(VerificationError, match="step 4a"):
                verify_inclusion(LEAVES[index], index, size, [*proof, LEAVES[0]], REF_ROOTS[size])


def test_an_inclusion_proof_does_not_verify_for_another_index_or_size(tree: MerkleTree) -> None:
    for size in range(1, MAX_SIZE + 1):
        for index in range(size):
            proof = tree.inclusion_proof(index, size)
            for other in range(size):
                if other != index:
                    with pytest.raises(VerificationError):
                        verify_inclusion(LEAVES[index], other, size, proof, REF_ROOTS[size])
            for other_size in range(index + 1, MAX_SIZE + 1):
                if other_size != size:
                    with pytest.raises(VerificationError):
                        verify_inclusion(
                            LEAVES[index], index, other_size, proof, REF_ROOTS[other_size]
                        )


def test_inclusion_proof_arguments_out_of_range_fail() -> None:
    with pytest.raises(VerificationError, match="step 1") as caught:
        verify_inclusion(LEAVES[3], 3, 3, [], REF_ROOTS[3])
    assert caught.value.index == 3
    with pytest.raises(VerificationError, match="non-negative"):
        verify_inclusion(LEAVES[0], -1, 3, [], REF_ROOTS[3])
    with pytest.raises(VerificationError, match="32 bytes"):
        verify_inclusion(LEAVES[0], 0, 2, [b"short"], REF_ROOTS[2])
    with pytest.raises(VerificationError, match="32 bytes"):
        verify_inclusion(LEAVES[0][:31], 0, 1, [], REF_ROOTS[1])


def test_a_failed_inclusion_proof_names_the_index_size_and_roots(tree: MerkleTree) -> None:
    proof = tree.inclusion_proof(5, 13)
    with pytest.raises(VerificationError) as caught:
        verify_inclusion(LEAVES[6], 5, 13, proof, REF_ROOTS[13])
    message = str(caught.value)
    assert "index 5" in message and "tree size 13" in message
    assert REF_ROOTS[13].hex() in message


def test_a_tampered_consistency_proof_fails(tree: MerkleTree) -> None:
    for new in range(2, MAX_SIZE + 1):
        for old in range(1, new):
            proof = tree.consistency_proof(old, new)
            for position in range(len(proof)):
                bad = list(proof)
                bad[position] = _flip(bad[position], position % 32)
                with pytest.raises(VerificationError):
                    verify_consistency(old, new, REF_ROOTS[old], REF_ROOTS[new], bad)
            with pytest.raises(VerificationError):
                verify_consistency(old, new, _flip(REF_ROOTS[old]), REF_ROOTS[new], proof)
            with pytest.raises(VerificationError):
                verify_consistency(old, new, REF_ROOTS[old], _flip(REF_ROOTS[new]), proof)
            with pytest.raises(VerificationError, match=r"too few|step 1"):
                verify_consistency(old, new, REF_ROOTS[old], REF_ROOTS[new], proof[:-1])
            with pytest.raises(VerificationError, match="step 6a"):
                verify_consistency(old, new, REF_ROOTS[old], REF_ROOTS[new], [*proof, LEAVES[0]])


def test_a_consistency_proof_does_not_verify_for_other_sizes(tree: MerkleTree) -> None:
    for new in range(2, MAX_SIZE + 1):
        for old in range(1, new):
            proof = tree.consistency_proof(old, new)
            for other_old in range(1, new):
                if other_old != old:
                    with pytest.raises(VerificationError):
                        verify_consistency(
                            other_old, new, REF_ROOTS[other_old], REF_ROOTS[new], proof
                        )
            for other_new in range(old + 1, MAX_SIZE + 1):
                if other_new != new:
                    with pytest.raises(VerificationError):
                        verify_consistency(
                            old, other_new, REF_ROOTS[old], REF_ROOTS[other_new], proof
                        )


def test_a_forked_tree_is_not_consistent() -> None:
    forked = [*LEAVES[:10], leaf_hash(b"rewritten"), *LEAVES[11:20]]
    fork_tree = MerkleTree(forked)
    proof = fork_tree.consistency_proof(12, 20)
    with pytest.raises(VerificationError, match="old root"):
        verify_consistency(12, 20, REF_ROOTS[12], fork_tree.root(20), proof)


def test_consistency_edge_cases() -> None:
    verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
    verify_consistency(0, 5, EMPTY_ROOT, REF_ROOTS[5], [])
    verify_consistency(5, 5, REF_ROOTS[5], REF_ROOTS[5], [])
    with pytest.raises(VerificationError, match="must be empty"):
        verify_consistency(0, 5, EMPTY_ROOT, REF_ROOTS[5], [LEAVES[0]])
    with pytest.raises(VerificationError, match="empty tree"):
        verify_consistency(0, 5, REF_ROOTS[1], REF_ROOTS[5], [])
    with pytest.raises(VerificationError, match="roots differ"):
        verify_consistency(5, 5, REF_ROOTS[5], REF_ROOTS[4], [])
    with pytest.raises(VerificationError, match="must be empty"):
        verify_consistency(5, 5, REF_ROOTS[5], REF_ROOTS[5], [LEAVES[0]])
    with pytest.raises(VerificationError, match="larger"):
        verify_consistency(6, 5, REF_ROOTS[6], REF_ROOTS[5], [])
    with pytest.raises(VerificationError, match="step 1"):
        verify_consistency(3, 5, REF_ROOTS[3], REF_ROOTS[5], [])
    with pytest.raises(VerificationError, match="32 bytes"):
        verify_consistency(3, 5, REF_ROOTS[3], REF_ROOTS[5], [b"x"])


def test_server_side_arguments_out_of_range_raise_value_error(tree: MerkleTree) -> None:
    with pytest.raises(ValueError):
        tree.root(MAX_SIZE + 1)
    with pytest.raises(ValueError):
        tree.root(-1)
    with pytest.raises(ValueError):
        tree.leaf(MAX_SIZE)
    with pytest.raises(ValueError):
        tree.inclusion_proof(5, 5)
    with pytest.raises(ValueError):
        tree.inclusion_proof(0, MAX_SIZE + 1)
    with pytest.raises(ValueError):
        tree.inclusion_proof(-1, 5)
    with pytest.raises(ValueError):
        tree.consistency_proof(6, 5)
    with pytest.raises(ValueError):
        tree.consistency_proof(1, MAX_SIZE + 1)
    with pytest.raises(ValueError):
        tree.consistency_proof(-1, 5)


def test_a_leaf_hash_of_the_wrong_length_is_refused_and_changes_nothing() -> None:
    tree = MerkleTree(LEAVES[:3])
    with pytest.raises(ValueError):
        tree.append(b"short")
    with pytest.raises(ValueError):
        tree.extend([LEAVES[3], b"x" * 33])
    assert tree.size == 3
    assert tree.root() == REF_ROOTS[3]
    tree.extend(LEAVES[3:9])
    assert tree.root() == REF_ROOTS[9]


def test_compact_range_root_matches_the_reference() -> None:
    compact = CompactRange()
    assert compact.root() == EMPTY_ROOT
    for n, h in enumerate(LEAVES, start=1):
        compact.append(h)
        assert compact.size == n
        assert compact.root() == REF_ROOTS[n]
    with pytest.raises(ValueError):
        compact.append(b"short")
    assert compact.size == MAX_SIZE


def test_large_tree_agrees_with_compact_range_and_proves_inclusion() -> None:
    n = 100_003
    hashes = [hashlib.sha256(i.to_bytes(8, "big")).digest() for i in range(n)]
    tree = MerkleTree(hashes)
    compact = CompactRange()
    checkpoints = {1, 2, 1023, 1024, 1025, 65_536, 99_999, n}
    for size, h in enumerate(hashes, start=1):
        compact.append(h)
        if size in checkpoints:
            assert compact.root() == tree.root(size), size
    for index, size in ((0, n), (n - 1, n), (65_535, 65_536), (65_536, 99_999), (4242, 5000)):
        verify_inclusion(
            hashes[index], index, size, tree.inclusion_proof(index, size), tree.root(size)
        )
    for old, new in ((1, n), (65_536, n), (99_999, n), (1023, 1025)):
        verify_consistency(
            old, new, tree.root(old), tree.root(new), tree.consistency_proof(old, new)
        )


def _leaves(count: int) -> list[bytes]:
    return [leaf_hash(n.to_bytes(4, "big")) for n in range(count)]


@pytest.mark.parametrize("size", [256, 300, 512, 1000, 2 * 65536 + 300])
def test_a_tree_resumed_from_its_height_8_nodes_answers_as_the_whole_tree(size: int) -> None:
    """Resumed from the nodes of height 8 of its whole tiles, reading the leaf hashes of a tile
    back only when a proof needs them, a tree gives the roots and proofs of the whole tree, and
    goes on growing and letting go of what its tiles hold."""
    leaves = _leaves(size + 700)
    whole = MerkleTree(leaves[:size])
    base = size // 256 * 256
    read: list[int] = []

    def lower(tile: int) -> list[bytes]:
        read.append(tile)
        return [b"".join(leaves[tile * 256 : tile * 256 + 256])]

    tree = MerkleTree.resume(base, whole.nodes(8, 0, base // 256), lower)
    tree.extend(leaves[base:size])
    assert (tree.size, tree.base, tree.root()) == (size, base, whole.root())
    assert not read
    for index in range(0, size, max(size // 50, 1)):
        assert tree.leaf(index) == whole.leaf(index)
        assert tree.inclusion_proof(index, size) == whole.inclusion_proof(index, size)
        assert tree.root(index + 1) == whole.root(index + 1)
        assert tree.consistency_proof(index + 1, size) == whole.consistency_proof(index + 1, size)
    assert tree.nodes(0, 0, size) == whole.nodes(0, 0, size)
    assert read
    for leaf in leaves[size : size + 300]:
        tree.append(leaf)
        whole.append(leaf)
    tree.extend(leaves[size + 300 :])
    whole.extend(leaves[size + 300 :])
    assert tree.retire(tree.size, lower) == tree.size // 256 * 256
    assert tree.root() == whole.root()
    assert tree.inclusion_proof(size + 100, tree.size) == whole.inclusion_proof(
        size + 100, tree.size
    )


def test_leaf_hashes_read_back_are_checked_and_a_wrong_candidate_is_passed_over() -> None:
    leaves = _leaves(1024)
    whole = MerkleTree(leaves)
    right = b"".join(leaves[256:512])
    candidates = {1: [right[32:] + right[:32], b"short", right]}
    tree = MerkleTree.resume(1024, whole.nodes(8, 0, 4), lambda t: candidates.get(t, []))
    assert tree.inclusion_proof(300, 1024) == whole.inclusion_proof(300, 1024)
    with pytest.raises(VerificationError, match="entries 512 to 767 do not hash") as caught:
        tree.inclusion_proof(600, 1024)
    assert caught.value.index == 512
    with pytest.raises(ValueError, match="resumes from 4 nodes of height 8"):
        MerkleTree.resume(1024, whole.nodes(8, 0, 3), lambda t: [])


def test_a_shared_proof_hashes_each_node_above_its_leaves_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leaves = [leaf_hash(n.to_bytes(4, "big")) for n in range(10_000)]
    tree = MerkleTree(leaves)
    wanted = range(0, 10_000, 10)
    proofs = {index: tree.inclusion_proof(index, 10_000) for index in wanted}
    nodes = tree.multiproof(wanted, 10_000)
    hashed = 0

    def counting(data: bytes) -> Any:
        nonlocal hashed
        hashed += 1
        return hashlib.sha256(data)

    monkeypatch.setattr(merkle, "_sha256", counting)
    paths = verify_multiproof({i: leaves[i] for i in wanted}, 10_000, nodes, tree.root(10_000))
    together, hashed = hashed, 0
    for index in wanted:
        verify_inclusion(leaves[index], index, 10_000, proofs[index], tree.root(10_000))
    assert paths == proofs
    # About the nodes of the union of the paths (5 a leaf here), not 14 a leaf.
    assert together < 6 * len(wanted) and together * 2 < hashed
    assert len(nodes) * 2 < sum(map(len, proofs.values()))
