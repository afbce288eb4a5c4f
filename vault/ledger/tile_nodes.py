"""The nodes of height 4 of each full level 0 tile, 16 hashes (512 bytes) a tile, in one file
beside the tiles (not among them: the tiles folder is the C2SP layout, served as it is). With
them an inclusion proof for an entry whose tile the tree let go of hashes 30 nodes (its group of
16 leaves, and the tile's 16 nodes) rather than the tile's 255.

Derived data, like the tiles: written without a sync, and never trusted. The tree checks what it
reads against its node of height 8 (`MerkleTree._tile_path`) and falls back to the whole tile; a
slot that did not check is written again by the checkpointer."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Final

from vault.ledger.merkle import HASH_SIZE, INNER_NODES

SLOT: Final = INNER_NODES * HASH_SIZE


class TileNodesFile:
    """Slot `t` of the file holds level 0 tile `t`'s nodes of height 4; slots are written in
    tile order (`filled`), and again when the tree suspects one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self._lock = threading.Lock()
        self._suspects: set[int] = set()

    @property
    def filled(self) -> int:
        """How many tiles, from the first, have a slot (written or not checked yet)."""
        return os.fstat(self._fd).st_size // SLOT

    def get(self, tile: int) -> bytes | None:
        data = os.pread(self._fd, SLOT, tile * SLOT)
        return data if len(data) == SLOT else None

    def put(self, tile: int, nodes: bytes) -> None:
        if len(nodes) != SLOT:
            raise ValueError(f"a tile has {SLOT} bytes of nodes of height 4, found {len(nodes)}")
        os.pwrite(self._fd, nodes, tile * SLOT)

    def suspect(self, tile: int) -> None:
        with self._lock:
            self._suspects.add(tile)

    def take_suspects(self) -> list[int]:
        with self._lock:
            taken = sorted(self._suspects)
            self._suspects.clear()
        return taken

    def close(self) -> None:
        os.close(self._fd)
