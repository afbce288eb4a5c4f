"""Dataset manifests (docs/dataset-manifest.md): the canonical blob that names every file of a
dataset by path, size, permission bits and digest, and the one validator of it that admission
and checkout share."""

from __future__ import annotations

import re
from collections.abc import Sequence
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


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes; anything malformed or not canonical is refused with
    a message that names the problem."""
    obj = load_json_object("dataset manifest", data, MAX_MANIFEST_BYTES)
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
        raise InvalidArgument(
            "dataset manifest is not in canonical form "
            "(RFC 8785 JSON, files sorted by bytewise UTF-8 path)"
        )
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
