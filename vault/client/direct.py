"""Bytes straight between this client and the vault's object store: a put uploads the file with
the presigned PUT the vault hands out (the store takes only bytes with the file's SHA-256) and
the vault adopts it once it has verified it; a get downloads a mirror copy's stored chunks with
a presigned GET and checks them here, as every read is checked, before the file appears. The
store and the network between are trusted with nothing: what they answer is hashed here."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import blake3

from vault.client.channel import rpc_errors
from vault.client.partial import create_partial, settle
from vault.client.results import BlobInfo, PutResult
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound, Unavailable
from vault.files import write_all
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

BLOCK: Final = 1 << 20
# S3's largest single PUT, its most parts an upload, and the part size a client starts from.
SINGLE_PUT_MAX: Final = 5 << 30
MAX_PARTS: Final = 10_000
PART_SIZE: Final = 64 << 20
# A stored chunk decompresses to at most the chunk size, which a vault may choose up to this;
# a stored extent is at most that plus zstd's worst-case overhead.
MAX_CHUNK: Final = 64 << 20
# What of an object store's refusal is shown.
_REFUSAL_BYTES: Final = 2048
# How long the store may leave a connection silent.
STORE_TIMEOUT: Final = 60.0


def put_direct(
    store: rpc.StoreStub,
    timeout: float | None,
    path: Path,
    *,
    part_size: int | None = None,
    uploads: Path | None = None,
) -> PutResult:
    """Store the file at `path` by uploading it straight to the vault's object store: in one
    PUT, or in parts of `part_size` bytes (always for a file larger than one PUT takes). An
    upload in parts is remembered in the folder `uploads`, if given, until it is finished, so
    that a put of the same file cut short resumes it, uploading only the parts missing."""
    size = _size_of(path)
    in_parts = part_size is not None or size > SINGLE_PUT_MAX
    chosen = part_size or max(PART_SIZE, -(-size // MAX_PARTS))
    size, sha256, b3, parts = _hash_file(path, chosen if in_parts else None)
    request = pb.DirectPutRequest(sha256=str(sha256), size=size)
    state = uploads / f"{sha256.hex}.json" if uploads is not None and in_parts else None
    if in_parts:
        request.part_size = chosen
        request.part_sha256.extend(parts)
        begun = _begun(state, chosen)
        if begun is not None:
            request.resume_mirror, request.resume_key, request.resume_upload_id = begun
    try:
        with rpc_errors():
            plan = store.DirectPut(request, timeout=timeout)
    except NotFound:
        if not request.resume_upload_id:
            raise
        # The upload begun earlier is gone (finished, aborted or expired): begin anew.
        request.resume_mirror = request.resume_key = request.resume_upload_id = ""
        with rpc_errors():
            plan = store.DirectPut(request, timeout=timeout)
    if plan.HasField("stored"):
        return _checked(PutResult(BlobInfo.from_wire(plan.stored), False), sha256, b3, size)
    if plan.upload_id:
        if len(plan.part_urls) != len(parts):
            raise IntegrityError(
                f"the vault planned {len(plan.part_urls)} parts for the client's {len(parts)}"
            )
        _remember(state, plan, chosen)
        present = set(plan.parts_present)
        for number, url in enumerate(plan.part_urls, start=1):
            if number not in present:
                offset = (number - 1) * chosen
                checksum = base64.b64encode(parts[number - 1]).decode()
                _upload(
                    url,
                    {"x-amz-checksum-sha256": checksum},
                    path,
                    offset,
                    min(chosen, size - offset),
                )
    else:
        _upload(plan.url, dict(plan.headers), path, 0, size)
    with rpc_errors():
        response = store.FinishDirectPut(
            pb.FinishDirectPutRequest(
                sha256=str(sha256),
                mirror=plan.mirror,
                key=plan.key,
                upload_id=plan.upload_id,
                size=size,
            ),
            timeout=timeout,
        )
    if state is not None:
        state.unlink(missing_ok=True)
    return _checked(
        PutResult(BlobInfo.from_wire(response.blob), response.created), sha256, b3, size
    )


def _begun(state: Path | None, part_size: int) -> tuple[str, str, str] | None:
    """The upload in parts of this file begun earlier with the same part size, if any."""
    if state is None:
        return None
    try:
        found = json.loads(state.read_text())
        begun = (str(found["mirror"]), str(found["key"]), str(found["upload_id"]))
        return begun if found["part_size"] == part_size else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(state: Path | None, plan: pb.DirectPutPlan, part_size: int) -> None:
    if state is None:
        return
    state.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = state.with_name(f".{state.name}.{os.getpid()}")
    partial.write_text(
        json.dumps(
            {
                "mirror": plan.mirror,
                "key": plan.key,
                "upload_id": plan.upload_id,
                "part_size": part_size,
            }
        )
    )
    os.replace(partial, state)


def get_direct(store: rpc.StoreStub, timeout: float | None, digest: str, path: Path) -> BlobInfo:
    """Write the blob to `path` from a mirror copy read straight from the object store; the
    file appears only once every byte was checked against the blob's digest."""
    wanted = Digest.parse(digest)
    if path.is_dir():
        raise InvalidArgument(f"cannot write {path}: it is a folder")
    with rpc_errors():
        plan = store.DirectGet(pb.DirectGetRequest(digest=str(wanted)), timeout=timeout)
    info = BlobInfo.from_wire(plan.blob)
    if wanted not in (info.sha256, info.blake3):
        raise IntegrityError(f"asked for {wanted}, the vault described {info.sha256}")
    _check_plan(plan, info)
    fd, partial = create_partial(path)

    def fill() -> None:
        sha, b3, written = _download(plan, fd)
        if written != info.size or sha != info.sha256.raw or b3 != info.blake3.raw:
            raise IntegrityError(
                f"the object store answered {written} bytes that are not {info.sha256}: "
                "nothing was written"
            )

    settle(fd, partial, path, fill)
    return info


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None


def _hash_file(path: Path, part_size: int | None) -> tuple[int, Digest, bytes, list[bytes]]:
    """The file's size, SHA-256 and BLAKE3, and with `part_size`, each part's SHA-256."""
    sha, b3, size = hashlib.sha256(), blake3.blake3(), 0
    parts: list[bytes] = []
    part, filled = hashlib.sha256(), 0
    try:
        with open(path, "rb") as file:
            while block := file.read(BLOCK):
                sha.update(block)
                b3.update(block)
                size += len(block)
                view = memoryview(block)
                while part_size is not None and len(view):
                    take = min(len(view), part_size - filled)
                    part.update(view[:take])
                    view, filled = view[take:], filled + take
                    if filled == part_size:
                        parts.append(part.digest())
                        part, filled = hashlib.sha256(), 0
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
    if part_size is not None and (filled or not parts):
        parts.append(part.digest())
    return size, Digest.sha256(sha.digest()), b3.digest(), parts


def _checked(result: PutResult, sha256: Digest, b3: bytes, size: int) -> PutResult:
    """The vault's answer, once checked to name the file sent."""
    blob = result.blob
    if blob.sha256 != sha256 or blob.blake3.raw != b3 or blob.size != size:
        raise IntegrityError(
            f"the vault stored {blob.sha256} ({blob.size} bytes) for the client's {sha256} "
            f"({size} bytes)"
        )
    return result


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise IntegrityError(f"the vault handed out {parts.scheme or 'a'} URL, not http(s)")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return kind(parts.netloc, timeout=STORE_TIMEOUT, blocksize=BLOCK), target


def _upload(url: str, headers: dict[str, str], path: Path, offset: int, length: int) -> None:
    """PUT `length` bytes of the file from `offset` to a presigned URL."""
    connection, target = _connection(url)
    try:
        connection.putrequest("PUT", target, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(length))
        connection.endheaders()
        with open(path, "rb") as file:
            file.seek(offset)
            left = length
            while left and (block := file.read(min(BLOCK, left))):
                connection.send(block)
                left -= len(block)
        if left:
            raise InvalidArgument(f"{path} changed while it was uploaded")
        response = connection.getresponse()
        answer = response.read(_REFUSAL_BYTES)
        if response.status != 200:
            refusal = answer.decode(errors="replace")
            kind = (
                IntegrityError if "Checksum" in refusal or "BadDigest" in refusal else Unavailable
            )
            raise kind(f"the object store refused the upload: HTTP {response.status} {refusal}")
    except OSError as exc:
        raise Unavailable(f"uploading to the object store failed: {exc}") from None
    finally:
        connection.close()


def _check_plan(plan: pb.DirectGetPlan, info: BlobInfo) -> None:
    """A plan that could make this client hold or write more than the blob is refused."""
    chunk = plan.chunk_size
    if not 0 < chunk <= MAX_CHUNK:
        raise IntegrityError(f"the vault gave a chunk size of {chunk} bytes")
    if len(plan.extents) != -(-info.size // chunk):
        raise IntegrityError(
            f"the vault listed {len(plan.extents)} stored chunks for {info.size} bytes"
        )
    for extent in plan.extents:
        # zstd's worst case adds well under 1/128 of its input.
        if extent.length > chunk + chunk // 128 + 1024:
            raise IntegrityError(f"the vault listed a stored chunk of {extent.length} bytes")


def _download(plan: pb.DirectGetPlan, fd: int) -> tuple[bytes, bytes, int]:
    stored = sum(extent.length for extent in plan.extents)
    sha, b3, written = hashlib.sha256(), blake3.blake3(), 0
    if not stored:
        return sha.digest(), b3.digest(), 0
    connection, target = _connection(plan.url)
    try:
        connection.request(
            "GET", target, headers={"Range": f"bytes={plan.offset}-{plan.offset + stored - 1}"}
        )
        response = connection.getresponse()
        if response.status != 206:
            refusal = response.read(_REFUSAL_BYTES).decode(errors="replace")
            raise Unavailable(
                f"the object store refused the read: HTTP {response.status} {refusal}"
            )
        import zstandard  # only a download needs it

        decompressor = zstandard.ZstdDecompressor()
        for extent in plan.extents:
            data = _read_exactly(response, extent.length)
            if extent.compressed:
                try:
                    data = decompressor.decompress(data, max_output_size=plan.chunk_size)
                except zstandard.ZstdError as exc:
                    raise IntegrityError(f"a stored chunk does not decompress: {exc}") from None
            write_all(fd, data)
            sha.update(data)
            b3.update(data)
            written += len(data)
    except OSError as exc:
        raise Unavailable(f"reading from the object store failed: {exc}") from None
    finally:
        connection.close()
    return sha.digest(), b3.digest(), written


def _read_exactly(response: http.client.HTTPResponse, length: int) -> bytes:
    data = response.read(length)
    if len(data) != length:
        raise IntegrityError(
            f"the object store's answer ended early ({len(data)} of {length} bytes of a chunk)"
        )
    return data
