"""Puts into the warm tier: a blob of one chunk becomes a record in memory for the open pack;
a larger one streams, chunk by chunk, into a record file of its own in tmp/."""

from __future__ import annotations

import contextlib
import hashlib
import os
from array import array
from typing import TYPE_CHECKING

import blake3

from tiers.copies import new_temp_file
from tiers.warm._codec import ChunkCodec
from tiers.warm._index import NewRow
from tiers.warm._record import entry, trailer
from vault.digest import Digest
from vault.files import write_all
from vault.store.chunks import CHUNK_SIZE, BlobHasher, BlobInfo, ChunkList, check_expected
from vault.store.protocol import BlobWriter

if TYPE_CHECKING:
    from tiers.warm._tier import WarmTier


class WarmWriter(BlobWriter):
    """One put into the warm tier. The first chunk is held in memory; a blob that outgrows it
    streams on, chunk by chunk, into a record file in tmp/, so memory stays bounded."""

    def __init__(self, tier: WarmTier) -> None:
        self._tier = tier
        self._buffer = bytearray()
        self._large: _LargeRecord | None = None
        self._open = True

    def write(self, data: bytes | memoryview) -> None:
        if not self._open:
            raise ValueError("write to a blob writer that was committed or aborted")
        try:
            view = memoryview(data)
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            position, total = 0, len(view)
            while position < total:
                if len(self._buffer) == CHUNK_SIZE:
                    # Another byte is coming, so the chunk held is whole.
                    self._spill()
                take = min(CHUNK_SIZE - len(self._buffer), total - position)
                self._buffer += view[position : position + take]
                position += take
        except BaseException:
            self.abort()
            raise

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        if not self._open:
            raise ValueError("commit of a blob writer that was committed or aborted")
        try:
            if self._large is None:
                put = small_put(bytes(self._buffer), expected, self._tier._codec)
                self._buffer = bytearray()
            else:
                self._spill()
                put = self._large.finish(expected)
            self._tier._submit([put])
            assert put.created is not None
            return put.chunks.info, put.created
        finally:
            self.abort()

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._buffer = bytearray()
            if self._large is not None:
                self._large.discard()

    def _spill(self) -> None:
        if self._large is None:
            self._large = _LargeRecord(self._tier)
        chunk = bytes(self._buffer)
        self._buffer.clear()
        self._large.add(chunk)


class _LargeRecord:
    """A large blob's record being written to its own file in tmp/."""

    def __init__(self, tier: WarmTier) -> None:
        self._codec = tier._codec
        self._fd, self.path = new_temp_file(tier._tmp, ".part")
        self._closed = False
        self._hasher = BlobHasher()
        self._entries = array("I")
        self._payload = 0
        self._compressed = False

    def add(self, chunk: bytes) -> None:
        self._hasher.update(chunk)
        frame, compressed = self._codec.deflate(chunk)
        write_all(self._fd, frame)
        self._entries.append(entry(frame, compressed))
        self._payload += len(frame)
        self._compressed |= compressed

    def finish(self, expected: Digest | None) -> Put:
        """Seal the record file: trailer, read-only, synced. It is moved into the archive by
        the commit that takes the returned put."""
        chunks = self._hasher.finish()
        if expected is not None:
            check_expected(expected, chunks.info)
        end = trailer(self._entries, self._payload, chunks.sha256.raw)
        write_all(self._fd, end)
        os.fchmod(self._fd, 0o444)
        os.fsync(self._fd)
        self._close()
        return Put(
            chunks,
            "zstd" if self._compressed else "none",
            temp=self.path,
            length=self._payload + len(end),
        )

    def discard(self) -> None:
        self._hasher.cancel()
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class Put:
    """One blob on its way through a group commit: either a packed record in memory or a record
    file in tmp/. `created` is set once it is committed (or found already stored), `error` if
    the commit failed, `done` once its commit is over either way."""

    __slots__ = ("chunks", "compression", "created", "done", "error", "length", "record", "temp")

    def __init__(
        self,
        chunks: ChunkList,
        compression: str,
        *,
        record: bytes = b"",
        temp: str | None = None,
        length: int = 0,
    ) -> None:
        self.chunks = chunks
        self.compression = compression
        self.record = record
        self.temp = temp
        self.length = length
        self.created: bool | None = None
        self.error: BaseException | None = None
        self.done = False

    def row(self, pack: int, position: int, length: int) -> NewRow:
        return (
            self.chunks.sha256.raw,
            pack,
            position,
            length,
            self.compression,
            self.chunks.encode(),
        )

    def discard(self) -> None:
        if self.temp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp)
            self.temp = None


def small_put(data: bytes, expected: Digest | None, codec: ChunkCodec) -> Put:
    """A blob of at most one chunk as a record in memory, for the open pack."""
    sha_raw = hashlib.sha256(data).digest()
    b3_raw = blake3.blake3(data).digest()
    # A blob of one chunk is its only chunk, so its BLAKE3 is that chunk's hash.
    chunks = ChunkList(
        CHUNK_SIZE,
        len(data),
        Digest.sha256(sha_raw),
        Digest.blake3(b3_raw),
        (b3_raw,) if data else (),
    )
    if expected is not None:
        check_expected(expected, chunks.info)
    entries = array("I")
    if data:
        frame, compressed = codec.deflate(data)
        entries.append(entry(frame, compressed))
    else:
        frame, compressed = b"", False
    record = frame + trailer(entries, len(frame), sha_raw)
    return Put(chunks, "zstd" if compressed else "none", record=record)
