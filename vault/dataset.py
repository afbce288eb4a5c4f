"""Datasets by manifest (docs/dataset-manifest.md): a folder of files becomes blobs plus one
canonical manifest blob naming them, pinned as `dataset`, and checked out again verified."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from vault.client import ProvenEntry, VaultClient
from vault.digest import Digest
from vault.entry import canonical_json
from vault.errors import IntegrityError, InvalidArgument

MANIFEST_VERSION: Final = 1
# Bounds every read of a manifest from the network; about two million files.
MAX_MANIFEST_BYTES: Final = 256 * 1024 * 1024
# Integers above 2**53 are not exact in every JSON reader, so the format forbids them.
MAX_SIZE: Final = 2**53 - 1
FIND_MISSING_BATCH: Final = 10_000
PUTS_IN_FLIGHT: Final = 8
HASH_BLOCK: Final = 1 << 20

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


# ---------------------------------------------------------------------- pure functions


def check_path(path: str) -> str:
    """A manifest path: relative, POSIX, no empty, `.` or `..` component, valid UTF-8."""
    if not path:
        raise InvalidArgument("dataset manifest: empty path")
    if path.startswith("/"):
        raise InvalidArgument(f"dataset manifest: path {path!r} is absolute")
    parts = path.split("/")
    if ".." in parts:
        raise InvalidArgument(f"dataset manifest: path {path!r} has a '..' component")
    if "" in parts:
        raise InvalidArgument(f"dataset manifest: path {path!r} has an empty component")
    if "." in parts:
        raise InvalidArgument(f"dataset manifest: path {path!r} has a '.' component")
    if "\x00" in path:
        raise InvalidArgument(f"dataset manifest: path {path!r} has a NUL character")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"dataset manifest: path {path!r} is not valid UTF-8") from None
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


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise InvalidArgument(f"dataset manifest: key {key!r} appears twice in an object")
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    raise InvalidArgument(f"dataset manifest: {name} is not JSON")


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes; anything malformed or not canonical is refused with
    a message that names the problem."""
    try:
        obj = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"dataset manifest is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("dataset manifest is nested too deeply") from None
    if not isinstance(obj, dict):
        raise InvalidArgument("dataset manifest is not a JSON object")
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
    unknown = sorted(set(item) - _FILE_FIELDS)
    if unknown:
        raise InvalidArgument(f"dataset manifest: file {number} has unknown field {unknown[0]!r}")
    missing = sorted(_FILE_FIELDS - set(item))
    if missing:
        raise InvalidArgument(f"dataset manifest: file {number} lacks field {missing[0]!r}")
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


# ---------------------------------------------------------------------- the local tree


def _tree_error(root: Path, path: Path, message: str) -> InvalidArgument:
    return InvalidArgument(f"dataset {root}: {path.relative_to(root).as_posix()!r} {message}")


def scan_tree(root: Path) -> list[FileEntry]:
    """Every regular file under `root`, hashed. Symlinks are refused (one escaping the tree
    is named as such), as is anything that is neither a file nor a folder."""
    if not root.is_dir():
        raise InvalidArgument(f"dataset {root}: not a folder")
    files: list[FileEntry] = []
    pending = [root]
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as it:
            children = sorted(it, key=lambda e: e.name)
        for child in children:
            path = Path(child.path)
            if child.is_symlink():
                raise _symlink_error(root, path)
            if child.is_dir(follow_symlinks=False):
                pending.append(path)
            elif child.is_file(follow_symlinks=False):
                files.append(_hash_file(root, path))
            else:
                raise _tree_error(root, path, "is neither a regular file nor a folder")
    return files


def _symlink_error(root: Path, path: Path) -> InvalidArgument:
    target = os.readlink(path)
    relative = path.relative_to(root)
    resolved = os.path.normpath(os.path.join(relative.parent.as_posix(), target))
    if os.path.isabs(target) or resolved == ".." or resolved.startswith("../"):
        return _tree_error(root, path, f"is a symlink to {target!r}, which escapes the tree")
    return _tree_error(
        root, path, f"is a symlink to {target!r}: a dataset holds no symlinks, copy the file in"
    )


def _hash_file(root: Path, path: Path) -> FileEntry:
    name = path.relative_to(root).as_posix()
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise _tree_error(root, path, "has a name that is not valid UTF-8") from None
    # O_NOFOLLOW: the file was a regular file when listed; refuse it if swapped for a link.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        while block := f.read(HASH_BLOCK):
            digest.update(block)
            size += len(block)
    if size != info.st_size:
        raise _tree_error(root, path, "changed while it was being read")
    return FileEntry(name, size, info.st_mode & 0o777, f"sha256:{digest.hexdigest()}")


# ---------------------------------------------------------------------- with a vault


@dataclass(frozen=True, slots=True)
class AddResult:
    digest: str
    manifest: Manifest
    sent_files: int
    sent_bytes: int
    pin: ProvenEntry


def add_dataset(client: VaultClient, root: Path, *, name: str | None = None) -> AddResult:
    """Store the files of `root` the store lacks, then the manifest, and pin the manifest."""
    manifest = build_manifest(scan_tree(root))
    by_digest = {f.sha256: f for f in manifest.files}
    lacking = set(find_missing(client, list(by_digest)))
    missing = [d for d in by_digest if d in lacking]

    def send(digest: str) -> int:
        f = by_digest[digest]
        # `expected` makes the vault refuse a file that changed after it was hashed.
        client.put(root / f.path, expected=digest)
        return f.size

    # Small files are bound by round trips, not bytes: keep several puts in flight.
    with ThreadPoolExecutor(max_workers=PUTS_IN_FLIGHT) as pool:
        sent_bytes = sum(pool.map(send, missing))
    data = encode_manifest(manifest)
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    client.put(data, expected=digest)
    meta = {"name": name or root.resolve().name or "/", "files": str(len(manifest.files))}
    pin = client.pin("dataset", digest, meta=meta)
    return AddResult(digest, manifest, len(missing), sent_bytes, pin)


def find_missing(client: VaultClient, digests: Sequence[str]) -> list[str]:
    missing: list[str] = []
    for start in range(0, len(digests), FIND_MISSING_BATCH):
        missing += client.find_missing(digests[start : start + FIND_MISSING_BATCH])
    return missing


def fetch_manifest(client: VaultClient, digest: str) -> Manifest:
    """The manifest blob, verified against its digest by the client, then validated."""
    wanted = Digest.parse(digest)
    reader = client.open(str(wanted))
    if reader.info.size > MAX_MANIFEST_BYTES:
        raise InvalidArgument(
            f"dataset manifest {digest} is {reader.info.size} bytes (at most {MAX_MANIFEST_BYTES})"
        )
    data = b"".join(bytes(c) for c in reader.chunks())
    return decode_manifest(data)


def checkout_dataset(client: VaultClient, digest: str, target: Path) -> Manifest:
    """Materialise a dataset in `target` (absent or an empty folder).

    The tree is built in a staging folder (next to an absent `target`, inside an empty one so
    that it is on the same file system even when `target` is a mount point) and moved into
    place only once every file was verified against its digest; on any failure the staging
    folder is removed and `target` is left as it was."""
    manifest = fetch_manifest(client, digest)
    target = Path(os.path.abspath(target))
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise InvalidArgument(f"cannot check out into {target}: it is not a folder")
    existing = target.is_dir()
    if existing and any(target.iterdir()):
        raise InvalidArgument(f"cannot check out into {target}: the folder is not empty")
    missing = find_missing(client, sorted({f.sha256 for f in manifest.files}))
    if missing:
        raise InvalidArgument(
            f"dataset {digest}: the store lacks {len(missing)} of its blobs, first {missing[0]}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with _staging(target if existing else target.parent, target.name) as staging:
        for f in manifest.files:
            _materialise(client, f, staging)
        for f in manifest.files:
            os.chmod(staging / f.path, f.mode)
        for folder in sorted({(staging / f.path).parent for f in manifest.files} | {staging}):
            _fsync_folder(folder)
        if existing:
            if any(p != staging for p in target.iterdir()):
                raise InvalidArgument(f"cannot check out into {target}: it was written to")
            for child in staging.iterdir():
                os.rename(child, target / child.name)
            _fsync_folder(target)
        else:
            # rename(2) fails if something was created at `target` meanwhile.
            os.rename(staging, target)
            _fsync_folder(target.parent)
    return manifest


@contextlib.contextmanager
def _staging(parent: Path, name: str) -> Iterator[Path]:
    staging = parent / f".{name}.pinvault-partial-{secrets.token_hex(8)}"
    # 0o777 less the umask: the mode a folder made by the user would have, kept after renaming.
    staging.mkdir(0o777)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _materialise(client: VaultClient, f: FileEntry, staging: Path) -> None:
    path = staging / f.path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Per-chunk checks add nothing: the tree appears only once every whole digest matched.
    reader = client.open(f.sha256, check_chunks=False)
    if reader.info.size != f.size:
        raise IntegrityError(
            f"dataset manifest says {f.path!r} is {f.size} bytes, "
            f"its blob {f.sha256} is {reader.info.size}"
        )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        for piece in reader.chunks():
            out.write(piece)
        out.flush()
        os.fsync(out.fileno())


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def diff_datasets(client: VaultClient, old: str, new: str) -> Diff:
    return diff_manifests(fetch_manifest(client, old), fetch_manifest(client, new))
