"""`vault verify`'s audit: re-derive every leaf hash, chain link, Merkle root and signature from
the stored ledger, and name the first index where anything breaks. No I/O: the caller streams
the stored rows and checkpoint notes in, either all to one `Auditor` or, to use several
processes, each aligned chunk of rows to its own `ChunkAudit`, whose results the `Auditor`
joins in index order."""

from __future__ import annotations

import hashlib
import json
import json.encoder
import json.scanner
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vault.errors import VerificationError
from vault.ledger.entry import FORMAT_VERSION, INDEX, ZERO_HASH
from vault.ledger.merkle import CompactRange
from vault.ledger.records import RawEntry
from vault.ledger.subject_map import MapPart, audit_map

if TYPE_CHECKING:
    # Only the Auditor's caller opens checkpoints; a chunk's worker process never needs
    # the signature code.
    from vault.ledger.checkpoint import Checkpoint, Verifier

_DECODER = json.JSONDecoder()
_decode = _DECODER.decode
# A string as canonical JSON writes it (RFC 8785 escapes what Python's encoder escapes when
# it keeps non-ASCII characters); a string it writes otherwise only misses the fast path.
_QUOTE: Callable[[str], str] = json.encoder.encode_basestring
# What `_DECODER.decode` calls once it has skipped leading white space: a text it takes whole
# decodes to the same value either way.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]

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
    # Processes that audited chunks of the entries side by side (1: the caller's alone).
    workers: int = 1

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def first(self) -> Failure | None:
        return min(self.failures, key=lambda f: f.index) if self.failures else None


class Auditor:
    """Feed stored entry rows in index order, then call `finish`. Failures are collected; the
    first (lowest index) is the one to report, but all are kept for the operator."""

    def __init__(
        self, verifier: Verifier, origin: str, notes: Iterable[str], *, subject_map: bool = False
    ) -> None:
        """`subject_map`: also rebuild the subject map and check the newest `index` entry's
        root (memory grows with the ledger's distinct digests; every `index` entry's coverage
        is checked either way)."""
        self.report = AuditReport()
        self._subject_map = subject_map
        self._range = CompactRange()
        self._prev = ZERO_HASH
        self._roots: dict[int, list[Checkpoint]] = {}
        # The subject map's parts, in index order: the chunks' and then the rows fed here.
        self._map_parts: list[MapPart] = []
        self._own_part: MapPart | None = None
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

    def checkpoint_sizes(self) -> list[int]:
        """The sizes of the checkpoints whose roots are still to be checked, in order."""
        return sorted(self._roots)

    def _check_roots(self, size: int) -> None:
        for checkpoint in self._roots.pop(size, ()):
            # A tree missing stored entries (a gap was reported) is never the signed one.
            if self._range.size != size or checkpoint.root != self._range.root():
                self._fail(
                    _last_index(size),
                    f"the Merkle root of the first {size} entries does not match the root "
                    f"signed in the checkpoint for size {size}",
                )

    def feed(self, rows: Iterable[StoredRow]) -> None:
        # The hot loop of `vault verify` (a million entries): locals, no per-row allocations
        # beyond the hash and the parsed body.
        sha256 = hashlib.sha256
        append = self._range.append
        report = self.report
        if self._own_part is None or self._map_parts[-1] is not self._own_part:
            self._own_part = MapPart(self._subject_map)
            self._map_parts.append(self._own_part)
        part = self._own_part
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
            _check_decoded(
                self._fail,
                n,
                _decode_entry,
                body,
                self._prev.hex(),
                (row.kind, row.author, row.time, row.external, list(row.subjects)),
            )
            append(leaf)
            self._prev = leaf
            part.add(n, row.subjects)
            if row.kind == INDEX:
                part.add_index_entry(n, _meta_of(body))
            report.entries = n + 1
            if self._roots:
                self._check_roots(n + 1)

    def absorb(self, chunk: ChunkResult) -> None:
        """Join the audit of the next chunk of rows, in index order: check its first row
        against the hash of the entry before it, the chunk's link to it and every checkpoint
        whose size falls in it, and extend the tree by the chunk's leaves."""
        first = chunk.first
        if first is None:
            return
        n = self.report.entries
        if first.index != n:
            self._fail(n, f"entry {n} is missing (the next stored entry is {first.index})")
        contiguous = self._range.size == n == chunk.start == first.index
        _check_row(
            self._fail,
            first.index,
            self._prev.hex(),
            first.body,
            first.leaf_hash,
            first.kind,
            first.author,
            first.time,
            first.external,
            list(first.subjects),
        )
        self.report.failures.extend(chunk.failures)
        self._map_parts.append(chunk.subject_map)
        for size, leaves, nodes in chunk.ranges:
            checkpoints = self._roots.pop(size, ())
            if not checkpoints:
                continue
            # A tree missing stored entries (a gap was reported) is never the signed one.
            root = (
                self._range.root_with(nodes)
                if contiguous and leaves == size - chunk.start
                else None
            )
            for checkpoint in checkpoints:
                if checkpoint.root != root:
                    self._fail(
                        _last_index(size),
                        f"the Merkle root of the first {size} entries does not match the root "
                        f"signed in the checkpoint for size {size}",
                    )
        if contiguous and chunk.leaves == chunk.last_index + 1 - chunk.start:
            self._range.join(chunk.nodes, chunk.leaves)
        self._prev = chunk.last_leaf
        self.report.entries = chunk.last_index + 1

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
        for index, message in audit_map(self._map_parts):
            self._fail(index, message)
        return self.report


def _meta_of(body: bytes) -> dict[str, str]:
    """An `index` entry's meta, or nothing if its body has none to read (its own check fails)."""
    try:
        meta = _decode_entry(body).get("meta")
    except (ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


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


def _check_body(
    fail: Callable[[int, str], None],
    n: int,
    body: dict[str, Any],
    prev_hex: str,
    columns: tuple[str, str, str, bool, list[str]],
) -> None:
    """Name what is wrong with an entry that did not match (the slow, rare path)."""
    if not body:
        return
    if body.get("v") != FORMAT_VERSION:
        fail(n, "the entry is not a version-1 entry object")
        return
    if body.get("index") != n:
        fail(n, f"the entry at position {n} says it is entry {body.get('index')!r}")
    if body.get("prev") != prev_hex:
        fail(n, f"chain broken: the entry's prev hash is not the hash of entry {n - 1}")
    kind, author, time, external, subjects = columns
    if (
        body.get("kind") != kind
        or body.get("author") != author
        or body.get("time") != time
        or body.get("external") != external
        or sorted(body.get("subjects") or ()) != subjects
    ):
        fail(n, "the stored index columns (kind, author, time, subjects) disagree with the entry")


def _decode_entry(body: bytes) -> Any:
    return _DECODER.decode(body.decode())


def _check_decoded(
    fail: Callable[[int, str], None],
    n: int,
    decode: Callable[[bytes], Any],
    body: bytes,
    prev_hex: str,
    columns: tuple[str, str, str, bool, list[str]],
) -> None:
    """Check the entry `decode` reads from a row's `body` against its position, the chain's
    hash and the row's stored columns (kind, author, time, external, subjects), naming what
    disagrees."""
    try:
        entry = decode(body)
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
        fail(n, "the entry's bytes are not a version-1 entry object")
        return
    kind, author, time, external, subjects = columns
    if (
        fields != (FORMAT_VERSION, n, prev_hex, kind, author, time, external)
        or sorted(entry.get("subjects") or ()) != subjects
    ):
        _check_body(fail, n, entry, prev_hex, columns)


def _check_row(
    fail: Callable[[int, str], None],
    n: int,
    prev_hex: str,
    body: bytes,
    stored_leaf: bytes,
    kind: str,
    author: str,
    time: str,
    external: bool,
    subjects: list[str],
) -> bytes:
    """Check one stored row at position `n` after the entry whose hash is `prev_hex`, as
    `Auditor.feed` does; return its leaf hash."""
    leaf = hashlib.sha256(b"\x00" + body).digest()
    if leaf != stored_leaf:
        fail(n, "the stored leaf hash does not match the entry's bytes")
    _check_decoded(
        fail,
        n,
        _decode_entry,
        body,
        prev_hex,
        (kind, author, time, external, subjects),
    )
    return leaf


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What `ChunkAudit` found in rows [start, end): failures of every row but the first,
    which is handed back whole (only the `Auditor` knows the hash of the entry before it); the
    range's nodes at each checkpoint size in the chunk and at its end; the last row's index
    and leaf hash, which the next chunk's first entry must name."""

    start: int
    end: int
    first: RawEntry | None
    last_index: int
    last_leaf: bytes
    leaves: int
    nodes: tuple[bytes, ...]
    ranges: list[tuple[int, int, tuple[bytes, ...]]]
    failures: list[Failure]
    # Each subject of the chunk's rows, and its `index` entries (its first row's too).
    subject_map: MapPart


class ChunkAudit:
    """The audit of the stored rows with indexes in [start, end), where `start` is a multiple
    of a power of two no smaller than `end - start` (so that the chunk's Merkle nodes join the
    ones before it): every leaf hash, every row's agreement with its index columns and every
    chain link inside the chunk. `sizes` are the checkpoint sizes in (start, end], at which the
    chunk's range is kept; `subject_map`: gather the subject map's keys too (see `Auditor`).
    Feed its rows in index order as columns (`feed`), then `result`."""

    def __init__(
        self, start: int, end: int, sizes: Iterable[int], *, subject_map: bool = False
    ) -> None:
        self.start, self.end = start, end
        self._sizes = frozenset(sizes)
        self._range = CompactRange()
        self._failures: list[Failure] = []
        self._first: RawEntry | None = None
        self._next = start
        self._prev = ZERO_HASH
        self._ranges: list[tuple[int, int, tuple[bytes, ...]]] = []
        self._map = MapPart(subject_map)

    def _fail(self, index: int, message: str) -> None:
        self._failures.append(Failure(index, message))

    def feed(
        self,
        indexes: Sequence[int],
        bodies: Sequence[bytes],
        leaf_hashes: bytes,
        kinds: Sequence[str],
        authors: Sequence[str],
        times: Sequence[str],
        external: Sequence[bool],
        subject_counts: Sequence[int],
        subjects: Sequence[str],
    ) -> None:
        """Rows as the columns of `vault.ledger.RawColumns`. Rows outside the chunk belong to
        another chunk and are left to it."""
        if len(leaf_hashes) != 32 * len(indexes) or not (
            len(indexes)
            == len(bodies)
            == len(kinds)
            == len(authors)
            == len(times)
            == len(external)
            == len(subject_counts)
        ):
            raise VerificationError("a batch of stored rows has columns of different lengths")
        # The hot loop of a parallel `vault verify`: `_check_row` inlined, the leaf hashes
        # compared in place, the JSON scanner called directly (`_decode` where it stops short).
        sha256 = hashlib.sha256
        scan = _SCAN
        quote = _QUOTE
        fail = self._fail
        add_subjects = self._map.add
        sizes = self._sizes
        start, end = self.start, self.end
        leaves: list[bytes] = []
        marks: list[tuple[int, int]] = []
        n = self._next

        def decode(body: bytes) -> Any:
            text = body.decode()
            try:
                entry, stop = scan(text, 0)
            except StopIteration:
                return _decode(text)
            return entry if stop == len(text) else _decode(text)

        prev_hex = self._prev.hex()
        offset = 0
        for i, index in enumerate(indexes):
            count = subject_counts[i]
            row_subjects = list(subjects[offset : offset + count])
            offset += count
            if index < start or index >= end:
                continue
            body = bodies[i]
            leaf = sha256(b"\x00" + body).digest()
            add_subjects(index, row_subjects)
            if kinds[i] == INDEX:
                self._map.add_index_entry(index, _meta_of(body))
            if self._first is None:
                # Checked by the Auditor, which knows the hash of the entry before it.
                n = index
                self._first = RawEntry(
                    index,
                    body,
                    leaf_hashes[32 * i : 32 * i + 32],
                    kinds[i],
                    authors[i],
                    times[i],
                    external[i],
                    tuple(row_subjects),
                )
            else:
                if index != n:
                    if index < n:
                        fail(n, f"entry {index} appears again after entry {n - 1}")
                        continue
                    fail(n, f"entry {n} is missing (the next stored entry is {index})")
                    n = index
                if not leaf_hashes.startswith(leaf, 32 * i):
                    fail(n, "the stored leaf hash does not match the entry's bytes")
                # The fast path: the entry exactly as the canonical encoding writes one whose
                # fields are the stored columns, the chain's hash and its position, around one
                # JSON value (the meta). Such text decodes to those fields and nothing else,
                # so the full check below would pass; any other text takes that check.
                try:
                    text = body.decode()
                except UnicodeDecodeError:
                    text = ""
                head = (
                    f'{{"author":{quote(authors[i])},"external":'
                    f'{"true" if external[i] is True else "false"},"index":{n},'
                    f'"kind":{quote(kinds[i])},"meta":'
                )
                tail = (
                    f',"prev":"{prev_hex}","subjects":[{",".join(map(quote, row_subjects))}],'
                    f'"time":{quote(times[i])},"v":{FORMAT_VERSION}}}'
                )
                if (
                    text.startswith(head)
                    and text.endswith(tail)
                    and (count < 2 or row_subjects == sorted(row_subjects))
                ):
                    try:
                        stop = scan(text, len(head))[1]
                    except (StopIteration, ValueError):
                        stop = -1
                    if stop == len(text) - len(tail):
                        leaves.append(leaf)
                        prev_hex = leaf.hex()
                        n += 1
                        if n in sizes:
                            marks.append((n, len(leaves)))
                        continue
                columns = (kinds[i], authors[i], times[i], external[i], row_subjects)
                _check_decoded(fail, n, decode, body, prev_hex, columns)
            leaves.append(leaf)
            prev_hex = leaf.hex()
            n += 1
            if n in sizes:
                marks.append((n, len(leaves)))
        self._next = n
        if leaves:
            self._prev = leaves[-1]
        done = 0
        for size, upto in marks:
            self._range.extend(leaves[done:upto])
            done = upto
            self._ranges.append((size, self._range.size, self._range.nodes()))
        self._range.extend(leaves[done:])

    def result(self) -> ChunkResult:
        return ChunkResult(
            start=self.start,
            end=self.end,
            first=self._first,
            last_index=self._next - 1,
            last_leaf=self._prev,
            leaves=self._range.size,
            nodes=self._range.nodes(),
            ranges=self._ranges,
            failures=self._failures,
            subject_map=self._map,
        )
