"""What `vault verify --blobs` checks: every pinned blob and every file of every pinned dataset,
each blob once, its stored copies re-hashed against its digest. A dataset's file is named by its
path and its dataset; what is found is journalled (vault/server/damage.py), so that admission
knows of a damaged file without reading it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import text

from vault.digest import Digest, digest_from_key
from vault.errors import IntegrityError, NotFound, VaultError
from vault.server.content import Content
from vault.server.damage import KnownDamage
from vault.store.manifest import MAX_MANIFEST_BYTES, RawFile, check_manifest, summarize_manifest


@dataclass(frozen=True, slots=True)
class BlobCheck:
    """One blob's audit result; `failure` is empty when it is present and intact."""

    digest: str
    size: int
    failure: str = ""


class _Found(Exception):
    """Ends a walk over a manifest's files at the one looked for."""


_DATASETS = text(
    "SELECT DISTINCT s.digest FROM entry_subjects s JOIN entries e ON e.idx = s.idx "
    "WHERE e.external = :external AND e.kind = 'dataset'"
)


class BlobAudit:
    """Checks, when iterated, the pinned blobs in order of digest, then the files of each pinned
    dataset not checked before, in order of digest, dataset by dataset. `total` counts the
    blobs listed so far: it grows as each dataset's files are listed (a dataset's manifest is
    read only when its turn comes). A dataset pin whose blob is not a dataset manifest (or
    cannot be read) adds no files; its own check says why it cannot be read."""

    def __init__(self, content: Content) -> None:
        self.content = content
        self._pinned = content.pinned_digests()
        with content.db.read.connect() as conn:
            found = conn.execute(_DATASETS, {"external": False})
            self._datasets = sorted(digest_from_key(bytes(key)) for (key,) in found)
        self.total = len(self._pinned)

    def __iter__(self) -> Iterator[BlobCheck]:
        damage = KnownDamage(self.content.store)
        try:
            yield from self._checks(self._pinned, damage, "pinned but not in the store")
            seen = set(self._pinned)
            for dataset in self._datasets:
                data = self._manifest(dataset)
                if data is None:
                    continue
                files = [d for d in _distinct_files(data) if d not in seen]
                seen.update(files)
                self.total += len(files)
                for result in self._checks(files, damage, "not in the store"):
                    if result.failure:
                        where = f"file {_path_of(data, result.digest)} of dataset {dataset}: "
                        result = BlobCheck(result.digest, result.size, where + result.failure)
                    yield result
        finally:
            damage.close()

    def _checks(self, digests: list[str], damage: KnownDamage, absent: str) -> Iterator[BlobCheck]:
        # Blobs known damaged before, found intact now, are no longer damaged: asked at once.
        known = {str(d) for d in damage.damaged(Digest.parse(d) for d in digests)}
        for digest in digests:
            yield self._check(digest, damage, known, absent)

    def _check(self, digest: str, damage: KnownDamage, known: set[str], absent: str) -> BlobCheck:
        """Re-hash the blob's stored copies against its digest (a store of several copies
        repairs a damaged one from a good one as it does)."""
        found = self.content.find(Digest.parse(digest))
        if found is None:
            return BlobCheck(digest, 0, absent)
        sha256, size = found.info.sha256, found.info.size
        try:
            self.content.store.verify(sha256)
        except NotFound:
            failure = "catalogued but its bytes are missing"
        except IntegrityError as exc:
            failure = str(exc)
        except VaultError as exc:
            return BlobCheck(digest, size, f"could not be checked: {exc}")
        else:
            if str(sha256) in known:
                damage.found_intact(sha256, size)
            return BlobCheck(digest, size)
        damage.found_damaged(sha256, failure)
        return BlobCheck(digest, size, failure)

    def _manifest(self, dataset: str) -> bytearray | None:
        """A dataset's manifest bytes, verified; None if they are not in the store whole or are
        larger than any manifest may be."""
        found = self.content.find(Digest.parse(dataset))
        if found is None or found.info.size > MAX_MANIFEST_BYTES:
            return None
        data = bytearray()
        try:
            _, chunks = self.content.read(found)
            for chunk in chunks:
                data += chunk.data
        except VaultError:
            return None
        return data


def _distinct_files(data: bytearray) -> list[str]:
    """The distinct digests of a dataset's files, in order; none if it is not a manifest."""
    try:
        summary = summarize_manifest(data)
    except VaultError:
        return []
    return ["sha256:" + raw.hex() for raw in sorted(summary.sizes)]


def _path_of(data: bytearray, digest: str) -> str:
    """The path of the first file of the manifest `data` whose digest is `digest`."""
    wanted = digest.removeprefix("sha256:").encode()
    paths: list[str] = []

    def look(batch: list[RawFile]) -> None:
        for path, _, _, hexdigest in batch:
            if hexdigest == wanted:
                paths.append(path.decode())
                raise _Found

    with contextlib.suppress(_Found):
        check_manifest(data, look)
    return paths[0]
