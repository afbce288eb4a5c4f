"""Repair from outside the vault (`vault repair DIGEST --from PATH`): each damaged or missing copy
of a blob rewritten from a file that hashes to its digest, for when no good copy is left that
the tier manager could repair it from, as in a vault that keeps a single copy of each blob."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiers.copies import rehash
from tiers.manager import TierManager
from tiers.placements import REWRITE_FAILED
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound, Unavailable, VaultError
from vault.store.chunks import CHUNK_SIZE, ChunkList
from vault.store.protocol import put_file


@dataclass(frozen=True, slots=True)
class CopyRestore:
    """One tier's copy: what was wrong with it ("" if it verified), what was done (one line),
    and whether the tier now holds a good copy (None: out of reach, not checked)."""

    tier: str
    found: str
    done: str
    good: bool | None


def restore_from_file(
    manager: TierManager, digest: Digest, path: Path, *, catalogued: bool
) -> tuple[Digest, list[CopyRestore]]:
    """Check every copy of the blob `digest` (sha256 or blake3) names on the manager's tiers and
    rewrite each damaged or missing one from the file at `path`, journalling each; returns the
    blob's sha256 and what became of each copy.

    The file is hashed first: InvalidArgument, and nothing changed, unless it is the blob. A
    copy counts as missing on a tier that the placement record or the journal says holds it;
    with no such tier, on the first one if the vault's catalogue has the blob (`catalogued`),
    else NotFound. A tier out of reach is left as it is."""
    found = _hash_file(path)
    claimed = found.sha256 if digest.algorithm == "sha256" else found.blake3
    if claimed != digest:
        raise InvalidArgument(
            f"{path} hashes to {claimed}, not {digest}: it is not that blob's content, and "
            "no copy was changed"
        )
    sha256 = found.sha256
    source = f"the file {path}"
    with manager.repair_lock:
        holders = manager.journal.placed(sha256) | manager.journal.lost_copies(sha256)
        results: list[CopyRestore] = []
        faults: list[tuple[int, str]] = []
        for index, (name, tier) in enumerate(zip(manager.names, manager.tiers, strict=True)):
            try:
                info = tier.verify(sha256)
            except NotFound as error:
                if isinstance(error, Unavailable):
                    results.append(CopyRestore(name, "", f"not checked: {error}", None))
                elif name in holders:
                    faults.append((index, f"missing: {error}"))
                continue
            except IntegrityError as error:
                faults.append((index, str(error)))
                continue
            manager.journal.place(sha256, name, size=info.size, verified=time.time())
            results.append(CopyRestore(name, "", "intact, left as it is", True))
        if not faults and not any(result.good for result in results):
            if not catalogued:
                raise NotFound(
                    f"blob {sha256} is not in this vault (no tier holds it and the catalogue "
                    "does not name it): store it with `vault put`"
                )
            faults.append((0, f"missing: blob {sha256} is catalogued but on no tier"))
        for index, what in faults:
            results.append(_rewrite(manager, index, sha256, path, what, source))
    order = {name: number for number, name in enumerate(manager.names)}
    return sha256, sorted(results, key=lambda result: order[result.tier])


def _rewrite(
    manager: TierManager, index: int, sha256: Digest, path: Path, found: str, source: str
) -> CopyRestore:
    """Rewrite one tier's copy from the file; journalled before the damaged copy is deleted, so
    that a crash in between leaves a trace."""
    name, tier = manager.names[index], manager.tiers[index]
    action = f"deleted the damaged copy and rewrote it from {source}"
    if found.startswith("missing: "):
        action = f"rewrote the missing copy from {source}"
    manager.journal.record(sha256, name, None, found, action)
    try:
        with contextlib.suppress(NotFound):
            tier.delete(sha256)
        info = put_file(tier, path, expected=sha256)
    except (VaultError, OSError) as error:
        failed = f"{REWRITE_FAILED}: {error}"
        manager.journal.record(sha256, name, None, found, failed)
        return CopyRestore(name, found, failed, False)
    manager.journal.place(sha256, name, size=info.size, verified=time.time())
    return CopyRestore(name, found, f"rewrote it from {source}", True)


def _hash_file(path: Path) -> ChunkList:
    try:
        return rehash(_pieces(path))
    except OSError as error:
        raise InvalidArgument(f"cannot read {path}: {error.strerror or error}") from None


def _pieces(path: Path) -> Iterator[bytes]:
    with path.open("rb", buffering=0) as file:
        while data := file.read(CHUNK_SIZE):
            yield data
