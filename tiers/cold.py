"""The cold tier: blobs on one S3 endpoint (a peer institution's mirror), each 1 MiB chunk kept
zstd-compressed where that saves space, so that any range can be fetched, decompressed and
checked without the rest of the blob. Speaks only the common S3 API, so any S3 server will do."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import secrets
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import botocore.session  # type: ignore[import-untyped]
import zstandard
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound, Unavailable
from vault.store.protocol import (
    CHUNK_SIZE,
    HASH_SIZE,
    BlobHasher,
    BlobInfo,
    BlobStore,
    BlobWriter,
    Chunk,
    ChunkList,
    Closing,
    check_expected,
    require_sha256,
)

FORMAT: Final = "pinvault-cold-1"
DATA_FORMAT: Final = "pinvault-cold-data-1"

# S3 takes at most 10,000 parts of at least 5 MiB (bar the last) per upload. Parts start at
# `part_size` and double every PART_GROWTH parts, up to PART_MAX_DOUBLINGS times: small blobs
# need little memory, and 8 MiB parts still reach 484 GiB.
MIN_PART_SIZE: Final = 5 << 20
MAX_PART_SIZE: Final = 5 << 30
PART_SIZE: Final = 8 << 20
MAX_PARTS: Final = 10_000
PART_GROWTH: Final = 2_000
PART_MAX_DOUBLINGS: Final = 4
# Parts in flight at once per put. A put holds at most these, one more waiting for them and
# the one being filled: with the defaults, some 50 MiB.
UPLOAD_THREADS: Final = 4
# HEAD requests in flight at once for find_missing.
LOOKUP_THREADS: Final = 8
# One ranged GET covers at most this many stored bytes, so that a slow reader never holds a
# response open for long.
READ_WINDOW: Final = 64 << 20
# The first GET of a blob's index object asks for this much: the whole index of a blob of up
# to some 1,800 chunks, and all of a small blob kept inline.
INDEX_PROBE: Final = 64 << 10
COMPRESSION_LEVEL: Final = 3
# A chunk is kept compressed only if that saves at least 1/32 of it: below that, the saving
# is not worth decompressing the chunk on every read.
_SAVING_FRACTION: Final = 32

_COMPRESSED: Final = 1 << 31
_MAGIC: Final = b"PVCO"
_VERSION: Final = 1
# magic, version, 3 zero bytes, stored size, chunk count, chunk list length, data key length,
# 6 zero bytes
_HEADER = struct.Struct(">4sB3xQIIH6x")
_ENTRY = struct.Struct(">I")
_MAX_KEY: Final = 1024
_HEX = re.compile(r"[0-9a-f]{64}")
_MISSING: Final = frozenset({"NoSuchKey", "NotFound", "404"})
_CHECKSUM_REFUSED: Final = frozenset({"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest"})
_TRANSPORT_ERRORS = (BotoCoreError, OSError)


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
    """

    key: str
    data_key: str
    data_offset: int
    stored_size: int
    chunks: ChunkList
    extents: tuple[Extent, ...]

    @property
    def inline(self) -> bool:
        return self.data_key == self.key


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
    stored_size = sum(entry & ~_COMPRESSED for entry in entries)
    key = (data_key or "").encode()
    encoded_chunks = chunks.encode()
    body = b"".join(
        (
            _HEADER.pack(
                _MAGIC, _VERSION, stored_size, chunks.count, len(encoded_chunks), len(key)
            ),
            key,
            encoded_chunks,
            table,
        )
    )
    return body + hashlib.sha256(body).digest()


def index_length(head: bytes) -> int:
    """The length of an index from its first _HEADER.size bytes."""
    count: int
    chunks_length: int
    key_length: int
    _, _, _, count, chunks_length, key_length = _HEADER.unpack_from(head)
    return _HEADER.size + key_length + chunks_length + count * _ENTRY.size + HASH_SIZE


def decode_index(data: bytes, sha256: Digest, key: str) -> ColdLayout:
    """Parse and self-check an index (any inline data after it is ignored)."""
    where = f"index of {sha256} ({key})"
    if len(data) < _HEADER.size:
        raise IntegrityError(f"{where} is damaged: only {len(data)} bytes")
    magic, version, stored_size, count, chunks_length, key_length = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
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
    position = _HEADER.size
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
        stored = entry & ~_COMPRESSED
        compressed = bool(entry & _COMPRESSED)
        expected = chunks.span(index)[1]
        if stored > expected or (not compressed and stored != expected):
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


# -- the tier ----------------------------------------------------------------------------------


class ColdTier(Closing, BlobStore):
    """A BlobStore on one bucket (under an optional key prefix) of one S3 endpoint::

        <prefix>blobs/sha256/<hex>   the blob's index (ColdLayout), and its data if small
        <prefix>data/<random>        the data of a larger blob, uploaded in parts

    A blob whose stored chunks fit in `inline_limit` bytes (by default one part) is kept
    whole in its index object, so that it costs one PUT and one GET. A blob's digest is known
    only once its last byte has been hashed, and S3 cannot rename, so a larger blob's data
    goes up first under a random name and is checked; only then is its index written under
    the digest, with If-None-Match so that of two puts of the same bytes exactly one creates
    it. The index object appearing is what makes a blob visible, as the link into blobs/ does
    in the hot tier; deleting a blob removes its index first, then its data.

    An uploaded copy counts only once checked: by the server, against the SHA-256 of every
    part (or object) sent as x-amz-checksum-sha256 and echoed back, or else by reading it back.
    Every read checks each chunk against the chunk list before handing it on.

    Failures to reach the endpoint, or refusals by it, are Unavailable naming the endpoint.
    Credentials, region, timeouts and retries are the ones given here: no profile, ~/.aws file
    or AWS_* credential variable is read.
    """

    def __init__(
        self,
        *,
        endpoint_url: str,
        bucket: str,
        access_key_id: str,
        secret_access_key: str,
        region: str = "us-east-1",
        prefix: str = "",
        addressing_style: str = "path",
        part_size: int = PART_SIZE,
        inline_limit: int | None = None,
        upload_threads: int = UPLOAD_THREADS,
        compression_level: int = COMPRESSION_LEVEL,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE >> PART_MAX_DOUBLINGS:
            raise InvalidArgument(
                f"part size {part_size} is outside {MIN_PART_SIZE}.."
                f"{MAX_PART_SIZE >> PART_MAX_DOUBLINGS} (S3's limits, with room to double)"
            )
        if addressing_style not in ("path", "virtual", "auto"):
            raise InvalidArgument(
                f"addressing style {addressing_style!r} is not one of path, virtual, auto"
            )
        if compression_level > zstandard.MAX_COMPRESSION_LEVEL:
            raise InvalidArgument(
                f"zstd compression level {compression_level} is above "
                f"{zstandard.MAX_COMPRESSION_LEVEL}"
            )
        if inline_limit is None:
            inline_limit = part_size
        if not 0 <= inline_limit <= part_size:
            raise InvalidArgument(
                f"inline limit {inline_limit} must be between 0 and the part size {part_size}"
            )
        if upload_threads < 1 or max_attempts < 1:
            raise InvalidArgument(
                f"upload threads ({upload_threads}) and attempts ({max_attempts}) must be >= 1"
            )
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.endpoint_url = endpoint_url
        self.bucket = bucket
        self.prefix = prefix
        self.part_size = part_size
        self.inline_limit = inline_limit
        self.upload_threads = upload_threads
        self.compression_level = compression_level
        self._blobs = f"{prefix}blobs/sha256/"
        self._where = f"{endpoint_url.rstrip('/')}/{bucket}/{prefix}"
        self._conditional_puts = True
        self.client: Any = _create_client(
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            region_name=region,
            config=Config(
                region_name=region,
                signature_version="s3v4",
                s3={"addressing_style": addressing_style},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": max_attempts, "mode": "standard"},
                max_pool_connections=max(upload_threads, LOOKUP_THREADS) + 2,
                tcp_keepalive=True,
                # The checksums sent are the ones computed here (SHA-256, per object or part);
                # botocore's own trailing CRCs are not understood by every S3 server.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def __repr__(self) -> str:
        return f"ColdTier({self._where!r})"

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()

    def probe(self) -> None:
        """One cheap request (HEAD of the bucket): Unavailable, naming the endpoint, if it
        does not answer within the tier's timeouts or refuses."""
        self._call(f"looking up bucket {self.bucket}", "head_bucket")

    # -- writes ------------------------------------------------------------------------------

    def writer(self) -> ColdWriter:
        return ColdWriter(self)

    def delete(self, sha256: Digest) -> None:
        key = self._index_key(sha256)
        try:
            layout: ColdLayout | None = self._load(sha256)[0]
        except IntegrityError:
            # A damaged index must still go, so that a good copy can take its place; the
            # data object it named, if any, cannot be found from it.
            layout = None
        self._call(f"deleting {key}", "delete_object", Key=key)
        if layout is not None and not layout.inline:
            self._call(f"deleting {layout.data_key}", "delete_object", Key=layout.data_key)

    # -- reads -------------------------------------------------------------------------------

    def info(self, sha256: Digest) -> BlobInfo | None:
        """The blob's digests and size from its index (one GET); damage to the stored chunks
        is found by read and verify, not here."""
        try:
            return self._load(sha256)[0].chunks.info
        except NotFound:
            return None

    def find_missing(self, digests: Iterable[Digest]) -> list[Digest]:
        unique = list(dict.fromkeys(digests))
        keys = [self._index_key(digest) for digest in unique]
        if len(keys) <= 1:
            present = [self._exists(key) for key in keys]
        else:
            with ThreadPoolExecutor(
                max_workers=min(LOOKUP_THREADS, len(keys)), thread_name_prefix="pinvault-cold-head"
            ) as pool:
                present = list(pool.map(self._exists, keys))
        return [digest for digest, found in zip(unique, present, strict=True) if not found]

    def chunk_list(self, sha256: Digest) -> ChunkList:
        return self._load(sha256)[0].chunks

    def layout(self, sha256: Digest) -> ColdLayout:
        """Where and how the blob's bytes are kept; NotFound if it is not stored."""
        return self._load(sha256)[0]

    def read(self, sha256: Digest, offset: int = 0, length: int | None = None) -> Iterator[Chunk]:
        layout, head = self._load(sha256)
        wanted = layout.chunks.chunk_range(offset, length)
        return self._read_chunks(layout, head, wanted)

    def verify(self, sha256: Digest) -> BlobInfo:
        """Fetch and re-hash every chunk: each against the chunk list as it comes, the whole
        against the digest."""
        layout, head = self._load(sha256)
        hasher = BlobHasher(layout.chunks.chunk_size)
        try:
            for chunk in self._read_chunks(layout, head, range(layout.chunks.count)):
                hasher.update(chunk.data)
        except BaseException:
            hasher.cancel()
            raise
        found = hasher.finish()
        if found != layout.chunks:
            raise IntegrityError(
                f"stored copy of {sha256} is damaged: its {found.size} bytes hash to "
                f"{found.sha256} and {found.blake3}, which its chunk list does not describe"
            )
        return found.info

    def digests(self) -> Iterator[Digest]:
        """Every stored blob, in the order the endpoint lists keys (by digest on S3)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._blobs
        )
        with self._errors(f"listing {self._blobs}"):
            for page in pages:
                for item in page.get("Contents", ()):
                    name = item["Key"][len(self._blobs) :]
                    if _HEX.fullmatch(name):
                        yield Digest("sha256", name)

    # -- inside: objects ---------------------------------------------------------------------

    def _index_key(self, sha256: Digest) -> str:
        return self._blobs + require_sha256(sha256)

    def _new_data_key(self) -> str:
        return f"{self.prefix}data/{secrets.token_hex(16)}"

    def _exists(self, key: str) -> bool:
        try:
            self._call(f"looking up {key}", "head_object", tolerate=_MISSING, Key=key)
        except _Refused:
            return False
        return True

    def _load(self, sha256: Digest) -> tuple[ColdLayout, bytes]:
        """The blob's checked layout, and the first bytes of its index object (which hold the
        whole of a small inline blob)."""
        key = self._index_key(sha256)
        try:
            head, total = self._get(key, 0, INDEX_PROBE)
            if head.startswith(_MAGIC) and len(head) >= _HEADER.size:
                # A damaged header may claim any length; the object's size bounds the fetch.
                needed = min(index_length(head), total)
                if len(head) < needed:
                    more, _ = self._get(key, len(head), needed - len(head))
                    head += more
        except _Refused as refused:
            if refused.code == "InvalidRange":
                raise IntegrityError(f"index of {sha256} ({key}) is damaged: it is empty") from None
            raise NotFound(f"blob {sha256} is not in the cold tier {self._where}") from None
        layout = decode_index(head, sha256, key)
        if layout.inline:
            self._check_stored_size(layout, total)
        return layout, head

    def _get(self, key: str, start: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes of an object from `start`, and the object's whole size;
        _Refused if the object is missing or shorter than `start`."""
        response = self._call(
            f"reading {key}",
            "get_object",
            tolerate=_MISSING | {"InvalidRange"},
            Key=key,
            Range=f"bytes={start}-{start + length - 1}",
        )
        with self._errors(f"reading {key}"), contextlib.closing(response["Body"]) as body:
            data: bytes = body.read()
        return data, _object_size(response)

    def _read_chunks(self, layout: ColdLayout, head: bytes, wanted: range) -> Iterator[Chunk]:
        if not wanted:
            return
        decompressor = zstandard.ZstdDecompressor()
        for window in _windows(layout, wanted):
            first, last = layout.extents[window.start], layout.extents[window.stop - 1]
            start = layout.data_offset + first.start
            end = layout.data_offset + last.start + last.length
            if layout.inline and end <= len(head):
                pieces: Iterator[bytes] = iter([head[start:end]])
            else:
                pieces = self._stream(layout, window, start, end)
            reader = _Reader(pieces)
            try:
                for index in window:
                    extent = layout.extents[index]
                    stored = reader.take(extent.length)
                    data = _unpack(layout.chunks, index, extent, stored, decompressor)
                    yield Chunk(
                        layout.chunks.span(index)[0], data, layout.chunks.check(index, data)
                    )
            finally:
                reader.close()

    def _stream(self, layout: ColdLayout, window: range, start: int, end: int) -> Iterator[bytes]:
        """The stored bytes [start, end) of the blob's data object, as they arrive."""
        key = layout.data_key
        what = f"reading {key}"
        try:
            response = self._call(
                what,
                "get_object",
                tolerate=_MISSING | {"InvalidRange"},
                Key=key,
                Range=f"bytes={start}-{end - 1}",
            )
        except _Refused as refused:
            offset = layout.chunks.span(window.start)[0]
            if refused.code == "InvalidRange":
                # The object ends before the range starts; its size tells where it was cut.
                head = self._call(f"looking up {key}", "head_object", Key=key)
                self._check_stored_size(layout, int(head["ContentLength"]))
                raise IntegrityError(
                    f"stored copy of {layout.chunks.sha256} is damaged: chunk at byte offset "
                    f"{offset} lies beyond the end of its stored object {key}"
                ) from None
            if not self._exists(layout.key):
                raise NotFound(
                    f"blob {layout.chunks.sha256} was deleted from the cold tier "
                    f"{self._where} while being read"
                ) from None
            raise IntegrityError(
                f"stored copy of {layout.chunks.sha256} is damaged: its data object {key} "
                f"(chunk at byte offset {offset} onwards) is missing"
            ) from None
        body = response["Body"]
        try:
            self._check_stored_size(layout, _object_size(response))
            with self._errors(what):
                while data := body.read(CHUNK_SIZE):
                    yield data
        finally:
            body.close()

    def _check_stored_size(self, layout: ColdLayout, total: int) -> None:
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

    # -- inside: committing a put ------------------------------------------------------------

    def _install(self, writer: ColdWriter, chunks: ChunkList) -> bool:
        """Store a finished put under its digest; False if the blob was already there."""
        key = self._index_key(chunks.sha256)
        upload = writer.upload
        inline = upload is None and len(writer.pending) <= self.inline_limit
        # A small blob goes up in its one conditional PUT, which refuses to replace a copy
        # already there: looking first would cost as much as the PUT.
        if not (inline and self._conditional_puts) and self._exists(key):
            return False
        if inline:
            body = encode_index(chunks, writer.entries, None) + bytes(writer.pending)
            return self._put_index(key, body, chunks, writer.stored_size, None)
        if upload is None:
            upload = writer.upload = _Upload(self)
        if writer.pending:
            upload.add(writer.take_pending())
        upload.complete()
        body = encode_index(chunks, writer.entries, upload.key)
        created = self._put_index(key, body, chunks, writer.stored_size, upload.key)
        upload.keep = created
        return created

    def _put_index(
        self, key: str, body: bytes, chunks: ChunkList, stored_size: int, data_key: str | None
    ) -> bool:
        checksum = _b64(hashlib.sha256(body).digest())
        params: dict[str, Any] = {
            "Key": key,
            "Body": body,
            "ContentType": "application/octet-stream",
            "ChecksumSHA256": checksum,
            "Metadata": {
                "format": FORMAT,
                "size": str(chunks.size),
                "sha256": str(chunks.sha256),
                "blake3": str(chunks.blake3),
                "stored-size": str(stored_size),
            },
        }
        what = f"storing {key}"
        if self._conditional_puts:
            try:
                response = self._call(
                    what,
                    "put_object",
                    tolerate=frozenset({"PreconditionFailed", "NotImplemented"}),
                    IfNoneMatch="*",
                    **params,
                )
            except _Refused as refused:
                if refused.code == "PreconditionFailed":
                    return self._is_own_index(chunks.sha256, data_key)
                # A server without conditional writes: two puts of the same bytes may then
                # both report creating it, and the data of the first is left unreferenced.
                self._conditional_puts = False
                response = self._call(what, "put_object", **params)
        else:
            response = self._call(what, "put_object", **params)
        if response.get("ChecksumSHA256") != checksum:
            try:
                self._read_back(key, [hashlib.sha256(body).digest()], [len(body)])
            except IntegrityError:
                with contextlib.suppress(Unavailable):
                    self._call(f"deleting {key}", "delete_object", Key=key)
                raise
        return True

    def _is_own_index(self, sha256: Digest, data_key: str | None) -> bool:
        """After a refused conditional put: whether the index there is this put's own, as when
        a retried request follows one that succeeded unanswered."""
        if data_key is None:
            return False
        try:
            layout = self._load(sha256)[0]
        except (NotFound, IntegrityError):
            return False
        return layout.data_key == data_key

    def _read_back(self, key: str, digests: list[bytes], sizes: list[int]) -> None:
        """Check a copy the server did not vouch for by reading it back: each run of `sizes`
        bytes must hash to the SHA-256 in `digests`."""
        what = f"reading back {key}"
        response = self._call(what, "get_object", Key=key)
        with self._errors(what), contextlib.closing(response["Body"]) as body:
            for number, (digest, size) in enumerate(zip(digests, sizes, strict=True), 1):
                sha = hashlib.sha256()
                left = size
                while left and (data := body.read(min(left, CHUNK_SIZE))):
                    sha.update(data)
                    left -= len(data)
                if left or sha.digest() != digest:
                    raise IntegrityError(
                        f"copy of {key} on {self._where} reads back differently from what was "
                        f"sent (part {number} of {len(sizes)})"
                    )
            if body.read(1):
                raise IntegrityError(
                    f"copy of {key} on {self._where} reads back longer than what was sent"
                )

    # -- inside: talking to the endpoint -----------------------------------------------------

    def _call(
        self, what: str, operation: str, *, tolerate: frozenset[str] = frozenset(), **params: Any
    ) -> Any:
        """One S3 call on the bucket. An error code in `tolerate` is raised as _Refused for the
        caller to handle; anything else as the project's own error."""
        method = getattr(self.client, operation)
        with self._errors(what, tolerate):
            return method(Bucket=self.bucket, **params)

    @contextlib.contextmanager
    def _errors(self, what: str, tolerate: frozenset[str] = frozenset()) -> Iterator[None]:
        try:
            yield
        except ClientError as error:
            self._refused(what, error, tolerate)
        except _TRANSPORT_ERRORS as error:
            raise Unavailable(f"cold tier {self._where}: {what} failed: {error}") from error

    def _refused(self, what: str, error: Any, tolerate: frozenset[str]) -> NoReturn:
        details = error.response.get("Error", {})
        code = str(details.get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in tolerate:
            raise _Refused(code) from None
        message = details.get("Message") or "no message"
        if code in _CHECKSUM_REFUSED:
            raise IntegrityError(
                f"cold tier {self._where}: {what}: the server received bytes other than those "
                f"sent ({code}: {message})"
            ) from error
        raise Unavailable(
            f"cold tier {self._where}: {what} was refused: {code or 'error'} "
            f"(HTTP {status}): {message}"
        ) from error


class _Refused(Exception):
    """An S3 error the caller asked to handle itself."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


# -- writing -----------------------------------------------------------------------------------


class ColdWriter(BlobWriter):
    """One put into the cold tier.

    Bytes are hashed as they come (BlobHasher) and cut into chunks; each chunk is compressed
    if that saves space, and the stored chunks gather into parts. A blob that ends before its
    first part is full goes up in one PUT, together with its index; a larger one is uploaded in
    parts, UPLOAD_THREADS at a time, while the caller goes on writing.
    """

    def __init__(self, tier: ColdTier) -> None:
        self._tier = tier
        self._hasher = BlobHasher()
        # Each frame states its size, which reads check before decompressing.
        self._compressor = zstandard.ZstdCompressor(
            level=tier.compression_level, write_content_size=True
        )
        self._chunk = bytearray()
        self.entries: list[int] = []
        self.pending = bytearray()
        self.stored_size = 0
        self.upload: _Upload | None = None
        self._open = True

    def write(self, data: bytes | memoryview) -> None:
        if not self._open:
            raise ValueError("write to a blob writer that was committed or aborted")
        try:
            self._hasher.update(data)
            view = memoryview(data)
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            position, total = 0, len(view)
            while position < total:
                take = min(total - position, CHUNK_SIZE - len(self._chunk))
                if take == CHUNK_SIZE:
                    self._seal(view[position : position + take])
                else:
                    self._chunk += view[position : position + take]
                    if len(self._chunk) == CHUNK_SIZE:
                        self._seal(self._chunk)
                        self._chunk.clear()
                position += take
        except BaseException:
            self.abort()
            raise

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        if not self._open:
            raise ValueError("commit of a blob writer that was committed or aborted")
        try:
            if self._chunk:
                self._seal(self._chunk)
                self._chunk.clear()
            chunks = self._hasher.finish()
            if expected is not None:
                check_expected(expected, chunks.info)
            created = self._tier._install(self, chunks)
        finally:
            self.abort()
        return chunks.info, created

    def abort(self) -> None:
        """Drop the put. Parts already uploaded are removed as far as the endpoint allows:
        if it cannot be reached, an unfinished upload stays for the bucket's lifecycle rule
        (AbortIncompleteMultipartUpload) to remove."""
        if not self._open:
            return
        self._open = False
        self._hasher.cancel()
        self.pending.clear()
        upload, self.upload = self.upload, None
        if upload is not None:
            upload.close()

    def _seal(self, raw: bytes | bytearray | memoryview) -> None:
        """Store one whole chunk (or the last, shorter one)."""
        compressed = self._compressor.compress(raw)
        if len(compressed) <= len(raw) - len(raw) // _SAVING_FRACTION:
            self.entries.append(len(compressed) | _COMPRESSED)
            self.pending += compressed
        else:
            self.entries.append(len(raw))
            self.pending += raw
        self.stored_size += self.entries[-1] & ~_COMPRESSED
        upload = self.upload
        target = _part_target(self._tier.part_size, 1 if upload is None else upload.parts + 1)
        if len(self.pending) >= target:
            if upload is None:
                upload = self.upload = _Upload(self._tier)
            upload.add(self.take_pending())

    def take_pending(self) -> bytearray:
        """The stored bytes gathered so far, handed over whole (not copied) as one part."""
        part, self.pending = self.pending, bytearray()
        return part


@dataclass(frozen=True, slots=True)
class _Part:
    number: int
    etag: str
    checksum: str
    digest: bytes
    size: int
    vouched: bool


class _Upload:
    """One multipart upload of a blob's stored chunks to a fresh data key."""

    def __init__(self, tier: ColdTier) -> None:
        self._tier = tier
        self.key = tier._new_data_key()
        response = tier._call(
            f"starting an upload to {self.key}",
            "create_multipart_upload",
            Key=self.key,
            ContentType="application/octet-stream",
            ChecksumAlgorithm="SHA256",
            Metadata={"format": DATA_FORMAT},
        )
        self._id: str = response["UploadId"]
        self._pool = ThreadPoolExecutor(
            max_workers=tier.upload_threads, thread_name_prefix="pinvault-cold-upload"
        )
        self._slots = threading.BoundedSemaphore(tier.upload_threads)
        self._parts: list[Future[_Part]] = []
        self._failure: BaseException | None = None
        self.completed = False
        self.keep = False

    @property
    def parts(self) -> int:
        return len(self._parts)

    def add(self, data: bytearray) -> None:
        """Queue one part, waiting while UPLOAD_THREADS parts are already in flight."""
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise InvalidArgument(
                f"blob too large for one S3 object in parts of up to "
                f"{_part_target(self._tier.part_size, MAX_PARTS)} bytes"
            )
        self._slots.acquire()
        try:
            if self._failure is not None:
                raise self._failure
            future = self._pool.submit(self._send, number, data)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._done)
        self._parts.append(future)

    def _done(self, future: Future[_Part]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._failure = self._failure or future.exception()
        self._slots.release()

    def complete(self) -> None:
        """Finish the upload and make sure the object holds exactly the bytes sent."""
        parts = [future.result() for future in self._parts]
        tier = self._tier
        response = tier._call(
            f"completing the upload to {self.key}",
            "complete_multipart_upload",
            Key=self.key,
            UploadId=self._id,
            MultipartUpload={
                "Parts": [
                    {"PartNumber": p.number, "ETag": p.etag, "ChecksumSHA256": p.checksum}
                    for p in parts
                ]
            },
        )
        self.completed = True
        # S3's checksum of a multipart object is the SHA-256 of the parts' SHA-256s, "-N".
        composite = _b64(hashlib.sha256(b"".join(p.digest for p in parts)).digest())
        vouched = all(p.vouched for p in parts)
        if not vouched or response.get("ChecksumSHA256") != f"{composite}-{len(parts)}":
            tier._read_back(self.key, [p.digest for p in parts], [p.size for p in parts])

    def close(self) -> None:
        """Stop the uploads; remove what was uploaded unless the blob now refers to it."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.keep:
            return
        tier = self._tier
        with contextlib.suppress(Unavailable, _Refused):
            if self.completed:
                tier._call(f"deleting {self.key}", "delete_object", Key=self.key)
            else:
                tier._call(
                    f"aborting the upload to {self.key}",
                    "abort_multipart_upload",
                    tolerate=frozenset({"NoSuchUpload"}) | _MISSING,
                    Key=self.key,
                    UploadId=self._id,
                )

    def _send(self, number: int, data: bytearray) -> _Part:
        digest = hashlib.sha256(data).digest()
        checksum = _b64(digest)
        response = self._tier._call(
            f"uploading part {number} of {self.key}",
            "upload_part",
            Key=self.key,
            UploadId=self._id,
            PartNumber=number,
            Body=data,
            ChecksumSHA256=checksum,
        )
        vouched = response.get("ChecksumSHA256") == checksum
        return _Part(number, response["ETag"], checksum, digest, len(data), vouched)


# -- small pieces ------------------------------------------------------------------------------

# One botocore session for every tier: it caches the S3 service model, which takes a tenth of
# a second to load for each new session. It reads no profile, config or credentials file;
# every setting a client uses is passed to it.
_session: Any = None
_session_lock = threading.Lock()


def _create_client(**options: Any) -> Any:
    global _session
    # Clients are thread-safe once made, sessions are not while making them.
    with _session_lock:
        if _session is None:
            _session = botocore.session.Session(
                session_vars={
                    "profile": (None, None, None, None),
                    "config_file": (None, None, os.devnull, None),
                    "credentials_file": (None, None, os.devnull, None),
                    "data_path": (None, None, None, None),
                }
            )
        return _session.create_client("s3", **options)


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


def _windows(layout: ColdLayout, wanted: range) -> Iterator[range]:
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


def _unpack(
    chunks: ChunkList,
    index: int,
    extent: Extent,
    stored: bytes,
    decompressor: zstandard.ZstdDecompressor,
) -> bytes:
    """A chunk's bytes from its stored form; IntegrityError naming the chunk if they cannot be
    had (the caller checks them against the chunk list)."""
    offset, length = chunks.span(index)
    if len(stored) != extent.length:
        raise IntegrityError(
            f"stored copy of {chunks.sha256} is damaged: chunk at byte offset {offset} "
            f"has {len(stored)} stored bytes, expected {extent.length}"
        )
    if not extent.compressed:
        return stored
    # The frame states its size; checking it first keeps a damaged frame from making the
    # decompressor allocate whatever it claims.
    try:
        claimed = zstandard.frame_content_size(stored)
        if claimed != length:
            raise IntegrityError(
                f"stored copy of {chunks.sha256} is damaged: chunk at byte offset {offset} "
                f"claims {claimed} bytes, expected {length}"
            )
        data: bytes = decompressor.decompress(stored)
    except zstandard.ZstdError as error:
        raise IntegrityError(
            f"stored copy of {chunks.sha256} is damaged: chunk at byte offset {offset} "
            f"does not decompress ({error})"
        ) from None
    return data


def _part_target(part_size: int, number: int) -> int:
    return part_size << min((number - 1) // PART_GROWTH, PART_MAX_DOUBLINGS)


def _object_size(response: Any) -> int:
    """The whole object's size from a (ranged) GetObject response."""
    content_range = response.get("ContentRange")
    if content_range:
        return int(str(content_range).rsplit("/", 1)[1])
    return int(response["ContentLength"])


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")
