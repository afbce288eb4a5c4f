"""`vault verify`'s audit: re-derive every leaf hash, chain link, Merkle root and signature from
the stored ledger, and name the first index where anything breaks. No I/O: the caller streams
the stored rows and checkpoint notes in."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vault.errors import VerificationError
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.entry import FORMAT_VERSION, ZERO_HASH
from vault.ledger.merkle import CompactRange

_DECODER = json.JSONDecoder()

Progress = Callable[[int], None]


class StoredRow(Protocol):
    """One entry row as stored, with its index columns: `vault.ledger.RawEntry` on the server,
    the wire's StoredEntry in a client. (The client does not import the ledger, and with it
    SQLAlchemy, just to audit.)"""

    @property
    def index(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def leaf_hash(self) -> bytes: ...
    @property
    def kind(self) -> str: ...
    @property
    def author(self) -> str: ...
    @property
    def time(self) -> str: ...
    @property
    def external(self) -> bool: ...
    @property
    def subjects(self) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class Failure:
    index: int
    message: str

    def __str__(self) -> str:
        return f"index {self.index}: {self.message}"


@dataclass
class AuditReport:
    entries: int = 0
    checkpoints: int = 0
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def first(self) -> Failure | None:
        return min(self.failures, key=lambda f: f.index) if self.failures else None


class Auditor:
    """Feed stored entry rows in index order, then call `finish`. Failures are collected; the
    first (lowest index) is the one to report, but all are kept for the operator."""

    def __init__(self, verifier: Verifier, origin: str, notes: Iterable[str]) -> None:
        self.report = AuditReport()
        self._range = CompactRange()
        self._prev = ZERO_HASH
        self._roots: dict[int, list[Checkpoint]] = {}
        for note in notes:
            self.report.checkpoints += 1
            try:
                checkpoint = verifier.open(note)
            except VerificationError as exc:
                self._fail(_last_index(_note_size(note)), f"checkpoint: {exc}")
                continue
            if checkpoint.origin != origin:
                self._fail(
                    _last_index(checkpoint.size),
                    f"checkpoint for size {checkpoint.size} names origin {checkpoint.origin!r}, "
                    f"not {origin!r}",
                )
                continue
            self._roots.setdefault(checkpoint.size, []).append(checkpoint)
        self._check_roots(0)

    def _fail(self, index: int, message: str) -> None:
        self.report.failures.append(Failure(index, message))

    def _check_roots(self, size: int) -> None:
        for checkpoint in self._roots.pop(size, ()):
            if checkpoint.root != self._range.root():
                self._fail(
                    _last_index(size),
                    f"the Merkle root of the first {size} entries does not match the root "
                    f"signed in the checkpoint for size {size}",
                )

    def feed(self, rows: Iterable[StoredRow]) -> None:
        # The hot loop of `vault verify` (a million entries): locals, no per-row allocations
        # beyond the hash and the parsed body.
        sha256 = hashlib.sha256
        decode = _DECODER.decode
        append = self._range.append
        report = self.report
        for row in rows:
            n = report.entries
            if row.index != n:
                if row.index > n:
                    self._fail(n, f"entry {n} is missing (the next stored entry is {row.index})")
                else:
                    self._fail(n, f"entry {row.index} appears again after entry {n - 1}")
                # Resynchronise on the stored index so one gap is reported once.
                if row.index < n:
                    continue
                report.entries = n = row.index
            body = row.body
            leaf = sha256(b"\x00" + body).digest()
            if leaf != row.leaf_hash:
                self._fail(n, "the stored leaf hash does not match the entry's bytes")
            try:
                entry = decode(body.decode())
                fields: tuple[Any, ...] = (
                    entry["v"],
                    entry["index"],
                    entry["prev"],
                    entry["kind"],
                    entry["author"],
                    entry["time"],
                    entry["external"],
                )
            except (UnicodeDecodeError, ValueError, TypeError, KeyError):
                self._fail(n, "the entry's bytes are not a version-1 entry object")
                entry, fields = {}, ()
            if fields != (
                FORMAT_VERSION,
                n,
                self._prev.hex(),
                row.kind,
                row.author,
                row.time,
                row.external,
            ) or sorted(entry.get("subjects") or ()) != list(row.subjects):
                self._check_body(n, entry, row)
            append(leaf)
            self._prev = leaf
            report.entries = n + 1
            if self._roots:
                self._check_roots(n + 1)

    def _check_body(self, n: int, body: dict[str, Any], row: StoredRow) -> None:
        """Name what is wrong with an entry that did not match (the slow, rare path)."""
        if not body:
            return
        if body.get("v") != FORMAT_VERSION:
            self._fail(n, "the entry is not a version-1 entry object")
            return
        if body.get("index") != n:
            self._fail(n, f"the entry at position {n} says it is entry {body.get('index')!r}")
        if body.get("prev") != self._prev.hex():
            self._fail(n, f"chain broken: the entry's prev hash is not the hash of entry {n - 1}")
        if (
            body.get("kind") != row.kind
            or body.get("author") != row.author
            or body.get("time") != row.time
            or body.get("external") != row.external
            or sorted(body.get("subjects") or ()) != list(row.subjects)
        ):
            self._fail(
                n, "the stored index columns (kind, author, time, subjects) disagree with the entry"
            )

    def finish(self, head_size: int) -> AuditReport:
        n = self.report.entries
        if head_size != n:
            self._fail(
                min(head_size, n),
                f"the ledger head records {head_size} entries but {n} are stored"
                + (" (truncated)" if head_size > n else " (entries were inserted)"),
            )
        for size in sorted(self._roots):
            self._fail(
                n,
                f"a checkpoint was signed for size {size} but only {n} entries are stored "
                "(the ledger was truncated)",
            )
        self._roots.clear()
        return self.report


def _last_index(size: int) -> int:
    """The index a checkpoint for `size` entries is reported at: the last entry it covers,
    whichever of its checks fails."""
    return max(size - 1, 0)


def _note_size(note: str) -> int:
    lines = note.split("\n")
    try:
        return int(lines[1])
    except (IndexError, ValueError):
        return 0
