"""Checking that a look-up's answer is complete: every entry naming the digest as of the
answer's checkpoint, or a proof that none does (vault.ledger.subject_map). No I/O here.

An answer carries the entries from the first one the newest `index` entry does not cover up to
the checkpoint (its tail, the `index` entry among them), each proven in the checkpoint's tree,
and for each digest asked about, its proof in the subject map whose root that entry commits
to. The entries naming the digest below what the map covers must chain to the map's value for
it (none if the map proves it absent); those above must be exactly the tail's entries naming
it. A server that leaves one out, or says a pinned digest was never pinned, fails one check."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vault.client.results import ProvenEntry
from vault.errors import VerificationError
from vault.ledger.checkpoint import Checkpoint
from vault.ledger.entry import INDEX
from vault.ledger.subject_map import MAP_FORMAT, KeyProof, check_keys, key_of, value_of
from vault.wire import pinvault_pb2 as pb

_ROOT = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class MapTail:
    """The part of an answer every digest's check shares: what the map covers, its root, the
    entries after it, verified, and the nodes proving the digests' buckets under the root."""

    covers: int
    root: bytes | None  # None: no map, every entry of the checkpoint is in `entries`
    entries: list[ProvenEntry]
    top: tuple[bytes, ...] = ()


def check_tail(
    message: pb.SubjectMapTail, checkpoint: Checkpoint, entries: Sequence[ProvenEntry]
) -> MapTail:
    """The answer's tail, once its entries (`message.entries`, each already proven in
    `checkpoint`) run without a gap to its last entry, and (unless they are the whole ledger)
    the `index` entry among them covers exactly those before them."""
    if checkpoint.size == 0 and not entries:
        return MapTail(0, None, [])
    if not entries:
        raise VerificationError(
            "the vault's answer does not prove it complete: it carries no index entry"
        )
    entries = list(entries)
    start = entries[0].entry.index
    for offset, proven in enumerate(entries):
        if proven.entry.index != start + offset:
            raise VerificationError(
                f"the entries after the subject map skip from {start + offset - 1} to "
                f"{proven.entry.index}",
                index=start + offset,
            )
    if entries[-1].entry.index != checkpoint.size - 1:
        raise VerificationError(
            f"the entries after the subject map stop at {entries[-1].entry.index}, before the "
            f"checkpoint's last entry {checkpoint.size - 1}",
            index=entries[-1].entry.index + 1,
        )
    if start == 0:  # the whole ledger (before its first `index` entry): complete by itself
        return MapTail(0, None, entries)
    for proven in entries:
        entry = proven.entry
        if entry.kind != INDEX or entry.meta.get("covers") != str(start):
            continue
        root = entry.meta.get("map-root", "")
        if entry.meta.get("map") != MAP_FORMAT or not _ROOT.fullmatch(root):
            raise VerificationError(
                f"index entry {entry.index} names a subject map this client does not know",
                index=entry.index,
            )
        return MapTail(start, bytes.fromhex(root), entries, tuple(message.top))
    raise VerificationError(
        f"the vault's answer does not prove it complete: no index entry among entries "
        f"{start}..{checkpoint.size - 1} covers the {start} before them"
    )


def key_proof(message: pb.SubjectMapProof) -> KeyProof:
    return KeyProof(
        message.bucket_size,
        message.position,
        tuple((r.position, bytes(r.record), tuple(r.path)) for r in message.records),
    )


def check_complete(
    answers: Sequence[tuple[str, Sequence[ProvenEntry], pb.SubjectMapProof]], tail: MapTail
) -> None:
    """That for each (digest, entries, proof) of an answer, `entries` (verified, each naming
    the digest or a digest the client tied to it) hold every entry naming the digest in the
    answer's checkpoint: the digests' map proofs checked together under the tail's root."""
    values = (
        [None] * len(answers)
        if tail.root is None
        else check_keys(
            [(key_of(d), key_proof(proof), d) for d, _, proof in answers], tail.top, tail.root
        )
    )
    for (digest, entries, _), value in zip(answers, values, strict=True):
        _check_one(digest, entries, value, tail)


def _check_one(
    digest: str, entries: Sequence[ProvenEntry], value: bytes | None, tail: MapTail
) -> None:
    naming = [p.entry.index for p in entries if digest in p.entry.subjects]
    below = [i for i in naming if i < tail.covers]
    if (value_of(below) if below else None) != value:
        said = "never pinned" if value is None else "pinned by other entries"
        raise VerificationError(
            f"the vault's answer about {digest} is not complete: the signed subject map says "
            f"it is {said} among the first {tail.covers} entries, and the answer gives "
            f"{len(below)} ({', '.join(map(str, below)) or 'none'})"
        )
    above = [p.entry.index for p in tail.entries if digest in p.entry.subjects]
    if [i for i in naming if i >= tail.covers] != above:
        raise VerificationError(
            f"the vault's answer about {digest} is not complete: entries "
            f"{', '.join(map(str, above))} after the subject map name it, and the answer gives "
            f"{', '.join(str(i) for i in naming if i >= tail.covers) or 'none of them'}"
        )
