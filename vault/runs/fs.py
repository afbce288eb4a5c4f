"""`vault://` for data tools: a read-only fsspec file system over a vault, so that pandas, pyarrow
and anything else that takes fsspec URLs read blobs and the files of pinned datasets, every byte
verified by the client before a tool sees it.

    vault://sha256:HEX                      a blob (or blake3:HEX)
    vault://dataset/NAME/PATH               a file of the newest pin of NAME (NAME@TAG: of the tag)
    vault://dataset/NAME@DIGEST/PATH        a file of the dataset DIGEST, pinned under NAME
    vault://dataset/DIGEST/PATH             a file of the dataset DIGEST

A name is resolved through `resolve_dataset` (its pin proven in the signed ledger); a dataset's
folders, files, sizes and digests come from its manifest, fetched verified against its digest.
A file whose blob a verified pin records the chunk root of (vault.client.ranges) is read by
range: each read fetches only the chunks it covers, each checked against the chunk list that
root vouches for, so a Parquet footer or one tensor of a safetensors file costs what it reads.
Any other file's first read fetches its whole blob once, through `VaultClient.get`, into a
private spool file that is used only once its digest matched (and, for a dataset's file, its
size the manifest's). The server and credentials come from the client's configuration (`[client]` of
PINVAULT_CONFIG, then PINVAULT_CLIENT_*), as for the `vault` command. Needs the `fsspec` extra,
which registers the `vault` protocol."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, ClassVar, Final, NoReturn

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from vault import config
from vault.client import VaultClient, open_client
from vault.client.ranges import RangeReader
from vault.client.transfer import spool_folder
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound, PermissionDenied
from vault.runs.dataset import fetch_manifest
from vault.runs.names import DATASET, check_name, is_digest, list_datasets, resolve_dataset
from vault.store.manifest import FileEntry, Manifest

PROTOCOL: Final = "vault"
DATASETS: Final = "dataset"
FORMS: Final = (
    "expected vault://sha256:…, vault://blake3:… or vault://dataset/NAME[@TAG|@DIGEST]/PATH"
)


class Missing(NotFound, FileNotFoundError):
    """No blob, dataset or dataset file at a `vault://` path; a FileNotFoundError too, as data
    tools expect of a file system."""


class ReadOnly(PermissionDenied, PermissionError):
    """A write through `vault://`, which only reads; a PermissionError too."""


def _read_only(path: str) -> NoReturn:
    raise ReadOnly(
        f"vault://{path}: vault:// is read-only; store blobs with VaultClient.put and "
        "datasets with `vault dataset add`"
    )


@dataclass(frozen=True, slots=True)
class _Tree:
    """A dataset's manifest, indexed: its files by path, and each folder's children."""

    digest: str
    files: dict[str, FileEntry]
    folders: dict[str, set[str]]

    @classmethod
    def of(cls, digest: str, manifest: Manifest) -> _Tree:
        files = {f.path: f for f in manifest.files}
        folders: dict[str, set[str]] = {"": set()}
        for path in files:
            child = path
            while True:
                parent = child.rpartition("/")[0]
                known = parent in folders
                folders.setdefault(parent, set()).add(child)
                if known:
                    break
                child = parent
        return cls(digest, files, folders)


class VaultFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """The `vault` protocol of fsspec: read-only, every byte verified.

    `client` is the vault to read (default: one from the client's configuration, closed with
    this file system); `author` picks whose pins of a dataset name count, as `vault dataset
    --author` does. Writes raise ReadOnly; a path that names nothing raises Missing (a
    FileNotFoundError); a malformed path raises InvalidArgument; bytes that do not match their
    digest raise IntegrityError, and a name whose pin the vault cannot prove
    VerificationError or IntegrityError."""

    protocol: ClassVar[str] = PROTOCOL
    root_marker: ClassVar[str] = ""
    # Each instance holds a connection to the server the configuration named when it was made.
    cachable: ClassVar[bool] = False

    def __init__(self, client: VaultClient | None = None, *, author: str = "", **options: Any):
        super().__init__(**options)
        self.client = client if client is not None else open_client(config.load())
        self.author = author
        self._owns_client = client is None
        self._trees: dict[str, _Tree] = {}

    def close(self) -> None:
        """Close the client this file system made (one passed in is the caller's)."""
        if self._owns_client:
            self.client.close()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = str(path)
        for prefix in (f"{PROTOCOL}://", f"{PROTOCOL}::"):
            text = text.removeprefix(prefix)
        return text.strip("/")

    # ------------------------------------------------------------------ reading

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """What `path` is: a blob (its size from the vault's Stat, checked again when read), a
        dataset's file or folder (from its verified manifest), or a folder of names."""
        path = self._strip_protocol(path)
        if path in ("", DATASETS):
            return _folder(path)
        if is_digest(path):
            return self._blob_info(path)
        tree, member = self._member(path)
        entry = tree.files.get(member)
        if entry is not None:
            return _file(path, entry)
        if member in tree.folders:
            return _folder(path)
        raise Missing(f"vault://{path}: dataset {tree.digest} has no file or folder {member!r}")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        """A folder's children (the top holds `dataset`, which holds the pinned names), or a
        file's own info. Blobs outside datasets are not listed: ask for them by digest."""
        path = self._strip_protocol(path)
        if path == "":
            found = [_folder(DATASETS)]
        elif path == DATASETS:
            pinned = list_datasets(self.client, author=self.author)
            names = sorted(
                {n.name for n in pinned} | {f"{n.name}@{n.tag}" for n in pinned if n.tag}
            )
            found = [_folder(f"{DATASETS}/{name}") for name in names]
        elif is_digest(path):
            found = [self._blob_info(path)]
        else:
            tree, member = self._member(path)
            if member in tree.files:
                found = [_file(path, tree.files[member])]
            elif member in tree.folders:
                base = path[: len(path) - len(member)].rstrip("/")
                found = [
                    _file(f"{base}/{child}", tree.files[child])
                    if child in tree.files
                    else _folder(f"{base}/{child}")
                    for child in sorted(tree.folders[member])
                ]
            else:
                raise Missing(
                    f"vault://{path}: dataset {tree.digest} has no file or folder {member!r}"
                )
        return found if detail else [f["name"] for f in found]

    def ukey(self, path: str) -> str:
        """A file's content digest, which names its bytes forever."""
        return str(self.info(path)["sha256"])

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> VaultFile:
        path = self._strip_protocol(path)
        if mode != "rb":
            _read_only(path)
        found = self.info(path)
        if found["type"] != "file":
            raise IsADirectoryError(f"vault://{path} is a folder")
        return VaultFile(self, path, found, block_size=block_size)

    def _blob_info(self, path: str) -> dict[str, Any]:
        if "/" in path:
            raise InvalidArgument(f"vault://{path}: a blob has no files inside; {FORMS}")
        digest = _digest(path, path)
        try:
            blob = self.client.stat(digest).blob
        except NotFound:
            raise Missing(f"vault://{path}: the vault holds no such blob") from None
        return {"name": path, "type": "file", "size": blob.size, "sha256": str(blob.sha256)}

    def _member(self, path: str) -> tuple[_Tree, str]:
        """The dataset `path` is in, and the path inside it ("" for its top)."""
        head, _, rest = path.partition("/")
        reference, _, member = rest.partition("/")
        if head != DATASETS or not reference:
            raise InvalidArgument(f"vault://{path}: {FORMS}")
        return self._tree(reference), member

    def _tree(self, reference: str) -> _Tree:
        if reference not in self._trees:
            digest = self._resolve(reference)
            try:
                manifest = fetch_manifest(self.client, digest)
            except NotFound:
                raise Missing(
                    f"vault://{DATASETS}/{reference}: the vault holds no such dataset"
                ) from None
            self._trees[reference] = _Tree.of(digest, manifest)
        return self._trees[reference]

    def _resolve(self, reference: str) -> str:
        """The manifest digest a dataset reference names, verified (see the module's top)."""
        if is_digest(reference):
            return _digest(f"{DATASETS}/{reference}", reference)
        name, _, after = reference.partition("@")
        if not is_digest(after):
            try:
                return resolve_dataset(self.client, reference, author=self.author).digest
            except NotFound as exc:
                raise Missing(str(exc)) from None
        check_name(name)
        digest = _digest(f"{DATASETS}/{reference}", after)
        try:
            pins = self.client.lookup(digest)
        except NotFound:
            pins = []
        if not any(p.entry.kind == DATASET and p.entry.meta.get("name") == name for p in pins):
            raise Missing(f"no dataset {digest} is pinned under the name {name!r}")
        return digest

    # ------------------------------------------------------------------ writing: refused

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> NoReturn:
        _read_only(self._strip_protocol(path))

    def makedirs(self, path: str, exist_ok: bool = False) -> NoReturn:
        _read_only(self._strip_protocol(path))

    def rmdir(self, path: str) -> NoReturn:
        _read_only(self._strip_protocol(path))

    def rm_file(self, path: str) -> NoReturn:
        _read_only(self._strip_protocol(path))

    def _rm(self, path: str) -> NoReturn:
        _read_only(self._strip_protocol(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> NoReturn:
        _read_only(self._strip_protocol(path if isinstance(path, str) else path[0]))

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> NoReturn:
        _read_only(self._strip_protocol(path2))

    def mv(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> NoReturn:
        _read_only(self._strip_protocol(path1 if isinstance(path1, str) else path1[0]))

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> NoReturn:
        _read_only(self._strip_protocol(path))

    def put_file(self, lpath: str, rpath: str, *args: Any, **kwargs: Any) -> NoReturn:
        _read_only(self._strip_protocol(rpath))

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> NoReturn:
        _read_only(self._strip_protocol(path))


def _digest(path: str, text: str) -> str:
    try:
        return str(Digest.parse(text))
    except InvalidArgument as exc:
        raise InvalidArgument(f"vault://{path}: {exc}") from None


def _folder(path: str) -> dict[str, Any]:
    return {"name": path, "type": "directory", "size": 0}


def _file(path: str, entry: FileEntry) -> dict[str, Any]:
    return {
        "name": path,
        "type": "file",
        "size": entry.size,
        "sha256": entry.sha256,
        "mode": entry.mode,
    }


class VaultFile(AbstractBufferedFile):  # type: ignore[misc]
    """A blob opened for reading. If a verified pin records the blob's chunk root, each read
    fetches only the chunks it covers, verified alone (the reader keeps the last few); else
    the first read fetches the whole blob through the client into a private spool file, used
    only once its digest matched and its size is the one the file was opened with, and every
    read after is served from it."""

    def __init__(
        self, fs: VaultFileSystem, path: str, found: dict[str, Any], block_size: int | None
    ) -> None:
        self._digest = str(found["sha256"])
        self._spool: int | None = None
        self._ranges: RangeReader | None = None
        self._looked_up = False
        self._client = fs.client
        # The spool is local and read at any offset, and the range reader keeps the chunks it
        # read last: no cache in front of either.
        super().__init__(
            fs, path, "rb", block_size=block_size, cache_type="none", size=int(found["size"])
        )

    def _fetch_range(self, start: int, end: int) -> bytes:
        if not self._looked_up:
            self._looked_up = True
            self._ranges = self._client.open_ranges(self._digest)
            if self._ranges is not None and self._ranges.size != self.size:
                raise IntegrityError(
                    f"vault://{self.path} is {self.size} bytes, "
                    f"its blob {self._digest} is {self._ranges.size}"
                )
        if self._ranges is not None:
            start, end = min(start, self.size), min(max(end, start), self.size)
            return self._ranges.read(start, end - start)
        if self._spool is None:
            self._spool = self._fetch()
        return os.pread(self._spool, max(end - start, 0), start)

    def _fetch(self) -> int:
        """The whole blob, verified, in a file only this process can open (its name is
        removed as soon as it is open)."""
        folder = tempfile.mkdtemp(prefix="vault-fs-", dir=spool_folder())
        try:
            path = os.path.join(folder, "blob")
            info = self._client.get(self._digest, path)
            if info.size != self.size:
                raise IntegrityError(
                    f"vault://{self.path} is {self.size} bytes, "
                    f"its blob {self._digest} is {info.size}"
                )
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        spool, self._spool = self._spool, None
        if spool is not None:
            with contextlib.suppress(OSError):
                os.close(spool)
        super().close()
