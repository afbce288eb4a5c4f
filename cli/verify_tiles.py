"""`vault verify --tiles DIR` on the vault's host: the tile folder the vault serves, checked
against its published checkpoint, once that is signed by the vault's key and consistent with
the checkpoint this client verified."""

from __future__ import annotations

import os
from pathlib import Path

from vault.client import VaultClient
from vault.errors import InvalidArgument, VerificationError
from vault.files import read_upto
from vault.ledger.merkle import verify_consistency
from vault.ledger.tile_audit import TileAudit, audit_tiles

# No tile file is larger than a full entry bundle of entries framed in 16 bits.
MAX_TILE_BYTES = 256 * (2 + 0xFFFF)
MAX_CHECKPOINT_BYTES = 1 << 16


def verify_tiles(client: VaultClient, folder: Path) -> tuple[int, TileAudit]:
    """The published checkpoint's size and what the check of `folder` found. InvalidArgument
    when the folder holds no tiles; VerificationError when its checkpoint is not the vault's."""
    note = _read(folder, "checkpoint", MAX_CHECKPOINT_BYTES)
    if note is None:
        raise InvalidArgument(f"{folder} holds no `checkpoint` file: is it the vault's tiles?")
    try:
        published = client.verifier().open(note.decode("utf-8"))
    except UnicodeDecodeError:
        raise VerificationError(f"{folder}/checkpoint is not a signed note") from None
    latest = client.checkpoint()
    if published.size <= latest.size:
        proof = client.consistency_proof(published.size, latest.size)
        try:
            verify_consistency(
                published.size, latest.size, published.root, latest.root, list(proof.hashes)
            )
        except VerificationError as exc:
            raise VerificationError(
                f"{folder}/checkpoint (size {published.size}) is not consistent with the "
                f"vault's checkpoint of size {latest.size}: {exc}"
            ) from None
    present = []
    for parent, _, files in os.walk(folder / "tile"):
        present += [str((Path(parent) / name).relative_to(folder)) for name in files]
    audit = audit_tiles(lambda path: _read(folder, path, MAX_TILE_BYTES), present, published)
    return published.size, audit


def _read(folder: Path, relative: str, limit: int) -> bytes | None:
    try:
        fd = os.open(folder / relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return read_upto(fd, limit)
    finally:
        os.close(fd)
