"""Moving blobs: put (streamed, or a file handed to the server on its own host), put_many in
batches, and get into a file that appears only once verified. The client hashes what it sends
and checks the vault stored exactly that."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Final

import blake3

from vault.client.channel import rpc_errors
from vault.client.handoff import HANDOFF_MIN, Mode, hand_off, open_pipe
from vault.client.partial import (
    create_partial,
    keep_verified,
    open_resumable,
    remove_if_ours,
    settle,
)
from vault.client.ranges import ChunkRootHasher, VerifiedChunks, range_answer
from vault.client.reader import BackgroundHash, BlobReader, read_chunk_hashes
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


class _CommitGate:
    """The commit of a client-streaming put is sent only once the thread that called the put
    lets it. gRPC reads the requests on a thread of its own, which may reach the end of the
    source (a pipe whose writer was stopped by the same Ctrl-C) before the calling thread has
    run its interrupt; the commit waits for that thread, so an interrupt raised there stops it."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self._go = threading.Event()
        self._stopped = False

    def passes(self) -> bool:
        """On the requests' thread, at the commit: whether to send it."""
        self.ready.set()
        self._go.wait()
        return not self._stopped

    def open(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stopped = True
        self._go.set()


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
        chunk_root: bool = False,
    ) -> PutResult:
        if expected:
            Digest.parse(expected)
        if handoff is not False and isinstance(source, (str, os.PathLike)):
            result = self._put_handed_off(
                source, expected, progress, required=bool(handoff), chunk_root=chunk_root
            )
            if result is not None:
                return result
        elif handoff:
            raise InvalidArgument("only a file named by its path can be handed off")
        local = blake3.blake3()
        # The chunk root of what is sent, if asked: a pin of the blob records it
        # (vault.client.ranges).
        chunked = ChunkRootHasher() if chunk_root else None

        def requests(stream: IO[bytes], gate: _CommitGate) -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(expected_digest=expected or ""))
            size = 0
            while data := stream.read(PUT_CHUNK):
                local.update(data)
                if chunked is not None:
                    chunked.update(data)
                size += len(data)
                if progress:
                    progress(len(data))
                yield pb.PutRequest(data=data)
            # Only a source read to its end commits the blob; a put stopped before stores nothing.
            meant = expected or f"blake3:{local.hexdigest()}"
            if gate.passes():
                yield pb.PutRequest(commit=pb.PutCommit(size=size, digest=meant))

        with _open_source(source) as stream:
            response = self._call(self._store.Put, lambda gate: requests(stream, gate))
        return _stored(response, local.digest(), chunked.root() if chunked else None)

    def _call(self, method: Any, requests: Callable[[_CommitGate], Iterator[Any]]) -> Any:
        """A client-streaming call that an interrupt (Ctrl-C, or SIGTERM raised as one) in the
        calling thread cancels at once, and whose commit that thread lets through: an interrupt
        never lets a commit out, whenever the requests' thread reached it."""
        gate = _CommitGate()
        with rpc_errors():
            call = method.future(requests(gate), timeout=self._timeout)
            call.add_done_callback(lambda _: gate.ready.set())
            try:
                gate.ready.wait()
                gate.open()
                return call.result()
            except BaseException:
                gate.stop()
                call.cancel()
                raise

    def _put_handed_off(
        self,
        source: str | os.PathLike[str],
        expected: str | None,
        progress: Callable[[int], None] | None,
        *,
        required: bool,
        chunk_root: bool,
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
            # What the client sends is its file: hash it while the server reads it too. The
            # commit follows once it is hashed.
            local = _FileHash(fd, size, chunk_root=chunk_root)

            def requests(gate: _CommitGate) -> Iterator[pb.PutRequest]:
                yield pb.PutRequest(
                    header=pb.PutHeader(
                        expected_digest=expected or "", handoff=ticket, handoff_size=size
                    )
                )
                meant = expected or f"blake3:{local.digest().hex()}"
                if gate.passes():
                    yield pb.PutRequest(commit=pb.PutCommit(size=size, digest=meant))

            try:
                response = self._call(self._store.Put, requests)
            finally:
                sent = local.digest()
        finally:
            os.close(fd)
        if progress:
            progress(size)
        return _stored(response, sent, local.chunk_root())

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
        parsed = [Digest.parse(e) if e else None for e in expected or [None] * len(sources)]
        wanted = [str(digest) if digest else "" for digest in parsed]
        # The BLAKE3 and size of each blob as sent. A blob sent with its expected digest needs
        # no hash of its own: the vault refuses it unless its bytes hash to that digest, and the
        # answer is checked to name it.
        sent: list[tuple[bytes | None, int]] = []
        failed: list[BaseException] = []

        def requests(gate: _CommitGate) -> Iterator[pb.PutBatchRequest]:
            try:
                # Each blob is added to the message in place: one built apart and listed would
                # be copied in again, its bytes too.
                message = pb.PutBatchRequest()
                size = 0
                for source, digest in zip(sources, wanted, strict=True):
                    data = _read_small(source)
                    local = None if digest else blake3.blake3(data).digest()
                    sent.append((local, len(data)))
                    if message.blobs and size + len(data) > BATCH_MESSAGE:
                        yield message
                        message, size = pb.PutBatchRequest(), 0
                    message.blobs.add(expected_digest=digest, data=data)
                    size += len(data)
                # The last message commits the batch: one stopped before stores none of it.
                message.commit.blobs = len(sent)
                message.commit.bytes = sum(n for _, n in sent)
                if gate.passes():
                    yield message
            except GeneratorExit:
                # gRPC closed the stream: the call ended first, and its status says why.
                raise
            except BaseException as exc:  # gRPC reports it only as a cancelled call
                failed.append(exc)
                raise

        try:
            response = self._call(self._store.PutBatch, requests)
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
            blob = _stored_info(answer.blob, parsed[number])
            local, size = sent[number]
            digest = parsed[number]
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
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        check_chunks: bool = True,
        chunks: VerifiedChunks | None = None,
    ) -> BlobReader:
        wanted = Digest.parse(digest)
        if offset == 0 and length is None:
            with rpc_errors():
                return BlobReader(
                    self._store.Get(pb.GetRequest(digest=str(wanted)), timeout=self._timeout),
                    wanted,
                    check_chunks=check_chunks,
                )
        if chunks is not None:
            # Bound to the digest by a signed pin's chunk root: only the range is fetched.
            answer = range_answer(self._store, self._timeout, chunks, offset, length)
            return BlobReader(answer, wanted, prechecked=True)
        # Without a chunk root, a range is checked by the server's chunk list only, which
        # nothing signed binds to the digest: the whole blob is fetched into a private spool
        # file and verified first.
        spool = _anonymous_file(spool_folder())
        try:
            info, start, count = self._fetch(wanted, spool, offset=offset, length=length)
        except BaseException:
            os.close(spool)
            raise
        return BlobReader(_spooled(spool, info, start, count), wanted)

    def copy_to(
        self,
        digest: str,
        out: int,
        *,
        offset: int = 0,
        length: int | None = None,
        spool: str | os.PathLike[str] | None = None,
        chunks: VerifiedChunks | None = None,
    ) -> BlobInfo:
        """Write a verified blob (or range) to the descriptor `out` (standard output), which
        cannot take back what it was given: the whole blob is first fetched into an unlinked
        file in `spool` (default: the user's cache folder) and its digest checked, and only
        then is any of it copied to `out`. A range of a blob whose `chunks` are verified is
        fetched alone, each chunk checked as it comes, and spooled until all of it was."""
        wanted = Digest.parse(digest)
        fd = _anonymous_file(Path(spool) if spool is not None else spool_folder())
        try:
            if chunks is not None and (offset or length is not None):
                reader = self.open(digest, offset=offset, length=length, chunks=chunks)
                for piece in reader.chunks():
                    write_all(fd, piece)
                info, start, count = reader.info, 0, os.lseek(fd, 0, os.SEEK_CUR)
            else:
                info, start, count = self._fetch(wanted, fd, offset=offset, length=length)
            _copy_out(fd, out, start, count)
        finally:
            os.close(fd)
        return info

    def sha256_of(self, digest: Digest) -> Digest:
        """The SHA-256 of the blob named by a blake3 digest, from its bytes: fetched, hashed,
        and verified against `digest` itself (the only way to tie an alias to its blob)."""
        sha = hashlib.sha256()
        self._read_verified(digest, sha.update)
        return Digest.sha256(sha.digest())

    def chunk_root_of(self, digest: Digest) -> tuple[int, bytes]:
        """The size and chunk root of a stored blob, from its bytes: fetched, hashed chunk by
        chunk, and verified against `digest` itself before the root is returned (the server's
        chunk list is not taken on its word)."""
        chunked = ChunkRootHasher()
        self._read_verified(digest, chunked.update)
        return chunked.size, chunked.root()

    def _read_verified(self, digest: Digest, take: Callable[[memoryview], object]) -> None:
        """Hand each piece of the whole blob `digest` to `take`; returns once its digest
        matched (IntegrityError otherwise), so what `take` made of it may then be used."""
        with rpc_errors():
            reader = BlobReader(
                self._store.Get(pb.GetRequest(digest=str(digest)), timeout=self._timeout),
                digest,
                check_chunks=False,
            )
        for piece in reader.chunks():
            take(piece)

    def get(
        self,
        digest: str,
        path: str | os.PathLike[str],
        *,
        offset: int = 0,
        length: int | None = None,
        progress: Callable[[int], None] | None = None,
        handoff: bool | None = None,
        chunks: VerifiedChunks | None = None,
    ) -> BlobInfo:
        target = Path(path)
        if target.is_dir():
            raise InvalidArgument(f"cannot write {target}: it is a folder")
        whole = offset == 0 and length is None
        if handoff and not whole:
            raise InvalidArgument(
                "a range cannot be handed off: the whole blob is fetched and verified first"
            )
        wanted = Digest.parse(digest)
        fd, partial = open_resumable(target, wanted) if whole else create_partial(target)

        def fill() -> BlobInfo:
            if whole:
                return self._fetch_resuming(wanted, fd, handoff=handoff, progress=progress)
            if chunks is not None:
                reader = self.open(digest, offset=offset, length=length, chunks=chunks)
                for piece in reader.chunks():
                    write_all(fd, piece)
                    if progress:
                        progress(len(piece))
                return reader.info
            # The range is verified only as part of the whole blob (see `open`), spooled
            # beside the target, on its file system.
            spool = _anonymous_file(target.parent)
            try:
                info, start, count = self._fetch(
                    wanted,
                    spool,
                    offset=offset,
                    length=length,
                    handoff=handoff,
                    progress=progress,
                )
                _copy_out(spool, fd, start, count)
            finally:
                os.close(spool)
            return info

        return settle(fd, partial, target, fill)

    def _fetch_resuming(
        self,
        wanted: Digest,
        fd: int,
        *,
        handoff: bool | None,
        progress: Callable[[int], None] | None,
    ) -> BlobInfo:
        """Write the whole blob `wanted` into the partial file `fd` and check its digest: from
        the last of the chunks it already holds that match the blob's chunk list, if any do,
        else from the start (`_fetch`)."""
        held = os.fstat(fd).st_size
        whole = BackgroundHash(wanted.algorithm, held)
        try:
            kept = self._keep_verified(wanted, fd, whole.update) if held else 0
            if kept:
                if progress:
                    progress(kept)
                request = pb.GetRequest(digest=str(wanted), offset=kept)
                with rpc_errors():
                    # A range: each chunk is checked against its hash as it comes.
                    reader = BlobReader(self._store.Get(request, timeout=self._timeout), wanted)
                os.lseek(fd, kept, os.SEEK_SET)
                for piece in reader.chunks():
                    write_all(fd, piece)
                    whole.update(piece)
                    if progress:
                        progress(len(piece))
        finally:
            digest = whole.digest()
        if not kept:
            os.ftruncate(fd, 0)
            info, _, _ = self._fetch(wanted, fd, handoff=handoff, progress=progress)
            return info
        if digest != wanted.raw or os.fstat(fd).st_size != reader.info.size:
            raise IntegrityError(
                f"{wanted}: the download resumed from byte {kept} does not match the digest"
            )
        return reader.info

    def _keep_verified(self, wanted: Digest, fd: int, hashed: Callable[[bytes], None]) -> int:
        """How much of the partial file `fd` matches the blob's chunk list, cut to that; 0
        when nothing does, or the server lists no chunk hashes."""
        request = pb.GetRequest(digest=str(wanted), hashes_only=True)
        with rpc_errors():
            listed = read_chunk_hashes(self._store.Get(request, timeout=self._timeout), wanted)
        if listed is None:
            return 0
        return keep_verified(fd, listed, hashed)

    def _fetch(
        self,
        wanted: Digest,
        fd: int,
        *,
        offset: int = 0,
        length: int | None = None,
        handoff: bool | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[BlobInfo, int, int]:
        """Write the whole blob `wanted` into the empty file `fd` and check its digest; the
        blob's description and the start and length of [offset, offset + length) in it, which
        is refused as soon as the blob's size is known if it reaches beyond the end.

        A client on the vault's own host hands the server the write end of a pipe, never the
        file (vault.store.handoff says why): the server writes each verified chunk into it,
        and this client reads, hashes and writes the file itself. `handoff=False` streams;
        `handoff=True` fails if the handoff cannot be had."""
        ticket = None
        read_end = None
        if handoff is not False:
            read_end, write_end = open_pipe()
            try:
                ticket = self._hand_off(write_end, "write", required=bool(handoff))
            except BaseException:
                os.close(read_end)
                raise
            finally:
                # Only the server holds the write end now: the pipe ends when it closes it.
                os.close(write_end)
            if ticket is None:
                os.close(read_end)
                read_end = None
        reader = None
        try:
            request = pb.GetRequest(digest=str(wanted), handoff=ticket or "")
            with rpc_errors():
                # Nothing of `fd` is handed on before the whole digest matched, so per-chunk
                # checks add nothing.
                reader = BlobReader(
                    self._store.Get(request, timeout=self._timeout),
                    wanted,
                    check_chunks=False,
                    handed_off=read_end,
                )
            info = reader.info
            start, count = _range_of(info, offset, length)
            for piece in reader.chunks():
                write_all(fd, piece)
                if progress:
                    progress(len(piece))
        finally:
            # Closed before the file is used: what the server writes after, it writes nowhere.
            if read_end is not None:
                os.close(read_end)
            if reader is not None:
                reader.close()
        return info, start, count


def spool_folder() -> Path:
    """Where a blob bound for standard output waits, unlinked, until its digest is checked: the
    user's own cache folder (on disk, unlike a /tmp that may be memory), else the temp folder."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    folder = Path(base) / "pinvault"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return Path(tempfile.gettempdir())
    return folder


def _range_of(info: BlobInfo, offset: int, length: int | None) -> tuple[int, int]:
    """[offset, offset + length) of the blob as (start, count), refused beyond its end."""
    if offset < 0 or (length is not None and length < 0):
        raise InvalidArgument(f"negative offset or length ({offset}, {length}) for {info.sha256}")
    if offset > info.size:
        raise InvalidArgument(
            f"offset {offset} is beyond the end of {info.sha256} ({info.size} bytes)"
        )
    if length is None:
        return offset, info.size - offset
    if offset + length > info.size:
        raise InvalidArgument(
            f"range {offset}+{length} is beyond the end of {info.sha256} ({info.size} bytes)"
        )
    return offset, length


def _anonymous_file(folder: Path) -> int:
    """A private file with no name (O_TMPFILE, or a random name unlinked at once) in `folder`:
    nothing else can open it, and it disappears with its last descriptor."""
    try:
        return os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise InvalidArgument(f"cannot write in {folder}: {exc.strerror}") from None
    fd, partial = create_partial(folder / "spool")
    remove_if_ours(fd, partial)
    return fd


def _copy_out(source: int, out: int, start: int, count: int) -> None:
    """Copy `count` bytes of the file `source` from `start` to the descriptor `out`."""
    position, end = start, start + count
    try:
        while position < end:
            sent = os.sendfile(out, source, position, min(end - position, 1 << 30))
            if sent == 0:
                raise IntegrityError(f"the spooled blob ended at byte {position}, before {end}")
            position += sent
        return
    except OSError as exc:
        # Some outputs (a file opened for appending, some terminals) take no sendfile.
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EBADF) or position != start:
            raise
    while position < end:
        data = os.pread(source, min(end - position, 8 << 20), position)
        if not data:
            raise IntegrityError(f"the spooled blob ended at byte {position}, before {end}")
        write_all(out, data)
        position += len(data)


def _spooled(fd: int, info: BlobInfo, start: int, count: int) -> Iterator[pb.GetResponse]:
    """A verified, spooled blob's range as the answer to a Get of that range would give it;
    the spool file is closed once it has all been read (or the reader is dropped)."""
    try:
        chunk_size = PUT_CHUNK
        header = pb.GetHeader(chunk_size=chunk_size, offset=start, length=count)
        header.blob.CopyFrom(
            pb.BlobInfo(
                sha256=str(info.sha256),
                blake3=str(info.blake3),
                size=info.size,
                stored_at=info.stored_at,
            )
        )
        yield pb.GetResponse(header=header)
        position = start - start % chunk_size
        while position < start + count:
            data = os.pread(fd, min(chunk_size, info.size - position), position)
            chunk = pb.Chunk(offset=position, data=data, hash=blake3.blake3(data).digest())
            yield pb.GetResponse(chunk=chunk)
            position += len(data)
    finally:
        os.close(fd)


def _stored_info(blob: pb.BlobInfo, expected: Digest | None) -> BlobInfo:
    """BlobInfo.from_wire, but a digest the answer spells exactly as the one expected (parsed
    already) is taken as that one rather than parsed again: a batch answers thousands."""
    if expected is None:
        return BlobInfo.from_wire(blob)
    named = str(expected)
    sha256 = expected if blob.sha256 == named else Digest.parse(blob.sha256)
    blake3_ = expected if blob.blake3 == named else Digest.parse(blob.blake3)
    return BlobInfo(sha256, blake3_, blob.size, blob.stored_at)


def _stored(response: pb.PutResponse, sent_blake3: bytes, chunk_root: bytes | None) -> PutResult:
    """The answer to a put, once checked to name what the client sent (whose chunk root the
    client computed as it sent it, if asked)."""
    result = PutResult(BlobInfo.from_wire(response.blob), response.created, chunk_root=chunk_root)
    if result.blob.blake3.raw != sent_blake3:
        raise IntegrityError(
            f"the vault stored {result.blob.blake3} but the client sent blake3:{sent_blake3.hex()}"
        )
    return result


class _FileHash:
    """The BLAKE3 of a file's first `size` bytes, and their chunk root if asked, computed on a
    thread of its own."""

    def __init__(self, fd: int, size: int, *, chunk_root: bool) -> None:
        self._fd = fd
        self._size = size
        self._hash = blake3.blake3()
        self._chunked = ChunkRootHasher() if chunk_root else None
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
                if self._chunked is not None:
                    self._chunked.update(piece)
                offset += len(piece)
        except OSError as exc:
            self._error = exc

    def digest(self) -> bytes:
        self._thread.join()
        if self._error is not None:
            raise InvalidArgument(f"cannot read the file being put: {self._error.strerror}")
        return bytes(self._hash.digest())

    def chunk_root(self) -> bytes | None:
        self.digest()
        return None if self._chunked is None else self._chunked.root()


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
