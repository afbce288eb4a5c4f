"""Checking entries the vault proves against a checkpoint the client has verified: each entry's
inclusion in its tree, that it is the entry its index says, and that it is about the digest
asked for. No I/O here."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vault.client.results import ProvenEntry
from vault.errors import VerificationError
from vault.ledger.checkpoint import Checkpoint
from vault.ledger.entry import Entry
from vault.ledger.merkle import leaf_hash, verify_inclusion, verify_multiproof
from vault.wire import pinvault_pb2 as pb


def check_inclusion(
    index: int, body: bytes, path: list[bytes], checkpoint: Checkpoint
) -> ProvenEntry:
    """`body` as entry `index`, once `path` proves it is in `checkpoint`'s tree."""
    leaf = leaf_hash(body)
    verify_inclusion(leaf, index, checkpoint.size, path, checkpoint.root)
    return ProvenEntry(Entry.decode(body), leaf, path, checkpoint)


def check_proven(proven: pb.ProvenEntry, checkpoint: Checkpoint) -> ProvenEntry:
    """An entry of an answer that proves it alone (an admission's), once proved in
    `checkpoint`'s tree and found to be the entry its index says."""
    leaf = leaf_hash(proven.entry.body)
    path = list(proven.inclusion)
    verify_inclusion(leaf, proven.entry.index, checkpoint.size, path, checkpoint.root)
    entry = Entry.decode(proven.entry.body)
    if entry.index != proven.entry.index:
        raise VerificationError(
            f"entry {proven.entry.index} says it is entry {entry.index}",
            index=proven.entry.index,
        )
    return ProvenEntry(entry, leaf, path, checkpoint)


def check_proven_together(
    messages: Sequence[pb.ProvenEntry], nodes: Sequence[bytes], checkpoint: Checkpoint
) -> list[ProvenEntry]:
    """The entries of a look-up's answer, once `nodes` (its shared inclusion proof) prove
    them all in `checkpoint`'s tree and each is the entry its index says; an entry the answer
    gives more than once is decoded once, and refused if it comes with two bodies."""
    leaves: dict[int, bytes] = {}
    bodies: dict[int, bytes] = {}
    for message in messages:
        index, body = message.entry.index, message.entry.body
        known = bodies.setdefault(index, body)
        if known is not body and known != body:
            raise VerificationError(
                f"the vault's answer gives entry {index} with two different bodies", index=index
            )
        if index not in leaves:
            leaves[index] = leaf_hash(body)
    paths = verify_multiproof(leaves, checkpoint.size, nodes, checkpoint.root)
    proven: dict[int, ProvenEntry] = {}
    for index, body in bodies.items():
        entry = Entry.decode(body)
        if entry.index != index:
            raise VerificationError(f"entry {index} says it is entry {entry.index}", index=index)
        proven[index] = ProvenEntry(entry, leaves[index], paths[index], checkpoint)
    return [proven[message.entry.index] for message in messages]


def names_any(names: Collection[str], proven: ProvenEntry) -> bool:
    """Whether a proved entry names one of `names` (the digest asked for, and any digest the
    client itself tied to it) among its subjects, as its verified, decoded body says."""
    return not set(names).isdisjoint(proven.entry.subjects)


def not_about(wanted: str, proven: ProvenEntry, tied: str | None = None) -> VerificationError:
    """The error for a proved entry that does not name the digest asked for."""
    entry = proven.entry
    alias = f" (whose bytes the client hashed to {tied})" if tied else ""
    return VerificationError(
        f"asked for entries naming {wanted}{alias}, the vault answered entry {entry.index} "
        f"naming {', '.join(entry.subjects)}",
        index=entry.index,
    )
