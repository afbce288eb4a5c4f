"""The cold tier's BlobStore: blobs kept on one bucket of one S3 endpoint, as _layout lays them
out, put through _upload and read back chunk by chunk, each chunk checked before it is handed on."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import zstandard

from tiers.cold._crypt import (
    SEALED_HEADER,
    SEALED_MAGIC,
    ChunkSeal,
    KeyRing,
    open_index,
    seal_index,
    sealed_length,
)
from tiers.cold._layout import (
    FORMAT,
    HEADER,
    INDEX_PROBE,
    MAGIC,
    ColdLayout,
    check_stored_size,
    decode_index,
    encode_index,
    index_length,
    unpack_window,
    windows,
)
from tiers.cold._s3 import MISSING, Refused, S3Bucket, Unreadable, b64, object_size
from tiers.cold._upload import (
    MAX_PART_SIZE,
    MIN_PART_SIZE,
    PART_MAX_DOUBLINGS,
    PART_SIZE,
    UPLOAD_THREADS,
    ColdWriter,
    Upload,
)
from tiers.copies import rehash
from vault.digest import Digest
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from vault.store.chunks import CHUNK_SIZE, BlobInfo, Chunk, ChunkList
from vault.store.protocol import BlobStore, Closing, require_sha256

# HEAD requests in flight at once for find_missing (and index GETs for an encrypted tier's
# digests).
LOOKUP_THREADS: Final = 8
COMPRESSION_LEVEL: Final = 3
# An encrypted tier's index objects carry only this in their metadata.
SEALED_FORMAT: Final = "pinvault-cold-sealed-1"

log = logging.getLogger("pinvault.cold")

_HEX = re.compile(r"[0-9a-f]{64}")
_UPLOAD_KEY = re.compile(r"data/[0-9a-f]{32}")
# S3's largest object in one PUT: a direct upload is one PUT, whose checksum header binds it to
# the blob's SHA-256 (a multipart upload's checksum is not the object's).
DIRECT_PUT_MAX: Final = 5 << 30
# The most parts one direct upload may have: each is presigned when it is planned (some 50 µs
# of the server's CPU a part), so this bounds what one plan costs. Parts of up to 5 GiB still
# reach S3's largest object.
DIRECT_PARTS_MAX: Final = 1024


@dataclass(frozen=True, slots=True)
class DirectUpload:
    """A presigned PUT of one blob's bytes to a fresh data object, which the endpoint takes
    only with the blob's SHA-256 in `headers` and only if the bytes have it; or, for an upload
    in parts (`upload_id`), a presigned PUT of each part, bound to that part's SHA-256, and the
    numbers of the parts already uploaded."""

    key: str
    url: str
    headers: dict[str, str]
    upload_id: str = ""
    part_urls: tuple[str, ...] = ()
    present: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CheckedUpload:
    """An upload read back and found to hold the blob: its chunk list, and the SHA-256 and
    size of each part it was uploaded in (one part, the whole blob, for a single PUT), which
    the other copies' checksums are held against."""

    chunks: ChunkList
    parts: tuple[tuple[bytes, int], ...]


@dataclass(frozen=True, slots=True)
class DirectRead:
    """A presigned GET of the object holding a blob's stored chunks, from `offset`."""

    url: str
    layout: ColdLayout


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

    Given a key ring (`keys`), the tier is encrypted (_crypt): every stored chunk and every
    index is sealed, indexes are kept as `<prefix>blobs/keyed/<keyed hash of the digest>` with
    no digest in their metadata, and direct transfers (which would put or read clear bytes)
    are refused.

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
        keys: KeyRing | None = None,
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
        self.keys = keys
        self._blobs = f"{prefix}blobs/keyed/" if keys is not None else f"{prefix}blobs/sha256/"
        self._where = f"{endpoint_url.rstrip('/')}/{bucket}/{prefix}"
        self._conditional_puts = True
        self._s3 = S3Bucket(
            endpoint_url=endpoint_url,
            bucket=bucket,
            where=self._where,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            region=region,
            addressing_style=addressing_style,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            max_connections=max(upload_threads, LOOKUP_THREADS) + 2,
        )
        self.client: Any = self._s3.client

    def __repr__(self) -> str:
        return f"ColdTier({self._where!r}{', encrypted' if self.keys else ''})"

    @property
    def encrypted(self) -> bool:
        return self.keys is not None

    def _refuse_direct(self, what: str) -> None:
        """A direct transfer would put clear bytes on an encrypted mirror, or read its
        ciphertext: FailedPrecondition."""
        if self.keys is not None:
            raise FailedPrecondition(
                f"{self._where} is an encrypted mirror: no {what} to or from it directly; "
                "stream the bytes through the vault"
            )

    def close(self) -> None:
        """Close the client's connections."""
        self._s3.close()

    def probe(self) -> None:
        """One cheap request (HEAD of the bucket): Unavailable, naming the endpoint, if it
        does not answer within the tier's timeouts or refuses."""
        self._s3.call(f"looking up bucket {self.bucket}", "head_bucket")

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
        self._s3.call(f"deleting {key}", "delete_object", Key=key)
        if layout is not None and not layout.inline:
            self._s3.call(f"deleting {layout.data_key}", "delete_object", Key=layout.data_key)

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
            present = [self._s3.exists(key) for key in keys]
        else:
            with ThreadPoolExecutor(
                max_workers=min(LOOKUP_THREADS, len(keys)), thread_name_prefix="pinvault-cold-head"
            ) as pool:
                present = list(pool.map(self._s3.exists, keys))
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
        against the digest. An object that cannot be read out whole is read once more before
        the copy is called damaged: once, a connection may have dropped; twice, while the
        endpoint answers, the object is at fault (a server's bitrot check fails every time)."""
        try:
            return self._verify(sha256)
        except Unreadable:
            return self._verify(sha256)

    def _verify(self, sha256: Digest) -> BlobInfo:
        layout, head = self._load(sha256)
        chunks = self._read_chunks(layout, head, range(layout.chunks.count))
        found = rehash((chunk.data for chunk in chunks), layout.chunks.chunk_size)
        if found != layout.chunks:
            raise IntegrityError(
                f"stored copy of {sha256} is damaged: its {found.size} bytes hash to "
                f"{found.sha256} and {found.blake3}, which its chunk list does not describe"
            )
        return found.info

    def digests(self) -> Iterator[Digest]:
        """Every stored blob, in the order the endpoint lists keys (by digest on S3). An
        encrypted tier's names hide the digests: each index is fetched and opened (LOOKUP_THREADS
        at a time), and a copy that cannot be opened (damaged, or under a key the ring no
        longer holds) is logged and left out: reading it reports the damage."""
        if self.keys is None:
            for name in self._index_names():
                yield Digest("sha256", name)
            return
        for found in self.sealed_digests():
            if isinstance(found, IntegrityError):
                log.warning("cold tier %s: %s", self._where, found)
            else:
                yield found

    def sealed_digests(self) -> Iterator[Digest | IntegrityError]:
        """An encrypted tier's blobs, each index fetched and opened (LOOKUP_THREADS at a time):
        its digest, or why it cannot be opened (damaged, or under a key the ring no longer
        holds)."""
        with ThreadPoolExecutor(
            max_workers=LOOKUP_THREADS, thread_name_prefix="pinvault-cold-index"
        ) as pool:
            names = self._index_names()
            while batch := [
                name for _, name in zip(range(LOOKUP_THREADS * 4), names, strict=False)
            ]:
                for found in pool.map(self._digest_named, batch):
                    if found is not None:
                        yield found

    def _index_names(self) -> Iterator[str]:
        """The names below blobs/ (a digest's hex, or its keyed hash) of every index."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._blobs
        )
        with self._s3.errors(f"listing {self._blobs}"):
            for page in pages:
                for item in page.get("Contents", ()):
                    name = item["Key"][len(self._blobs) :]
                    if _HEX.fullmatch(name):
                        yield name

    def _digest_named(self, name: str) -> Digest | IntegrityError | None:
        """The digest whose sealed index is kept under keyed name `name`; the IntegrityError
        if the index cannot be opened or names another blob; None if it is gone."""
        assert self.keys is not None
        key = self._blobs + name
        try:
            head, _ = self._fetch_index(key, key)
            _, _, plain = open_index(self.keys, head, key.removeprefix(self.prefix), key)
            sha256 = _named_digest(plain)
            if sha256 is None or self.keys.name(sha256) != name:
                raise IntegrityError(f"index {key} is damaged: it names no blob of that name")
            decode_index(plain, sha256, key, sealed=True)
        except (NotFound, Refused):
            return None  # deleted meanwhile, or emptied: reading it by digest says which
        except IntegrityError as error:
            return error
        return sha256

    def rekey(self, sha256: Digest) -> bool:
        """Seal the blob's copy again under the key ring's current key, if it is under
        another: read (each chunk checked), written anew (the whole checked against the
        digest) and its index replaced; the old data object is then deleted. Returns whether
        it was rewritten; IntegrityError if the copy cannot be read (damaged, or under a key
        the ring no longer holds: repair it from another copy)."""
        if self.keys is None:
            raise FailedPrecondition(f"{self._where} is not an encrypted mirror: nothing to rekey")
        layout, head = self._load(sha256)
        if layout.seal is not None and layout.seal.key.id == self.keys.current.id:
            return False
        writer = ColdWriter(self)
        writer.replaces = layout
        try:
            for chunk in self._read_chunks(layout, head, range(layout.chunks.count)):
                writer.write(chunk.data)
        except BaseException:
            writer.abort()
            raise
        writer.commit(sha256)
        return True

    # -- direct transfers --------------------------------------------------------------------

    def presign_upload(self, sha256: Digest, size: int, expires: int) -> DirectUpload:
        """A presigned PUT for a client to upload the blob's bytes itself, to a fresh object
        under data/; the endpoint refuses any bytes whose SHA-256 is not the blob's."""
        self._refuse_direct("upload")
        require_sha256(sha256)
        if size > DIRECT_PUT_MAX:
            raise InvalidArgument(
                f"a direct upload is one PUT of at most {DIRECT_PUT_MAX} bytes; "
                f"{sha256} has {size}: stream it through the vault"
            )
        key = f"{self.prefix}data/{secrets.token_hex(16)}"
        checksum = b64(sha256.raw)
        with self._s3.errors("presigning an upload"):
            url = self.client.generate_presigned_url(
                "put_object",
                Params={"Bucket": self.bucket, "Key": key, "ChecksumSHA256": checksum},
                ExpiresIn=expires,
            )
        return DirectUpload(key, url, {"x-amz-checksum-sha256": checksum})

    def presign_parts(
        self,
        sha256: Digest,
        size: int,
        part_size: int,
        parts: Sequence[bytes],
        expires: int,
        resume: tuple[str, str] | None = None,
    ) -> DirectUpload:
        """An upload in parts of `part_size` bytes (the last smaller), each presigned with its
        SHA-256 from `parts`; a new upload under data/, or the upload `resume` (key, upload
        id) begun earlier, with the parts it already holds named."""
        self._refuse_direct("upload")
        require_sha256(sha256)
        count = -(-size // part_size) if part_size else 0
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE or not 0 < count <= DIRECT_PARTS_MAX:
            raise InvalidArgument(
                f"a direct upload in parts takes parts of {MIN_PART_SIZE} to {MAX_PART_SIZE} "
                f"bytes, at most {DIRECT_PARTS_MAX} of them: {part_size} bytes for {size} is "
                "not that"
            )
        if len(parts) != count or any(len(digest) != 32 for digest in parts):
            raise InvalidArgument(
                f"{size} bytes in parts of {part_size} are {count} parts, each with a "
                f"SHA-256: {len(parts)} were given"
            )
        present: tuple[int, ...] = ()
        if resume is None:
            key = f"{self.prefix}data/{secrets.token_hex(16)}"
            started = self._s3.call(
                f"starting an upload to {key}",
                "create_multipart_upload",
                Key=key,
                ContentType="application/octet-stream",
                ChecksumAlgorithm="SHA256",
            )
            upload_id = str(started["UploadId"])
        else:
            key, upload_id = resume
            self.check_upload_key(key)
            held = self._uploaded_parts(key, upload_id)
            present = tuple(
                n
                for n, (checksum, _, _) in sorted(held.items())
                if n <= count and checksum == b64(parts[n - 1])
            )
        with self._s3.errors("presigning an upload"):
            urls = tuple(
                self.client.generate_presigned_url(
                    "upload_part",
                    Params={
                        "Bucket": self.bucket,
                        "Key": key,
                        "UploadId": upload_id,
                        "PartNumber": number,
                        "ChecksumSHA256": b64(digest),
                    },
                    ExpiresIn=expires,
                )
                for number, digest in enumerate(parts, start=1)
            )
        return DirectUpload(key, "", {}, upload_id, urls, present)

    def _uploaded_parts(self, key: str, upload_id: str) -> dict[int, tuple[str, str, int]]:
        """Part number to its SHA-256 checksum, ETag and size, of the parts an upload holds."""
        found: dict[int, tuple[str, str, int]] = {}
        marker = 0
        while True:
            try:
                page = self._s3.call(
                    f"listing the parts of {key}",
                    "list_parts",
                    tolerate=frozenset({"NoSuchUpload"}) | MISSING,
                    Key=key,
                    UploadId=upload_id,
                    PartNumberMarker=marker,
                )
            except Refused:
                raise NotFound(f"no upload {upload_id} to {self._where}{key}") from None
            for part in page.get("Parts", ()):
                found[int(part["PartNumber"])] = (
                    str(part.get("ChecksumSHA256", "")),
                    str(part["ETag"]),
                    int(part["Size"]),
                )
            if not page.get("IsTruncated"):
                return found
            marker = int(page["NextPartNumberMarker"])

    def check_upload_key(self, key: str) -> None:
        """InvalidArgument unless `key` has the form of the objects uploads go to."""
        if not key.startswith(self.prefix) or not _UPLOAD_KEY.fullmatch(
            key.removeprefix(self.prefix)
        ):
            raise InvalidArgument(f"{key!r} is not an upload this vault hands out")

    def _complete_parts(self, key: str, upload_id: str, size: int) -> list[tuple[str, int]]:
        """Join an upload's parts into its object, once they are numbered from 1 without a
        gap and hold `size` bytes; returns each part's SHA-256 checksum (as the store holds
        it) and size, in order."""
        held = self._uploaded_parts(key, upload_id)
        total = sum(part[2] for part in held.values())
        if not held or sorted(held) != list(range(1, len(held) + 1)) or total != size:
            raise FailedPrecondition(
                f"the upload to {key} lacks parts: it holds {len(held)} parts, {total} bytes, "
                f"of the blob's {size}; upload the rest, then finish"
            )
        self._s3.call(
            f"completing the upload to {key}",
            "complete_multipart_upload",
            Key=key,
            UploadId=upload_id,
            MultipartUpload={
                "Parts": [
                    {"PartNumber": n, "ETag": held[n][1], "ChecksumSHA256": held[n][0]}
                    for n in sorted(held)
                ]
            },
        )
        return [(held[n][0], held[n][2]) for n in sorted(held)]

    def adopt_upload(
        self, sha256: Digest, key: str, upload_id: str = "", size: int = 0
    ) -> tuple[BlobInfo, bool]:
        """Store, under its digest, the blob a client uploaded to data object `key` (in parts,
        if `upload_id`): check_upload, then install_upload. Returns its info and whether it
        was new here."""
        checked = self.check_upload(sha256, key, upload_id, size)
        return checked.chunks.info, self.install_upload(checked, key)

    def check_upload(
        self, sha256: Digest, key: str, upload_id: str = "", size: int = 0
    ) -> CheckedUpload:
        """Read back the blob a client uploaded to data object `key` (in parts, if
        `upload_id`, which are joined first once they hold `size` bytes) and hash it here: its
        chunk list, its BLAKE3 and its SHA-256, and for an upload in parts each part's SHA-256. A
        single PUT must also be held with the blob's SHA-256 as its checksum. An object that is
        not the blob is refused (IntegrityError), never deleted: the key may name another
        blob's data (a reader learns data keys from its presigned reads); an upload left
        behind is collected later."""
        self._refuse_direct("upload")
        require_sha256(sha256)
        self.check_upload_key(key)
        held = self._complete_parts(key, upload_id, size) if upload_id else None
        head = self._head_upload(key)
        size = int(head["ContentLength"])
        # An object made of parts carries the SHA-256 of its parts' SHA-256s: only reading it
        # back says what it holds.
        if held is None and head.get("ChecksumSHA256") != b64(sha256.raw):
            raise IntegrityError(
                f"the object uploaded to {key} was not stored with {sha256} as its checksum: "
                "refused"
            )
        sizes = [part_size for _, part_size in held] if held is not None else [size]
        parts: list[bytes] = []
        try:
            with self._s3.reading(f"reading {key}", MISSING):
                response = self.client.get_object(Bucket=self.bucket, Key=key)
        except Refused:
            raise NotFound(f"the upload {self._where}{key} was deleted meanwhile") from None
        body = response["Body"]
        try:
            with self._s3.reading(f"reading {key}"):
                pieces = iter(lambda: body.read(CHUNK_SIZE), b"")
                # The SHA-256 is computed again beside the chunk list and the BLAKE3 alias,
                # though a single PUT's store already checked it: the alias the vault records
                # must be of the very bytes that hash to the digest, whatever the store or the
                # link to it says (about 0.7 CPU-seconds a GiB).
                if held is not None:
                    pieces = _hashing_parts(pieces, sizes, parts)
                chunks = rehash(pieces, CHUNK_SIZE)
        finally:
            body.close()
        if chunks.sha256 != sha256 or chunks.size != size:
            raise IntegrityError(
                f"the object uploaded to {key} is not {sha256}: its {chunks.size} bytes hash "
                f"to {chunks.sha256}; refused"
            )
        if held is None:
            parts = [sha256.raw]
        elif [checksum for checksum, _ in held] != [b64(digest) for digest in parts]:
            raise IntegrityError(
                f"the parts of the object uploaded to {key} read back other than the store "
                "holds them: refused"
            )
        return CheckedUpload(chunks, tuple(zip(parts, sizes, strict=True)))

    def check_copy(self, checked: CheckedUpload, key: str, upload_id: str = "") -> None:
        """Make sure data object `key` (an upload in parts, if `upload_id`, joined here)
        holds the same bytes as the upload `checked` was read back from, without reading it:
        the store must hold it with the same SHA-256 checksums, of the whole for a single PUT
        or of every part (and the same part sizes) for an upload in parts, which it took only
        with those bytes. A store that keeps no checksum has the copy read back instead. An
        object that is not the blob is refused (IntegrityError), never deleted."""
        self._refuse_direct("upload")
        self.check_upload_key(key)
        chunks = checked.chunks
        expected = [(b64(digest), part_size) for digest, part_size in checked.parts]
        if upload_id:
            held = self._uploaded_parts(key, upload_id)
            found = [(held[n][0], held[n][2]) for n in sorted(held)]
            vouched = all(checksum for checksum, _ in found)
            if sorted(held) != list(range(1, len(held) + 1)) or (vouched and found != expected):
                raise IntegrityError(
                    f"the upload to {key} holds other parts than the copy of {chunks.sha256} "
                    "read back: refused"
                )
            self._complete_parts(key, upload_id, chunks.size)
            composite = hashlib.sha256(b"".join(digest for digest, _ in checked.parts))
            wanted = f"{b64(composite.digest())}-{len(checked.parts)}"
        else:
            wanted = b64(chunks.sha256.raw)
        head = self._head_upload(key)
        stored = head.get("ChecksumSHA256")
        if int(head["ContentLength"]) != chunks.size or (stored and stored != wanted):
            raise IntegrityError(
                f"the object uploaded to {key} is not {chunks.sha256}: it holds "
                f"{head['ContentLength']} bytes with checksum {stored}; refused"
            )
        if not stored:
            self._s3.read_back(
                key,
                [digest for digest, _ in checked.parts],
                [part_size for _, part_size in checked.parts],
            )

    def _head_upload(self, key: str) -> Any:
        try:
            return self._s3.call(
                f"looking up {key}",
                "head_object",
                tolerate=MISSING,
                Key=key,
                ChecksumMode="ENABLED",
            )
        except Refused:
            raise NotFound(f"nothing was uploaded to {self._where}{key}") from None

    def install_upload(self, checked: CheckedUpload, key: str) -> bool:
        """Write the index that makes a checked upload at `key` this mirror's copy of the
        blob; False if the mirror held the blob already (the upload is then not needed)."""
        self._refuse_direct("upload")
        chunks = checked.chunks
        entries = [chunks.span(n)[1] for n in range(chunks.count)]
        created = self._put_index(
            self._index_key(chunks.sha256),
            encode_index(chunks, entries, key),
            chunks,
            chunks.size,
            key,
        )
        if not created:
            # Stored already, from other data: this copy is not needed.
            self._drop_upload(key)
        return created

    def abort_unfinished_uploads(self, older_than: float, *, limit: int = 1000) -> int:
        """Abort uploads in parts under data/ begun more than `older_than` seconds ago (a
        client that gave up, a put cut short): S3 keeps their parts, and bills them, until
        then. Returns how many were aborted, at most `limit` a call. Lists the whole bucket's
        uploads: some servers (MinIO) list only those of one key when given a prefix."""
        cutoff = time.time() - older_than
        aborted = 0
        params: dict[str, Any] = {}
        while aborted < limit:
            page = self._s3.call("listing unfinished uploads", "list_multipart_uploads", **params)
            for upload in page.get("Uploads", ()):
                key = str(upload["Key"])
                initiated = upload["Initiated"].timestamp()
                if initiated > cutoff or not key.startswith(self.prefix):
                    continue
                if not _UPLOAD_KEY.fullmatch(key.removeprefix(self.prefix)):
                    continue
                if self._abort_upload(key, upload["UploadId"]):
                    aborted += 1
                if aborted >= limit:
                    break
            if not page.get("IsTruncated"):
                break
            params = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }
        return aborted

    def drop_abandoned_upload(self, sha256: Digest, key: str, upload_id: str = "") -> bool:
        """Delete what a client was handed data object `key` for (and abort its upload in
        parts `upload_id`) and never had adopted: a put given up, cut short or refused. Kept,
        and False, when the blob's index names the object as its data (an adoption whose answer
        was lost); a damaged index raises IntegrityError, so that nothing it may name is
        deleted before it is repaired."""
        self.check_upload_key(key)
        try:
            layout = self._load(sha256)[0]
        except NotFound:
            layout = None
        if layout is not None and layout.data_key == key:
            return False
        if upload_id:
            self._abort_upload(key, upload_id)
        self._s3.call(f"deleting {key}", "delete_object", Key=key)
        return True

    def _abort_upload(self, key: str, upload_id: str) -> bool:
        """Abort upload in parts `upload_id` to `key`; False if it was gone already."""
        try:
            self._s3.call(
                f"aborting the upload to {key}",
                "abort_multipart_upload",
                tolerate=frozenset({"NoSuchUpload"}) | MISSING,
                Key=key,
                UploadId=upload_id,
            )
        except Refused:
            return False
        return True

    def _drop_upload(self, key: str) -> None:
        with contextlib.suppress(Unavailable):
            self._s3.call(f"deleting {key}", "delete_object", Key=key)

    def presign_read(self, sha256: Digest, expires: int) -> DirectRead:
        """A presigned GET of the object holding the blob's stored chunks."""
        self._refuse_direct("read")
        layout = self._load(sha256)[0]
        with self._s3.errors("presigning a read"):
            url = self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": layout.data_key},
                ExpiresIn=expires,
            )
        return DirectRead(url, layout)

    # -- inside: objects ---------------------------------------------------------------------

    def _index_key(self, sha256: Digest) -> str:
        if self.keys is not None:
            require_sha256(sha256)
            return self._blobs + self.keys.name(sha256)
        return self._blobs + require_sha256(sha256)

    def _new_upload(self) -> Upload:
        """A multipart upload of a put's stored chunks, to a fresh key under data/."""
        return Upload(
            self._s3,
            f"{self.prefix}data/{secrets.token_hex(16)}",
            part_size=self.part_size,
            threads=self.upload_threads,
        )

    def _load(self, sha256: Digest) -> tuple[ColdLayout, bytes]:
        """The blob's checked layout, and the first bytes of its index object (which hold the
        whole of a small inline blob)."""
        key = self._index_key(sha256)
        try:
            head, total = self._fetch_index(key, sha256)
        except Refused as refused:
            if refused.code == "InvalidRange":
                raise IntegrityError(f"index of {sha256} ({key}) is damaged: it is empty") from None
            raise NotFound(f"blob {sha256} is not in the cold tier {self._where}") from None
        if self.keys is None:
            layout = decode_index(head, sha256, key)
        else:
            where = f"index of {sha256} ({key})"
            data_key, object_id, plain = open_index(
                self.keys, head, key.removeprefix(self.prefix), where
            )
            layout = decode_index(plain, sha256, key, sealed=True)
            seal = ChunkSeal(data_key, object_id)
            if layout.inline:
                layout = dataclasses.replace(layout, data_offset=sealed_length(head), seal=seal)
            else:
                layout = dataclasses.replace(layout, seal=seal)
        if layout.inline:
            check_stored_size(layout, total)
        return layout, head

    def _fetch_index(self, key: str, what: object) -> tuple[bytes, int]:
        """The first bytes of index object `key`, the whole index among them, and the object's
        size; Refused if it is missing or empty."""
        with _damage_of(what):
            head, total = self._s3.get(key, 0, INDEX_PROBE)
            needed = 0
            if self.keys is None and head.startswith(MAGIC) and len(head) >= HEADER.size:
                needed = index_length(head)
            elif (
                self.keys is not None
                and head.startswith(SEALED_MAGIC)
                and len(head) >= SEALED_HEADER.size
            ):
                needed = sealed_length(head)
            # A damaged header may claim any length; the object's size bounds the fetch.
            needed = min(needed, total)
            if len(head) < needed:
                more, _ = self._s3.get(key, len(head), needed - len(head))
                head += more
        return head, total

    def _read_chunks(self, layout: ColdLayout, head: bytes, wanted: range) -> Iterator[Chunk]:
        if not wanted:
            return
        decompressor = zstandard.ZstdDecompressor()
        for window in windows(layout, wanted):
            first, last = layout.extents[window.start], layout.extents[window.stop - 1]
            start = layout.data_offset + first.start
            end = layout.data_offset + last.start + last.length
            if layout.inline and end <= len(head):
                pieces: Iterator[bytes] = iter([head[start:end]])
            else:
                pieces = self._stream(layout, window, start, end)
            yield from unpack_window(layout, window, pieces, decompressor)

    def _stream(self, layout: ColdLayout, window: range, start: int, end: int) -> Iterator[bytes]:
        """The stored bytes [start, end) of the blob's data object, as they arrive."""
        key = layout.data_key
        what = f"reading {key}"
        try:
            with (
                _damage_of(layout.chunks.sha256),
                self._s3.reading(what, MISSING | {"InvalidRange"}),
            ):
                response = self._s3.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
                )
        except Refused as refused:
            offset = layout.chunks.span(window.start)[0]
            if refused.code == "InvalidRange":
                # The object ends before the range starts; its size tells where it was cut.
                head = self._s3.call(f"looking up {key}", "head_object", Key=key)
                check_stored_size(layout, int(head["ContentLength"]))
                raise IntegrityError(
                    f"stored copy of {layout.chunks.sha256} is damaged: chunk at byte offset "
                    f"{offset} lies beyond the end of its stored object {key}"
                ) from None
            if not self._s3.exists(layout.key):
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
            check_stored_size(layout, object_size(response))
            with _damage_of(layout.chunks.sha256), self._s3.reading(what):
                while data := body.read(CHUNK_SIZE):
                    yield data
        finally:
            body.close()

    # -- inside: committing a put ------------------------------------------------------------

    def _install(self, writer: ColdWriter, chunks: ChunkList) -> bool:
        """Store a finished put under its digest; False if the blob was already there."""
        key = self._index_key(chunks.sha256)
        upload = writer.upload
        inline = upload is None and len(writer.pending) <= self.inline_limit
        replaces = writer.replaces
        # A small blob goes up in its one conditional PUT, which refuses to replace a copy
        # already there: looking first would cost as much as the PUT.
        if replaces is None and not (inline and self._conditional_puts) and self._s3.exists(key):
            return False
        if inline:
            body = self._index_body(key, chunks, writer, None) + bytes(writer.pending)
            created = self._put_index(key, body, chunks, writer.stored_size, None, replaces)
        else:
            if upload is None:
                upload = writer.upload = self._new_upload()
            if writer.pending:
                upload.add(writer.take_pending())
            upload.complete()
            body = self._index_body(key, chunks, writer, upload.key)
            created = self._put_index(key, body, chunks, writer.stored_size, upload.key, replaces)
            upload.keep = created
        if created and replaces is not None and not replaces.inline:
            # The copy replaced: its index now names the new data, or holds it.
            self._drop_upload(replaces.data_key)
        return created

    def _index_body(
        self, key: str, chunks: ChunkList, writer: ColdWriter, data_key: str | None
    ) -> bytes:
        """The index object's leading bytes for a put: the index, sealed if encrypted."""
        index = encode_index(chunks, writer.entries, data_key)
        seal = writer.seal
        if seal is None:
            return index
        return seal_index(seal.key, key.removeprefix(self.prefix), seal.object_id, index)

    def _put_index(
        self,
        key: str,
        body: bytes,
        chunks: ChunkList,
        stored_size: int,
        data_key: str | None,
        replaces: ColdLayout | None = None,
    ) -> bool:
        """Write an index object: only if none is there, unless it `replaces` the copy there
        (a rekey). True if this put's index is the one there now."""
        checksum = b64(hashlib.sha256(body).digest())
        # An encrypted mirror's metadata names no digest (its administrators read it).
        metadata = (
            {"format": SEALED_FORMAT}
            if self.keys is not None
            else {
                "format": FORMAT,
                "size": str(chunks.size),
                "sha256": str(chunks.sha256),
                "blake3": str(chunks.blake3),
                "stored-size": str(stored_size),
            }
        )
        params: dict[str, Any] = {
            "Key": key,
            "Body": body,
            "ContentType": "application/octet-stream",
            "ChecksumSHA256": checksum,
            "Metadata": metadata,
        }
        what = f"storing {key}"
        if replaces is not None:
            response = self._s3.call(what, "put_object", **params)
        elif self._conditional_puts:
            try:
                response = self._s3.call(
                    what,
                    "put_object",
                    tolerate=frozenset({"PreconditionFailed", "NotImplemented"}),
                    IfNoneMatch="*",
                    **params,
                )
            except Refused as refused:
                if refused.code == "PreconditionFailed":
                    return self._is_own_index(chunks.sha256, data_key)
                # A server without conditional writes: two puts of the same bytes may then
                # both report creating it, and the data of the first is left unreferenced.
                self._conditional_puts = False
                response = self._s3.call(what, "put_object", **params)
        else:
            response = self._s3.call(what, "put_object", **params)
        if response.get("ChecksumSHA256") != checksum:
            try:
                self._s3.read_back(key, [hashlib.sha256(body).digest()], [len(body)])
            except IntegrityError:
                with contextlib.suppress(Unavailable):
                    self._s3.call(f"deleting {key}", "delete_object", Key=key)
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


def _hashing_parts(
    pieces: Iterator[bytes], sizes: Sequence[int], out: list[bytes]
) -> Iterator[bytes]:
    """Hand `pieces` on, appending to `out` the SHA-256 of each run of `sizes` bytes in them."""
    left = iter(sizes)
    part, want = hashlib.sha256(), next(left, 0)
    for data in pieces:
        view = memoryview(data)
        while len(view) and want:
            take = min(want, len(view))
            part.update(view[:take])
            view, want = view[take:], want - take
            if not want:
                out.append(part.digest())
                part, want = hashlib.sha256(), next(left, 0)
        yield data


def _named_digest(index: bytes) -> Digest | None:
    """The SHA-256 an index's chunk list names, read without checking (decode_index checks)."""
    if len(index) < HEADER.size:
        return None
    key_length = HEADER.unpack_from(index)[5]
    # The chunk list's header holds the blob's SHA-256 at byte 24.
    start = HEADER.size + key_length + 24
    raw = index[start : start + 32]
    return Digest.sha256(raw) if len(raw) == 32 else None


@contextlib.contextmanager
def _damage_of(sha256: object) -> Iterator[None]:
    """An object of the blob's copy that the endpoint fails to read out whole: the copy is
    damaged."""
    try:
        yield
    except Unreadable as error:
        raise Unreadable(f"stored copy of {sha256} is damaged: {error}") from error
