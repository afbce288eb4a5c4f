"""Reading a blob from the answer to a Get: a file-like reader that hands on only bytes checked
against their chunk hashes and, for a whole blob, against its digest; and a blob's list of chunk
hashes, which a resumed download checks the bytes it holds against."""

from __future__ import annotations

import hashlib
import io
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import blake3

from vault.client.channel import rpc_errors
from vault.client.handoff import PipedGet
from vault.client.results import BlobInfo
from vault.digest import Digest
from vault.errors import IntegrityError
from vault.wire import pinvault_pb2 as pb

_THREADED_FROM: Final = 4 << 20
# The BLAKE3-256 of a chunk.
HASH_SIZE: Final = 32


class BackgroundHash:
    """Hashes on its own thread (hashlib and blake3 release the GIL), so that receiving,
    hashing and writing overlap; the bounded queue keeps memory bounded. For fewer than
    `threaded_from` bytes, a thread costs more than it saves, and it hashes as it is fed."""

    def __init__(self, algorithm: str, size: int, threaded_from: int = _THREADED_FROM) -> None:
        self._hash: Any = hashlib.sha256() if algorithm == "sha256" else blake3.blake3()
        self._queue: queue.Queue[bytes | memoryview | None] | None = None
        self._thread: threading.Thread | None = None
        if size >= threaded_from:
            self._queue = queue.Queue(maxsize=8)
            self._thread = threading.Thread(target=self._run, name="pinvault-hash", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._queue is not None
        while (data := self._queue.get()) is not None:
            self._hash.update(data)

    def update(self, data: bytes | memoryview) -> None:
        """Hash `data` (on the thread: it must not change)."""
        if self._queue is None:
            self._hash.update(data)
        else:
            self._queue.put(data)

    def digest(self) -> bytes:
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        return bytes(self._hash.digest())


class BlobReader(io.RawIOBase):
    """A file-like view of a blob (or a range) that yields only verified bytes.

    Each chunk is checked against its chunk hash before any of it is returned; on a whole-blob
    read, the digest of everything is checked too, and reading the end raises IntegrityError
    if it does not match. `check_chunks=False` is for callers that hand nothing on before the
    end (a file that appears only once the whole digest matched); `prechecked=True` for an
    answer whose every chunk the caller checked already against a verified chunk list."""

    def __init__(
        self,
        responses: Iterator[pb.GetResponse],
        requested: Digest,
        *,
        check_chunks: bool = True,
        handed_off: int | None = None,
        prechecked: bool = False,
    ) -> None:
        super().__init__()
        self._responses = responses
        # The read end of the pipe handed to the server, which writes each chunk into it
        # instead of sending its bytes; they are checked here as if received.
        self._handed_off = handed_off
        header = answer_header(responses, requested)
        self.info = BlobInfo.from_wire(header.blob)
        self._start = header.offset
        self._end = header.offset + header.length
        self._chunk_size = header.chunk_size
        self._whole = header.offset == 0 and header.length == self.info.size
        if handed_off is not None and not self._whole:
            raise IntegrityError("the server answered a get into a handed-off file with a range")
        # A range's chunks are checked as they come, unless the caller checked each already
        # against a chunk list it verified (vault.client.ranges).
        self._check_chunks = not prechecked and (check_chunks or not self._whole)
        self._hash = BackgroundHash(requested.algorithm, header.length) if self._whole else None
        self._piped = (
            None
            if handed_off is None
            else PipedGet(
                handed_off, responses, self._start, self._end, header.chunk_size, rpc_errors
            )
        )
        self._requested = requested
        self._buffer = memoryview(b"")
        self._position = self._start
        self._done = False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        # Also run when a reader whose header failed is collected: it may have no pipe yet.
        piped = getattr(self, "_piped", None)
        if piped is not None:
            piped.close()
        super().close()

    def _next_chunk(self) -> bool:
        if self._piped is not None:
            return self._next_piped(self._piped)
        with rpc_errors():
            message = next(self._responses, None)
        if message is None:
            if self._position != self._end:
                raise IntegrityError(
                    f"{self._requested}: the stream ended at byte {self._position}, "
                    f"expected {self._end}"
                )
            if self._hash is not None and self._hash.digest() != self._requested.raw:
                raise IntegrityError(
                    f"{self._requested}: the bytes received do not match the digest"
                )
            self._done = True
            return False
        chunk = message.chunk
        data = chunk.data
        if self._check_chunks and blake3.blake3(data).digest() != chunk.hash:
            raise IntegrityError(
                f"{self._requested}: chunk at offset {chunk.offset} failed its check"
            )
        if self._hash is not None:
            self._hash.update(data)
        lo = max(self._position - chunk.offset, 0)
        hi = min(self._end - chunk.offset, len(data))
        if chunk.offset > self._position or lo > hi:
            raise IntegrityError(
                f"{self._requested}: chunk at offset {chunk.offset} is out of order"
            )
        self._buffer = memoryview(data)[lo:hi]
        self._position += hi - lo
        return True

    def _next_piped(self, piped: PipedGet) -> bool:
        """As _next_chunk, for a get whose bytes the server writes into the handed-off pipe."""
        data = piped.next_chunk()
        if data is None:
            if self._hash is not None and self._hash.digest() != self._requested.raw:
                raise IntegrityError(
                    f"{self._requested}: the bytes received do not match the digest"
                )
            self._done = True
            return False
        if self._hash is not None:
            self._hash.update(data)
        self._buffer = data
        self._position += len(data)
        return True

    def readinto(self, buffer: Any) -> int:
        """Verified bytes into `buffer`; IntegrityError for a chunk that fails its check, a
        stream cut short or, at the end of a whole blob, a digest that does not match."""
        while not self._buffer:
            if self._done or not self._next_chunk():
                return 0
        n = min(len(buffer), len(self._buffer))
        buffer[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

    def chunks(self) -> Iterator[memoryview]:
        """The verified bytes, a chunk at a time, without copying."""
        if self._buffer:
            yield self._buffer
            self._buffer = memoryview(b"")
        while not self._done and self._next_chunk():
            yield self._buffer
            self._buffer = memoryview(b"")


def answer_header(responses: Iterator[pb.GetResponse], requested: Digest) -> pb.GetHeader:
    """The header that starts the answer to a get, checked to name the blob asked for."""
    with rpc_errors():
        first = next(responses, None)
    if first is None or first.WhichOneof("part") != "header":
        raise IntegrityError("the server's answer to a get did not start with a header")
    named = BlobInfo.from_wire(first.header.blob)
    if requested not in (named.sha256, named.blake3):
        raise IntegrityError(f"asked for {requested}, the server answered with {named.sha256}")
    return first.header


@dataclass(frozen=True, slots=True)
class ChunkHashes:
    """A whole blob's chunk hashes, as the server listed them. They are the server's word
    until the bytes they check hash to the blob's digest, which the caller must check."""

    info: BlobInfo
    chunk_size: int
    hashes: tuple[bytes, ...]

    def span(self, index: int) -> tuple[int, int]:
        """The byte offset and length of chunk `index`."""
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.info.size - offset)


def read_chunk_hashes(call: Any, requested: Digest) -> ChunkHashes | None:
    """The chunk hashes of a whole blob from the answer to a Get that asked for them only;
    None (and the call cancelled) if the server answers with bytes instead: a server that
    lists no hashes."""
    header = answer_header(call, requested)
    info = BlobInfo.from_wire(header.blob)
    if header.offset != 0 or header.length != info.size or header.chunk_size <= 0:
        raise IntegrityError(
            f"{requested}: the server listed the chunks of bytes {header.offset}+{header.length} "
            f"in chunks of {header.chunk_size}, not the whole blob"
        )
    count = -(-info.size // header.chunk_size)
    hashes: list[bytes] = []
    with rpc_errors():
        for message in call:
            part = message.WhichOneof("part")
            if part == "chunk":
                call.cancel()
                return None
            if part != "hashes":
                raise IntegrityError(f"{requested}: the server's list of chunk hashes is garbled")
            listed = message.hashes
            if listed.offset != len(hashes) * header.chunk_size:
                raise IntegrityError(
                    f"{requested}: chunk hashes from offset {listed.offset} are out of order"
                )
            hashes += listed.hashes
            if len(hashes) > count or any(len(h) != HASH_SIZE for h in listed.hashes):
                raise IntegrityError(f"{requested}: the server listed malformed chunk hashes")
    if len(hashes) != count:
        raise IntegrityError(
            f"{requested}: the server listed {len(hashes)} chunk hashes, expected {count}"
        )
    return ChunkHashes(info, header.chunk_size, tuple(hashes))


def read_all(reader: BlobReader) -> bytes:
    """Everything `reader` has left, once verified (IntegrityError otherwise)."""
    return b"".join(bytes(c) for c in reader.chunks())
