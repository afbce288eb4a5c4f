"""Datasets by manifest (docs/dataset-manifest.md): a folder of files becomes blobs plus one
canonical manifest blob naming them, pinned as `dataset`, and checked out again verified."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from vault.client import ProvenEntry, VaultClient
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound
from vault.files import fsync_dir
from vault.runs.ignore import IgnoreRules
from vault.runs.names import DATASET, check_name
from vault.store.hashcache import HashCache
from vault.store.manifest import (
    MAX_MANIFEST_BYTES,
    Diff,
    FileEntry,
    Manifest,
    build_manifest,
    check_path,
    decode_manifest,
    diff_manifests,
    encode_manifest,
)

FIND_MISSING_BATCH: Final = 10_000
PUTS_IN_FLIGHT: Final = 8
HASH_BLOCK: Final = 1 << 20
# Files this small go to the vault in batches (put_many), which share the vault's syncs: a
# small file costs a round trip and syncs, not bytes. Larger files are streamed one by one.
SMALL_FILE: Final = 1 << 20
BATCH_FILES: Final = 1000
BATCH_BYTES: Final = 32 << 20
# A few batches in flight: while one is read and hashed here, the vault stores another.
BATCHES_IN_FLIGHT: Final = 3
# Hashing threads: hashlib and the file reads release the GIL.
HASH_THREADS: Final = 4


# ---------------------------------------------------------------------- the local tree


class Progress(Protocol):
    """Whoever shows a long operation's progress (the command's bar, on a terminal)."""

    def set(self, done: int, total: int | None = None) -> None: ...

    def advance(self, n: int) -> None: ...


def _tree_error(root: Path, path: Path, message: str) -> InvalidArgument:
    return InvalidArgument(f"dataset {root}: {path.relative_to(root).as_posix()!r} {message}")


def scan_tree(root: Path) -> list[FileEntry]:
    """Every regular file under `root`, hashed. Symlinks are refused (one escaping the tree
    is named as such), as is anything that is neither a file nor a folder."""
    listed = _list_tree(root)
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        return [entry for entry, _ in pool.map(lambda file: _read_file(root, file), listed)]


@dataclass(frozen=True, slots=True)
class _Listed:
    """A file found by the walk: its manifest path, its path here, what `stat` said of it.
    Plain strings, not Path: pathlib's parsing costs more than hashing a small file."""

    name: str
    path: str
    stat: os.stat_result

    @property
    def size(self) -> int:
        return self.stat.st_size


def _list_tree(root: Path, ignore: IgnoreRules | None = None) -> list[_Listed]:
    """Every regular file under `root` that `ignore` keeps, in walk order; anything that
    cannot be in a dataset is refused here, before a byte is read or sent."""
    if not root.is_dir():
        raise InvalidArgument(f"dataset {root}: not a folder")
    files: list[_Listed] = []
    pending = [(str(root), "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as it:
            children = sorted(it, key=lambda e: e.name)
        for child in children:
            name = prefix + child.name
            if ignore and ignore.ignores(name, folder=child.is_dir(follow_symlinks=False)):
                continue
            if child.is_symlink():
                raise _symlink_error(root, Path(child.path))
            if child.is_dir(follow_symlinks=False):
                pending.append((child.path, name + "/"))
            elif child.is_file(follow_symlinks=False):
                try:
                    name.encode("utf-8")
                except UnicodeEncodeError:
                    raise _tree_error(
                        root, Path(child.path), "has a name that is not valid UTF-8"
                    ) from None
                check_path(name)
                files.append(_Listed(name, child.path, child.stat(follow_symlinks=False)))
            else:
                raise _tree_error(root, Path(child.path), "is neither a regular file nor a folder")
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


def _known_file(file: _Listed, sha256: str) -> FileEntry:
    return FileEntry(file.name, file.size, file.stat.st_mode & 0o777, sha256)


def _reread(root: Path, file: _Listed, known: FileEntry) -> bytes:
    """The bytes of a small file whose digest came from the cache, for sending."""
    entry, data = _read_file(root, file, keep=True)
    if entry.sha256 != known.sha256 or data is None:
        raise _tree_error(
            root, Path(file.path), "changed while it was being added (or since it was hashed)"
        )
    return data


def _read_file(root: Path, file: _Listed, *, keep: bool = False) -> tuple[FileEntry, bytes | None]:
    """The file's entry, hashed; with `keep`, also its bytes, read whole (for small files)."""
    # O_NOFOLLOW: the file was a regular file when listed; refuse it if swapped for a link.
    # The descriptor is read with os.read, not a file object: for a small file, the object
    # costs more than the reading.
    fd = os.open(file.path, os.O_RDONLY | os.O_NOFOLLOW)
    data: bytes | None = None
    try:
        info = os.fstat(fd)
        if keep:
            # One read of a byte more than the file has: a file that grew shows it here, one
            # that shrank by coming up short (a regular file is read whole, short only at EOF).
            data = os.read(fd, info.st_size + 1)
            digest = hashlib.sha256(data)
            size = len(data)
        else:
            digest = hashlib.sha256()
            size = 0
            while block := os.read(fd, HASH_BLOCK):
                digest.update(block)
                size += len(block)
    finally:
        os.close(fd)
    if size != info.st_size:
        raise _tree_error(root, Path(file.path), "changed while it was being read")
    entry = FileEntry(file.name, size, info.st_mode & 0o777, f"sha256:{digest.hexdigest()}")
    return entry, data


# ---------------------------------------------------------------------- with a vault


@dataclass(frozen=True, slots=True)
class AddResult:
    """What `add_dataset` did: the manifest's digest, the bytes it sent, and the pin that
    names the dataset: the new one, or (`new` false) the one that already did."""

    digest: str
    manifest: Manifest
    sent_files: int
    sent_bytes: int
    pin: ProvenEntry
    new: bool = True


def add_dataset(
    client: VaultClient,
    root: Path,
    *,
    name: str | None = None,
    tag: str = "",
    exclude: Sequence[str] = (),
    cache: HashCache | None = None,
    progress: Progress | None = None,
) -> AddResult:
    """Store the files of `root` the store lacks (leaving out what `exclude` and the folder's
    `.vaultignore` match), then the manifest, and pin the manifest under `name` (by default
    the folder's name) and `tag`, unless a verified pin of this manifest under that name and
    tag is already in the ledger: then nothing is appended and that pin is returned.

    Small files go in batches, each read once: hashed, looked up (FindMissing) and the missing
    ones sent (put_many) from the same bytes, several batches at a time, so that reading and
    hashing here overlap with the vault storing. Large files are hashed in the same pass and
    sent one by one after. With a `cache` (vault/hashcache.py), a file unchanged since it was
    last hashed is not read again unless the vault lacks it. `progress` is told the bytes
    hashed, then those of large files sent."""
    name = check_name(name or root.resolve().name or "/")
    if tag:
        check_name(tag, "dataset tag")
    groups = _groups(_list_tree(root, IgnoreRules.load(root, exclude)))
    total = sum(file.size for group in groups for file in group)
    if progress:
        progress.set(0, total)
    # The cache knows files by absolute path.
    where = os.path.abspath(root) + os.sep
    lock = threading.Lock()
    # Digests some batch has taken on sending, so that a file's twin is not sent twice.
    claimed: set[str] = set()
    large: list[FileEntry] = []

    def claim(lacking: set[str], digest: str) -> bool:
        with lock:
            if digest not in lacking or digest in claimed:
                return False
            claimed.add(digest)
            return True

    def process(group: list[_Listed]) -> tuple[list[FileEntry], int, int]:
        began = time.time()
        keys = [where + file.name for file in group]
        known = (
            cache.lookup([(k, f.stat) for k, f in zip(keys, group, strict=True)]) if cache else {}
        )
        read = [
            (_known_file(file, known[key]), None)
            if key in known
            else _read_file(root, file, keep=file.size <= SMALL_FILE)
            for key, file in zip(keys, group, strict=True)
        ]
        entries = [entry for entry, _ in read]
        lacking = set(client.find_missing(list({entry.sha256 for entry in entries})))
        batch: dict[str, bytes] = {}
        for file, (entry, data) in zip(group, read, strict=True):
            if claim(lacking, entry.sha256):
                if entry.size > SMALL_FILE:
                    with lock:
                        large.append(entry)
                else:
                    batch[entry.sha256] = data if data is not None else _reread(root, file, entry)
        if cache:
            cache.record(
                (key, file.stat, entry.sha256, began)
                for key, file, entry in zip(keys, group, entries, strict=True)
                if key not in known
            )
        if batch:
            # `expected` makes the vault refuse bytes that are not what was hashed.
            client.put_many(list(batch.values()), expected=list(batch))
        return entries, len(batch), sum(len(data) for data in batch.values())

    files: list[FileEntry] = []
    sent_files = sent_bytes = 0
    with ThreadPoolExecutor(max_workers=BATCHES_IN_FLIGHT) as pool:
        for entries, count, size in pool.map(process, groups):
            files += entries
            sent_files += count
            sent_bytes += size
            if progress:
                progress.advance(sum(entry.size for entry in entries))

    def send(f: FileEntry) -> int:
        # `expected` makes the vault refuse a file that changed after it was hashed.
        client.put(root / f.path, expected=f.sha256)
        return f.size

    # Each large put is bound by bytes, but several in flight still overlap their syncs.
    if progress and large:
        progress.set(total, total + sum(f.size for f in large))
    with ThreadPoolExecutor(max_workers=PUTS_IN_FLIGHT) as pool:
        for size in pool.map(send, large):
            sent_bytes += size
            if progress:
                progress.advance(size)
    sent_files += len(large)
    manifest = build_manifest(files)
    data = encode_manifest(manifest)
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    client.put(data, expected=digest)
    meta = {"name": name, "files": str(len(manifest.files))}
    if tag:
        meta["tag"] = tag
    try:
        pins = client.lookup(digest)
    except NotFound:
        pins = []
    for known in pins:
        entry = known.entry
        if entry.kind == DATASET and (entry.meta.get("name"), entry.meta.get("tag", "")) == (
            name,
            tag,
        ):
            return AddResult(digest, manifest, sent_files, sent_bytes, known, new=False)
    pin = client.pin(DATASET, digest, meta=meta)
    return AddResult(digest, manifest, sent_files, sent_bytes, pin)


def _groups(listed: Sequence[_Listed]) -> list[list[_Listed]]:
    """The files in groups of at most BATCH_FILES files and about BATCH_BYTES of small files
    (large files are not held in memory, so they count for nothing)."""
    groups: list[list[_Listed]] = []
    group: list[_Listed] = []
    size = 0
    for file in listed:
        held = file.size if file.size <= SMALL_FILE else 0
        if group and (len(group) == BATCH_FILES or size + held > BATCH_BYTES):
            groups.append(group)
            group, size = [], 0
        group.append(file)
        size += held
    if group:
        groups.append(group)
    return groups


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


def checkout_dataset(
    client: VaultClient, digest: str, target: Path, *, progress: Progress | None = None
) -> Manifest:
    """Materialise a dataset in `target` (absent or an empty folder).

    The tree is built in a staging folder (next to an absent `target`, inside an empty one so
    that it is on the same file system even when `target` is a mount point) and moved into
    place only once every file was verified against its digest; on any failure the staging
    folder is removed and `target` is left as it was. `progress` is told the bytes written."""
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
        if progress:
            progress.set(0, manifest.size)
        for f in manifest.files:
            _materialise(client, f, staging)
            if progress:
                progress.advance(f.size)
        for f in manifest.files:
            os.chmod(staging / f.path, f.mode)
        for folder in sorted({(staging / f.path).parent for f in manifest.files} | {staging}):
            fsync_dir(folder)
        if existing:
            if any(p != staging for p in target.iterdir()):
                raise InvalidArgument(f"cannot check out into {target}: it was written to")
            for child in staging.iterdir():
                os.rename(child, target / child.name)
            fsync_dir(target)
        else:
            # rename(2) fails if something was created at `target` meanwhile.
            os.rename(staging, target)
            fsync_dir(target.parent)
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


def diff_datasets(client: VaultClient, old: str, new: str) -> Diff:
    return diff_manifests(fetch_manifest(client, old), fetch_manifest(client, new))
