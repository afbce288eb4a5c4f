"""Ranges of a blob verified alone, against what the signed ledger says of the blob.

A pin may record its first subject's chunk root (`chunk-root`: the RFC 9162 Merkle tree hash,
the ledger's own, over the BLAKE3 of each 1 MiB chunk of the blob), which the vault checks
against the blob it holds before it appends the pin. A reader that has proved such a pin
fetches the blob's chunk hashes (32 bytes a chunk: 128 KiB for 4 GiB), checks that they hash to
that root, and then fetches only the chunks a range covers, each checked against its hash. The
server's chunk hashes alone are bound to nothing signed (a hostile server could change a byte
and send the hash of the changed chunk); through the root they are bound to the digest by an
entry every client can prove and every auditor sees."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import blake3

from vault.client.channel import rpc_errors
from vault.client.reader import answer_header, read_chunk_hashes
from vault.client.results import BlobInfo, ProvenEntry
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument
from vault.ledger.merkle import items_root
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

# The store's chunk size (vault.store.chunks.CHUNK_SIZE, which the client does not import): a
# chunk root is taken over chunks of this size, and a chunk list in any other is not the one it
# names.
CHUNK_SIZE: Final = 1 << 20
# The metadata key of a pin that records its first subject's chunk root, in lowercase hex.
CHUNK_ROOT: Final = "chunk-root"
_ROOT_TEXT: Final = re.compile(r"[0-9a-f]{64}")
# Chunks a reader of random ranges keeps, so that reads close together (a Parquet footer read in
# a few pieces) fetch each chunk once.
KEPT_CHUNKS: Final = 4


def chunk_root(hashes: Iterable[bytes]) -> bytes:
    """The chunk root of a blob whose chunk hashes (BLAKE3 of each 1 MiB chunk) these are."""
    return items_root(hashes)


def parse_root(text: str) -> bytes | None:
    """A `chunk-root` value as 32 bytes, or None if it is not 64 lowercase hex digits."""
    return bytes.fromhex(text) if _ROOT_TEXT.fullmatch(text) else None


class ChunkRootHasher:
    """The BLAKE3 of each 1 MiB chunk of a stream of bytes, fed in pieces of any size, and the
    chunk root over them: what a put computes of the bytes it sends."""

    def __init__(self) -> None:
        self.size = 0
        self._hashes: list[bytes] = []
        self._partial = blake3.blake3()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        """Hash the next `data` of the stream."""
        view = memoryview(data)
        total, position = len(view), 0
        while position < total:
            take = min(total - position, CHUNK_SIZE - self._filled)
            piece = view[position : position + take]
            if take == CHUNK_SIZE:
                self._hashes.append(blake3.blake3(piece).digest())
            else:
                self._partial.update(piece)
                self._filled += take
                if self._filled == CHUNK_SIZE:
                    self._hashes.append(self._partial.digest())
                    self._partial.reset()
                    self._filled = 0
            position += take
        self.size += total

    def root(self) -> bytes:
        """The chunk root of everything hashed so far."""
        hashes = list(self._hashes)
        if self._filled:
            hashes.append(self._partial.digest())
        return chunk_root(hashes)


def signed_root(wanted: Digest, pins: Sequence[ProvenEntry]) -> bytes | None:
    """The chunk root that the verified pins whose first subject is `wanted` record, if they
    record one and all agree; None otherwise (no pin records one, two disagree, or one is
    malformed), and the caller verifies the whole blob instead. A second root appended for the
    same digest, by a server honest or not, is seen here and only costs the shortcut."""
    found: set[str] = set()
    for proven in pins:
        entry = proven.entry
        text = entry.meta.get(CHUNK_ROOT)
        if text is not None and not entry.external and entry.subjects[:1] == (str(wanted),):
            found.add(text)
    if len(found) != 1:
        return None
    return parse_root(found.pop())


@dataclass(frozen=True, slots=True)
class VerifiedChunks:
    """A blob's chunk hashes, once found to hash to the chunk root a verified pin of its digest
    records. `info` is the server's description; its size is bound only to within the last
    chunk (the number of hashes is bound by the root), whose length is checked when it is
    read."""

    digest: Digest
    info: BlobInfo
    root: bytes
    hashes: tuple[bytes, ...]

    def span(self, index: int) -> tuple[int, int]:
        """The byte offset and length of chunk `index`."""
        offset = index * CHUNK_SIZE
        return offset, min(CHUNK_SIZE, self.info.size - offset)

    def covering(self, offset: int, length: int | None) -> tuple[int, int, range]:
        """[offset, offset + length) as (start, count) and the chunks covering it; refused if
        it reaches beyond the blob (length None: to its end)."""
        size = self.info.size
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument(
                f"negative offset or length ({offset}, {length}) for {self.digest}"
            )
        if offset > size:
            raise InvalidArgument(
                f"offset {offset} is beyond the end of {self.digest} ({size} bytes)"
            )
        count = size - offset if length is None else length
        if offset + count > size:
            raise InvalidArgument(
                f"range {offset}+{count} is beyond the end of {self.digest} ({size} bytes)"
            )
        if not count:
            return offset, 0, range(0)
        return offset, count, range(offset // CHUNK_SIZE, (offset + count - 1) // CHUNK_SIZE + 1)

    def check(self, index: int, offset: int, data: bytes) -> None:
        """Refuse `data` unless it is chunk `index`, at its offset, hashing to its hash."""
        expected_offset, length = self.span(index)
        if offset != expected_offset:
            raise IntegrityError(
                f"{self.digest}: the vault sent the chunk at byte offset {offset} where the one "
                f"at {expected_offset} was due"
            )
        if len(data) != length or blake3.blake3(data).digest() != self.hashes[index]:
            raise IntegrityError(
                f"{self.digest}: the chunk at byte offset {offset} does not match its hash in "
                f"the chunk list whose root {self.root.hex()} the ledger records"
            )


def fetch_chunk_hashes(
    store: rpc.StoreStub, timeout: float | None, wanted: Digest, root: bytes
) -> VerifiedChunks | None:
    """The blob's chunk hashes, checked against `root` (from a verified pin); None if the
    server lists no chunk hashes (it answers with bytes: a server before chunk lists), and the
    whole blob is verified instead. IntegrityError naming the digest if they do not hash to
    `root`."""
    request = pb.GetRequest(digest=str(wanted), hashes_only=True)
    with rpc_errors():
        listed = read_chunk_hashes(store.Get(request, timeout=timeout), wanted)
    if listed is None:
        return None
    found = chunk_root(listed.hashes) if listed.chunk_size == CHUNK_SIZE else None
    if listed.info.sha256 != wanted or found != root:
        what = (
            f"chunks of {listed.chunk_size} bytes, not {CHUNK_SIZE}"
            if found is None
            else f"chunk hashes whose root is {found.hex()}"
        )
        raise IntegrityError(
            f"{wanted}: the vault listed {what}, but the ledger records chunk root {root.hex()} "
            f"for {wanted}"
        )
    return VerifiedChunks(wanted, listed.info, root, listed.hashes)


def fetch_chunks(
    store: rpc.StoreStub, timeout: float | None, chunks: VerifiedChunks, wanted: range
) -> Iterator[tuple[int, bytes]]:
    """Chunks `wanted` (consecutive) of the blob as (index, bytes), each checked against its
    verified hash before it is yielded; only those chunks are asked for."""
    if not wanted:
        return
    first, _ = chunks.span(wanted.start)
    last, length = chunks.span(wanted.stop - 1)
    request = pb.GetRequest(digest=str(chunks.digest), offset=first, length=last + length - first)
    with rpc_errors():
        call = store.Get(request, timeout=timeout)
    try:
        answer_header(call, chunks.digest)
        for index in wanted:
            with rpc_errors():
                message = next(call, None)
            if message is None:
                raise IntegrityError(
                    f"{chunks.digest}: the stream ended before the chunk at byte offset "
                    f"{chunks.span(index)[0]}"
                )
            if message.WhichOneof("part") != "chunk":
                raise IntegrityError(f"{chunks.digest}: the vault's answer to a get is garbled")
            data = message.chunk.data
            chunks.check(index, message.chunk.offset, data)
            yield index, data
    finally:
        call.cancel()


def range_answer(
    store: rpc.StoreStub,
    timeout: float | None,
    chunks: VerifiedChunks,
    offset: int,
    length: int | None,
) -> Iterator[pb.GetResponse]:
    """A verified range as the answer to a Get of it would give it (for a BlobReader): the
    header, then each covering chunk, already checked."""
    start, count, wanted = chunks.covering(offset, length)
    header = pb.GetHeader(chunk_size=CHUNK_SIZE, offset=start, length=count)
    header.blob.CopyFrom(
        pb.BlobInfo(
            sha256=str(chunks.info.sha256),
            blake3=str(chunks.info.blake3),
            size=chunks.info.size,
            stored_at=chunks.info.stored_at,
        )
    )
    yield pb.GetResponse(header=header)
    for index, data in fetch_chunks(store, timeout, chunks, wanted):
        yield pb.GetResponse(
            chunk=pb.Chunk(offset=chunks.span(index)[0], data=data, hash=chunks.hashes[index])
        )


class RangeReader:
    """Random reads of one blob verified alone: each read fetches only the chunks it covers
    that this reader does not keep (the last KEPT_CHUNKS read), every one checked against the
    verified chunk list."""

    def __init__(self, store: rpc.StoreStub, timeout: float | None, chunks: VerifiedChunks) -> None:
        self.chunks = chunks
        self._store = store
        self._timeout = timeout
        self._kept: OrderedDict[int, bytes] = OrderedDict()

    @property
    def size(self) -> int:
        """The blob's size, as the vault gives it (see VerifiedChunks)."""
        return self.chunks.info.size

    def read(self, offset: int, length: int | None = None) -> bytes:
        """The verified bytes [offset, offset + length) (to the end if length is None)."""
        start, count, wanted = self.chunks.covering(offset, length)
        held: dict[int, bytes] = {i: self._kept[i] for i in wanted if i in self._kept}
        missing = [i for i in wanted if i not in held]
        if missing:
            # Chunks kept sit at either end of a read's span at most: fetch the run between.
            fetched = fetch_chunks(
                self._store, self._timeout, self.chunks, range(missing[0], missing[-1] + 1)
            )
            for index, data in fetched:
                held[index] = data
        for index in wanted[-KEPT_CHUNKS:]:
            self._kept[index] = held[index]
            self._kept.move_to_end(index)
        while len(self._kept) > KEPT_CHUNKS:
            self._kept.popitem(last=False)
        pieces = []
        for index in wanted:
            chunk_start, _ = self.chunks.span(index)
            lo = max(start - chunk_start, 0)
            hi = min(start + count - chunk_start, len(held[index]))
            pieces.append(held[index][lo:hi])
        return b"".join(pieces)
