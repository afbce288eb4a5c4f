"""Puts into the cold tier: bytes hashed and cut into chunks as they come, each chunk kept raw
or as a zstd frame, and the stored chunks sent to S3 in one PUT or as a multipart upload."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tiers import frames
from tiers.cold._crypt import ChunkSeal, new_object_id
from tiers.cold._layout import COMPRESSED, DATA_FORMAT, ColdLayout
from tiers.cold._s3 import MISSING, Refused, S3Bucket, b64
from vault.digest import Digest
from vault.errors import InvalidArgument, Unavailable
from vault.store.chunks import CHUNK_SIZE, BlobHasher, BlobInfo, check_expected
from vault.store.protocol import BlobWriter

if TYPE_CHECKING:
    from tiers.cold._tier import ColdTier

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


class ColdWriter(BlobWriter):
    """One put into the cold tier.

    Bytes are hashed as they come (BlobHasher) and cut into chunks; each chunk is compressed
    if that saves space, and the stored chunks gather into parts. A blob that ends before its
    first part is full goes up in one PUT, together with its index; a larger one is uploaded in
    parts, UPLOAD_THREADS at a time, while the caller goes on writing. On an encrypted tier
    each stored chunk is sealed (after compression) under the key ring's current key, bound to
    a fresh object id and the chunk's number.
    """

    def __init__(self, tier: ColdTier) -> None:
        self._tier = tier
        self._hasher = BlobHasher()
        self._compressor = frames.compressor(tier.compression_level)
        self._chunk = bytearray()
        self.entries: list[int] = []
        self.pending = bytearray()
        self.stored_size = 0
        self.upload: Upload | None = None
        keys = tier.keys
        self.seal = ChunkSeal(keys.current, new_object_id()) if keys is not None else None
        # The copy this put replaces (a rekey), written over rather than kept.
        self.replaces: ColdLayout | None = None
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
        payload: bytes | bytearray | memoryview = raw
        flag = 0
        if frames.worth_keeping(len(raw), len(compressed)):
            payload, flag = compressed, COMPRESSED
        if self.seal is not None:
            payload = self.seal.seal(len(self.entries), payload)
        self.entries.append(len(payload) | flag)
        self.pending += payload
        self.stored_size += len(payload)
        upload = self.upload
        target = part_target(self._tier.part_size, 1 if upload is None else upload.parts + 1)
        if len(self.pending) >= target:
            if upload is None:
                upload = self.upload = self._tier._new_upload()
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


class Upload:
    """One multipart upload of a blob's stored chunks to a fresh data key, `threads` parts in
    flight at once."""

    def __init__(self, s3: S3Bucket, key: str, *, part_size: int, threads: int) -> None:
        self._s3 = s3
        self.key = key
        self._part_size = part_size
        response = s3.call(
            f"starting an upload to {self.key}",
            "create_multipart_upload",
            Key=self.key,
            ContentType="application/octet-stream",
            ChecksumAlgorithm="SHA256",
            Metadata={"format": DATA_FORMAT},
        )
        self._id: str = response["UploadId"]
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="pinvault-cold-upload"
        )
        self._slots = threading.BoundedSemaphore(threads)
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
                f"{part_target(self._part_size, MAX_PARTS)} bytes"
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
        response = self._s3.call(
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
        composite = b64(hashlib.sha256(b"".join(p.digest for p in parts)).digest())
        vouched = all(p.vouched for p in parts)
        if not vouched or response.get("ChecksumSHA256") != f"{composite}-{len(parts)}":
            self._s3.read_back(self.key, [p.digest for p in parts], [p.size for p in parts])

    def close(self) -> None:
        """Stop the uploads; remove what was uploaded unless the blob now refers to it."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.keep:
            return
        with contextlib.suppress(Unavailable, Refused):
            if self.completed:
                self._s3.call(f"deleting {self.key}", "delete_object", Key=self.key)
            else:
                self._s3.call(
                    f"aborting the upload to {self.key}",
                    "abort_multipart_upload",
                    tolerate=frozenset({"NoSuchUpload"}) | MISSING,
                    Key=self.key,
                    UploadId=self._id,
                )

    def _send(self, number: int, data: bytearray) -> _Part:
        digest = hashlib.sha256(data).digest()
        checksum = b64(digest)
        response = self._s3.call(
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


def part_target(part_size: int, number: int) -> int:
    """How many stored bytes part `number` of an upload gathers before it is sent."""
    return part_size << min((number - 1) // PART_GROWTH, PART_MAX_DOUBLINGS)
