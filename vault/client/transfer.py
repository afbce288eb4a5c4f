"""Moving blobs: put (streamed, or a file handed to the server on its own host), put_many in
batches, and get into a file that appears only once verified. The client hashes what it sends
and checks the vault stored exactly that."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Final

import blake3

from vault.client.channel import rpc_errors
from vault.client.handoff import HANDOFF_MIN, Mode, hand_off
from vault.client.reader import BlobReader
from vault.client.results import BlobInfo, PutResult
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, Unavailable, VaultError
from vault.files import write_all
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

PUT_CHUNK: Final = 1 << 20
# put_many: the largest blob a batch takes (the vault's limit), and about how many bytes of
# blobs go in one message of the stream.
BATCH_BLOB: Final = 4 << 20
BATCH_MESSAGE: Final = 4 << 20


class Transfer:
    """The work behind VaultClient's put, put_many, open and get (documented there): the Store
    stub and timeout they call with, and the server's handoff desk, asked for once."""

    def __init__(self, store: rpc.StoreStub, timeout: float | None) -> None:
        self._store = store
        self._timeout = timeout
        # Where this client may hand files to the server (vault.client.handoff), once asked.
        self._desk: pb.HandoffInfo | None = None

    def put(
        self,
        source: str | os.PathLike[str] | IO[bytes] | bytes,
        *,
        expected: str | None = None,
        progress: Callable[[int], None] | None = None,
        handoff: bool | None = None,
    ) -> PutResult:
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

        with _open_source(source) as stream, rpc_errors():
            response = self._store.Put(requests(stream), timeout=self._timeout)
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
                with rpc_errors():
                    response = self._store.Put(
                        iter([pb.PutRequest(header=header)]), timeout=self._timeout
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
                with rpc_errors():
                    self._desk = self._store.Handoff(pb.HandoffRequest(), timeout=self._timeout)
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
            with rpc_errors():
                response = self._store.PutBatch(requests(), timeout=self._timeout)
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
        wanted = Digest.parse(digest)
        request = pb.GetRequest(digest=str(wanted), offset=offset)
        if length is not None:
            request.length = length
        with rpc_errors():
            return BlobReader(
                self._store.Get(request, timeout=self._timeout), wanted, check_chunks=check_chunks
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
                with rpc_errors():
                    # The file appears only once the whole digest matched, so per-chunk checks
                    # add nothing.
                    reader = BlobReader(
                        self._store.Get(request, timeout=self._timeout),
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
