"""The warm tier's record: how one blob lies in a pack file (its chunks, each a zstd frame or the
raw bytes, then a self-checked trailer), and the check that a record is the one the index named."""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.errors import IntegrityError
from vault.store.chunks import ChunkList

_MAGIC: Final = b"PVWR"
_FORMAT: Final = 1
# magic, format version, 3 zero bytes, chunk count, payload length, SHA-256 of the blob
_FOOTER = struct.Struct(">4sB3xIQ32s")
_CRC_SIZE: Final = 4
_FOOTER_SIZE: Final = _FOOTER.size + _CRC_SIZE
_ENTRY_SIZE: Final = 4
# A frame table entry is the frame's stored length, with this bit set if it is a zstd frame.
ZSTD: Final = 1 << 31
LENGTH: Final = ZSTD - 1


@dataclass(frozen=True, slots=True)
class Frame:
    """One chunk as stored: where its bytes are in the pack file, and whether they are zstd."""

    offset: int
    length: int
    compressed: bool


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """Where a blob's record is: its pack file, the byte range of the whole record in it, and
    the frame of each chunk."""

    pack: Path
    offset: int
    length: int
    compression: str
    frames: tuple[Frame, ...]


def entry(frame: bytes, compressed: bool) -> int:
    """A frame's entry in the record's frame table."""
    return len(frame) | (ZSTD if compressed else 0)


def trailer_size(count: int) -> int:
    """The length of the trailer of a record of `count` chunks."""
    return count * _ENTRY_SIZE + _FOOTER_SIZE


def trailer(entries: array[int], payload: int, sha_raw: bytes) -> bytes:
    """A record's trailer: the frame table, the footer, and a CRC-32 over both."""
    table = _pack_entries(entries)
    body = table + _FOOTER.pack(_MAGIC, _FORMAT, len(entries), payload, sha_raw)
    return body + zlib.crc32(body).to_bytes(_CRC_SIZE, "big")


def check_trailer(
    trailer: bytes, chunks: ChunkList, *, pack: int, position: int, length: int
) -> array[int]:
    """The record's frame table, once the trailer is whole and names the blob the index
    says is there, in a record of `length` bytes at `position` in pack number `pack`."""
    where = f"stored copy of {chunks.sha256} is damaged: its record in pack {pack}"
    size = trailer_size(chunks.count)
    if len(trailer) != size:
        raise IntegrityError(f"{where} is cut short ({len(trailer)} of {size} trailer bytes)")
    body, crc = trailer[:-_CRC_SIZE], int.from_bytes(trailer[-_CRC_SIZE:], "big")
    if zlib.crc32(body) != crc:
        raise IntegrityError(f"{where} at byte {position} fails its trailer checksum")
    magic, version, count, payload, sha_raw = _FOOTER.unpack_from(body, len(body) - _FOOTER.size)
    if (magic, version) != (_MAGIC, _FORMAT) or sha_raw != chunks.sha256.raw:
        raise IntegrityError(
            f"{where} at byte {position} is not its record "
            f"(found magic {magic!r}, version {version}, blob sha256:{sha_raw.hex()})"
        )
    entries = _unpack_entries(body[: count * _ENTRY_SIZE]) if count == chunks.count else None
    if entries is None or payload + size != length:
        raise IntegrityError(
            f"{where} at byte {position} does not match its chunk list "
            f"({count} chunks in {payload} bytes, expected {chunks.count} chunks in "
            f"{length - size} bytes)"
        )
    return entries


def _pack_entries(entries: array[int]) -> bytes:
    if sys.byteorder == "little":
        entries = array("I", entries)
        entries.byteswap()
    return entries.tobytes()


def _unpack_entries(table: bytes) -> array[int]:
    entries = array("I", table)
    if sys.byteorder == "little":
        entries.byteswap()
    return entries


def frames(entries: array[int], position: int) -> tuple[Frame, ...]:
    """Each chunk's frame in a record at `position`, from the record's frame table."""
    found = []
    for value in entries:
        found.append(Frame(position, value & LENGTH, bool(value & ZSTD)))
        position += value & LENGTH
    return tuple(found)
