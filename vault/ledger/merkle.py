"""The ledger's Merkle tree (RFC 9162 §2.1, SHA-256): hashing, an append-only tree that answers
proofs (from memory, and for its older leaves from tiles read back a tile at a time), and the
pure functions that verify inclusion and consistency proofs."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

from vault.errors import VerificationError

HASH_SIZE: Final = 32
EMPTY_ROOT: Final = hashlib.sha256(b"").digest()

_sha256 = hashlib.sha256
_LEAF_PREFIX: Final = b"\x00"
_NODE_PREFIX: Final = b"\x01"


def leaf_hash(body: bytes) -> bytes:
    """RFC 9162 leaf hash of one entry body: SHA-256(0x00 || body)."""
    return _sha256(_LEAF_PREFIX + body).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 interior node hash: SHA-256(0x01 || left || right)."""
    return _sha256(_NODE_PREFIX + left + right).digest()


def _largest_power_of_two_below(n: int) -> int:
    """The k of RFC 9162's MTH split: the largest power of two strictly less than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


_EDGE_CACHE = 4096
# The tree height of one level 0 tile of C2SP tlog-tiles (256 leaves). A tree may keep the nodes
# below this height outside memory for whole tiles of leaves, and read them back a tile at a time.
STRATUM: Final = 8
TILE_LEAVES: Final = 1 << STRATUM
_TILE_CACHE = 256

# `lower(t)`: candidates, best first, for the 256 leaf hashes (concatenated) of leaves 256 × t to
# 256 × t + 255; the tree takes the first whose subtree root is its own node of height 8.
LowerLeaves = Callable[[int], Iterable[bytes]]
# The height, inside a level 0 tile, of the nodes a `TileNodes` keeps: 16 a tile.
INNER: Final = 4
INNER_NODES: Final = 1 << (STRATUM - INNER)


class TileNodes(Protocol):
    """Where a tree may find, for a level 0 tile it let go of, that tile's 16 nodes of height
    4 (concatenated), so that an inclusion proof hashes 30 nodes rather than the tile's 255.
    Unchecked: the tree checks what it is given against its node of height 8, and tells
    `suspect` of a tile whose nodes did not check."""

    def get(self, tile: int) -> bytes | None: ...

    def suspect(self, tile: int) -> None: ...


class MerkleTree:
    """An append-only Merkle tree over leaf hashes that answers roots and proofs.

    Level 0 holds the leaf hashes; level k holds the roots of the complete perfect subtrees of
    2**k leaves, all as 32-byte hashes concatenated in one bytearray per level (about 64 bytes
    per leaf in all). Any root or proof is assembled from O(log n) stored nodes.

    A tree can let go of the nodes below height 8 of its first leaves, a multiple of 256 of them
    (`resume`, `retire`): those are read back a tile at a time from `lower`, each tile checked
    against the node of height 8 kept for it, so that memory holds about a byte for every four
    leaves let go.

    One thread may append (or retire) while others read: `size` is published only once every
    level has been updated, and the levels a reader uses are taken with the first leaf they
    start at, as one value, after the size.
    """

    __slots__ = ("_cache", "_cache_lock", "_edges", "_inner", "_lower", "_size", "_state")

    def __init__(self, leaf_hashes: Iterable[bytes] = ()) -> None:
        # (the first leaf whose nodes below STRATUM are in memory, the levels): level k < STRATUM
        # starts at node base >> k, every level from STRATUM up at node 0.
        self._state: tuple[int, list[bytearray]] = (0, [bytearray()])
        self._size = 0
        self._edges: dict[tuple[int, int], bytes] = {}
        self._lower: LowerLeaves | None = None
        self._inner: TileNodes | None = None
        self._cache: OrderedDict[int, list[bytes]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.extend(leaf_hashes)

    @classmethod
    def resume(
        cls, size: int, stratum: bytes, lower: LowerLeaves, inner: TileNodes | None = None
    ) -> MerkleTree:
        """The tree of `size` leaves, a multiple of 256, from its nodes of height 8 alone
        (`stratum`, concatenated); the nodes below are read from `lower` (and `inner`) when
        needed."""
        if size % TILE_LEAVES or len(stratum) != (size >> STRATUM) * HASH_SIZE:
            raise ValueError(
                f"a tree of {size} leaves resumes from {size >> STRATUM} nodes of height "
                f"{STRATUM} ({len(stratum) // HASH_SIZE} given)"
            )
        tree = cls()
        if not size:
            return tree
        levels = [bytearray() for _ in range(STRATUM)] + [bytearray(stratum)]
        _grow(levels, STRATUM, 0, size)
        tree._lower = lower
        tree._inner = inner
        tree._state = (size, levels)
        tree._size = size
        return tree

    @property
    def size(self) -> int:
        return self._size

    @property
    def base(self) -> int:
        """The first leaf whose nodes below height 8 are held in memory."""
        return self._state[0]

    def __len__(self) -> int:
        return self._size

    def append(self, leaf_hash: bytes) -> None:
        if len(leaf_hash) != HASH_SIZE:
            raise ValueError(f"a leaf hash is {HASH_SIZE} bytes, found {len(leaf_hash)}")
        _, levels = self._state
        node = bytes(leaf_hash)
        levels[0] += node
        # Each trailing zero bit of the new size completes one more perfect subtree. Its left
        # half is in memory: below STRATUM, a pair never straddles the first leaf held, which
        # is a multiple of 256.
        count = self._size + 1
        level = 0
        while not count & 1:
            node = _sha256(_NODE_PREFIX + levels[level][-64:-32] + node).digest()
            level += 1
            if level == len(levels):
                levels.append(bytearray())
            levels[level] += node
            count >>= 1
        self._size += 1

    def extend(self, leaf_hashes: Iterable[bytes]) -> None:
        """Append many leaf hashes at once, a level at a time (the fast path for loading)."""
        hashes = leaf_hashes if isinstance(leaf_hashes, list) else list(leaf_hashes)
        if not hashes:
            return
        if set(map(len, hashes)) != {HASH_SIZE}:
            bad = next(h for h in hashes if len(h) != HASH_SIZE)
            raise ValueError(f"a leaf hash is {HASH_SIZE} bytes, found {len(bad)}")
        base, levels = self._state
        old = self._size
        new = old + len(hashes)
        levels[0] += b"".join(hashes)
        _grow(levels, 0, old, new, base)
        self._size = new

    def retire(self, upto: int, lower: LowerLeaves, inner: TileNodes | None = None) -> int:
        """Let go of the nodes below height 8 of the leaves under `upto` (rounded down to a
        multiple of 256), which `lower` can give back; returns the first leaf still held whole.
        The caller keeps appends out meanwhile."""
        base, levels = self._state
        new_base = (min(upto, self._size) >> STRATUM) << STRATUM
        if new_base <= base:
            return base
        kept = [
            bytearray(levels[k][((new_base >> k) - (base >> k)) * HASH_SIZE :])
            for k in range(STRATUM)
        ]
        self._lower = lower
        self._inner = inner
        self._state = (new_base, kept + levels[STRATUM:])
        return new_base

    def leaf(self, index: int) -> bytes:
        if not 0 <= index < self._size:
            raise ValueError(f"no leaf {index}: the tree has {self._size} leaves")
        return self._node(0, index)

    def nodes(self, height: int, start: int, end: int) -> bytes:
        """The roots of the perfect subtrees of 2**height leaves numbered `start` to `end` - 1,
        concatenated: at height 0 the leaf hashes (the hashes a tile lists)."""
        if height < 0 or not 0 <= start <= end or end << height > self._size:
            raise ValueError(
                f"no nodes {start} to {end} of height {height}: the tree has {self._size} leaves"
            )
        base, levels = self._state
        first = base >> height if height < STRATUM else 0
        if start >= first:
            return bytes(levels[height][(start - first) * HASH_SIZE : (end - first) * HASH_SIZE])
        return b"".join(self._node(height, index) for index in range(start, end))

    def root(self, size: int | None = None) -> bytes:
        """The root of the tree of the first `size` leaves (default: all of them)."""
        if size is None:
            size = self._size
        elif not 0 <= size <= self._size:
            raise ValueError(f"no root for size {size}: the tree has {self._size} leaves")
        if size == 0:
            return EMPTY_ROOT
        return self._subtree_root(0, size)

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        """RFC 9162 §2.1.3.1 PATH(index, D[0:size]), deepest sibling first."""
        if not 0 <= size <= self._size:
            raise ValueError(f"no tree of size {size}: the tree has {self._size} leaves")
        if not 0 <= index < size:
            raise ValueError(f"no leaf {index} in a tree of size {size}")
        # Bottom up, one level at a time: the sibling of the path's node at each level, which
        # is a stored perfect subtree, or the tree's ragged right edge (a cached range root), or
        # absent when the path's node is the level's last and is carried up as it is.
        path: list[bytes] = []
        # A leaf of a tile let go of: its siblings below height 8, from the tile's inner nodes,
        # when the tree of `size` leaves holds the whole tile (else some are ragged edges).
        within = self._tile_path(index) if self._whole_tile_let_go(index, size) else None
        node, last, level = index, size - 1, 0
        while last:
            sibling = node ^ 1
            if within is not None and level < STRATUM:
                path.append(within[level])  # a full tile: every sibling in it is complete
            elif sibling < last or (sibling == last and (sibling + 1) << level <= size):
                path.append(self._node(level, sibling))
            elif sibling == last:
                path.append(self._subtree_root(sibling << level, size))
            node >>= 1
            last >>= 1
            level += 1
        return path

    def inclusion_proofs(self, indexes: Iterable[int], size: int) -> dict[int, tuple[bytes, ...]]:
        """`inclusion_proof` of each of `indexes` in the tree of `size` leaves, by index. Paths
        that meet share every node above where they meet, so each node is read (or hashed) once
        for the whole batch, and the part of the paths above a node is one tuple they share:
        a batch of n leaves costs about n × (height - log2 n) + n steps, not n × height."""
        if not 0 <= size <= self._size:
            raise ValueError(f"no tree of size {size}: the tree has {self._size} leaves")
        wanted = set(indexes)
        if not wanted:
            return {}
        if min(wanted) < 0 or max(wanted) >= size:
            bad = min(wanted) if min(wanted) < 0 else max(wanted)
            raise ValueError(f"no leaf {bad} in a tree of size {size}")
        if len(wanted) == 1:  # a single look-up's: nothing to share
            (index,) = wanted
            return {index: tuple(self.inclusion_proof(index, size))}
        base, levels = self._state
        alone = self._alone(wanted, size)
        height = (size - 1).bit_length()
        # The nodes on the paths at each height, bottom up.
        on_paths: list[set[int]] = []
        nodes = wanted.difference(alone)
        for level in range(height):
            if level == STRATUM and alone:
                nodes = nodes | {index >> STRATUM for index in alone}
            on_paths.append(nodes)
            nodes = {node >> 1 for node in nodes}
        # Top down: the path from each node on a path at this height up to the root.
        paths: dict[int, tuple[bytes, ...]] = {0: ()}
        at_stratum = paths
        last_leaf = size - 1
        for level in range(height - 1, -1, -1):
            last = last_leaf >> level
            first = base >> level if level < STRATUM else 0
            held = levels[level] if level < len(levels) else b""
            above, paths = paths, {}
            for node in on_paths[level]:
                rest = above[node >> 1]
                sibling = node ^ 1
                if sibling < last or (sibling == last and (sibling + 1) << level <= size):
                    if sibling >= first:
                        at = (sibling - first) * HASH_SIZE
                        paths[node] = (bytes(held[at : at + HASH_SIZE]), *rest)
                    else:
                        paths[node] = (self._node(level, sibling), *rest)
                elif sibling == last:
                    paths[node] = (self._subtree_root(sibling << level, size), *rest)
                else:  # the level's last node, carried up as it is
                    paths[node] = rest
            if level == STRATUM:
                at_stratum = paths
        for index, path in alone.items():
            paths[index] = (*path, *at_stratum[index >> STRATUM])
        return paths

    def multiproof(self, indexes: Iterable[int], size: int) -> list[bytes]:
        """The nodes that prove the leaves at `indexes` in the tree of `size` leaves together:
        at each height from the leaves up, left to right, the sibling of each node on a leaf's
        path that is neither on a path itself nor missing (a level's last node, carried up as
        it is). `verify_multiproof` takes them back. A batch of n leaves costs about
        n × (height - log2 n) nodes, where their inclusion proofs hold n × height."""
        if not 0 <= size <= self._size:
            raise ValueError(f"no tree of size {size}: the tree has {self._size} leaves")
        wanted = set(indexes)
        if not wanted:
            return []
        if min(wanted) < 0 or max(wanted) >= size:
            bad = min(wanted) if min(wanted) < 0 else max(wanted)
            raise ValueError(f"no leaf {bad} in a tree of size {size}")
        base, levels = self._state
        # The siblings below height 8 of a leaf alone in its tile come from the tile's path.
        alone = {index >> STRATUM: path for index, path in self._alone(wanted, size).items()}
        nodes: list[bytes] = []
        on_path = wanted
        for level in range((size - 1).bit_length()):
            last = (size - 1) >> level
            first = base >> level if level < STRATUM else 0
            held = levels[level] if level < len(levels) else b""
            for sibling in sorted({node ^ 1 for node in on_path}.difference(on_path)):
                if sibling > last:
                    continue  # the path's node is the level's last: carried up
                if level < STRATUM and alone and sibling >> (STRATUM - level) in alone:
                    nodes.append(alone[sibling >> (STRATUM - level)][level])
                elif sibling == last and (sibling + 1) << level > size:
                    nodes.append(self._subtree_root(sibling << level, size))
                elif sibling >= first:
                    at = (sibling - first) * HASH_SIZE
                    nodes.append(bytes(held[at : at + HASH_SIZE]))
                else:
                    nodes.append(self._node(level, sibling))
            on_path = {node >> 1 for node in on_path}
        return nodes

    def _alone(self, wanted: set[int], size: int) -> dict[int, list[bytes]]:
        """Each of `wanted` that is the batch's only leaf of a whole tile let go of and not
        cached, with its siblings below height 8 from the tile's inner nodes (30 hashes
        rather than the tile's 255)."""
        alone: dict[int, list[bytes]] = {}
        if self._inner is not None and min(wanted) < self._state[0]:
            tiles = Counter(index >> STRATUM for index in wanted if index < self._state[0])
            for index in wanted:
                if tiles.get(index >> STRATUM) == 1 and self._whole_tile_let_go(index, size):
                    path = self._tile_path(index)
                    if path is not None:
                        alone[index] = path
        return alone

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        """RFC 9162 §2.1.4.1 PROOF(old_size, D[0:new_size]); empty when old_size is 0 or equal."""
        if not 0 <= new_size <= self._size:
            raise ValueError(f"no tree of size {new_size}: the tree has {self._size} leaves")
        if not 0 <= old_size <= new_size:
            raise ValueError(f"no consistency proof from size {old_size} to size {new_size}")
        if old_size in (0, new_size):
            return []
        proof: list[bytes] = []
        start, m, n, whole = 0, old_size, new_size, True
        while m != n:
            k = _largest_power_of_two_below(n)
            if m <= k:
                proof.append(self._subtree_root(start + k, start + n))
                n = k
            else:
                proof.append(self._subtree_root(start, start + k))
                start, m, n, whole = start + k, m - k, n - k, False
        if not whole:
            proof.append(self._subtree_root(start, start + n))
        proof.reverse()
        return proof

    def _node(self, level: int, index: int) -> bytes:
        base, levels = self._state
        first = base >> level if level < STRATUM else 0
        if index >= first:
            at = (index - first) * HASH_SIZE
            return bytes(levels[level][at : at + HASH_SIZE])
        tile = index >> (STRATUM - level)
        at = (index - (tile << (STRATUM - level))) * HASH_SIZE
        return self._tile_levels(tile)[level][at : at + HASH_SIZE]

    def _whole_tile_let_go(self, index: int, size: int) -> bool:
        """Whether leaf `index` is in a level 0 tile the tree let go of, all of whose leaves
        the tree of `size` leaves holds."""
        return index < self._state[0] and ((index >> STRATUM) + 1) << STRATUM <= size

    def _tile_path(self, index: int) -> list[bytes] | None:
        """The siblings below height 8 of leaf `index`, in a tile let go of, from the tile's
        inner nodes and the 16 leaves of its group, both checked; None when the tile's levels
        are cached (cheaper), or the inner nodes are missing or do not check."""
        inner = self._inner
        if inner is None or self._lower is None:
            return None
        tile, offset = index >> STRATUM, index & (TILE_LEAVES - 1)
        with self._cache_lock:
            if tile in self._cache:
                return None
        nodes = inner.get(tile)
        if nodes is None or len(nodes) != INNER_NODES * HASH_SIZE:
            return None
        leaves = next(iter(self._lower(tile)), None)
        if leaves is None or len(leaves) != TILE_LEAVES * HASH_SIZE:
            return None
        group, at = offset >> INNER, offset & (INNER_NODES - 1)
        span = INNER_NODES * HASH_SIZE
        below = _levels(leaves[group * span : (group + 1) * span])
        above = _levels(nodes)
        held = nodes[group * HASH_SIZE : (group + 1) * HASH_SIZE]
        if below[-1] != held or above[-1] != self._node(STRATUM, tile):
            inner.suspect(tile)
            return None
        path = []
        for levels, position in ((below, at), (above, group)):
            for level in levels[:-1]:
                sibling = position ^ 1
                path.append(level[sibling * HASH_SIZE : (sibling + 1) * HASH_SIZE])
                position >>= 1
        return path

    def _tile_levels(self, tile: int) -> list[bytes]:
        """The nodes below height 8 of the leaves of level 0 tile `tile`, a level a list item,
        from the first candidate `lower` gives that hashes to the node of height 8 held."""
        with self._cache_lock:
            found = self._cache.get(tile)
            if found is not None:
                self._cache.move_to_end(tile)
                return found
        assert self._lower is not None
        expected = self._node(STRATUM, tile)
        for candidate in self._lower(tile):
            if len(candidate) != TILE_LEAVES * HASH_SIZE:
                continue
            levels = [bytes(candidate)]
            for _ in range(STRATUM):
                below = levels[-1]
                levels.append(
                    b"".join(
                        _sha256(_NODE_PREFIX + below[i : i + 64]).digest()
                        for i in range(0, len(below), 64)
                    )
                )
            if levels.pop() == expected:
                with self._cache_lock:
                    self._cache[tile] = levels
                    if len(self._cache) > _TILE_CACHE:
                        self._cache.popitem(last=False)
                return levels
        first = tile * TILE_LEAVES
        raise VerificationError(
            f"the leaf hashes of entries {first} to {first + TILE_LEAVES - 1} do not hash to "
            "the tree's node over them",
            index=first,
        )

    def _subtree_root(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) for a range that is a node of the tree: `start` is a multiple of
        the smallest power of two >= end - start, so the range splits into stored perfect
        subtrees whose sizes are the set bits of its length, largest first."""
        length = end - start
        if not length & (length - 1):
            return self._node(length.bit_length() - 1, start >> (length.bit_length() - 1))
        # A range's root never changes once its leaves exist, and proofs against one tree size
        # share the same few right-edge ranges: remember them.
        cached = self._edges.get((start, end))
        if cached is not None:
            return cached
        parts: list[bytes] = []
        position = start
        while length:
            level = length.bit_length() - 1
            parts.append(self._node(level, position >> level))
            position += 1 << level
            length -= 1 << level
        node = parts.pop()
        while parts:
            node = _sha256(_NODE_PREFIX + parts.pop() + node).digest()
        if len(self._edges) >= _EDGE_CACHE:
            self._edges.clear()
        self._edges[(start, end)] = node
        return node


def _grow(levels: list[bytearray], level: int, old: int, new: int, base: int = 0) -> None:
    """Add to `levels` (level k < STRATUM starting at node base >> k) the nodes from height
    `level` + 1 up that leaves `old` to `new` - 1 complete, given those at height `level`."""
    sha, prefix = _sha256, _NODE_PREFIX
    while new >> (level + 1):
        if level + 1 == len(levels):
            levels.append(bytearray())
        first = base >> level if level < STRATUM else 0
        start = ((old >> (level + 1)) * 2 - first) * HASH_SIZE
        end = ((new >> (level + 1)) * 2 - first) * HASH_SIZE
        below = bytes(levels[level][start:end])
        levels[level + 1] += b"".join(
            [sha(prefix + below[i : i + 64]).digest() for i in range(0, end - start, 64)]
        )
        level += 1


class CompactRange:
    """The root of a growing ledger from one pass over its leaf hashes, in O(log n) memory.

    The stack holds the roots of the perfect subtrees that make up the leaves so far, largest
    first: one per set bit of `size`.
    """

    __slots__ = ("_size", "_stack")

    def __init__(self) -> None:
        self._stack: list[bytes] = []
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def append(self, leaf_hash: bytes) -> None:
        if len(leaf_hash) != HASH_SIZE:
            raise ValueError(f"a leaf hash is {HASH_SIZE} bytes, found {len(leaf_hash)}")
        n = self._size
        self._size = n + 1
        stack = self._stack
        # Each trailing one bit of the old size is a subtree the new leaf completes.
        while n & 1:
            leaf_hash = _sha256(_NODE_PREFIX + stack.pop() + leaf_hash).digest()
            n >>= 1
        stack.append(leaf_hash)

    def extend(self, leaf_hashes: Iterable[bytes]) -> None:
        """`append` each of these, in order."""
        n = self._size
        stack = self._stack
        sha256, prefix = _sha256, _NODE_PREFIX
        for node in leaf_hashes:
            if len(node) != HASH_SIZE:
                raise ValueError(f"a leaf hash is {HASH_SIZE} bytes, found {len(node)}")
            m = n
            n += 1
            while m & 1:
                node = sha256(prefix + stack.pop() + node).digest()
                m >>= 1
            stack.append(node)
        self._size = n

    def root(self) -> bytes:
        return self.root_with(())

    def nodes(self) -> tuple[bytes, ...]:
        """The roots of the perfect subtrees that make up the leaves so far, largest first."""
        return tuple(self._stack)

    def root_with(self, nodes: Sequence[bytes]) -> bytes:
        """The root of these leaves followed by those of another range whose `nodes` these
        are, which starts where this one ends: its size must be at most the lowest set bit
        of this one's size (any size when this one is empty), as a chunk's range is when chunks
        start at multiples of a power of two no smaller than any chunk."""
        stack = [*self._stack, *nodes]
        if not stack:
            return EMPTY_ROOT
        node = stack[-1]
        for left in reversed(stack[:-1]):
            node = _sha256(_NODE_PREFIX + left + node).digest()
        return node

    def join(self, nodes: Sequence[bytes], size: int) -> None:
        """Append the leaves of another range of `size` leaves whose `nodes` these are, which
        starts where this one ends, on the same condition as `root_with`."""
        if self._size and size > self._size & -self._size:
            raise ValueError(f"a range of {size} leaves does not join one of {self._size}")
        heights = [h for h in range(size.bit_length() - 1, -1, -1) if size >> h & 1]
        if len(heights) != len(nodes):
            raise ValueError(f"a range of {size} leaves has {len(heights)} nodes, not {len(nodes)}")
        stack = self._stack
        for height, node in zip(heights, nodes, strict=True):
            n = self._size >> height
            self._size += 1 << height
            # As in `append`, one subtree of this height at a time.
            while n & 1:
                node = _sha256(_NODE_PREFIX + stack.pop() + node).digest()
                n >>= 1
            stack.append(node)


def _check_hash(value: bytes, what: str, index: int | None = None) -> None:
    if not isinstance(value, bytes | bytearray) or len(value) != HASH_SIZE:
        found = len(value) if isinstance(value, bytes | bytearray) else type(value).__name__
        raise VerificationError(f"{what} must be {HASH_SIZE} bytes, found {found}", index=index)


def _check_size(value: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise VerificationError(f"{what} must be a non-negative integer, found {value!r}")


def root_from_inclusion(leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes]) -> bytes:
    """The root that an inclusion proof leads to (RFC 9162 §2.1.3.2 steps 1 to 4 and the
    length check of step 5); `verify_inclusion` compares it with the expected root."""
    _check_size(index, "leaf index")
    _check_size(size, "tree size")
    _check_hash(leaf_hash, f"leaf hash of index {index}", index)
    where = f"inclusion proof for index {index} in tree size {size}"
    if index >= size:
        raise VerificationError(
            f"{where}: index is not below the tree size (RFC 9162 §2.1.3.2 step 1)", index=index
        )
    fn, sn = index, size - 1
    node = bytes(leaf_hash)
    for used, sibling in enumerate(proof):
        _check_hash(sibling, f"{where}: hash {used}", index)
        if sn == 0:
            raise VerificationError(
                f"{where}: has {len(proof)} hashes but a valid proof has {used} "
                "(RFC 9162 §2.1.3.2 step 4a)",
                index=index,
            )
        if fn & 1 or fn == sn:
            node = _sha256(_NODE_PREFIX + sibling + node).digest()
            while fn and not fn & 1:
                fn >>= 1
                sn >>= 1
        else:
            node = _sha256(_NODE_PREFIX + node + sibling).digest()
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerificationError(
            f"{where}: has only {len(proof)} hashes, too few to reach the root "
            "(RFC 9162 §2.1.3.2 step 5)",
            index=index,
        )
    return node


def verify_inclusion(
    leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes
) -> None:
    """Check that `leaf_hash` is leaf `index` of the tree of `size` leaves whose root is `root`
    (RFC 9162 §2.1.3.2). Raises VerificationError naming the step that failed."""
    _check_hash(root, f"root of tree size {size}", index)
    computed = root_from_inclusion(leaf_hash, index, size, proof)
    if computed != root:
        raise VerificationError(
            f"inclusion proof for index {index} in tree size {size} leads to root "
            f"{computed.hex()}, not the expected {bytes(root).hex()} (RFC 9162 §2.1.3.2 step 5)",
            index=index,
        )


def verify_multiproof(
    leaves: dict[int, bytes], size: int, nodes: Sequence[bytes], root: bytes
) -> dict[int, list[bytes]]:
    """Check that the leaves (index to leaf hash) are in the tree of `size` leaves with root
    `root`, by the nodes `MerkleTree.multiproof` gives for them, and return each one's
    inclusion proof (RFC 9162 §2.1.3.1 PATH, deepest sibling first) made of those nodes and
    the ones hashed on the way. Each node of the tree above the leaves is hashed once. Raises
    VerificationError if a leaf lies outside the tree, the nodes are too few or too many, or
    they lead to another root."""
    _check_size(size, "tree size")
    _check_hash(root, f"root of tree size {size}")
    where = f"the shared inclusion proof of {len(leaves)} entries in tree size {size}"
    outside = [index for index in leaves if not 0 <= index < size]
    if outside:
        raise VerificationError(f"{where}: no leaf {outside[0]} in the tree", index=outside[0])
    height = (size - 1).bit_length() if size else 0
    # The known nodes of each height: the leaves, the proof's nodes and those hashed from them.
    known: list[dict[int, bytes]] = [dict(leaves)]
    used = 0
    for level in range(height):
        last = (size - 1) >> level
        here = known[level]
        wanted = sorted({node ^ 1 for node in here if node ^ 1 <= last}.difference(here))
        if used + len(wanted) > len(nodes):
            raise VerificationError(f"{where}: it has {len(nodes)} nodes, too few")
        for sibling in wanted:
            given = nodes[used]
            _check_hash(given, f"node {used} of {where}")
            here[sibling] = bytes(given)
            used += 1
        above: dict[int, bytes] = {}
        for place in here:
            parent = place >> 1
            if parent in above:
                continue
            left = parent << 1
            if left + 1 > last:
                above[parent] = here[left]
            else:
                above[parent] = _sha256(_NODE_PREFIX + here[left] + here[left + 1]).digest()
        known.append(above)
    if used != len(nodes):
        raise VerificationError(f"{where}: it has {len(nodes)} nodes, {used} were needed")
    if leaves and known[height][0] != root:
        raise VerificationError(
            f"{where} leads to root {known[height][0].hex()}, not the expected {root.hex()}"
        )
    paths: dict[int, list[bytes]] = {}
    for index in leaves:
        path = []
        for level in range(height):
            sibling = (index >> level) ^ 1
            if sibling <= (size - 1) >> level:
                path.append(known[level][sibling])
        paths[index] = path
    return paths


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> None:
    """Check that the tree of `new_size` leaves with root `new_root` extends the tree of
    `old_size` leaves with root `old_root` (RFC 9162 §2.1.4.2).

    The RFC algorithm covers 0 < old_size < new_size. Outside it the proof must be empty: equal
    sizes need equal roots, and every tree extends the empty one. Raises VerificationError
    naming the step that failed."""
    _check_size(old_size, "old tree size")
    _check_size(new_size, "new tree size")
    _check_hash(old_root, f"root of tree size {old_size}")
    _check_hash(new_root, f"root of tree size {new_size}")
    where = f"consistency proof from tree size {old_size} to {new_size}"
    if old_size > new_size:
        raise VerificationError(f"{where}: the old tree is larger than the new one")
    if old_size == new_size:
        if proof:
            raise VerificationError(
                f"{where}: the sizes are equal, so the proof must be empty, "
                f"found {len(proof)} hashes"
            )
        if old_root != new_root:
            raise VerificationError(
                f"{where}: the sizes are equal but the roots differ "
                f"({bytes(old_root).hex()} and {bytes(new_root).hex()})"
            )
        return
    if old_size == 0:
        if proof:
            raise VerificationError(
                f"{where}: every tree extends the empty tree, so the proof must be empty, "
                f"found {len(proof)} hashes"
            )
        if old_root != EMPTY_ROOT:
            raise VerificationError(
                f"{where}: the root of the empty tree is {EMPTY_ROOT.hex()}, "
                f"not {bytes(old_root).hex()}"
            )
        return
    for position, value in enumerate(proof):
        _check_hash(value, f"{where}: hash {position}")
    if not proof:
        raise VerificationError(f"{where}: the proof is empty (RFC 9162 §2.1.4.2 step 1)")
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, bytes(old_root))
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = bytes(path[0])
    for used, c in enumerate(path[1:], start=1):
        if sn == 0:
            raise VerificationError(
                f"{where}: has more hashes than a valid proof (RFC 9162 §2.1.4.2 step 6a, "
                f"at hash {used})"
            )
        if fn & 1 or fn == sn:
            fr = _sha256(_NODE_PREFIX + c + fr).digest()
            sr = _sha256(_NODE_PREFIX + c + sr).digest()
            while fn and not fn & 1:
                fn >>= 1
                sn >>= 1
        else:
            sr = _sha256(_NODE_PREFIX + sr + c).digest()
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerificationError(
            f"{where}: has only {len(proof)} hashes, too few to reach the new root "
            "(RFC 9162 §2.1.4.2 step 7)"
        )
    if fr != old_root:
        raise VerificationError(
            f"{where}: leads to old root {fr.hex()}, not the verified {bytes(old_root).hex()} "
            "(RFC 9162 §2.1.4.2 step 7)"
        )
    if sr != new_root:
        raise VerificationError(
            f"{where}: leads to new root {sr.hex()}, not the presented {bytes(new_root).hex()} "
            "(RFC 9162 §2.1.4.2 step 7)"
        )


def _levels(nodes: bytes) -> list[bytes]:
    """`nodes` (16 concatenated hashes: a group of leaves, or a tile's nodes of height 4) and
    each level above them, up to their one root."""
    levels = [nodes]
    while len(levels[-1]) > HASH_SIZE:
        below = levels[-1]
        levels.append(
            b"".join(
                _sha256(_NODE_PREFIX + below[i : i + 2 * HASH_SIZE]).digest()
                for i in range(0, len(below), 2 * HASH_SIZE)
            )
        )
    return levels


def items_root(items: Iterable[bytes]) -> bytes:
    """The RFC 9162 Merkle tree hash MTH(D) of the data items `items`, in order, each hashed
    as a leaf (SHA-256(0x00 || item)) and the leaves joined exactly as the ledger's entries
    are. Over a blob's chunk hashes it is the blob's chunk root, which a pin records so that
    one range can be verified against the signed ledger without the rest of the blob."""
    sha256 = _sha256
    level = [sha256(_LEAF_PREFIX + item).digest() for item in items]
    if not level:
        return EMPTY_ROOT
    # Level by level from the leaves, a level's last node carried up alone when it has no
    # sibling: the same tree as RFC 9162's split at the largest power of two, in one list
    # comprehension a level rather than a call a leaf.
    while (count := len(level)) > 1:
        up = [sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, count - 1, 2)]
        if count & 1:
            up.append(level[-1])
        level = up
    return level[0]
