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

from vault.audit import Auditor, AuditReport
from vault.checkpoint import Checkpoint, Verifier
from vault.digest import Digest
from vault.entry import Entry
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
    VaultError,
    VerificationError,
)
from vault.merkle import leaf_hash, verify_inclusion
from vault.trust import TrustedLog
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

PUT_CHUNK: Final = 1 << 20
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
    hashing and writing overlap; the bounded queue keeps memory bounded."""

    def __init__(self, algorithm: str) -> None:
        self._hash: Any = hashlib.sha256() if algorithm == "sha256" else blake3.blake3()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
        self._thread = threading.Thread(target=self._run, name="pinvault-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._hash.update(data)

    def update(self, data: bytes) -> None:
        self._queue.put(data)

    def digest(self) -> bytes:
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
        self, responses: Iterator[pb.GetResponse], requested: Digest, *, check_chunks: bool = True
    ) -> None:
        super().__init__()
        self._responses = responses
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
        self._whole = header.offset == 0 and header.length == self.info.size
        self._check_chunks = check_chunks or not self._whole
        self._hash = _BackgroundHash(requested.algorithm) if self._whole else None
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
        if self._check_chunks and blake3.blake3(chunk.data).digest() != chunk.hash:
            raise IntegrityError(
                f"{self._requested}: chunk at offset {chunk.offset} failed its check"
            )
        if self._hash is not None:
            self._hash.update(chunk.data)
        lo = max(self._position - chunk.offset, 0)
        hi = min(self._end - chunk.offset, len(chunk.data))
        if chunk.offset > self._position or lo > hi:
            raise IntegrityError(
                f"{self._requested}: chunk at offset {chunk.offset} is out of order"
            )
        self._buffer = memoryview(chunk.data)[lo:hi]
        self._position += hi - lo
        return True

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
        timeout: float | None = None,
    ) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.store = rpc.StoreStub(self.channel)
        self.ledger = rpc.LedgerStub(self.channel)
        self.state = StateFile(state) if state else None
        self._verifier_key = verifier_key
        self._memory_state: dict[str, Any] = {}
        self.author = author or default_author()
        self.timeout = timeout

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
    ) -> PutResult:
        """Stream bytes to the vault; returns once they are durable. The client hashes what it
        sends (BLAKE3, cheap) and checks the server stored exactly that."""
        if expected:
            Digest.parse(expected)
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
        result = PutResult(BlobInfo.from_wire(response.blob), response.created)
        if result.blob.blake3.raw != local.digest():
            raise IntegrityError(
                f"the vault stored {result.blob.blake3} but the client sent "
                f"blake3:{local.hexdigest()}"
            )
        return result

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
    ) -> BlobInfo:
        """Write a verified blob (or range) to `path`; the file appears only once verified."""
        target = Path(path)
        if target.is_dir():
            raise InvalidArgument(f"cannot write {target}: it is a folder")
        tmp = target.with_name(f".{target.name}.pinvault-partial")
        # The file appears only once the whole digest matched, so per-chunk checks add nothing.
        reader = self.open(digest, offset=offset, length=length, check_chunks=False)
        try:
            try:
                out = open(tmp, "wb")  # noqa: SIM115
            except OSError as exc:
                raise InvalidArgument(f"cannot write {target}: {exc.strerror}") from None
            with out:
                for piece in reader.chunks():
                    out.write(piece)
                    if progress:
                        progress(len(piece))
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


def read_all(reader: BlobReader) -> bytes:
    return b"".join(bytes(c) for c in reader.chunks())


def iter_digests(values: Iterable[str]) -> list[str]:
    return [str(Digest.parse(v)) for v in values]
