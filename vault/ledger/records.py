"""What the ledger's storage takes and gives: a validated request to append an entry, entries
as stored, and a signed checkpoint with its note."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vault.errors import InvalidArgument
from vault.ledger.entry import check_author, check_kind, check_meta, check_subjects

if TYPE_CHECKING:
    # Only named: the audit's worker processes read these records without the signature code.
    from vault.ledger.checkpoint import Checkpoint


@dataclass(frozen=True, slots=True)
class PinSpec:
    """A validated request to append one entry; the ledger adds index, time and prev."""

    kind: str
    subjects: tuple[str, ...]
    author: str
    meta: Mapping[str, str] = field(default_factory=dict)
    external: bool = False

    @classmethod
    def checked(
        cls,
        *,
        kind: str,
        subjects: Sequence[str],
        author: str,
        meta: Mapping[str, str] | None = None,
        external: bool = False,
    ) -> PinSpec:
        subjects_ = check_subjects(subjects)
        if len(subjects_) > 1 and len(set(subjects_)) != len(subjects_):
            raise InvalidArgument("the same subject digest is named twice")
        # Positional: appends make one of these a pin, and keywords cost more than the checks.
        kind_, author_ = check_kind(kind), check_author(author)
        return cls(kind_, subjects_, author_, check_meta(meta or {}), external)


@dataclass(frozen=True, slots=True)
class StoredEntry:
    index: int
    body: bytes


@dataclass(frozen=True, slots=True)
class RawEntry:
    """An entry row exactly as stored, with its index rows, for auditors."""

    index: int
    body: bytes
    leaf_hash: bytes
    kind: str
    author: str
    time: str
    external: bool
    subjects: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RawColumns:
    """A batch of `RawEntry` rows as columns: the i-th value of each belongs to the i-th row;
    `leaf_hashes` 32 bytes a row; each row's `subject_counts` subjects follow one another in
    `subjects`, sorted."""

    indexes: Sequence[int]
    bodies: Sequence[bytes]
    leaf_hashes: bytes
    kinds: Sequence[str]
    authors: Sequence[str]
    times: Sequence[str]
    external: Sequence[int]
    subject_counts: Sequence[int]
    subjects: Sequence[str]


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    checkpoint: Checkpoint
    note: str

    @property
    def size(self) -> int:
        return self.checkpoint.size


@dataclass(frozen=True, slots=True)
class LogFilter:
    kind: str | None = None
    digest: str | None = None
    author: str | None = None
    since: str | None = None
    until: str | None = None
