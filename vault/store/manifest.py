"""Dataset manifests (docs/dataset-manifest.md): the canonical blob that names every file of a
dataset by path, size, permission bits and digest, and the one validator of it that admission
and checkout share."""

from __future__ import annotations

import binascii
import codecs
import itertools
import json
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from vault.canonical import canonical_json, expect_fields, load_json_object
from vault.errors import InvalidArgument

MANIFEST_VERSION: Final = 1
# Bounds every read of a manifest from the network; about two million files.
MAX_MANIFEST_BYTES: Final = 256 * 1024 * 1024
# Integers above 2**53 are not exact in every JSON reader, so the format forbids them.
MAX_SIZE: Final = 2**53 - 1
# What a checkout can create under a folder of its own on Linux (PATH_MAX is 4096, NAME_MAX
# 255), with room left for the folder it is checked out into.
MAX_PATH_BYTES: Final = 2048
MAX_PATH_DEPTH: Final = 256
MAX_NAME_BYTES: Final = 255

_MANIFEST_FIELDS: Final = frozenset({"v", "files"})
_FILE_FIELDS: Final = frozenset({"path", "size", "mode", "sha256"})
_MODE: Final = re.compile(r"0[0-7]{3}")
_SHA256: Final = re.compile(r"sha256:[0-9a-f]{64}")

# The fast reader accepts only the exact canonical bytes, one file entry at a time: keys in
# order, no whitespace, the path's escapes as JCS writes them (`\"`, `\\`, `\b \t \n \f \r`,
# and lowercase `\u00xx` for the other controls), sizes in plain decimal.
_HEAD: Final = b'{"files":['
_TAIL: Final = b'],"v":1}'
_ENTRY: Final = re.compile(
    rb'\{"mode":"(0[0-7]{3})",'
    rb'"path":"([^"\\\x00-\x1f]*(?:\\(?:["\\bfnrt]|u00(?:0[0-7bef]|1[0-9a-f]))[^"\\\x00-\x1f]*)*)",'
    rb'"sha256":"sha256:([0-9a-f]{64})",'
    rb'"size":(0|[1-9][0-9]{0,15})\}([,\]])'
)
# Only paths hold a `/`; one that starts or ends badly, or has an empty, `.` or `..` name, shows
# one of these. A path without, without escapes and at most MAX_NAME_BYTES long, passes
# check_path.
_PATH_SUSPECTS: Final = (b"//", b"/.", b'/"', b'"path":"/', b'"path":".', b'"path":""')
# The same signs in paths joined by NULs, with each `/` made a NUL too (a path in the manifest's
# bytes holds none of its own): a `/` at either end, an empty name or an empty path shows as two
# NULs in a row, a name or path starting with `.` as a NUL and a `.`; and a backslash (an escape).
_JOINED_SUSPECTS: Final = (b"\0\0", b"\0.", b"\\")
_SLASH_TO_NUL: Final = bytes.maketrans(b"/", b"\0")
_UTF8_PIECE: Final = 1 << 22
# A file as the fast reader hands it on: path (UTF-8), size, mode, digest (hex).
RawFile = tuple[bytes, int, int, bytes]
_MODES: Final = {f"{m:04o}".encode(): m for m in range(0o1000)}
# Files handed to a reader's sink at a time.
BATCH_FILES: Final = 10_000


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a dataset: relative POSIX path, size in bytes, permission bits, digest."""

    path: str
    size: int
    mode: int
    sha256: str

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "mode": f"{self.mode:04o}",
            "sha256": self.sha256,
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    files: tuple[FileEntry, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True, slots=True)
class Diff:
    added: list[str]
    removed: list[str]
    changed: list[str]

    def as_json(self) -> dict[str, list[str]]:
        return {"added": self.added, "removed": self.removed, "changed": self.changed}


def _path_key(path: str) -> bytes:
    return path.encode("utf-8")


def check_path(path: str, what: str = "dataset manifest") -> str:
    """A path in a manifest: relative, POSIX, no empty, `.` or `..` component, no NUL, UTF-8,
    and short and shallow enough to be checked out on any Linux file system (see the limits
    above). Admission and checkout both read a manifest through here, so a dataset that is
    admitted can be checked out."""
    if not path:
        raise InvalidArgument(f"{what}: empty path")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: path {path[:80]!r} is not valid UTF-8") from None
    if size > MAX_PATH_BYTES:
        raise InvalidArgument(
            f"{what}: path {path[:80]!r}… is {size} bytes long (at most {MAX_PATH_BYTES})"
        )
    if path.startswith("/"):
        raise InvalidArgument(f"{what}: path {path!r} is absolute")
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        raise InvalidArgument(
            f"{what}: path {path[:80]!r}… is {len(parts)} folders deep (at most {MAX_PATH_DEPTH})"
        )
    for bad, why in (("..", "a '..'"), ("", "an empty"), (".", "a '.'")):
        if bad in parts:
            raise InvalidArgument(f"{what}: path {path!r} has {why} component")
    if "\x00" in path:
        raise InvalidArgument(f"{what}: path {path!r} has a NUL character")
    longest = max(parts, key=lambda part: len(part.encode("utf-8")))
    if len(longest.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidArgument(
            f"{what}: path {path[:80]!r} has a name of {len(longest.encode('utf-8'))} bytes "
            f"(at most {MAX_NAME_BYTES})"
        )
    return path


def build_manifest(files: Sequence[FileEntry]) -> Manifest:
    """Check the files as a whole and put them in manifest order (bytewise UTF-8 path)."""
    for f in files:
        check_path(f.path)
    ordered = sorted(files, key=lambda f: _path_key(f.path))
    seen: set[str] = set()
    for f in ordered:
        if f.path in seen:
            raise InvalidArgument(f"dataset manifest: duplicate path {f.path!r}")
        seen.add(f.path)
        if not _SHA256.fullmatch(f.sha256):
            raise InvalidArgument(
                f"dataset manifest: {f.path!r} has bad digest {f.sha256[:80]!r}: "
                "expected 'sha256:<64 lowercase hex digits>'"
            )
        if not 0 <= f.size <= MAX_SIZE:
            raise InvalidArgument(f"dataset manifest: {f.path!r} has bad size {f.size}")
        if not 0 <= f.mode <= 0o777:
            raise InvalidArgument(f"dataset manifest: {f.path!r} has bad mode {f.mode:o}")
    for f in ordered:
        parts = f.path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in seen:
                raise InvalidArgument(
                    f"dataset manifest: {folder!r} is a file and also the folder of {f.path!r}"
                )
    sizes: dict[str, int] = {}
    for f in ordered:
        if sizes.setdefault(f.sha256, f.size) != f.size:
            raise InvalidArgument(
                f"dataset manifest: {f.sha256} is listed with sizes {sizes[f.sha256]} and {f.size}"
            )
    return Manifest(tuple(ordered))


def encode_manifest(manifest: Manifest) -> bytes:
    """The canonical bytes: RFC 8785 JSON, files in bytewise UTF-8 path order."""
    return canonical_json({"v": MANIFEST_VERSION, "files": [f.as_json() for f in manifest.files]})


def decode_manifest(data: bytes | bytearray, limit: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Parse and validate manifest bytes; anything malformed or not canonical is refused with
    a message that names the problem."""
    files: list[FileEntry] = []

    def keep(batch: list[RawFile]) -> None:
        files.extend(
            FileEntry(path.decode(), size, mode, "sha256:" + digest.decode())
            for path, size, mode, digest in batch
        )

    check_manifest(data, keep, limit)
    return Manifest(tuple(files))


def check_manifest(
    data: bytes | bytearray,
    sink: Callable[[list[RawFile]], object],
    limit: int = MAX_MANIFEST_BYTES,
) -> int:
    """Validate manifest bytes exactly as `decode_manifest` does, handing the files to `sink`
    (as RawFile tuples) in manifest order, at most BATCH_FILES at a time, rather than keeping
    them all; returns the number of files. On a refusal `sink` may have been handed some
    files: discard them."""
    return _check(data, sink, limit).files


def summarize_manifest(data: bytes | bytearray, limit: int = MAX_MANIFEST_BYTES) -> Summary:
    """Validate manifest bytes exactly as `decode_manifest` does, keeping only the number of
    files and each distinct digest with its size (what admission looks up)."""
    return _check(data, None, limit)


@dataclass(frozen=True, slots=True)
class Summary:
    """A valid manifest's number of files, and each distinct file digest (32 bytes) with the
    size every file of that digest has."""

    files: int
    sizes: dict[bytes, int]


def _check(
    data: bytes | bytearray, sink: Callable[[list[RawFile]], object] | None, limit: int
) -> Summary:
    """Canonical bytes are read a piece at a time, each piece checked as a whole (a million
    files in about a second, without a million dicts); a piece the fast reader is unsure of
    is read again by the exact entry-by-entry one, and anything it refuses by the
    whole-document reader, whose messages name the problem."""
    if len(data) > limit:
        raise InvalidArgument(f"dataset manifest is {len(data)} bytes (at most {limit})")
    if data.startswith(_HEAD) and (data.isascii() or _is_utf8(data)):
        found = _scan_pieces(data, sink)
        if found is None:
            found = _scan(data, sink)
        if found is not None:
            return found
    _decode_document(data, limit)
    # The whole-document reader accepted what the fast one did not: they disagree, and a
    # manifest is admitted only when both readers would take it.
    raise InvalidArgument(_NOT_CANONICAL)


_NOT_CANONICAL: Final = (
    "dataset manifest is not in canonical form (RFC 8785 JSON, files sorted by bytewise UTF-8 path)"
)
# The bytes of a file entry besides its mode, path, digest and size, with the `,` or `]` after.
_ENTRY_FRAME: Final = len(b'{"mode":"","path":"","sha256":"sha256:","size":},')
# Where the next file entry starts: a `"` in a path is always escaped, so this never occurs
# inside one.
_NEXT_ENTRY: Final = b'},{"mode":"'
_PIECE_BYTES: Final = 1 << 18
_MODE_OF, _PATH_OF, _DIGEST_OF, _SIZE_OF, _AFTER_OF = map(operator.itemgetter, range(5))


def _scan_pieces(
    data: bytes | bytearray, sink: Callable[[list[RawFile]], object] | None
) -> Summary | None:
    """The fast reader of canonical manifest bytes (known to start with the head and to be
    UTF-8): pieces of about _PIECE_BYTES, each matched entry by entry in C and then checked
    with whole-list operations, and the sizes of each digest checked over all pieces at the
    end. None when something is not plainly valid; the exact reader then decides."""
    pos = len(_HEAD)
    end = len(data) - len(_TAIL) + 1
    sizes: dict[bytes, int] = {}
    if data[pos:] == _TAIL:
        return Summary(0, sizes)
    if end <= pos or data[end - 1 :] != _TAIL:
        return None
    prefixes: set[bytes] = set()
    folders: set[bytes] = {b""}
    batch: list[RawFile] = []
    # Every file's digest (raw) and size, in manifest order, made into `sizes` in one pass.
    file_digests: list[bytes] = []
    file_sizes: list[int] = []
    previous = b""
    count = 0
    unhex = binascii.a2b_hex
    while pos < end:
        stop = data.find(_NEXT_ENTRY, pos + _PIECE_BYTES, end)
        stop = end if stop < 0 else stop + 2
        found = _ENTRY.findall(data, pos, stop)
        if not found:
            return None
        raw_paths = list(map(_PATH_OF, found))
        size_texts = list(map(_SIZE_OF, found))
        afters = list(map(_AFTER_OF, found))
        # Matches never overlap, so they cover the piece exactly when their lengths add up;
        # only the last entry of all ends with `]`.
        covered = len(found) * (_ENTRY_FRAME + 4 + 64)
        covered += sum(map(len, raw_paths)) + sum(map(len, size_texts))
        if covered != stop - pos or afters.count(b"]") != (stop == end):
            return None
        keys = _piece_keys(raw_paths)
        if keys is None or not previous < keys[0] or not all(map(operator.lt, keys, keys[1:])):
            return None
        # A file that is another's folder is a proper prefix of the path after it (every
        # path between `d` and `d/…` starts with `d`), so only such files are kept to look at.
        before = [previous, *keys[:-1]]
        prefixes.update(itertools.compress(before, map(bytes.startswith, keys, before)))
        prefixes.discard(b"")
        for folder in {key.rpartition(b"/")[0] for key in keys} - folders:
            while folder not in folders:
                folders.add(folder)
                folder = folder.rpartition(b"/")[0]
        if not prefixes.isdisjoint(folders):
            return None
        numbers = list(map(int, size_texts))
        if max(numbers) > MAX_SIZE:
            return None
        digests = list(map(_DIGEST_OF, found))
        file_digests.extend(map(unhex, digests))
        file_sizes.extend(numbers)
        if sink is not None:
            modes = map(_MODES.__getitem__, map(_MODE_OF, found))
            batch.extend(zip(keys, numbers, modes, digests, strict=True))
            while len(batch) >= BATCH_FILES:
                sink(batch[:BATCH_FILES])
                del batch[:BATCH_FILES]
        count += len(found)
        previous = keys[-1]
        pos = stop
    sizes.update(zip(file_digests, file_sizes, strict=True))
    # A digest listed with two sizes keeps the last: some file's size then differs from it.
    if len(sizes) < count and any(
        map(operator.ne, map(sizes.__getitem__, file_digests), file_sizes)
    ):
        return None
    if batch and sink is not None:
        sink(batch)
    return Summary(count, sizes)


def _piece_keys(raw_paths: list[bytes]) -> list[bytes] | None:
    """A piece's paths as UTF-8 bytes, each that might break a rule of check_path checked by
    it; None at the first that does. The paths are looked at together first, joined by a NUL
    (which a path in the manifest's bytes cannot hold): most pieces have nothing to check."""
    joined = (b"\0" + b"\0".join(raw_paths) + b"\0").translate(_SLASH_TO_NUL)
    if max(map(len, raw_paths)) <= MAX_NAME_BYTES and all(
        joined.find(needle) < 0 for needle in _JOINED_SUSPECTS
    ):
        return raw_paths
    keys = []
    for raw in raw_paths:
        key = raw
        if b"\\" in raw:
            try:
                key = json.loads(b'"' + raw + b'"').encode("utf-8")
            except ValueError:
                return None
        if key is raw and not _suspect(key):
            keys.append(key)
            continue
        try:
            check_path(key.decode("utf-8"))
        except (InvalidArgument, UnicodeDecodeError):
            return None
        keys.append(key)
    return keys


def _suspect(key: bytes) -> bool:
    """Whether an unescaped path might break a rule of check_path; otherwise it is sure not to."""
    return (
        not key
        or key[:1] in (b"/", b".")
        or key.endswith(b"/")
        or b"//" in key
        or b"/." in key
        or len(key) > MAX_NAME_BYTES
    )


def _scan(
    data: bytes | bytearray, sink: Callable[[list[RawFile]], object] | None
) -> Summary | None:
    """The exact reader of canonical manifest bytes (known to start with the head and to be
    UTF-8), one entry at a time: their files handed to `sink`, and their summary; None at the
    first thing that is not a valid manifest in canonical form."""
    pos = len(_HEAD)
    sizes: dict[bytes, int] = {}
    if data[pos:] == _TAIL:
        return Summary(0, sizes)
    count = 0
    batch: list[RawFile] = []
    previous = b""
    # The files that are proper prefixes of the current path: in bytewise order every path
    # between a file `d` and a path `d/…` starts with `d`, so a file that is another's folder
    # is found here.
    prefixes: list[bytes] = []
    unhex = binascii.a2b_hex
    # Where a path may break a rule check_path enforces; elsewhere only length can.
    suspects = [_find(data, needle, pos) for needle in _PATH_SUSPECTS]
    suspect = min(suspects)
    for match in _ENTRY.finditer(data, pos):
        if match.start() != pos:
            return None
        pos = match.end()
        mode, key, digest, size_text, after = match.groups()
        escaped = b"\\" in key
        if escaped:
            try:
                key = json.loads(b'"' + key + b'"').encode("utf-8")
            except ValueError:
                return None
        if escaped or suspect < pos or len(key) > MAX_NAME_BYTES:
            try:
                check_path(key.decode("utf-8"))
            except InvalidArgument:
                return None
            suspects = [
                s if s >= pos else _find(data, n, pos)
                for s, n in zip(suspects, _PATH_SUSPECTS, strict=True)
            ]
            suspect = min(suspects)
        if key <= previous:
            return None
        if key.startswith(previous):
            if previous:
                if key[len(previous) : len(previous) + 1] == b"/":
                    return None
                prefixes.append(previous)
        elif prefixes:
            while prefixes and not key.startswith(prefixes[-1]):
                prefixes.pop()
            for folder in prefixes:
                if key[len(folder) : len(folder) + 1] == b"/":
                    return None
        previous = key
        size = int(size_text)
        if size > MAX_SIZE or sizes.setdefault(unhex(digest), size) != size:
            return None
        batch.append((key, size, _MODES[mode], digest))
        count += 1
        if len(batch) >= BATCH_FILES:
            if sink is not None:
                sink(batch)
            batch = []
        if after == b"]":
            break
    else:
        return None
    if data[pos - 1 :] != _TAIL:
        return None
    if batch and sink is not None:
        sink(batch)
    return Summary(count, sizes)


def _find(data: bytes | bytearray, needle: bytes, start: int) -> int:
    found = data.find(needle, start)
    return len(data) if found < 0 else found


def _is_utf8(data: bytes | bytearray) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    try:
        for start in range(0, len(view), _UTF8_PIECE):
            decoder.decode(view[start : start + _UTF8_PIECE])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _decode_document(data: bytes | bytearray, limit: int) -> Manifest:
    """The whole-document reader: what it refuses, and the message, define the format."""
    obj = load_json_object("dataset manifest", bytes(data), limit)
    unknown = sorted(set(obj) - _MANIFEST_FIELDS)
    if unknown:
        raise InvalidArgument(f"dataset manifest: unknown field {unknown[0]!r}")
    if obj.get("v") != MANIFEST_VERSION or isinstance(obj.get("v"), bool):
        raise InvalidArgument(
            f"dataset manifest: version {obj.get('v')!r} is not {MANIFEST_VERSION}"
        )
    if not isinstance(obj.get("files"), list):
        raise InvalidArgument("dataset manifest: 'files' is missing or not a list")
    files = [_decode_file(n, item) for n, item in enumerate(obj["files"])]
    manifest = build_manifest(files)
    if encode_manifest(manifest) != data:
        raise InvalidArgument(_NOT_CANONICAL)
    return manifest


def _decode_file(number: int, item: object) -> FileEntry:
    if not isinstance(item, dict):
        raise InvalidArgument(f"dataset manifest: file {number} is not an object")
    expect_fields(f"dataset manifest: file {number}", item, _FILE_FIELDS)
    path, size, mode, digest = item["path"], item["size"], item["mode"], item["sha256"]
    if not isinstance(path, str):
        raise InvalidArgument(f"dataset manifest: file {number} has a path that is not a string")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_SIZE:
        raise InvalidArgument(f"dataset manifest: {path!r} has bad size {size!r}")
    if not isinstance(mode, str) or not _MODE.fullmatch(mode):
        raise InvalidArgument(
            f"dataset manifest: {path!r} has bad mode {mode!r}: expected four octal digits "
            "of permission bits, as '0644'"
        )
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise InvalidArgument(
            f"dataset manifest: {path!r} has bad digest {str(digest)[:80]!r}: "
            "expected 'sha256:<64 lowercase hex digits>'"
        )
    return FileEntry(path, size, int(mode, 8), digest)


def diff_manifests(old: Manifest, new: Manifest) -> Diff:
    """Paths added, removed, and changed (digest or mode), each in manifest order."""
    before = {f.path: f for f in old.files}
    after = {f.path: f for f in new.files}
    return Diff(
        added=[f.path for f in new.files if f.path not in before],
        removed=[f.path for f in old.files if f.path not in after],
        changed=[
            f.path
            for f in new.files
            if f.path in before
            and (before[f.path].sha256, before[f.path].mode) != (f.sha256, f.mode)
        ],
    )
