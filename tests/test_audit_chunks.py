"""The audit in chunks (`ChunkAudit`s joined by an `Auditor`) reports exactly what the audit
of every row by one `Auditor` reports, failure for failure, on stored rows altered in every
way a row can be: the bytes, their encoding, the fields, the chain, the index columns, the
stored leaf hash, missing and extra rows, and checkpoints. Pure: no server."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence

import pytest

from vault.ledger.audit import Auditor, AuditReport, ChunkAudit
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.entry import Entry
from vault.ledger.merkle import CompactRange
from vault.ledger.records import RawEntry

ORIGIN = "chunks.test/ledger"
KEY = SigningKey.generate(ORIGIN)
SIZE = 45
SUBJECTS = ["sha256:" + hashlib.sha256(b"%d" % n).hexdigest() for n in range(4)]


def leaf(body: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + body).digest()


def good_rows() -> list[RawEntry]:
    rows: list[RawEntry] = []
    prev = b"\x00" * 32
    for n in range(SIZE):
        subjects = tuple(sorted(SUBJECTS[: 1 + n % 3]))
        entry = Entry(
            index=n,
            kind=("image", "dataset", "config")[n % 3],
            subjects=subjects,
            author="ana@lab" if n % 2 else 'Zoë "q" \\ lab',
            time=f"2026-11-26T10:00:{n:02d}Z",
            prev=prev,
            meta={"n": str(n), "note": "line\nbreak"} if n % 4 else {},
            external=n % 5 == 0,
        )
        body = entry.encode()
        prev = leaf(body)
        rows.append(
            RawEntry(n, body, prev, entry.kind, entry.author, entry.time, entry.external, subjects)
        )
    return rows


def notes(rows: Sequence[RawEntry], sizes: Sequence[int]) -> list[str]:
    found = []
    for size in sizes:
        tree = CompactRange()
        for row in rows[:size]:
            tree.append(leaf(row.body))
        found.append(KEY.sign(Checkpoint(ORIGIN, size, tree.root())))
    return found


def in_one(rows: Sequence[RawEntry], signed: list[str], head: int) -> AuditReport:
    auditor = Auditor(KEY.verifier(), ORIGIN, signed)
    auditor.feed(rows)
    return auditor.finish(head)


def in_chunks(rows: Sequence[RawEntry], signed: list[str], head: int, chunk: int) -> AuditReport:
    """As `vault verify` with workers: chunks up to the head, each fed in batches of 3 rows as
    columns, then the rows past the head fed whole."""
    auditor = Auditor(KEY.verifier(), ORIGIN, signed)
    sizes = auditor.checkpoint_sizes()
    for start in range(0, head, chunk):
        end = min(start + chunk, head)
        audit = ChunkAudit(start, end, [s for s in sizes if start < s <= end])
        part = [r for r in rows if start <= r.index < end]
        for at in range(0, len(part), 3):
            batch = part[at : at + 3]
            audit.feed(
                [r.index for r in batch],
                [r.body for r in batch],
                b"".join(r.leaf_hash for r in batch),
                [r.kind for r in batch],
                [r.author for r in batch],
                [r.time for r in batch],
                [r.external for r in batch],
                [len(r.subjects) for r in batch],
                [s for r in batch for s in r.subjects],
            )
        auditor.absorb(audit.result())
    auditor.feed([r for r in rows if r.index >= head])
    return auditor.finish(head)


def sorted_failures(report: AuditReport) -> list[tuple[int, str]]:
    return [(f.index, f.message) for f in sorted(report.failures, key=lambda f: f.index)]


def rebody(row: RawEntry, text: str, *, keep_leaf: bool = False) -> RawEntry:
    body = text.encode()
    return dataclasses.replace(row, body=body, leaf_hash=row.leaf_hash if keep_leaf else leaf(body))


def reencode(row: RawEntry, change: Callable[[dict[str, object]], None]) -> RawEntry:
    fields = json.loads(row.body)
    change(fields)
    return rebody(row, json.dumps(fields, sort_keys=True, separators=(",", ":")))


ALTERATIONS: dict[str, Callable[[list[RawEntry]], list[RawEntry]]] = {
    "untouched": lambda rows: rows,
    "a changed byte": lambda rows: [
        *rows[:17],
        rebody(rows[17], rows[17].body.decode().replace("ana", "anb"), keep_leaf=True),
        *rows[18:],
    ],
    "white space": lambda rows: [
        *rows[:9],
        rebody(rows[9], " " + json.dumps(json.loads(rows[9].body), indent=1) + "\n"),
        *rows[10:],
    ],
    "keys out of order": lambda rows: [
        *rows[:16],
        rebody(rows[16], json.dumps(dict(reversed(json.loads(rows[16].body).items())))),
        *rows[17:],
    ],
    "a key given twice": lambda rows: [
        *rows[:24],
        rebody(rows[24], rows[24].body.decode()[:-1] + ',"kind":"image"}'),
        rebody(rows[25], rows[25].body.decode()[:-1] + ',"kind":"x"}'),
        *rows[26:],
    ],
    "a field inside meta": lambda rows: [
        *rows[:33],
        rebody(rows[33], rows[33].body.decode().replace('"meta":{', '"meta":{"kind":"x",')),
        *rows[34:],
    ],
    "a key given twice after meta": lambda rows: [
        *rows[:28],
        rebody(rows[28], rows[28].body.decode().replace('"meta":{}', '"meta":{},"kind":"x"')),
        *rows[29:],
    ],
    "subjects out of order in the entry": lambda rows: [
        *rows[:14],
        reencode(rows[14], lambda f: f.update(subjects=sorted(f["subjects"], reverse=True))),  # type: ignore[call-overload]
        *rows[15:],
    ],
    "subjects out of order in the columns": lambda rows: [
        *rows[:26],
        dataclasses.replace(rows[26], subjects=tuple(sorted(rows[26].subjects, reverse=True))),
        *rows[27:],
    ],
    "a changed column": lambda rows: [
        *rows[:8],
        dataclasses.replace(rows[8], time="2026-01-01T00:00:00Z"),
        dataclasses.replace(rows[9], external=not rows[9].external),
        *rows[10:],
    ],
    "a wrong prev at a chunk start": lambda rows: [
        *rows[:16],
        reencode(rows[16], lambda f: f.update(prev="00" * 32)),
        *rows[17:],
    ],
    "a wrong index": lambda rows: [
        *rows[:21],
        reencode(rows[21], lambda f: f.update(index=20)),
        *rows[22:],
    ],
    "another version": lambda rows: [
        *rows[:31],
        reencode(rows[31], lambda f: f.update(v=2)),
        *rows[32:],
    ],
    "not JSON": lambda rows: [*rows[:19], rebody(rows[19], "{not json"), *rows[20:]],
    "not UTF-8 inside meta": lambda rows: [
        *rows[:22],
        dataclasses.replace(
            rows[22],
            body=rows[22].body.replace(b'"note":"line', b'"note":"\xffine'),
            leaf_hash=leaf(rows[22].body.replace(b'"note":"line', b'"note":"\xffine')),
        ),
        *rows[23:],
    ],
    "not UTF-8": lambda rows: [
        *rows[:35],
        dataclasses.replace(rows[35], body=b"\xff\xfe", leaf_hash=leaf(b"\xff\xfe")),
        *rows[36:],
    ],
    "a stored leaf hash": lambda rows: [
        *rows[:39],
        dataclasses.replace(rows[39], leaf_hash=b"\x01" * 32),
        *rows[40:],
    ],
    "missing rows across chunks": lambda rows: [*rows[:13], *rows[27:]],
    "a missing first row": lambda rows: rows[1:],
    "a missing chunk start": lambda rows: [*rows[:8], *rows[9:]],
    "missing rows at the end": lambda rows: rows[:37],
    "a row past the head": lambda rows: [
        *rows,
        dataclasses.replace(rows[-1], index=SIZE),
    ],
}


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
@pytest.mark.parametrize("alteration", sorted(ALTERATIONS))
def test_chunks_report_what_one_auditor_reports(alteration: str, chunk: int) -> None:
    good = good_rows()
    signed = notes(good, [0, 1, 7, 8, 9, 16, 23, 30, SIZE])
    signed[4] = KEY.sign(Checkpoint(ORIGIN, 12, hashlib.sha256(b"wrong").digest()))
    rows = ALTERATIONS[alteration](good)
    one = in_one(rows, signed, SIZE)
    chunks = in_chunks(rows, signed, SIZE, chunk)
    assert (chunks.entries, chunks.checkpoints) == (one.entries, one.checkpoints)
    assert sorted_failures(chunks) == sorted_failures(one)
    wrong = (
        11,
        "the Merkle root of the first 12 entries does not match the root signed in the "
        "checkpoint for size 12",
    )
    assert wrong in sorted_failures(one)
    # Each alteration is caught (beyond the wrong checkpoint), so the comparison means much.
    assert (sorted_failures(one) == [wrong]) == (alteration == "untouched")
