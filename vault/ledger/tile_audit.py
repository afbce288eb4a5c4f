"""The check `vault verify --tiles` makes of a folder of C2SP tlog-tiles on the vault's host:
every entry bundle, hash tile and older partial tile against a signed checkpoint's root, naming
the first file that is wrong. Pure: the caller reads the files."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vault.ledger.checkpoint import Checkpoint
from vault.ledger.merkle import HASH_SIZE, MerkleTree, leaf_hash
from vault.ledger.tile_layout import (
    ENTRIES,
    TILE_HEIGHT,
    TILE_WIDTH,
    Tile,
    parse_tile_path,
    split_bundle,
    tiles_of,
)

# `read(path)`: the bytes of the file at a tile path, or None if there is none.
Read = Callable[[str], bytes | None]


@dataclass(frozen=True, slots=True)
class TileAudit:
    """What was checked, and the first file found wrong (its path and why), if any."""

    files: int
    bad: str | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.bad is None


def audit_tiles(read: Read, present: Iterable[str], checkpoint: Checkpoint) -> TileAudit:
    """Check the tiles of `checkpoint`'s tree: its entry bundles must give its root, every hash
    tile it needs must be there, and every tile file `present` (paths relative to the folder)
    within its tree must hold exactly the tree's hashes or entries."""
    size = checkpoint.size
    leaves: list[bytes] = []
    checked = 0
    for index in range((size + TILE_WIDTH - 1) // TILE_WIDTH):
        tile = Tile(ENTRIES, index, min(TILE_WIDTH, size - index * TILE_WIDTH))
        data, path = _read_tile(read, tile)
        if data is None:
            return TileAudit(checked, tile.path, "missing")
        entries = split_bundle(data)
        if entries is None or len(entries) < tile.width:
            return TileAudit(checked, path, f"not an entry bundle of {tile.width} entries")
        leaves += [leaf_hash(entry) for entry in entries[: tile.width]]
        checked += 1
    tree = MerkleTree(leaves)
    if size and tree.root(size) != checkpoint.root:
        return _bad_bundle(read, tree, size, checked)
    for tile in tiles_of(size):
        data, path = _read_tile(read, tile)
        if data is None:
            return TileAudit(checked, tile.path, "missing")
        if data[: tile.width * HASH_SIZE] != _expected(tree, tile):
            return TileAudit(checked, path, "its hashes are not the checkpoint's tree's")
    for path in sorted(present, key=_order):
        named = parse_tile_path(path)
        if named is None or (named.first + named.width) << _height(named) > size:
            continue
        tile = named
        data = read(path)
        if data is None:
            continue
        checked += 1
        if tile.level == ENTRIES:
            entries = split_bundle(data)
            got = None if entries is None else b"".join(map(leaf_hash, entries))
            if got != tree.nodes(0, tile.first, tile.first + tile.width):
                return TileAudit(checked, path, "its entries are not the checkpoint's tree's")
        elif data != _expected(tree, tile):
            return TileAudit(checked, path, "its hashes are not the checkpoint's tree's")
    return TileAudit(checked)


def _bad_bundle(read: Read, tree: MerkleTree, size: int, checked: int) -> TileAudit:
    """The entry bundles do not give the signed root: name the first that disagrees with its
    level 0 hash tile (if those give the root, the bundle is the damaged one)."""
    for index in range((size + TILE_WIDTH - 1) // TILE_WIDTH):
        width = min(TILE_WIDTH, size - index * TILE_WIDTH)
        hashes, _ = _read_tile(read, Tile(0, index, width))
        first = index * TILE_WIDTH
        if hashes is None or hashes[: width * HASH_SIZE] != tree.nodes(0, first, first + width):
            _, path = _read_tile(read, Tile(ENTRIES, index, width))
            return TileAudit(checked, path, "its entries do not give the checkpoint's root")
    return TileAudit(checked, "tile/entries", "the entry bundles do not give the checkpoint's root")


def _read_tile(read: Read, tile: Tile) -> tuple[bytes | None, str]:
    """A tile's bytes and the path they came from: its partial version, else the full tile
    (whose first hashes or entries are the same)."""
    data = read(tile.path)
    if data is None and not tile.full:
        full = Tile(tile.level, tile.index)
        return read(full.path), full.path
    return data, tile.path


def _expected(tree: MerkleTree, tile: Tile) -> bytes:
    return tree.nodes(_height(tile), tile.first, tile.first + tile.width)


def _height(tile: Tile) -> int:
    return TILE_HEIGHT * max(tile.level, 0)


def _order(path: str) -> tuple[int, int, int]:
    tile = parse_tile_path(path)
    return (-2, 0, 0) if tile is None else (tile.level, tile.index, tile.width)
