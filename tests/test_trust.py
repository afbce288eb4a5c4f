"""A client's trusted checkpoint: it moves forward only along a signed, provably consistent
history, and a vault that rolls back or rewrites its ledger is caught."""

from __future__ import annotations

import json
import re

import pytest

from vault.client.trust import TrustedLog
from vault.errors import InvalidArgument, RollbackError, VerificationError
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.merkle import EMPTY_ROOT, MerkleTree, leaf_hash

ORIGIN = "pinvault.test/ledger"
KEY = SigningKey(ORIGIN, bytes(range(32)))
LEAVES = [leaf_hash(f"entry {i}".encode()) for i in range(64)]
TREE = MerkleTree(LEAVES)


def note_at(size: int, tree: MerkleTree = TREE, key: SigningKey = KEY) -> str:
    return key.sign(Checkpoint(ORIGIN, size, tree.root(size)))


def trusted_at(size: int) -> TrustedLog:
    return TrustedLog(KEY.verifier(), ORIGIN, size, TREE.root(size))


def test_a_new_client_trusts_the_first_checkpoint_without_a_proof() -> None:
    log = TrustedLog(KEY.verifier(), ORIGIN)
    assert (log.size, log.root) == (0, EMPTY_ROOT)
    checkpoint = log.update(note_at(5), [])
    assert checkpoint == Checkpoint(ORIGIN, 5, TREE.root(5))
    assert (log.size, log.root) == (5, TREE.root(5))


def test_the_trusted_state_moves_forward_along_consistency_proofs() -> None:
    log = TrustedLog(KEY.verifier(), ORIGIN)
    previous = 0
    for size in (1, 2, 3, 7, 8, 9, 16, 17, 40, 63, 64):
        log.update(note_at(size), TREE.consistency_proof(previous, size))
        assert (log.size, log.root) == (size, TREE.root(size))
        previous = size


def test_the_same_checkpoint_again_is_accepted() -> None:
    log = trusted_at(9)
    log.update(note_at(9), [])
    assert (log.size, log.root) == (9, TREE.root(9))


def test_a_rollback_is_refused_and_changes_nothing() -> None:
    log = trusted_at(9)
    with pytest.raises(RollbackError) as caught:
        log.update(note_at(5), [])
    assert str(caught.value).startswith(
        "vault rolled back: it presents size 5 but size 9 was already verified, and it does "
        "not prove the one a prefix of the other"
    )
    assert (log.size, log.root) == (9, TREE.root(9))


def test_an_older_checkpoint_proved_a_prefix_is_believed_and_moves_nothing_back() -> None:
    # What a client sees when another client sharing its state moved it past this answer.
    log = trusted_at(9)
    assert log.update(note_at(5), TREE.consistency_proof(5, 9)) == Checkpoint(
        ORIGIN, 5, TREE.root(5)
    )
    assert (log.size, log.root) == (9, TREE.root(9))
    forked = MerkleTree([*LEAVES[:3], leaf_hash(b"rewritten"), *LEAVES[4:9]])
    with pytest.raises(RollbackError, match="presents size 5 but size 9 was already verified"):
        log.update(note_at(5, forked), TREE.consistency_proof(5, 9))
    assert (log.size, log.root) == (9, TREE.root(9))


def test_a_state_kept_elsewhere_is_joined_only_if_consistent() -> None:
    log = trusted_at(9)
    log.merge(5, TREE.root(5), TREE.consistency_proof(5, 9))
    assert (log.size, log.root) == (9, TREE.root(9))
    log.merge(20, TREE.root(20), TREE.consistency_proof(9, 20))
    assert (log.size, log.root) == (20, TREE.root(20))
    forked = MerkleTree([*LEAVES[:3], leaf_hash(b"rewritten"), *LEAVES[4:30]])
    with pytest.raises(RollbackError, match="the vault showed a fork"):
        log.merge(30, forked.root(30), forked.consistency_proof(20, 30))
    assert (log.size, log.root) == (20, TREE.root(20))


def test_a_rewritten_history_at_the_same_size_is_refused() -> None:
    rewritten = MerkleTree([*LEAVES[:3], leaf_hash(b"rewritten"), *LEAVES[4:9]])
    log = trusted_at(9)
    with pytest.raises(RollbackError, match="vault rewrote its history") as caught:
        log.update(note_at(9, rewritten), [])
    assert TREE.root(9).hex() in str(caught.value)
    assert rewritten.root(9).hex() in str(caught.value)
    assert (log.size, log.root) == (9, TREE.root(9))


def test_a_fork_that_grows_is_caught_by_the_consistency_proof() -> None:
    forked = MerkleTree([*LEAVES[:3], leaf_hash(b"rewritten"), *LEAVES[4:20]])
    log = trusted_at(9)
    with pytest.raises(VerificationError, match="did not prove") as caught:
        log.update(note_at(20, forked), forked.consistency_proof(9, 20))
    assert "size 20" in str(caught.value) and "size 9" in str(caught.value)
    assert (log.size, log.root) == (9, TREE.root(9))
    # Nor can the fork pass with the honest ledger's proof.
    with pytest.raises(VerificationError):
        log.update(note_at(20, forked), TREE.consistency_proof(9, 20))
    assert (log.size, log.root) == (9, TREE.root(9))


def test_a_tampered_or_missing_proof_is_refused() -> None:
    proof = TREE.consistency_proof(9, 20)
    for position in range(len(proof)):
        log = trusted_at(9)
        bad = list(proof)
        bad[position] = leaf_hash(b"tampered")
        with pytest.raises(VerificationError):
            log.update(note_at(20), bad)
        assert (log.size, log.root) == (9, TREE.root(9))
    log = trusted_at(9)
    with pytest.raises(VerificationError):
        log.update(note_at(20), [])
    with pytest.raises(VerificationError):
        log.update(note_at(20), proof[:-1])
    with pytest.raises(VerificationError):
        log.update(note_at(20), TREE.consistency_proof(8, 20))
    assert (log.size, log.root) == (9, TREE.root(9))


def test_a_checkpoint_for_another_ledger_is_refused() -> None:
    other_origin = KEY.sign(Checkpoint("other.test/ledger", 20, TREE.root(20)))
    log = trusted_at(9)
    with pytest.raises(VerificationError, match=re.escape("'other.test/ledger'")) as caught:
        log.update(other_origin, TREE.consistency_proof(9, 20))
    assert not isinstance(caught.value, RollbackError)
    assert (log.size, log.root) == (9, TREE.root(9))


def test_a_checkpoint_signed_by_another_key_is_refused() -> None:
    impostor = SigningKey(ORIGIN, bytes(32))
    log = trusted_at(9)
    with pytest.raises(VerificationError, match="not signed by key"):
        log.update(note_at(20, key=impostor), TREE.consistency_proof(9, 20))
    with pytest.raises(VerificationError, match="does not verify"):
        log.update(note_at(20).replace("\n20\n", "\n21\n"), TREE.consistency_proof(9, 20))
    assert (log.size, log.root) == (9, TREE.root(9))


def test_state_round_trips_through_json() -> None:
    log = trusted_at(17)
    state = json.loads(json.dumps(log.to_dict()))
    assert state == {
        "origin": ORIGIN,
        "size": 17,
        "root": TREE.root(17).hex(),
        "verifier": str(KEY.verifier()),
    }
    again = TrustedLog.from_dict(state)
    assert (again.origin, again.size, again.root) == (ORIGIN, 17, TREE.root(17))
    assert again.verifier == KEY.verifier()
    again.update(note_at(30), TREE.consistency_proof(17, 30))
    assert again.size == 30


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"extra": 1}, "unknown keys"),
        ({"size": "17"}, "size"),
        ({"size": -1}, "non-negative"),
        ({"root": "00"}, "hex digits"),
        ({"root": "zz" * 32}, "hex digits"),
        ({"verifier": "nonsense"}, "verifier key"),
        ({"size": 0}, "empty ledger"),
    ],
)
def test_a_corrupt_state_is_refused(change: dict[str, object], complaint: str) -> None:
    state = {**trusted_at(17).to_dict(), **change}
    with pytest.raises(InvalidArgument, match=complaint):
        TrustedLog.from_dict(state)


def test_a_state_missing_a_key_is_refused() -> None:
    state = trusted_at(17).to_dict()
    del state["root"]
    with pytest.raises(InvalidArgument, match="missing keys"):
        TrustedLog.from_dict(state)
