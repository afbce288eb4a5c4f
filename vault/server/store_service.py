"""The Store service: puts (streamed, batched or handed off on this host), verified gets,
existence checks, the audit of every pinned blob and the scrub of every tier on demand."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Final

from vault.digest import Digest
from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument, VaultError
from vault.ledger.log import Ledger
from vault.server.blob_audit import BlobAudit
from vault.server.content import Content, StoredBlob
from vault.server.damage import KnownDamage
from vault.server.direct import MAX_DIRECT_COPIES, DirectTransfers, Planned
from vault.server.edge import (
    Service,
    abort,
    client_stream,
    stream,
    streaming,
    transfer,
    unary,
)
from vault.server.ledger_service import entry_message
from vault.store.chunks import CHUNK_SIZE
from vault.store.handoff import Desk, Mode, read_handed_off, write_handed_off
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

log = logging.getLogger("pinvault")

# What fits in one message the vault reads (service.MAX_RECEIVE): 73 bytes a digest.
MAX_FIND_MISSING: Final = 100_000


def _blob(blob: StoredBlob) -> pb.BlobInfo:
    info = blob.info
    return pb.BlobInfo(
        sha256=str(info.sha256), blake3=str(info.blake3), size=info.size, stored_at=blob.stored_at
    )


# What Store.Scrub runs, as vault/server/workers.py composes it: every copy on every tier
# checked now, told a rate in bytes per second (None: no limit), a progress callback (bytes
# checked, total bytes) and an event set when the caller has gone; returns the totals, named
# as in ScrubProgress.
ScrubRunner = Callable[[float | None, Callable[[int, int], None], threading.Event], dict[str, int]]
_PROGRESS_EVERY: Final = 0.2


class _Upload:
    """One put's messages after its header: bytes (or a handed-off file's), then the commit
    that must end them. gRPC may tell a stream cut short or cancelled as a plain end, so the
    end of the stream is not the end of the put: one that ends without its commit raises
    before anything is stored."""

    def __init__(self, receive: Callable[[], pb.PutRequest | None], header: pb.PutHeader) -> None:
        self._receive = receive
        self._expected = Digest.parse(header.expected_digest) if header.expected_digest else None
        self._meant: Digest | None = None

    def streamed(self, first: pb.PutRequest) -> Iterator[bytes]:
        """The bytes of a streamed put; `first` is its first message (a header, or bytes)."""
        size = 0
        message = self._receive() if first.WhichOneof("part") == "header" else first
        while message is not None:
            part = message.WhichOneof("part")
            if part == "commit":
                self._commit(message.commit, size)
                return
            if part != "data":
                raise InvalidArgument(
                    "a put carries one header, first, then only bytes, then its commit"
                )
            data = message.data  # each read of the field copies its bytes
            size += len(data)
            yield data
            message = self._receive()
        raise self._uncommitted(size)

    def handed_off(self, data: Iterator[bytes]) -> Iterator[bytes]:
        """The bytes of a handed-off file, then the commit, which is all the call carries."""
        size = 0
        for piece in data:
            size += len(piece)
            yield piece
        message = self._receive()
        if message is None:
            raise self._uncommitted(size)
        if message.WhichOneof("part") != "commit":
            raise InvalidArgument("a put of a handed-off file carries no bytes of its own")
        self._commit(message.commit, size)

    def meant(self) -> Digest:
        """The digest the bytes must have, from the commit; asked once they are all in."""
        assert self._meant is not None, "asked before the put's commit"
        return self._meant

    def _commit(self, commit: pb.PutCommit, size: int) -> None:
        if commit.size != size:
            raise InvalidArgument(
                f"the put's commit says {commit.size} bytes, but {size} came; nothing was stored"
            )
        if not commit.digest:
            raise InvalidArgument("the put's commit names no digest; nothing was stored")
        meant = Digest.parse(commit.digest)
        if self._expected is not None and meant != self._expected:
            raise InvalidArgument(
                f"the put's header expects {self._expected} but its commit names {meant}"
            )
        if self._receive() is not None:
            raise InvalidArgument("a put's commit must be its last message")
        self._meant = meant

    def _uncommitted(self, size: int) -> FailedPrecondition:
        return FailedPrecondition(
            f"the put ended after {size} bytes without its commit message (the size and "
            "digest the client meant): it was cut short, or the client is older than this "
            "vault; nothing was stored"
        )


class StoreService(Service, rpc.StoreServicer):
    rpc_service = "Store"

    def __init__(
        self,
        content: Content,
        ledger: Ledger,
        desk: Desk | None = None,
        scrub: ScrubRunner | None = None,
    ) -> None:
        self.content = content
        self.ledger = ledger
        self.desk = desk
        self.scrub = scrub
        self._scrubbing = threading.Lock()
        self.inline = content.db.is_sqlite
        self.direct = DirectTransfers(content)

    def _claim(self, ticket: str, mode: Mode) -> int:
        if self.desk is None:
            raise InvalidArgument("this server takes no handed-off files: stream the bytes")
        return self.desk.claim(ticket, mode)

    @unary
    def Handoff(self, request: pb.HandoffRequest) -> pb.HandoffInfo:
        if self.desk is None:
            return pb.HandoffInfo()
        return pb.HandoffInfo(socket=str(self.desk.path), instance=self.desk.instance)

    async def Put(self, requests: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutResponse:
        blob, created = await client_stream(self, "Put", context, self._put)
        return pb.PutResponse(blob=_blob(blob), created=created)

    def _put(self, receive: Callable[[], pb.PutRequest | None]) -> tuple[StoredBlob, bool]:
        first = receive()
        if first is None:
            raise InvalidArgument("empty put: no header and no bytes")
        header = first.header if first.WhichOneof("part") == "header" else pb.PutHeader()
        upload = _Upload(receive, header)
        if header.handoff:
            fd = self._claim(header.handoff, "read")
            return self.content.put(
                upload.handed_off(read_handed_off(fd, header.handoff_size)), upload.meant
            )
        return self.content.put(upload.streamed(first), upload.meant)

    # A blob this small is read whole in one trip to a worker thread and sent at once: the
    # round trips between the loop and a streaming producer would cost more than its bytes.
    SMALL_GET: Final = 256 * 1024

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetResponse]:
        try:
            self.authorise("Get", context)
            blob, whole = await asyncio.to_thread(self._small_get, request)
        except Exception as exc:
            await abort(context, exc)
        if whole is not None:
            for message in whole:
                yield message
            return
        async for message in stream(lambda: self._get(request, blob), context):
            yield message

    def _small_get(self, request: pb.GetRequest) -> tuple[StoredBlob, list[pb.GetResponse] | None]:
        """The blob asked for, and all the messages of its get if it is small (else None)."""
        blob = self.content.get(Digest.parse(request.digest))
        # A get into a handed-off pipe streams: read whole first, the chunks would have to fit
        # in the pipe before the caller is told to read any of them.
        if blob.info.size > self.SMALL_GET or request.handoff:
            return blob, None
        return blob, list(self._get(request, blob))

    def _get(self, request: pb.GetRequest, blob: StoredBlob) -> Iterator[pb.GetResponse]:
        try:
            yield from self._get_messages(request, blob)
        except IntegrityError as error:
            self._found_damaged(blob, error)
            raise

    def _found_damaged(self, blob: StoredBlob, error: IntegrityError) -> None:
        """A get met a damaged copy (and fails, DATA_LOSS): for a hot tier alone, journalled,
        and so counted, and logged as any check that finds it (a tier manager has journalled
        and counted what it found itself)."""
        try:
            with KnownDamage(self.content.store) as damage:
                damage.found_damaged(blob.info.sha256, str(error), again=False)
        except VaultError as failed:
            log.error("could not journal the damage a get of %s met: %s", blob.info.sha256, failed)

    def _get_messages(self, request: pb.GetRequest, blob: StoredBlob) -> Iterator[pb.GetResponse]:
        length = request.length if request.HasField("length") else None
        if request.hashes_only:
            yield from self._chunk_hashes(request, blob, length)
            return
        target = self._claim(request.handoff, "write") if request.handoff else None
        try:
            length, chunks = self.content.read(blob, request.offset, length)
            if target is not None and length != blob.info.size:
                raise InvalidArgument(
                    "a get into a handed-off file takes the whole blob; ranges stream"
                )
            yield pb.GetResponse(
                header=pb.GetHeader(
                    blob=_blob(blob), chunk_size=CHUNK_SIZE, offset=request.offset, length=length
                )
            )
            for chunk in chunks:
                if target is None:
                    yield pb.GetResponse(
                        chunk=pb.Chunk(offset=chunk.offset, data=chunk.data, hash=chunk.hash)
                    )
                else:
                    # The message goes first, so the caller reads the chunk from the pipe while
                    # this thread writes it, whatever the pipe holds; the stream's worker runs
                    # on to this write as soon as the message is handed over.
                    yield pb.GetResponse(chunk=pb.Chunk(offset=chunk.offset, hash=chunk.hash))
                    write_handed_off(target, chunk.data)
        finally:
            if target is not None:
                os.close(target)

    # Chunk hashes a message: 128 KiB of them.
    HASHES_PER_MESSAGE: Final = 4096

    def _chunk_hashes(
        self, request: pb.GetRequest, blob: StoredBlob, length: int | None
    ) -> Iterator[pb.GetResponse]:
        """The hashes of the chunks covering the range, from the blob's chunk list: no byte
        of the blob is read."""
        if request.handoff:
            raise InvalidArgument("a get of chunk hashes carries no bytes: it takes no ticket")
        chunks = self.content.store.chunk_list(blob.info.sha256)
        wanted = chunks.chunk_range(request.offset, length)
        yield pb.GetResponse(
            header=pb.GetHeader(
                blob=_blob(blob),
                chunk_size=chunks.chunk_size,
                offset=request.offset,
                length=chunks.size - request.offset if length is None else length,
            )
        )
        for first in range(wanted.start, wanted.stop, self.HASHES_PER_MESSAGE):
            last = min(first + self.HASHES_PER_MESSAGE, wanted.stop)
            yield pb.GetResponse(
                hashes=pb.ChunkHashes(
                    offset=chunks.span(first)[0], hashes=chunks.hashes[first:last]
                )
            )

    @unary
    def Stat(self, request: pb.StatRequest) -> pb.StatResponse:
        blob = self.content.get(Digest.parse(request.digest))
        pins = self.ledger.entries_for([str(blob.info.sha256), str(blob.info.blake3)])
        entries = sorted(
            {e.index: e for es in pins.values() for e in es}.values(), key=lambda e: e.index
        )
        return pb.StatResponse(blob=_blob(blob), pins=[entry_message(e) for e in entries])

    @transfer
    def DirectPut(self, request: pb.DirectPutRequest) -> pb.DirectPutPlan:
        resume = [(u.mirror, u.key, u.upload_id) for u in request.resume]
        if request.resume_mirror and request.resume_key and request.resume_upload_id:
            resume.insert(0, (request.resume_mirror, request.resume_key, request.resume_upload_id))
        if len(resume) > MAX_DIRECT_COPIES:
            raise InvalidArgument(
                f"too many uploads to resume: {len(resume)} (at most {MAX_DIRECT_COPIES})"
            )
        planned = self.direct.plan_put(
            Planned(
                Digest.parse(request.sha256),
                request.size,
                parts=(request.part_size, list(request.part_sha256)) if request.part_size else None,
                resume=resume,
                copies=request.copies,
            )
        )
        if isinstance(planned, StoredBlob):
            return pb.DirectPutPlan(stored=_blob(planned))
        (mirror, upload), *others = planned
        return pb.DirectPutPlan(
            mirror=mirror,
            key=upload.key,
            url=upload.url,
            headers=upload.headers,
            expires_seconds=self.direct.expires,
            upload_id=upload.upload_id,
            part_urls=upload.part_urls,
            parts_present=upload.present,
            copies=[
                pb.DirectCopyPlan(
                    mirror=name,
                    key=other.key,
                    url=other.url,
                    headers=other.headers,
                    upload_id=other.upload_id,
                    part_urls=other.part_urls,
                    parts_present=other.present,
                )
                for name, other in others
            ],
        )

    @transfer
    def FinishDirectPut(self, request: pb.FinishDirectPutRequest) -> pb.PutResponse:
        if len(request.copies) >= MAX_DIRECT_COPIES:
            raise InvalidArgument(
                f"too many copies: {len(request.copies) + 1} (at most {MAX_DIRECT_COPIES})"
            )
        uploads = [(request.mirror, request.key, request.upload_id)]
        uploads += [(c.mirror, c.key, c.upload_id) for c in request.copies]
        blob, created, mirrors = self.direct.finish_put(
            Digest.parse(request.sha256), uploads, request.size
        )
        return pb.PutResponse(blob=_blob(blob), created=created, mirrors=mirrors)

    @unary
    def DirectGet(self, request: pb.DirectGetRequest) -> pb.DirectGetPlan:
        blob, read = self.direct.plan_get(Digest.parse(request.digest))
        layout = read.layout
        return pb.DirectGetPlan(
            blob=_blob(blob),
            url=read.url,
            offset=layout.data_offset,
            extents=[
                pb.StoredExtent(length=extent.length, compressed=extent.compressed)
                for extent in layout.extents
            ],
            chunk_size=layout.chunks.chunk_size,
            expires_seconds=self.direct.expires,
        )

    @unary
    def FindMissing(self, request: pb.FindMissingRequest) -> pb.FindMissingResponse:
        if len(request.digests) > MAX_FIND_MISSING:
            raise InvalidArgument(
                f"too many digests: {len(request.digests)} (at most {MAX_FIND_MISSING} a call)"
            )
        return pb.FindMissingResponse(missing=self.content.find_missing(request.digests))

    @streaming
    def VerifyBlobs(
        self, request: pb.VerifyBlobsRequest, context: Any
    ) -> Iterator[pb.VerifyBlobsProgress]:
        audit = BlobAudit(self.content)
        total_bytes = 0
        for checked, result in enumerate(audit, start=1):
            digest = result.digest
            total_bytes += result.size
            # After the check, which refreshed each copy's time of verification.
            copies, repairs = self.content.placements(digest)
            yield pb.VerifyBlobsProgress(
                checked=checked,
                total=audit.total,
                bytes=total_bytes,
                failed_digest=digest if result.failure else "",
                failure=result.failure,
                digest=digest,
                copies=[
                    pb.BlobCopy(place=c.tier, last_verified=c.last_verified or 0.0) for c in copies
                ],
                repairs=repairs,
            )
        if not audit.total:
            yield pb.VerifyBlobsProgress(checked=0, total=0)

    @streaming
    def Scrub(self, request: pb.ScrubRequest, context: Any) -> Iterator[pb.ScrubProgress]:
        if self.scrub is None:
            raise FailedPrecondition(
                "this vault keeps one tier, which every read checks: `vault verify --blobs` "
                "re-hashes every pinned blob"
            )
        if request.rate_mb_s < 0:
            raise InvalidArgument(f"scrub rate {request.rate_mb_s} MB/s is negative")
        if not self._scrubbing.acquire(blocking=False):
            raise FailedPrecondition("a scrub is already running on this vault: wait for it")
        try:
            yield from self._scrub(self.scrub, request.rate_mb_s * 1e6 or None)
        finally:
            self._scrubbing.release()

    def _scrub(self, scrub: ScrubRunner, rate: float | None) -> Iterator[pb.ScrubProgress]:
        """Runs the scrub on a thread of its own and relays its progress, a message every
        _PROGRESS_EVERY seconds at most; a caller gone away stops it."""
        updates: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        stop = threading.Event()
        outcome: list[dict[str, int] | BaseException] = []
        sent = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal sent
            if time.monotonic() - sent >= _PROGRESS_EVERY:
                sent = time.monotonic()
                updates.put((done, total))

        def run() -> None:
            try:
                outcome.append(scrub(rate, progress, stop))
            except BaseException as exc:  # raised to the caller below
                outcome.append(exc)
            finally:
                updates.put(None)

        worker = threading.Thread(target=run, name="pinvault-scrub", daemon=True)
        worker.start()
        try:
            while (update := updates.get()) is not None:
                yield pb.ScrubProgress(done_bytes=update[0], total_bytes=update[1])
            worker.join()
        finally:
            stop.set()
        (result,) = outcome
        if isinstance(result, BaseException):
            raise result
        yield pb.ScrubProgress(
            finished=True, done_bytes=result["bytes"], total_bytes=result["bytes"], **result
        )

    # A batch bounds what it stages before its one sync, and its answer; one blob must fit in
    # one message. Larger blobs go by Put.
    BATCH_BLOBS: Final = 10_000
    BATCH_BYTES: Final = 256 * 1024 * 1024
    BATCH_BLOB: Final = 4 * 1024 * 1024

    async def PutBatch(
        self, requests: AsyncIterator[pb.PutBatchRequest], context: Any
    ) -> pb.PutBatchResponse:
        return await client_stream(self, "PutBatch", context, self._put_batch)

    def _put_batch(self, receive: Callable[[], pb.PutBatchRequest | None]) -> pb.PutBatchResponse:
        """The batch stored, and its answer built, on the storing thread: a thousand results
        built on the event loop would hold up every other call's messages meanwhile."""
        answer = pb.PutBatchResponse()
        results = answer.results
        for n, result in enumerate(self.content.put_many(self._batch_blobs(receive))):
            if isinstance(result, IntegrityError):
                results.add(error=f"blob {n} of the batch was refused: {result}")
            else:
                stored, created = result
                info = stored.info
                # Set in place: a BlobInfo built apart would be copied into its result.
                blob = results.add(created=created).blob
                blob.sha256 = str(info.sha256)
                blob.blake3 = str(info.blake3)
                blob.size = info.size
                blob.stored_at = stored.stored_at
        return answer

    def _batch_blobs(
        self, receive: Callable[[], pb.PutBatchRequest | None]
    ) -> Iterator[tuple[bytes, Digest | None]]:
        """The blobs of a batch as its messages bring them, each checked against the batch's
        limits; the end of the batch only once its commit matched what came."""

        def blobs() -> Iterator[tuple[bytes, Digest | None]]:
            count = total = 0
            while (message := receive()) is not None:
                for blob in message.blobs:
                    data = blob.data
                    count += 1
                    total += len(data)
                    if len(data) > self.BATCH_BLOB:
                        raise InvalidArgument(
                            f"blob {count - 1} of the batch has {len(data)} bytes: a batch takes "
                            f"blobs of at most {self.BATCH_BLOB}, put larger ones one by one"
                        )
                    if count > self.BATCH_BLOBS or total > self.BATCH_BYTES:
                        raise InvalidArgument(
                            f"batch too large: at most {self.BATCH_BLOBS} blobs and "
                            f"{self.BATCH_BYTES} bytes a call"
                        )
                    expected = blob.expected_digest
                    yield data, Digest.parse(expected) if expected else None
                if committed(message, count, total):
                    return
            raise FailedPrecondition(
                f"the batch ended after {count} blobs without its commit message (the count "
                "of blobs and bytes sent): it was cut short, or the client is older than this "
                "vault; nothing of it was stored"
            )

        def committed(message: pb.PutBatchRequest, count: int, total: int) -> bool:
            """Whether `message` ends the batch, once the rest of it has been counted: its
            commit must match what came, and nothing may follow it."""
            if not message.HasField("commit"):
                return False
            commit = message.commit
            if (commit.blobs, commit.bytes) != (count, total):
                raise InvalidArgument(
                    f"the batch's commit says {commit.blobs} blobs of {commit.bytes} bytes, "
                    f"but {count} blobs of {total} bytes came; nothing of it was stored"
                )
            if receive() is not None:
                raise InvalidArgument("a batch's commit must be its last message")
            return True

        return blobs()
