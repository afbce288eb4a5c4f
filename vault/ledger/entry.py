"""Ledger entries and their canonical encoding (docs/ledger-format.md).

An entry's body is the RFC 8785 (JCS) serialisation of a JSON object whose values are only
strings, non-negative integers, booleans, arrays and objects; keys are ASCII, so Python's
sorted, compact, non-ASCII-preserving `json.dumps` is exactly JCS for them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Final

from vault.digest import check_digest
from vault.errors import InvalidArgument, VerificationError

FORMAT_VERSION: Final = 1
# The kinds a caller may pin. `hold` keeps a blob from the gc (docs/retention.md).
KINDS: Final = ("image", "dataset", "config", "run", "artefact", "checkpoint", "hold")
# The kind of the entry by which the vault's own gc releases a blob's bytes (an entry that
# released bytes it was not asked to would be a way to delete them).
RELEASE: Final = "release"
# The kind of the entry by which the vault's registry records a DELETE of a manifest or a tag:
# the name is withdrawn from a repository, the `image` pin and the bytes stay (docs/registry.md).
WITHDRAW: Final = "withdraw"
# The kind of the entry by which the ledger's writer commits the subject map's root: which
# entries name each digest, so that a look-up proves its answer complete (vault.ledger.subject_map).
INDEX: Final = "index"
# The kinds the vault writes itself, never pinned by a caller, and what writes each.
VAULT_KINDS: Final = {
    RELEASE: "the vault's gc (vault gc)",
    WITHDRAW: "the vault's registry, for a DELETE of a manifest or tag",
    INDEX: "the ledger's writer, committing the subject map",
}
# Every kind an entry may have.
ALL_KINDS: Final = (*KINDS, *VAULT_KINDS)
ZERO_HASH: Final = bytes(32)

MAX_SUBJECTS: Final = 16
MAX_META_KEYS: Final = 64
MAX_META_KEY_LENGTH: Final = 64
MAX_META_VALUE_BYTES: Final = 4096
MAX_META_TOTAL_BYTES: Final = 16384
MAX_AUTHOR_LENGTH: Final = 128

_META_KEY = re.compile(r"[a-z0-9][a-z0-9._-]*")
# What could make a value print as something else on a terminal or a web page: C0 and C1
# controls and DEL (newlines and escape sequences among them), line and paragraph separators,
# and the bidirectional marks, embeddings, overrides and isolates.
UNSAFE_TEXT: Final = "\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNSAFE_TEXT = re.compile(f"[{UNSAFE_TEXT}]")
_FIELDS: Final = frozenset(
    {"v", "index", "kind", "subjects", "meta", "external", "author", "time", "prev"}
)


def encode_fields(
    index: int,
    kind: str,
    subjects: Sequence[str],
    author: str,
    time: str,
    prev: bytes,
    meta: Mapping[str, str],
    external: bool,
) -> bytes:
    """An entry's canonical bytes from its fields (`Entry.encode`; the ledger's appender calls
    it without making an Entry).

    Written out by hand (keys already in sorted order, strings escaped by the json module's own
    encoder) because appends encode every entry; `canonical_json` of the same object gives the
    same bytes, and the test vectors hold both to it."""
    fields = (
        ",".join([f"{_string(k)}:{_string(v)}" for k, v in sorted(meta.items())]) if meta else ""
    )
    listed = _string(subjects[0]) if len(subjects) == 1 else ",".join(map(_string, subjects))
    return (
        f'{{"author":{_string(author)},'
        f'"external":{"true" if external else "false"},'
        f'"index":{index:d},"kind":{_string(kind)},"meta":{{{fields}}},'
        f'"prev":"{prev.hex()}","subjects":[{listed}],'
        f'"time":{_string(time)},"v":{FORMAT_VERSION}}}'
    ).encode()


@dataclass(frozen=True, slots=True)
class Entry:
    """One ledger record. Its position in the ledger is its `index`."""

    index: int
    kind: str
    subjects: tuple[str, ...]
    author: str
    time: str
    prev: bytes
    meta: Mapping[str, str] = field(default_factory=dict)
    external: bool = False

    def encode(self) -> bytes:
        """The canonical bytes: the same on every machine and Python version."""
        return encode_fields(
            self.index,
            self.kind,
            self.subjects,
            self.author,
            self.time,
            self.prev,
            self.meta,
            self.external,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "author": self.author,
            "external": self.external,
            "index": self.index,
            "kind": self.kind,
            "meta": dict(self.meta),
            "prev": self.prev.hex(),
            "subjects": list(self.subjects),
            "time": self.time,
            "v": FORMAT_VERSION,
        }

    @classmethod
    def decode(cls, body: bytes) -> Entry:
        """Parse canonical bytes; anything not exactly canonical is refused."""
        try:
            obj = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise VerificationError(f"entry body is not UTF-8 JSON: {exc}") from None
        if not isinstance(obj, dict) or set(obj) != _FIELDS:
            raise VerificationError("entry body does not have exactly the entry fields")
        if obj["v"] != FORMAT_VERSION:
            raise VerificationError(f"entry format version {obj['v']!r} is not {FORMAT_VERSION}")
        try:
            entry = cls(
                index=_int(obj["index"]),
                kind=_str(obj["kind"]),
                subjects=tuple(_str(s) for s in obj["subjects"]),
                author=_str(obj["author"]),
                time=_str(obj["time"]),
                prev=bytes.fromhex(_str(obj["prev"])),
                meta={_str(k): _str(v) for k, v in obj["meta"].items()},
                external=_bool(obj["external"]),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise VerificationError(f"entry body has a field of the wrong type: {exc}") from None
        if entry.encode() != body:
            raise VerificationError("entry body is not in canonical form")
        return entry


# The encoder json.dumps uses with ensure_ascii=False: JCS string escaping for these strings.
_string: Callable[[str], str] = json.encoder.encode_basestring


def now() -> str:
    """The entry time format: RFC 3339, UTC, microseconds, `Z`."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)


def time_bound(text: str, what: str) -> str:
    """An RFC 3339 time (any offset, up to nanoseconds) in the entry time format, so that it
    compares with entries' times as text; InvalidArgument naming `what` for anything else."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise InvalidArgument(
            f"{what} {text!r} is not an RFC 3339 time such as 2026-11-24T09:30:00Z"
        )
    year, month, day, hour, minute, second = (int(match[n]) for n in range(1, 7))
    micro = int((match[7] or "0")[:6].ljust(6, "0"))
    try:
        offset = timedelta(0)
        if match[9]:
            sign = 1 if match[9] == "+" else -1
            offset = sign * timedelta(hours=int(match[10]), minutes=int(match[11]))
        moment = datetime(year, month, day, hour, minute, min(second, 59), micro, timezone(offset))
    except ValueError as exc:
        raise InvalidArgument(f"{what} {text!r} is not a valid time: {exc}") from None
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def check_kind(kind: str) -> str:
    """A kind a caller may pin."""
    writer = VAULT_KINDS.get(kind)
    if writer is not None:
        raise InvalidArgument(f"a {kind!r} entry is written only by {writer}, never pinned")
    if kind not in KINDS:
        raise InvalidArgument(f"unknown kind {kind!r}: expected one of {', '.join(KINDS)}")
    return kind


def check_subjects(subjects: Sequence[str]) -> tuple[str, ...]:
    if not subjects:
        raise InvalidArgument("an entry needs at least one subject digest")
    if len(subjects) > MAX_SUBJECTS:
        raise InvalidArgument(f"too many subjects: {len(subjects)} (at most {MAX_SUBJECTS})")
    return tuple(map(check_digest, subjects))


def check_author(author: str) -> str:
    if not author or len(author) > MAX_AUTHOR_LENGTH or not author.isprintable():
        raise InvalidArgument(
            f"author must be 1 to {MAX_AUTHOR_LENGTH} printable characters, found {author!r}"
        )
    return author


def check_meta(meta: Mapping[str, str]) -> dict[str, str]:
    """Bounded metadata: ASCII keys, UTF-8 values that print as themselves (see UNSAFE_TEXT),
    limits that name what broke them."""
    if not meta:
        return {}
    if len(meta) > MAX_META_KEYS:
        raise InvalidArgument(f"too many metadata keys: {len(meta)} (at most {MAX_META_KEYS})")
    total = 0
    for key, value in meta.items():
        if len(key) > MAX_META_KEY_LENGTH or not _META_KEY.fullmatch(key):
            raise InvalidArgument(
                f"bad metadata key {key[:80]!r}: expected 1 to {MAX_META_KEY_LENGTH} characters "
                "of a-z 0-9 . _ -, starting with a letter or digit"
            )
        size = len(value.encode("utf-8"))
        if size > MAX_META_VALUE_BYTES:
            raise InvalidArgument(
                f"metadata value for {key!r} is {size} bytes (at most {MAX_META_VALUE_BYTES})"
            )
        unsafe = _UNSAFE_TEXT.search(value)
        if unsafe is not None:
            raise InvalidArgument(
                f"metadata value for {key!r} has U+{ord(unsafe.group()):04X} at character "
                f"{unsafe.start()}: control characters, line and paragraph separators and "
                "bidirectional controls are refused"
            )
        total += len(key) + size
    if total > MAX_META_TOTAL_BYTES:
        raise InvalidArgument(f"metadata is {total} bytes in all (at most {MAX_META_TOTAL_BYTES})")
    return dict(sorted(meta.items()))


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, found {type(value).__name__}")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a non-negative integer, found {value!r}")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, found {type(value).__name__}")
    return value
