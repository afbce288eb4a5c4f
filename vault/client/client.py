"""The typed Python client of a pinvault server: put, get, stat, find-missing, pin, look-up with
proof, checkpoints, log and audit. It fails closed: no data and no entry is returned unless it
was verified (bytes against their digest, entries against a signed, consistent checkpoint)."""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import io
import json
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import blake3
import grpc

from vault.client.handoff import HANDOFF_MIN, Mode, hand_off
from vault.client.trust import TrustedLog
from vault.digest import Digest
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
from vault.files import write_all
from vault.ledger.audit import Auditor, AuditReport
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.entry import Entry
from vault.ledger.merkle import leaf_hash, verify_inclusion
from vault.ledger.runid import RunInputs
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

PUT_CHUNK: Final = 1 << 20
# put_many: the largest blob a batch takes (the vault's limit), and about how many bytes of
# blobs go in one message of the stream.
BATCH_BLOB: Final = 4 << 20
BATCH_MESSAGE: Final = 4 << 20
CHANNEL_OPTIONS: Final = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

_ERRORS: Final[dict[grpc.StatusCode, type[VaultError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _error(exc: grpc.RpcError) -> VaultError:
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"vault server unavailable: {details}"
    if code not in _ERRORS:
        # No error type of ours says what went wrong, so the status must.
        return VaultError(f"{code.name}: {details}")
    return _ERRORS[code](details)


@contextlib.contextmanager
def _rpc() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:
        raise _error(exc) from None


@dataclass(frozen=True, slots=True)
class BlobInfo:
    sha256: Digest
    blake3: Digest
    size: int
    stored_at: str

    @classmethod
    def from_wire(cls, blob: pb.BlobInfo) -> BlobInfo:
        return cls(Digest.parse(blob.sha256), Digest.parse(blob.blake3), blob.size, blob.stored_at)


@dataclass(frozen=True, slots=True)
class PutResult:
    blob: BlobInfo
    created: bool


@dataclass(frozen=True, slots=True)
class Stat:
    blob: BlobInfo
    pins: list[Entry]


@dataclass(frozen=True, slots=True)
class ProvenEntry:
    """An entry whose inclusion in `checkpoint` was verified."""

    entry: Entry
    leaf_hash: bytes
    proof: list[bytes]
    checkpoint: Checkpoint


@dataclass(frozen=True, slots=True)
class Admission:
    """A job the vault admitted: its run id (the digest of `inputs`), the run's `run` pin,
    verified, whether the run is new, and a replay's slot in its team's quota."""

    run_id: str
    inputs: RunInputs
    entry: ProvenEntry
    new: bool
    lease: str
    # The team the vault admitted the job for; the run's pin may name the team that first
    # admitted the same inputs.
    team: str

    @property
    def seed(self) -> int:
        return self.inputs.seed


@dataclass(frozen=True, slots=True)
class Credentials:
    """How a client proves who it is: a bearer token, TLS with the server's CA, and a client
    certificate for mutual TLS (all PEM bytes)."""

    token: str = ""
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds the bearer token to every call. (gRPC's own call credentials need TLS; a vault on
    loopback or a private network may run without it.)"""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def open_channel(target: str, credentials: Credentials | None = None) -> grpc.Channel:
    creds = credentials or Credentials()
    if creds.ca or creds.cert:
        channel = grpc.secure_channel(
            target,
            grpc.ssl_channel_credentials(
                root_certificates=creds.ca, private_key=creds.key, certificate_chain=creds.cert
            ),
            options=CHANNEL_OPTIONS,
        )
    else:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if creds.token:
        return grpc.intercept_channel(channel, _Bearer(creds.token))
    return channel


def default_author() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


class StateFile:
    """The client's last verified checkpoint (and the vault key it trusts), kept in a small JSON
    file, updated atomically under a lock so concurrent commands cannot roll it back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state: dict[str, Any] = {}
                if self.path.exists():
                    try:
                        state = json.loads(self.path.read_text())
                    except (OSError, ValueError) as exc:
                        raise VerificationError(
                            f"client state file {self.path} is unreadable: {exc}"
                        ) from None
                before = dict(state)
                yield state
                if state != before:
                    tmp = self.path.with_suffix(".tmp")
                    with open(tmp, "w") as f:
                        json.dump(state, f, indent=1, sort_keys=True)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


class _BackgroundHash:
    """Hashes on its own thread (hashlib and blake3 release the GIL), so that receiving,
    hashing and writing overlap; the bounded queue keeps memory bounded. For fewer than
    `threaded_from` bytes, a thread costs more than it saves, and it hashes as it is fed."""

    def __init__(self, algorithm: str, size: int, threaded_from: int = 4 * PUT_CHUNK) -> None:
        self._hash: Any = hashlib.sha256() if algorithm == "sha256" else blake3.blake3()
        self._queue: queue.Queue[bytes | None] | None = None
        self._thread: threading.Thread | None = None
        if size >= threaded_from:
            self._queue = queue.Queue(maxsize=8)
            self._thread = threading.Thread(target=self._run, name="pinvault-hash", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._queue is not None
        while (data := self._queue.get()) is not None:
            self._hash.update(data)

    def update(self, data: bytes) -> None:
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
    end (a file that appears only once the whole digest matched)."""

    def __init__(
        self,
        responses: Iterator[pb.GetResponse],
        requested: Digest,
        *,
        check_chunks: bool = True,
        handed_off: int | None = None,
    ) -> None:
        super().__init__()
        self._responses = responses
        # The caller's file, handed to the server, which writes each chunk into it instead of
        # sending its bytes; the bytes are read back from it here and checked as if received.
        self._handed_off = handed_off
        with _rpc():
            first = next(responses, None)
        if first is None or first.WhichOneof("part") != "header":
            raise IntegrityError("the server's answer to a get did not start with a header")
        header = first.header
        self.info = BlobInfo.from_wire(header.blob)
        if requested not in (self.info.sha256, self.info.blake3):
            raise IntegrityError(
                f"asked for {requested}, the server answered with {self.info.sha256}"
            )
        self._start = header.offset
        self._end = header.offset + header.length
        self._chunk_size = header.chunk_size
        self._whole = header.offset == 0 and header.length == self.info.size
        if handed_off is not None and not self._whole:
            raise IntegrityError("the server answered a get into a handed-off file with a range")
        self._check_chunks = check_chunks or not self._whole
        self._hash = _BackgroundHash(requested.algorithm, header.length) if self._whole else None
        self._requested = requested
        self._buffer = memoryview(b"")
        self._position = self._start
        self._done = False

    def readable(self) -> bool:
        return True

    def _next_chunk(self) -> bool:
        with _rpc():
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
        data = chunk.data if self._handed_off is None else self._written(chunk)
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

    def _written(self, chunk: pb.Chunk) -> bytes:
        """What the server wrote into the handed-off file for this chunk."""
        assert self._handed_off is not None
        if chunk.data:
            raise IntegrityError("the server sent bytes for a get into a handed-off file")
        wanted = max(min(self._chunk_size, self._end - chunk.offset), 0)
        data = os.pread(self._handed_off, wanted, chunk.offset)
        if len(data) != wanted:
            raise IntegrityError(
                f"{self._requested}: the server wrote {len(data)} bytes at offset "
                f"{chunk.offset}, expected {wanted}"
            )
        return data

    def readinto(self, buffer: Any) -> int:
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


class VaultClient:
    """A connection to one vault server.

    `state` is where the last verified checkpoint is kept; `verifier_key` pins the vault's
    checkpoint key (otherwise the key is trusted on first use and kept in the state file)."""

    def __init__(
        self,
        target: str,
        *,
        state: Path | None = None,
        verifier_key: str | None = None,
        author: str | None = None,
        team: str | None = None,
        timeout: float | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.target = target
        self.channel = open_channel(target, credentials)
        self.store = rpc.StoreStub(self.channel)
        self.ledger = rpc.LedgerStub(self.channel)
        self.admission = rpc.AdmissionStub(self.channel)
        self.tokens = rpc.TokensStub(self.channel)
        self.state = StateFile(state) if state else None
        self._verifier_key = verifier_key
        self._memory_state: dict[str, Any] = {}
        self.author = author or default_author()
        # Empty: the vault takes the credential's team (in local mode, "local").
        self.team = team or ""
        self.timeout = timeout
        # Where this client may hand files to the server (vault/handoff.py), once asked.
        self._desk: pb.HandoffInfo | None = None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> VaultClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ content

    def put(
        self,
        source: str | os.PathLike[str] | IO[bytes] | bytes,
        *,
        expected: str | None = None,
        progress: Callable[[int], None] | None = None,
        handoff: bool | None = None,
    ) -> PutResult:
        """Store bytes in the vault; returns once they are durable. The client hashes what it
        sends (BLAKE3, cheap) and checks the server stored exactly that.

        A file of at least `HANDOFF_MIN` bytes on the vault's own host is handed to the server,
        which reads it itself (vault/handoff.py); anything else streams. `handoff=True` asks
        for the handoff whatever the size and fails if it cannot be had; `False` always
        streams."""
        if expected:
            Digest.parse(expected)
        if handoff is not False and isinstance(source, (str, os.PathLike)):
            result = self._put_handed_off(source, expected, progress, required=bool(handoff))
            if result is not None:
                return result
        elif handoff:
            raise InvalidArgument("only a file named by its path can be handed off")
        local = blake3.blake3()

        def requests(stream: IO[bytes]) -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(expected_digest=expected or ""))
            while True:
                data = stream.read(PUT_CHUNK)
                if not data:
                    return
                local.update(data)
                if progress:
                    progress(len(data))
                yield pb.PutRequest(data=data)

        with _open_source(source) as stream, _rpc():
            response = self.store.Put(requests(stream), timeout=self.timeout)
        return _stored(response, local.digest())

    def _put_handed_off(
        self,
        source: str | os.PathLike[str],
        expected: str | None,
        progress: Callable[[int], None] | None,
        *,
        required: bool,
    ) -> PutResult | None:
        """The put of a file handed to the server, or None when it should stream instead."""
        try:
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {os.fspath(source)}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if not required and size < HANDOFF_MIN:
                return None
            ticket = self._hand_off(fd, "read", required=required)
            if ticket is None:
                return None
            # What the client sends is its file: hash it while the server reads it too.
            local = _FileHash(fd, size)
            try:
                header = pb.PutHeader(
                    expected_digest=expected or "", handoff=ticket, handoff_size=size
                )
                with _rpc():
                    response = self.store.Put(
                        iter([pb.PutRequest(header=header)]), timeout=self.timeout
                    )
            finally:
                sent = local.digest()
        finally:
            os.close(fd)
        if progress:
            progress(size)
        return _stored(response, sent)

    def _hand_off(self, fd: int, mode: Mode, *, required: bool) -> str | None:
        """A ticket for `fd` from the server's handoff socket, or None (or, if `required`,
        Unavailable) when this client cannot hand files to it."""
        try:
            if self._desk is None:
                with _rpc():
                    self._desk = self.store.Handoff(pb.HandoffRequest(), timeout=self.timeout)
            if not self._desk.socket:
                raise OSError("the vault server takes no handed-off files")
            return hand_off(self._desk.socket, self._desk.instance, fd, mode)
        except (OSError, VaultError) as exc:
            if required:
                raise Unavailable(f"cannot hand the file to the vault server: {exc}") from None
            return None

    def put_many(
        self,
        sources: Sequence[str | os.PathLike[str] | bytes],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PutResult]:
        """Store many small blobs (files or bytes, each at most BATCH_BLOB bytes) in one call,
        whose syncs the vault shares among them; returns one result per source, in order, once
        every blob is durable. A call takes at most 10,000 blobs and 256 MiB. As `put` does,
        the client hashes what it sends and checks the vault stored exactly that; a blob the
        vault refused (its bytes do not match its `expected` digest) is an IntegrityError
        naming it, though the others of the call are stored."""
        if expected is not None and len(expected) != len(sources):
            raise InvalidArgument(
                f"put_many: {len(expected)} expected digests for {len(sources)} sources"
            )
        wanted = [str(Digest.parse(e)) if e else "" for e in expected or [None] * len(sources)]
        # The BLAKE3 and size of each blob as sent. A blob sent with its expected digest needs
        # no hash of its own: the vault refuses it unless its bytes hash to that digest, and the
        # answer is checked to name it.
        sent: list[tuple[bytes | None, int]] = []
        failed: list[BaseException] = []

        def requests() -> Iterator[pb.PutBatchRequest]:
            try:
                blobs: list[pb.PutBatchBlob] = []
                size = 0
                for source, digest in zip(sources, wanted, strict=True):
                    data = _read_small(source)
                    local = None if digest else blake3.blake3(data).digest()
                    sent.append((local, len(data)))
                    if blobs and size + len(data) > BATCH_MESSAGE:
                        yield pb.PutBatchRequest(blobs=blobs)
                        blobs, size = [], 0
                    blobs.append(pb.PutBatchBlob(expected_digest=digest, data=data))
                    size += len(data)
                if blobs:
                    yield pb.PutBatchRequest(blobs=blobs)
            except BaseException as exc:  # gRPC reports it only as a cancelled call
                failed.append(exc)
                raise

        try:
            with _rpc():
                response = self.store.PutBatch(requests(), timeout=self.timeout)
        except VaultError:
            if failed:
                raise failed[0] from None
            raise
        if len(response.results) != len(sources):
            raise IntegrityError(
                f"the vault answered {len(response.results)} results "
                f"for a batch of {len(sources)} blobs"
            )
        results: list[PutResult] = []
        refused: list[str] = []
        for number, (source, answer) in enumerate(zip(sources, response.results, strict=True)):
            label = f"blob {number}" if isinstance(source, bytes) else os.fspath(source)
            if answer.error:
                refused.append(f"{label}: {answer.error}")
                continue
            blob = BlobInfo.from_wire(answer.blob)
            local, size = sent[number]
            digest = Digest.parse(wanted[number]) if wanted[number] else None
            if (
                (local is not None and blob.blake3.raw != local)
                or blob.size != size
                or (digest is not None and digest not in (blob.sha256, blob.blake3))
            ):
                sent_as = f"blake3:{local.hex()}" if local is not None else str(digest)
                raise IntegrityError(
                    f"the vault stored {blob.sha256} ({blob.size} bytes) for {label} but the "
                    f"client sent {sent_as} ({size} bytes)"
                )
            results.append(PutResult(blob, answer.created))
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise IntegrityError(f"{refused[0]}{more}")
        return results

    def open(
        self, digest: str, *, offset: int = 0, length: int | None = None, check_chunks: bool = True
    ) -> BlobReader:
        """A verified, file-like reader of a blob or a range of it."""
        wanted = Digest.parse(digest)
        request = pb.GetRequest(digest=str(wanted), offset=offset)
        if length is not None:
            request.length = length
        with _rpc():
            return BlobReader(
                self.store.Get(request, timeout=self.timeout), wanted, check_chunks=check_chunks
            )

    def get(
        self,
        digest: str,
        path: str | os.PathLike[str],
        *,
        offset: int = 0,
        length: int | None = None,
        progress: Callable[[int], None] | None = None,
        handoff: bool | None = None,
    ) -> BlobInfo:
        """Write a verified blob (or range) to `path`; the file appears only once verified.

        For a whole blob, a client on the vault's own host hands the new file to the server,
        which writes each verified chunk into it (vault/handoff.py); the client then checks the
        whole digest of what it reads back. Ranges, and `handoff=False`, stream; `handoff=True`
        fails if the handoff cannot be had."""
        target = Path(path)
        if target.is_dir():
            raise InvalidArgument(f"cannot write {target}: it is a folder")
        whole = offset == 0 and length is None
        if handoff and not whole:
            raise InvalidArgument("a range cannot be handed off: it streams")
        wanted = Digest.parse(digest)
        tmp = target.with_name(f".{target.name}.pinvault-partial")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise InvalidArgument(f"cannot write {target}: {exc.strerror}") from None
        try:
            try:
                ticket = None
                if whole and handoff is not False:
                    ticket = self._hand_off(fd, "write", required=bool(handoff))
                request = pb.GetRequest(digest=str(wanted), offset=offset, handoff=ticket or "")
                if length is not None:
                    request.length = length
                with _rpc():
                    # The file appears only once the whole digest matched, so per-chunk checks
                    # add nothing.
                    reader = BlobReader(
                        self.store.Get(request, timeout=self.timeout),
                        wanted,
                        check_chunks=False,
                        handed_off=fd if ticket else None,
                    )
                for piece in reader.chunks():
                    if not ticket:
                        write_all(fd, piece)
                    if progress:
                        progress(len(piece))
                if ticket and os.fstat(fd).st_size != reader.info.size:
                    raise IntegrityError(
                        f"{wanted}: the server wrote past the end of the blob into {target}"
                    )
            finally:
                os.close(fd)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return reader.info

    def stat(self, digest: str) -> Stat:
        with _rpc():
            response = self.store.Stat(pb.StatRequest(digest=str(Digest.parse(digest))))
        return Stat(
            BlobInfo.from_wire(response.blob), [Entry.decode(e.body) for e in response.pins]
        )

    def find_missing(self, digests: Sequence[str]) -> list[str]:
        with _rpc():
            return list(self.store.FindMissing(pb.FindMissingRequest(digests=digests)).missing)

    def scrub(self, *, rate_mb_s: float = 0.0) -> Iterator[pb.ScrubProgress]:
        """Have the vault re-verify every copy on every tier now, repairing bad ones
        (Store.Scrub): its progress, then its totals, in a message marked `finished`."""
        with _rpc():
            yield from self.store.Scrub(pb.ScrubRequest(rate_mb_s=rate_mb_s))

    def verify_blobs(self) -> Iterator[pb.VerifyBlobsProgress]:
        with _rpc():
            yield from self.store.VerifyBlobs(pb.VerifyBlobsRequest())

    # ------------------------------------------------------------------ ledger

    def pin(
        self,
        kind: str,
        digests: str | Sequence[str],
        *,
        meta: dict[str, str] | None = None,
        external: bool = False,
    ) -> ProvenEntry:
        """Append a pin and return it once its inclusion in a signed checkpoint is verified."""
        subjects = [digests] if isinstance(digests, str) else list(digests)
        request = pb.PinRequest(
            kind=kind, subjects=subjects, meta=meta or {}, external=external, author=self.author
        )
        with _rpc():
            response = self.ledger.Pin(request, timeout=self.timeout)
        entry = Entry.decode(response.entry.body)
        if entry.kind != kind or dict(entry.meta) != dict(meta or {}) or entry.external != external:
            raise VerificationError("the vault recorded a different entry than the one asked for")
        return self.prove(response.entry.index, response.entry.body)

    def prove(self, index: int, body: bytes) -> ProvenEntry:
        """Verify that `body` is entry `index` of the vault's ledger."""
        with _rpc():
            proof = self.ledger.GetInclusionProof(pb.InclusionProofRequest(index=index))
        checkpoint = self._advance(proof.checkpoint.note)
        leaf = leaf_hash(body)
        path = list(proof.hashes)
        verify_inclusion(leaf, index, checkpoint.size, path, checkpoint.root)
        return ProvenEntry(Entry.decode(body), leaf, path, checkpoint)

    def lookup(self, digest: str) -> list[ProvenEntry]:
        """The entries that pin a digest, each verified to be in a signed checkpoint that is
        consistent with everything this client verified before."""
        wanted = str(Digest.parse(digest))
        with self._trusted() as trusted:
            with _rpc():
                response = self.ledger.Lookup(
                    pb.LookupRequest(digest=wanted, known_size=trusted.size), timeout=self.timeout
                )
            checkpoint = trusted.update(response.checkpoint.note, list(response.consistency.hashes))
        return [self._check_proven(p, checkpoint, wanted) for p in response.entries]

    def lookup_many(self, digests: Sequence[str]) -> dict[str, list[ProvenEntry]]:
        with self._trusted() as trusted:
            with _rpc():
                response = self.ledger.LookupBatch(
                    pb.LookupBatchRequest(digests=digests, known_size=trusted.size),
                    timeout=self.timeout,
                )
            checkpoint = trusted.update(response.checkpoint.note, list(response.consistency.hashes))
        return {
            r.digest: [self._check_proven(p, checkpoint, r.digest) for p in r.entries]
            for r in response.results
        }

    def _check_proven(
        self, proven: pb.ProvenEntry, checkpoint: Checkpoint, digest: str
    ) -> ProvenEntry:
        leaf = leaf_hash(proven.entry.body)
        path = list(proven.inclusion)
        verify_inclusion(leaf, proven.entry.index, checkpoint.size, path, checkpoint.root)
        entry = Entry.decode(proven.entry.body)
        if entry.index != proven.entry.index:
            raise VerificationError(
                f"entry {proven.entry.index} says it is entry {entry.index}",
                index=proven.entry.index,
            )
        return ProvenEntry(entry, leaf, path, checkpoint)

    # ------------------------------------------------------------------ admission

    def admit(
        self,
        *,
        image: str,
        dataset: str,
        seed: str | int,
        config: str = "",
        team: str = "",
        run_id: str = "",
        replay_of: str = "",
    ) -> Admission:
        """Ask the vault to admit a job on these inputs. The answer is checked: the run id is
        the digest of these very inputs, and the run's pin is proved in a signed checkpoint."""
        inputs = RunInputs.checked(image=image, dataset=dataset, config=config, seed=seed)
        with self._trusted() as trusted:
            request = pb.AdmitRequest(
                image=inputs.image,
                dataset=inputs.dataset,
                config=inputs.config,
                seed=str(inputs.seed),
                team=team or self.team,
                run_id=run_id,
                replay_of=replay_of,
                author=self.author,
                known_size=trusted.size,
            )
            with _rpc():
                response = self.admission.Admit(request, timeout=self.timeout)
            checkpoint = trusted.update(response.checkpoint.note, list(response.consistency.hashes))
        if response.inputs != inputs.encode() or response.run_id != inputs.run_id:
            raise VerificationError(
                f"the vault admitted run {response.run_id}, but these inputs make {inputs.run_id}"
            )
        proven = self._check_proven(response.entry, checkpoint, inputs.run_id)
        entry = proven.entry
        if (
            entry.kind != "run"
            or inputs.run_id not in entry.subjects
            or entry.meta.get("seed") != str(inputs.seed)
        ):
            raise VerificationError(
                f"the vault's pin for run {inputs.run_id} (entry {entry.index}) is not a pin of "
                "this run"
            )
        return Admission(inputs.run_id, inputs, proven, response.new, response.lease, response.team)

    def release_replay(self, lease: str, *, team: str = "") -> None:
        with _rpc():
            self.admission.ReleaseReplay(
                pb.ReleaseReplayRequest(lease=lease, team=team or self.team),
                timeout=self.timeout,
            )

    # ------------------------------------------------------------------ tokens

    def create_token(self, *, name: str, team: str, role: str) -> tuple[pb.TokenInfo, str]:
        """A new bearer token and its secret, which the vault shows this once."""
        with _rpc():
            response = self.tokens.CreateToken(
                pb.CreateTokenRequest(name=name, team=team, role=role), timeout=self.timeout
            )
        return response.token, response.secret

    def list_tokens(self) -> list[pb.TokenInfo]:
        with _rpc():
            return list(self.tokens.ListTokens(pb.ListTokensRequest(), timeout=self.timeout).tokens)

    def revoke_token(self, token_id: str) -> None:
        with _rpc():
            self.tokens.RevokeToken(pb.RevokeTokenRequest(token_id=token_id), timeout=self.timeout)

    def checkpoint(self) -> Checkpoint:
        """The latest checkpoint, verified and proved consistent with the last one verified."""
        return self._advance(self.checkpoint_note(verify=False))

    def checkpoint_note(self, *, verify: bool = True) -> str:
        """The latest checkpoint's signed note text (verified unless asked not to)."""
        with _rpc():
            note: str = self.ledger.GetCheckpoint(pb.GetCheckpointRequest()).note
        if verify:
            self._advance(note)
        return note

    def _advance(self, note: str) -> Checkpoint:
        with self._trusted() as trusted:
            proof: list[bytes] = []
            size = _note_size(note)
            if 0 < trusted.size < size:
                with _rpc():
                    proof = list(
                        self.ledger.GetConsistencyProof(
                            pb.ConsistencyProofRequest(old_size=trusted.size, new_size=size)
                        ).hashes
                    )
            return trusted.update(note, proof)

    def inclusion_proof(self, index: int, size: int = 0) -> pb.InclusionProof:
        with _rpc():
            proof: pb.InclusionProof = self.ledger.GetInclusionProof(
                pb.InclusionProofRequest(index=index, size=size)
            )
        return proof

    def consistency_proof(self, old_size: int, new_size: int = 0) -> pb.ConsistencyProof:
        with _rpc():
            proof: pb.ConsistencyProof = self.ledger.GetConsistencyProof(
                pb.ConsistencyProofRequest(old_size=old_size, new_size=new_size)
            )
        return proof

    def log(
        self,
        *,
        start: int = 0,
        limit: int | None = None,
        kind: str = "",
        digest: str = "",
        author: str = "",
        since: str = "",
        until: str = "",
    ) -> Iterator[Entry]:
        """Entries in index order, page by page, filtered on the server."""
        left = limit
        while True:
            page = 1000 if left is None else min(left, 1000)
            with _rpc():
                response = self.ledger.Log(
                    pb.LogRequest(
                        start=start,
                        limit=page,
                        kind=kind,
                        digest=digest,
                        author=author,
                        since=since,
                        until=until,
                    )
                )
            for e in response.entries:
                entry = Entry.decode(e.body)
                if entry.index != e.index:
                    raise VerificationError(
                        f"entry {e.index} says it is entry {entry.index}", index=e.index
                    )
                yield entry
            if left is not None:
                left -= len(response.entries)
            if not response.next or (left is not None and left <= 0):
                return
            start = response.next

    def verifier(self) -> Verifier:
        with self._trusted() as trusted:
            return trusted.verifier

    def audit(self, progress: Callable[[int, int], None] | None = None) -> AuditReport:
        """Re-derive the whole ledger from the server's stored rows (see vault.audit)."""
        with self._trusted() as trusted:
            verifier, origin = trusted.verifier, trusted.origin
        with _rpc():
            notes = [
                n
                for batch in self.ledger.ReadCheckpoints(pb.ReadCheckpointsRequest())
                for n in batch.notes
            ]
            auditor = Auditor(verifier, origin, notes)
            head = 0
            for batch in self.ledger.ReadEntries(pb.ReadEntriesRequest(start=0)):
                head = batch.head_size
                auditor.feed(batch.entries)
                if progress:
                    progress(auditor.report.entries, head)
        return auditor.finish(head)

    # ------------------------------------------------------------------ trust

    @contextlib.contextmanager
    def _trusted(self) -> Iterator[TrustedLog]:
        with self._state() as state:
            if "verifier" not in state:
                with _rpc():
                    key = self.ledger.GetVerifierKey(pb.VerifierKeyRequest())
                if self._verifier_key and key.key != self._verifier_key:
                    raise VerificationError(
                        f"the vault's checkpoint key is {key.key}, "
                        f"not the configured {self._verifier_key}"
                    )
                state.update(TrustedLog(Verifier.from_string(key.key), key.origin).to_dict())
            elif self._verifier_key and state["verifier"] != self._verifier_key:
                raise VerificationError(
                    f"the client state trusts key {state['verifier']}, not the configured "
                    f"{self._verifier_key}; remove the state file only if the vault's key "
                    "was rotated on purpose"
                )
            trusted = TrustedLog.from_dict(state)
            yield trusted
            state.update(trusted.to_dict())

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        if self.state is None:
            yield self._memory_state
        else:
            with self.state.locked() as state:
                yield state


def _note_size(note: str) -> int:
    try:
        return int(note.split("\n")[1])
    except (IndexError, ValueError):
        raise VerificationError("malformed checkpoint note: no size line") from None


def _stored(response: pb.PutResponse, sent_blake3: bytes) -> PutResult:
    """The answer to a put, once checked to name what the client sent."""
    result = PutResult(BlobInfo.from_wire(response.blob), response.created)
    if result.blob.blake3.raw != sent_blake3:
        raise IntegrityError(
            f"the vault stored {result.blob.blake3} but the client sent blake3:{sent_blake3.hex()}"
        )
    return result


class _FileHash:
    """The BLAKE3 of a file's first `size` bytes, computed on a thread of its own."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._hash = blake3.blake3()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="pinvault-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        try:
            while offset < self._size:
                piece = os.pread(self._fd, min(PUT_CHUNK * 8, self._size - offset), offset)
                if not piece:
                    break
                self._hash.update(piece)
                offset += len(piece)
        except OSError as exc:
            self._error = exc

    def digest(self) -> bytes:
        self._thread.join()
        if self._error is not None:
            raise InvalidArgument(f"cannot read the file being put: {self._error.strerror}")
        return bytes(self._hash.digest())


@contextlib.contextmanager
def _open_source(source: str | os.PathLike[str] | IO[bytes] | bytes) -> Iterator[IO[bytes]]:
    if isinstance(source, bytes):
        yield io.BytesIO(source)
    elif isinstance(source, (str, os.PathLike)):
        try:
            f = open(source, "rb")  # noqa: SIM115
        except OSError as exc:
            raise InvalidArgument(f"cannot read {os.fspath(source)}: {exc.strerror}") from None
        with f:
            yield f
    else:
        yield source


def _read_small(source: str | os.PathLike[str] | bytes) -> bytes:
    """The whole of a blob for put_many, refused if it is larger than a batch takes."""
    if isinstance(source, bytes):
        data = source
    else:
        try:
            with open(source, "rb") as f:
                data = f.read(BATCH_BLOB + 1)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {os.fspath(source)}: {exc.strerror}") from None
    if len(data) > BATCH_BLOB:
        name = "a blob" if isinstance(source, bytes) else os.fspath(source)
        raise InvalidArgument(
            f"{name} has more than {BATCH_BLOB} bytes: put_many takes small blobs, use put"
        )
    return data


def read_all(reader: BlobReader) -> bytes:
    return b"".join(bytes(c) for c in reader.chunks())


def iter_digests(values: Iterable[str]) -> list[str]:
    return [str(Digest.parse(v)) for v in values]
