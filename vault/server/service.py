"""The gRPC services over the ledger and the content store. Errors become status codes here,
at the transport edge, and nowhere else."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Final, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from vault.digest import Digest, check_digest
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    VaultError,
    VerificationError,
)
from vault.files import pwrite_all
from vault.ledger.log import Ledger, LogFilter, PinSpec, SignedCheckpoint, StoredEntry
from vault.ledger.runid import RunInputs
from vault.server.admission import Admitted, Admitter, check_run_id
from vault.server.auth import CALLER, Gate, Identity, caller
from vault.server.content import Content, StoredBlob
from vault.server.tokens import TokenInfo, TokenStore
from vault.store.handoff import Desk, Mode, read_handed_off
from vault.store.protocol import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

log = logging.getLogger(__name__)

MAX_MESSAGE: Final = 64 * 1024 * 1024
MAX_LOG_PAGE: Final = 1000
MAX_LOOKUP_BATCH: Final = 100_000
MAX_FIND_MISSING: Final = 1_000_000

_CODES: Final[dict[type[VaultError], grpc.StatusCode]] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    IntegrityError: grpc.StatusCode.DATA_LOSS,
    VerificationError: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_for(error: VaultError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in _CODES:
            return _CODES[kind]
    return grpc.StatusCode.INTERNAL


T = TypeVar("T")


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    if isinstance(exc, VaultError):
        await context.abort(status_for(exc), str(exc))
    log.error("unexpected error in a request", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
    )
    raise AssertionError("unreachable: context.abort raises")


class _Service:
    """Runs the services' plain (blocking) methods from the asyncio server: inline when they
    are short (SQLite queries, in-memory proofs), on a worker thread when they may wait (a
    PostgreSQL round trip, disk reads, hashing)."""

    inline: bool
    # The service's name in the proto, as `Gate` names RPCs: "Store.Put".
    rpc_service: str = ""
    gate: Gate = Gate()

    def authorise(self, method: str, context: Any) -> None:
        """Refuse the call unless its caller may make it; the caller is `auth.caller()` after."""
        if self.gate.mode != "local":
            CALLER.set(
                self.gate.check(
                    f"{self.rpc_service}.{method}",
                    context.invocation_metadata() or (),
                    context.auth_context(),
                )
            )

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)


Handler = Callable[..., Awaitable[Any]]


def unary(method: Callable[..., Any]) -> Handler:
    """An asyncio unary handler from a plain method `(self, request) -> response`."""

    @functools.wraps(method)
    async def wrapper(self: _Service, request: Any, context: Any) -> Any:
        try:
            self.authorise(method.__name__, context)
            return await self.call(method, self, request)
        except Exception as exc:
            await _abort(context, exc)

    return wrapper


def unary_async(method: Callable[..., Awaitable[Any]]) -> Handler:
    """An asyncio unary handler from a coroutine method `(self, request) -> response`."""

    @functools.wraps(method)
    async def wrapper(self: _Service, request: Any, context: Any) -> Any:
        try:
            self.authorise(method.__name__, context)
            return await method(self, request)
        except Exception as exc:
            await _abort(context, exc)

    return wrapper


_END = object()
_AHEAD = 4


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def streaming(method: Callable[..., Iterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """An asyncio server-streaming handler from a plain generator method: see `_stream`."""

    @functools.wraps(method)
    async def wrapper(self: _Service, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            self.authorise(method.__name__, context)
        except Exception as exc:
            await _abort(context, exc)
        async for message in _stream(lambda: method(self, request, context), context):
            yield message

    return wrapper


async def _stream(messages: Callable[[], Iterator[Any]], context: Any) -> AsyncIterator[Any]:
    """The messages of a plain generator, which runs on a worker thread (it reads disks or
    databases) up to a few messages ahead of the network, so that reading the next chunk
    overlaps with sending this one."""
    loop = asyncio.get_running_loop()
    # Unbounded on the loop side; `room` bounds it from the producer's side. The producer
    # never waits for the loop to take an item (a thread round trip per message would cost
    # more than the message).
    ready: asyncio.Queue[Any] = asyncio.Queue()
    room = threading.Semaphore(_AHEAD)
    stopped = threading.Event()

    def hand_over(item: Any) -> None:
        room.acquire()
        if not stopped.is_set():
            loop.call_soon_threadsafe(ready.put_nowait, item)

    def produce() -> None:
        try:
            for message in messages():
                if stopped.is_set():
                    return
                hand_over(message)
            hand_over(_END)
        except BaseException as exc:  # handed to the handler, which reports it
            hand_over(_Failed(exc))

    producer = loop.run_in_executor(None, produce)
    try:
        while (message := await ready.get()) is not _END:
            room.release()
            if isinstance(message, _Failed):
                raise message.error
            yield message
    except Exception as exc:
        await _abort(context, exc)
    finally:
        # The caller went away or the stream ended: wake a producer waiting for room.
        stopped.set()
        room.release()
        await producer


R = TypeVar("R")


async def _client_stream(
    service: _Service, method: str, context: Any, store: Callable[[Callable[[], Any]], R]
) -> R:
    """Serve a client-streaming call: `store(receive)` runs on a worker thread and calls
    `receive()` for each message (None at the end), while the loop reads ahead into `inbox`;
    `room` bounds how far, and the thread never waits on the loop per message."""
    try:
        service.authorise(method, context)
    except Exception as exc:
        await _abort(context, exc)
    loop = asyncio.get_running_loop()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    room = asyncio.Semaphore(_AHEAD)

    async def pump() -> None:
        try:
            while True:
                await room.acquire()
                message = await context.read()
                if message is grpc.aio.EOF:
                    inbox.put(None)
                    return
                inbox.put(message)
        except BaseException as exc:  # the storing thread reports it
            inbox.put(_Failed(exc))
            raise

    def receive() -> Any:
        item = inbox.get()
        loop.call_soon_threadsafe(room.release)
        if isinstance(item, _Failed):
            raise item.error
        return item

    reader = asyncio.ensure_future(pump())
    try:
        return await asyncio.to_thread(store, receive)
    except Exception as exc:
        await _abort(context, exc)
    finally:
        reader.cancel()


def _blob(blob: StoredBlob) -> pb.BlobInfo:
    info = blob.info
    return pb.BlobInfo(
        sha256=str(info.sha256), blake3=str(info.blake3), size=info.size, stored_at=blob.stored_at
    )


def _entry(entry: StoredEntry) -> pb.Entry:
    return pb.Entry(index=entry.index, body=entry.body)


def _checkpoint(signed: SignedCheckpoint) -> pb.Checkpoint:
    return pb.Checkpoint(note=signed.note)


# What Store.Scrub runs, as `vault serve` composes it (tiers/scrub.py): every copy on every tier
# checked now, told a rate in bytes per second (None: no limit), a progress callback (bytes
# checked, total bytes) and an event set when the caller has gone; returns the totals, named
# as in ScrubProgress.
ScrubRunner = Callable[[float | None, Callable[[int, int], None], threading.Event], dict[str, int]]
_PROGRESS_EVERY: Final = 0.2


class StoreService(_Service, rpc.StoreServicer):
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
        blob, created = await _client_stream(self, "Put", context, self._put)
        return pb.PutResponse(blob=_blob(blob), created=created)

    def _put(self, receive: Callable[[], pb.PutRequest | None]) -> tuple[StoredBlob, bool]:
        first = receive()
        if first is None:
            raise InvalidArgument("empty put: no header and no bytes")
        expected = None
        leading: list[bytes] = []
        if first.WhichOneof("part") == "header":
            if first.header.expected_digest:
                expected = Digest.parse(first.header.expected_digest)
            if first.header.handoff:
                return self._put_handed_off(first.header, expected, receive)
        else:
            leading.append(first.data)

        def data() -> Iterator[bytes]:
            yield from leading
            while (message := receive()) is not None:
                if message.WhichOneof("part") != "data":
                    raise InvalidArgument("a put carries one header, first, then only bytes")
                yield message.data

        return self.content.put(data(), expected)

    def _put_handed_off(
        self,
        header: pb.PutHeader,
        expected: Digest | None,
        receive: Callable[[], pb.PutRequest | None],
    ) -> tuple[StoredBlob, bool]:
        fd = self._claim(header.handoff, "read")
        if receive() is not None:
            os.close(fd)
            raise InvalidArgument("a put of a handed-off file carries no bytes of its own")
        return self.content.put(read_handed_off(fd, header.handoff_size), expected)

    # A blob this small is read whole in one trip to a worker thread and sent at once: the
    # round trips between the loop and a streaming producer would cost more than its bytes.
    SMALL_GET: Final = 256 * 1024

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetResponse]:
        try:
            self.authorise("Get", context)
            blob, whole = await asyncio.to_thread(self._small_get, request)
        except Exception as exc:
            await _abort(context, exc)
        if whole is not None:
            for message in whole:
                yield message
            return
        async for message in _stream(lambda: self._get(request, blob), context):
            yield message

    def _small_get(self, request: pb.GetRequest) -> tuple[StoredBlob, list[pb.GetResponse] | None]:
        """The blob asked for, and all the messages of its get if it is small (else None)."""
        blob = self.content.get(Digest.parse(request.digest))
        if blob.info.size > self.SMALL_GET:
            return blob, None
        return blob, list(self._get(request, blob))

    def _get(self, request: pb.GetRequest, blob: StoredBlob) -> Iterator[pb.GetResponse]:
        length = request.length if request.HasField("length") else None
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
                    pwrite_all(target, chunk.data, chunk.offset)
                    yield pb.GetResponse(chunk=pb.Chunk(offset=chunk.offset, hash=chunk.hash))
        finally:
            if target is not None:
                os.close(target)

    @unary
    def Stat(self, request: pb.StatRequest) -> pb.StatResponse:
        blob = self.content.get(Digest.parse(request.digest))
        pins = self.ledger.entries_for([str(blob.info.sha256), str(blob.info.blake3)])
        entries = sorted(
            {e.index: e for es in pins.values() for e in es}.values(), key=lambda e: e.index
        )
        return pb.StatResponse(blob=_blob(blob), pins=[_entry(e) for e in entries])

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
        pinned = self.content.pinned_digests()
        total_bytes = 0
        for checked, digest in enumerate(pinned, start=1):
            result = self.content.check(digest)
            total_bytes += result.size
            # After the check, which refreshed each copy's time of verification.
            copies, repairs = self.content.placements(digest)
            yield pb.VerifyBlobsProgress(
                checked=checked,
                total=len(pinned),
                bytes=total_bytes,
                failed_digest=digest if result.failure else "",
                failure=result.failure,
                digest=digest,
                copies=[
                    pb.BlobCopy(place=c.tier, last_verified=c.last_verified or 0.0) for c in copies
                ],
                repairs=repairs,
            )
        if not pinned:
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
        results = await _client_stream(self, "PutBatch", context, self._put_batch)
        return pb.PutBatchResponse(
            results=[
                pb.PutBatchResult(error=f"blob {n} of the batch was refused: {result}")
                if isinstance(result, IntegrityError)
                else pb.PutBatchResult(blob=_blob(result[0]), created=result[1])
                for n, result in enumerate(results)
            ]
        )

    def _put_batch(
        self, receive: Callable[[], pb.PutBatchRequest | None]
    ) -> list[tuple[StoredBlob, bool] | IntegrityError]:
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

        return self.content.put_many(blobs())


class LedgerService(_Service, rpc.LedgerServicer):
    rpc_service = "Ledger"

    def __init__(self, ledger: Ledger, content: Content) -> None:
        self.ledger = ledger
        self.content = content
        self.inline = ledger.db.is_sqlite

    def _spec(self, request: pb.PinRequest, who: Identity) -> PinSpec:
        spec = PinSpec.checked(
            kind=request.kind,
            subjects=request.subjects,
            author=who.author(request.author),
            meta=dict(request.meta) if request.meta else None,
            external=request.external,
        )
        if spec.external:
            return spec
        subjects = []
        for subject in spec.subjects:
            found = self.content.find(Digest.parse(subject))
            if found is None:
                raise FailedPrecondition(
                    f"blob {subject} is not in the store: put it first, or pin it as external "
                    "content kept elsewhere"
                )
            subjects.append(str(found.info.sha256))
        if len(set(subjects)) != len(subjects):
            raise InvalidArgument("the same blob is named twice (by sha256 and blake3)")
        return PinSpec(spec.kind, tuple(subjects), spec.author, spec.meta, spec.external)

    def _specs(self, pins: Sequence[pb.PinRequest]) -> list[PinSpec]:
        who = caller()
        specs = []
        for number, pin in enumerate(pins):
            try:
                specs.append(self._spec(pin, who))
            except VaultError as exc:
                if len(pins) == 1:
                    raise
                raise type(exc)(f"pin {number}: {exc}") from None
        return specs

    async def _append(self, pins: Sequence[pb.PinRequest]) -> list[StoredEntry]:
        specs = await self.call(self._specs, pins)
        # Waits for the group commit without holding a thread.
        return await self.ledger.append_async(specs)

    @unary_async
    async def Pin(self, request: pb.PinRequest) -> pb.PinResponse:
        (entry,) = await self._append([request])
        return pb.PinResponse(entry=_entry(entry))

    @unary_async
    async def PinBatch(self, request: pb.PinBatchRequest) -> pb.PinBatchResponse:
        response = pb.PinBatchResponse()
        add = response.entries.add
        for e in await self._append(request.pins):
            add(index=e.index, body=e.body)
        return response

    def _lookup_keys(self, text: str) -> list[str]:
        """Pins name stored blobs by sha256; a blake3 alias is resolved through the catalog."""
        digest = check_digest(text)
        if digest.startswith("sha256:"):
            return [digest]
        found = self.content.find(Digest.parse(digest))
        return [digest] if found is None else [digest, str(found.info.sha256)]

    def _prove(
        self,
        response: Any,
        groups: Sequence[tuple[Callable[[], pb.ProvenEntry], Sequence[StoredEntry]]],
        known_size: int,
    ) -> None:
        """Fill `response` (a message with `checkpoint` and `consistency`) in place: each
        group's entries, each added by its `add` with an inclusion proof against one signed
        checkpoint that covers them all, and that checkpoint's consistency with `known_size`."""
        needed = max((e.index + 1 for _, es in groups for e in es), default=0)
        signed = self.ledger.checkpoint(needed)
        if known_size > signed.size and known_size <= self.ledger.size:
            signed = self.ledger.checkpoint(known_size)
        size = signed.size
        prove = self.ledger.inclusion_proof
        for add, entries in groups:
            for e in entries:
                proven = add()
                proven.entry.index = e.index
                proven.entry.body = e.body
                proven.inclusion.extend(prove(e.index, size))
        response.checkpoint.note = signed.note
        consistency = response.consistency
        consistency.old_size = known_size
        consistency.new_size = size
        if 0 < known_size < size:
            consistency.hashes.extend(self.ledger.consistency_proof(known_size, size))

    @unary
    def Lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        keys = self._lookup_keys(request.digest)
        if len(keys) == 1:
            entries = self.ledger.entries_naming(keys[0])
        else:
            found = self.ledger.entries_for(keys)
            entries = sorted(
                {e.index: e for k in keys for e in found[k]}.values(), key=lambda e: e.index
            )
        if not entries:
            raise NotFound(f"no entry pins {request.digest}")
        response = pb.LookupResponse()
        self._prove(response, [(response.entries.add, entries)], request.known_size)
        return response

    @unary
    def LookupBatch(self, request: pb.LookupBatchRequest) -> pb.LookupBatchResponse:
        if len(request.digests) > MAX_LOOKUP_BATCH:
            raise InvalidArgument(
                f"too many digests: {len(request.digests)} (at most {MAX_LOOKUP_BATCH} a call)"
            )
        # A blake3 alias names the same pins as its sha256 digest, as in Lookup.
        keys = {d: self._lookup_keys(d) for d in request.digests}
        found = self.ledger.entries_for(k for ks in keys.values() for k in ks)
        response = pb.LookupBatchResponse()
        groups = []
        for d in request.digests:
            result = response.results.add(digest=d)
            entries = sorted(
                {e.index: e for k in keys[d] for e in found[k]}.values(), key=lambda e: e.index
            )
            groups.append((result.entries.add, entries))
        self._prove(response, groups, request.known_size)
        return response

    @unary
    def Log(self, request: pb.LogRequest) -> pb.LogResponse:
        limit = min(request.limit or 100, MAX_LOG_PAGE)
        where = LogFilter(
            kind=request.kind or None,
            digest=str(Digest.parse(request.digest)) if request.digest else None,
            author=request.author or None,
            since=request.since or None,
            until=request.until or None,
        )
        entries = self.ledger.log(request.start, limit + 1, where)
        more = len(entries) > limit
        entries = entries[:limit]
        return pb.LogResponse(
            entries=[_entry(e) for e in entries], next=entries[-1].index + 1 if more else 0
        )

    @unary
    def GetCheckpoint(self, request: pb.GetCheckpointRequest) -> pb.Checkpoint:
        return _checkpoint(self.ledger.checkpoint(self.ledger.sync()))

    @unary
    def GetInclusionProof(self, request: pb.InclusionProofRequest) -> pb.InclusionProof:
        signed = self.ledger.checkpoint(max(request.index + 1, request.size))
        size = request.size or signed.size
        return pb.InclusionProof(
            index=request.index,
            size=size,
            leaf_hash=self.ledger.leaf(request.index),
            hashes=self.ledger.inclusion_proof(request.index, size),
            checkpoint=_checkpoint(signed),
        )

    @unary
    def GetConsistencyProof(self, request: pb.ConsistencyProofRequest) -> pb.ConsistencyProof:
        new_size = request.new_size or self.ledger.checkpoint().size
        return pb.ConsistencyProof(
            old_size=request.old_size,
            new_size=new_size,
            hashes=self.ledger.consistency_proof(request.old_size, new_size),
        )

    @unary
    def GetVerifierKey(self, request: pb.VerifierKeyRequest) -> pb.VerifierKey:
        return pb.VerifierKey(key=str(self.ledger.verifier), origin=self.ledger.origin)

    @streaming
    def ReadEntries(
        self, request: pb.ReadEntriesRequest, context: Any
    ) -> Iterator[pb.StoredEntries]:
        head = self.ledger.head_size()
        sent_head = False
        for batch in self.ledger.read_raw(request.start):
            yield pb.StoredEntries(
                head_size=head,
                entries=[
                    pb.StoredEntry(
                        index=r.index,
                        body=r.body,
                        leaf_hash=r.leaf_hash,
                        kind=r.kind,
                        author=r.author,
                        time=r.time,
                        external=r.external,
                        subjects=r.subjects,
                    )
                    for r in batch
                ],
            )
            sent_head = True
        if not sent_head:
            yield pb.StoredEntries(head_size=head)

    @streaming
    def ReadCheckpoints(
        self, request: pb.ReadCheckpointsRequest, context: Any
    ) -> Iterator[pb.StoredCheckpoints]:
        for notes in self.ledger.stored_checkpoints():
            yield pb.StoredCheckpoints(notes=notes)


class AdmissionService(_Service, rpc.AdmissionServicer):
    rpc_service = "Admission"

    def __init__(self, admitter: Admitter, ledger_service: LedgerService) -> None:
        self.admitter = admitter
        self.ledger_service = ledger_service
        self.inline = ledger_service.inline

    @unary_async
    async def Admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        inputs = RunInputs.checked(
            image=request.image, dataset=request.dataset, config=request.config, seed=request.seed
        )
        # The scheduler's usual question, a run admitted before on recently checked inputs, is
        # answered from memory on the loop; re-hashing content or appending waits on a thread.
        if self.inline and not request.replay_of:
            check_run_id(inputs, request.run_id)
            if (known := self.admitter.known_run(inputs)) is not None:
                team = _team(caller().team_for(request.team))
                return self._answer(request, Admitted(inputs, known, new=False, team=team))
        return await asyncio.to_thread(self._admit, request, inputs)

    def _admit(self, request: pb.AdmitRequest, inputs: RunInputs) -> pb.AdmitResponse:
        who = caller()
        admitted = self.admitter.admit(
            inputs,
            team=_team(who.team_for(request.team)),
            author=who.author(request.author),
            run_id=request.run_id,
            replay_of=request.replay_of,
        )
        return self._answer(request, admitted)

    def _answer(self, request: pb.AdmitRequest, admitted: Admitted) -> pb.AdmitResponse:
        inputs = admitted.inputs
        response = pb.AdmitResponse(
            run_id=inputs.run_id,
            seed=str(inputs.seed),
            inputs=inputs.encode(),
            new=admitted.new,
            lease=admitted.lease,
            team=admitted.team,
        )
        self.ledger_service._prove(
            response, [(lambda: response.entry, [admitted.entry])], request.known_size
        )
        return response

    @unary
    def ReleaseReplay(self, request: pb.ReleaseReplayRequest) -> pb.ReleaseReplayResponse:
        who = caller()
        # A scheduler or an administrator may end any team's replay.
        team = None if who.authenticated and who.may("schedule") else who.team_for(request.team)
        self.admitter.release_replay(request.lease, team)
        return pb.ReleaseReplayResponse()


def _token(info: TokenInfo) -> pb.TokenInfo:
    return pb.TokenInfo(
        token_id=info.token_id,
        name=info.name,
        team=info.team,
        role=info.role,
        created=info.created,
        revoked=info.revoked,
    )


class TokensService(_Service, rpc.TokensServicer):
    rpc_service = "Tokens"

    def __init__(self, tokens: TokenStore) -> None:
        self.tokens = tokens
        self.inline = False

    @unary
    def CreateToken(self, request: pb.CreateTokenRequest) -> pb.CreateTokenResponse:
        info, secret = self.tokens.create(name=request.name, team=request.team, role=request.role)
        log.info(
            "%s created token %s for %s (%s, %s)",
            caller().name,
            info.token_id,
            info.name,
            info.team,
            info.role,
        )
        return pb.CreateTokenResponse(token=_token(info), secret=secret)

    @unary
    def ListTokens(self, request: pb.ListTokensRequest) -> pb.ListTokensResponse:
        return pb.ListTokensResponse(tokens=[_token(t) for t in self.tokens.list()])

    @unary
    def RevokeToken(self, request: pb.RevokeTokenRequest) -> pb.RevokeTokenResponse:
        self.tokens.revoke(request.token_id)
        log.info("%s revoked token %s", caller().name, request.token_id)
        return pb.RevokeTokenResponse()


def _team(team: str) -> str:
    if not team or len(team) > 128 or not team.isprintable():
        raise InvalidArgument(f"team must be 1 to 128 printable characters, found {team!r}")
    return team


SERVER_OPTIONS: Final = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
]


async def build_server(
    ledger: Ledger,
    content: Content,
    listen: str,
    *,
    admitter: Admitter | None = None,
    gate: Gate | None = None,
    tokens: TokenStore | None = None,
    tls: grpc.ServerCredentials | None = None,
    desk: Desk | None = None,
    scrub: ScrubRunner | None = None,
) -> tuple[grpc.aio.Server, str]:
    """An asyncio gRPC server with the vault's services, health and reflection; returns it and
    where it listens (the real port when `listen` asked for port 0); `await server.start()`
    next. Without `gate`, local mode: no credential is asked for; with `tokens`, administrators
    manage them over the Tokens service; with `desk`, clients on this host may hand files over
    (vault/handoff.py); with `scrub`, Store.Scrub checks every tier on demand."""
    gate = gate or Gate()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    ledger_service = LedgerService(ledger, content)
    servicers: list[_Service] = [StoreService(content, ledger, desk, scrub), ledger_service]
    if admitter is not None:
        servicers.append(AdmissionService(admitter, ledger_service))
    if tokens is not None:
        servicers.append(TokensService(tokens))
    for servicer in servicers:
        servicer.gate = gate
        getattr(rpc, f"add_{servicer.rpc_service}Servicer_to_server")(servicer, server)
    services = [s.rpc_service for s in servicers]
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in services]
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    host, sep, port_text = listen.rpartition(":")
    if not listen.startswith("unix:") and not (
        sep and host and port_text.isdigit() and int(port_text) <= 65535
    ):
        raise InvalidArgument(
            f"cannot listen on {listen!r}: expected HOST:PORT with a port from 0 to 65535, "
            "or unix:PATH"
        )
    try:
        port = server.add_secure_port(listen, tls) if tls else server.add_insecure_port(listen)
    except RuntimeError:  # gRPC's way of saying the bind failed
        port = 0
    if port == 0:
        raise Unavailable(f"cannot listen on {listen}: the address is in use or not available")
    if listen.startswith("unix:"):
        return server, listen
    return server, f"{host}:{port}"
