"""How the cold tier lays a blob out on S3: its index object (chunk list and chunk table,
self-checked) and its stored chunks, each raw or one zstd frame, read back window by window."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

import zstandard

from tiers import frames
from tiers.cold._crypt import OVERHEAD, ChunkSeal
from vault.digest import Digest
from vault.errors import IntegrityError
from vault.store.chunks import HASH_SIZE, Chunk, ChunkList

FORMAT: Final = "pinvault-cold-1"
DATA_FORMAT: Final = "pinvault-cold-data-1"

# One ranged GET covers at most this many stored bytes, so that a slow reader never holds a
# response open for long.
READ_WINDOW: Final = 64 << 20
# The first GET of a blob's index object asks for this much: the whole index of a blob of up
# to some 1,800 chunks, and all of a small blob kept inline.
INDEX_PROBE: Final = 64 << 10

# A chunk table entry is the chunk's stored length, with this bit set if it is a zstd frame.
COMPRESSED: Final = 1 << 31
MAGIC: Final = b"PVCO"
_VERSION: Final = 1
# magic, version, 3 zero bytes, stored size, chunk count, chunk list length, data key length,
# 6 zero bytes
HEADER = struct.Struct(">4sB3xQIIH6x")
_ENTRY = struct.Struct(">I")
_MAX_KEY: Final = 1024


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one chunk lies in the stored data, and whether it is zstd-compressed there."""

    start: int
    length: int
    compressed: bool


@dataclass(frozen=True, slots=True)
class ColdLayout:
    """How one blob is kept on the endpoint.

    `key` names the blob's index object, `blobs/sha256/<hex>` under the tier's prefix; it
    holds the chunk list and the chunk table and carries the blob's size and digests in its
    metadata. The stored chunks are the bytes from `data_offset` in object `data_key`: right
    after the index in the same object for a blob small enough to be uploaded whole, else an
    object of their own under data/.

    On an encrypted mirror (`seal` set) the index object is named by a keyed hash of the
    digest, carries no digest in its metadata and holds the index sealed (_crypt); each stored
    chunk is sealed by `seal`, which its extent's length includes.
    """

    key: str
    data_key: str
    data_offset: int
    stored_size: int
    chunks: ChunkList
    extents: tuple[Extent, ...]
    seal: ChunkSeal | None = None

    @property
    def inline(self) -> bool:
        return self.data_key == self.key

    @property
    def raw(self) -> bool:
        """Whether the data object is the blob's bytes as they are, nothing before or between
        them (a client's direct upload): its SHA-256 is then the blob's."""
        chunks = self.chunks
        return (
            self.seal is None
            and not self.inline
            and self.data_offset == 0
            and self.stored_size == chunks.size
            and all(
                not extent.compressed and (extent.start, extent.length) == chunks.span(n)
                for n, extent in enumerate(self.extents)
            )
        )


# -- the index ---------------------------------------------------------------------------------


def encode_index(chunks: ChunkList, entries: Iterable[int], data_key: str | None) -> bytes:
    """The index object's leading bytes (the whole object unless the data follows inline).

    Encoded form (integers big-endian)::

        offset   length   field
        0        4        magic b"PVCO"
        4        1        format version, 1
        5        3        zero
        8        8        stored size: the bytes of every chunk as stored
        16       4        chunk count n
        20       4        chunk list length L
        24       2        data key length K, 0 when the data follows inline
        26       6        zero
        32       K        data key (UTF-8)
        32+K     L        the encoded ChunkList
        32+K+L   4n       each chunk's stored length, top bit set when zstd-compressed
        ...      32       SHA-256 of every byte before it
    """
    table = b"".join(_ENTRY.pack(entry) for entry in entries)
    if len(table) != chunks.count * _ENTRY.size:
        raise ValueError(f"chunk table has {len(table) // 4} entries for {chunks.count} chunks")
    stored_size = sum(entry & ~COMPRESSED for entry in entries)
    key = (data_key or "").encode()
    encoded_chunks = chunks.encode()
    body = b"".join(
        (
            HEADER.pack(MAGIC, _VERSION, stored_size, chunks.count, len(encoded_chunks), len(key)),
            key,
            encoded_chunks,
            table,
        )
    )
    return body + hashlib.sha256(body).digest()


def index_length(head: bytes) -> int:
    """The length of an index from its first HEADER.size bytes."""
    count: int
    chunks_length: int
    key_length: int
    _, _, _, count, chunks_length, key_length = HEADER.unpack_from(head)
    return HEADER.size + key_length + chunks_length + count * _ENTRY.size + HASH_SIZE


def decode_index(data: bytes, sha256: Digest, key: str, *, sealed: bool = False) -> ColdLayout:
    """Parse and self-check an index (any inline data after it is ignored); `sealed`: the
    index of an encrypted copy, whose every stored chunk is OVERHEAD bytes longer."""
    overhead = OVERHEAD if sealed else 0
    where = f"index of {sha256} ({key})"
    if len(data) < HEADER.size:
        raise IntegrityError(f"{where} is damaged: only {len(data)} bytes")
    magic, version, stored_size, count, chunks_length, key_length = HEADER.unpack_from(data)
    if magic != MAGIC or version != _VERSION:
        raise IntegrityError(
            f"{where} is not a version {_VERSION} cold-tier index "
            f"(found magic {magic!r}, version {version})"
        )
    if key_length > _MAX_KEY:
        raise IntegrityError(f"{where} is damaged: data key of {key_length} bytes")
    length = index_length(data)
    if len(data) < length:
        raise IntegrityError(f"{where} is damaged: {len(data)} bytes, expected {length}")
    body, trailer = data[: length - HASH_SIZE], data[length - HASH_SIZE : length]
    if hashlib.sha256(body).digest() != trailer:
        raise IntegrityError(f"{where} is damaged: its trailing SHA-256 does not match")
    position = HEADER.size
    try:
        data_key = body[position : position + key_length].decode()
    except UnicodeDecodeError:
        raise IntegrityError(f"{where} is damaged: its data key is not UTF-8") from None
    position += key_length
    chunks = ChunkList.decode(body[position : position + chunks_length], sha256)
    position += chunks_length
    if chunks.count != count:
        raise IntegrityError(f"{where} is damaged: {count} table entries, {chunks.count} chunks")
    extents: list[Extent] = []
    start = 0
    for index in range(count):
        (entry,) = _ENTRY.unpack_from(body, position + index * _ENTRY.size)
        stored = entry & ~COMPRESSED
        compressed = bool(entry & COMPRESSED)
        expected = chunks.span(index)[1]
        payload = stored - overhead
        if payload < 0 or payload > expected or (not compressed and payload != expected):
            raise IntegrityError(
                f"{where} is damaged: chunk at byte offset {chunks.span(index)[0]} is stored "
                f"in {stored} bytes ({'compressed' if compressed else 'raw'}) "
                f"for {expected} bytes"
            )
        extents.append(Extent(start, stored, compressed))
        start += stored
    if start != stored_size:
        raise IntegrityError(
            f"{where} is damaged: chunks take {start} bytes, the header says {stored_size}"
        )
    if data_key:
        return ColdLayout(key, data_key, 0, stored_size, chunks, tuple(extents))
    return ColdLayout(key, key, length, stored_size, chunks, tuple(extents))


def check_stored_size(layout: ColdLayout, total: int) -> None:
    """IntegrityError unless the object holding the blob's data has `total` bytes as its
    layout says, naming where the object was cut short or grew."""
    expected = layout.data_offset + layout.stored_size
    if total == expected:
        return
    sha256 = layout.chunks.sha256
    if total > expected:
        raise IntegrityError(
            f"stored copy of {sha256} is damaged: object {layout.data_key} has {total} "
            f"bytes, expected {expected} (extra bytes after the chunk that ends at byte "
            f"offset {layout.chunks.size})"
        )
    cut = next(
        index
        for index, extent in enumerate(layout.extents)
        if layout.data_offset + extent.start + extent.length > total
    )
    raise IntegrityError(
        f"stored copy of {sha256} is damaged: object {layout.data_key} has {total} bytes, "
        f"expected {expected} (cut short in the chunk at byte offset "
        f"{layout.chunks.span(cut)[0]})"
    )


# -- reading stored chunks ---------------------------------------------------------------------


def windows(layout: ColdLayout, wanted: range) -> Iterator[range]:
    """`wanted` cut into runs of chunks of at most READ_WINDOW stored bytes (at least one)."""
    first = wanted.start
    size = 0
    for index in wanted:
        length = layout.extents[index].length
        if index > first and size + length > READ_WINDOW:
            yield range(first, index)
            first, size = index, 0
        size += length
    yield range(first, wanted.stop)


def unpack_window(
    layout: ColdLayout,
    window: range,
    pieces: Iterator[bytes],
    decompressor: zstandard.ZstdDecompressor,
) -> Iterator[Chunk]:
    """The chunks of `window`, each checked against the chunk list, from their stored bytes
    as they arrive in `pieces` (closed at the end)."""
    reader = _Reader(pieces)
    try:
        for index in window:
            extent = layout.extents[index]
            stored = reader.take(extent.length)
            data = _unpack(layout.chunks, index, extent, stored, decompressor, layout.seal)
            yield Chunk(layout.chunks.span(index)[0], data, layout.chunks.check(index, data))
    finally:
        reader.close()


def _unpack(
    chunks: ChunkList,
    index: int,
    extent: Extent,
    stored: bytes,
    decompressor: zstandard.ZstdDecompressor,
    seal: ChunkSeal | None = None,
) -> bytes:
    """A chunk's bytes from its stored form; IntegrityError naming the chunk if they cannot be
    had (the caller checks them against the chunk list)."""
    if len(stored) != extent.length:
        raise IntegrityError(
            f"stored copy of {chunks.sha256} is damaged: chunk at byte offset "
            f"{chunks.span(index)[0]} has {len(stored)} stored bytes, expected {extent.length}"
        )
    if seal is not None:
        stored = seal.open(
            index,
            stored,
            f"stored copy of {chunks.sha256}: chunk at byte offset {chunks.span(index)[0]}",
        )
    if not extent.compressed:
        return stored
    return frames.inflate(stored, chunks, index, decompressor)


class _Reader:
    """Exact-length reads from a stream of byte pieces."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        self._buffer = b""

    def take(self, length: int) -> bytes:
        """The next `length` bytes, or fewer if the stream ends first."""
        parts = [self._buffer[:length]]
        have = len(parts[0])
        self._buffer = self._buffer[length:]
        while have < length:
            piece = next(self._pieces, None)
            if piece is None:
                break
            need = length - have
            parts.append(piece[:need])
            have += len(parts[-1])
            self._buffer = piece[need:]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        close: Callable[[], None] | None = getattr(self._pieces, "close", None)
        if close is not None:
            close()
