"""Bytes straight between this client and the vault's object store: a put uploads the file to
each of the blob's mirrors with the presigned PUTs the vault hands out (each store takes only
bytes with the file's SHA-256) and the vault adopts them once it has verified them; a get
downloads a mirror copy's stored chunks with a presigned GET and checks them here, as every
read is checked, before the file appears. The store and the network between are trusted with
nothing: what they answer is hashed here."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import blake3

from vault import presigned
from vault.client.channel import rpc_errors
from vault.client.partial import create_partial, settle
from vault.client.results import BlobInfo, PutResult
from vault.digest import Digest
from vault.errors import IntegrityError, InvalidArgument, NotFound, Unavailable
from vault.files import write_all
from vault.presigned import BLOCK, REFUSAL_BYTES
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

# S3's largest single PUT, the most parts a vault presigns for one upload, and the part size
# a client starts from.
SINGLE_PUT_MAX: Final = 5 << 30
MAX_PARTS: Final = 1024
PART_SIZE: Final = 64 << 20
# The most mirrors a put uploads to at once; the vault keeps a blob on fewer.
MAX_COPIES: Final = 16
# How long a record of an upload begun is kept: the vault aborts uploads left longer.
STALE_UPLOAD_SECONDS: Final = 2 * 24 * 3600
# A stored chunk decompresses to at most the chunk size, which a vault may choose up to this;
# a stored extent is at most that plus zstd's worst-case overhead.
MAX_CHUNK: Final = 64 << 20


def put_direct(
    store: rpc.StoreStub,
    timeout: float | None,
    path: Path,
    *,
    part_size: int | None = None,
    uploads: Path | None = None,
    copies: int | None = None,
) -> PutResult:
    """Store the file at `path` by uploading it straight to the vault's object store: in one
    PUT, or in parts of `part_size` bytes (always for a file larger than one PUT takes), to
    `copies` of the vault's mirrors at once (by default every one the blob is kept on; those
    left out, or that refuse, get their copy from the vault's queue). An upload in parts is
    remembered in the folder `uploads`, if given, until it is finished, so that a put of the
    same file cut short resumes it, uploading only the parts missing; records left there
    longer than STALE_UPLOAD_SECONDS are removed."""
    size = _size_of(path)
    in_parts = part_size is not None or size > SINGLE_PUT_MAX
    chosen = part_size or max(PART_SIZE, -(-size // MAX_PARTS))
    size, sha256, b3, parts = _hash_file(path, chosen if in_parts else None)
    request = pb.DirectPutRequest(
        sha256=str(sha256), size=size, copies=MAX_COPIES if copies is None else copies
    )
    if uploads is not None:
        _remove_stale(uploads)
    state = uploads / f"{sha256.hex}.json" if uploads is not None and in_parts else None
    if in_parts:
        request.part_size = chosen
        request.part_sha256.extend(parts)
        request.resume.extend(
            pb.DirectUploadRef(mirror=mirror, key=key, upload_id=upload_id)
            for mirror, key, upload_id in _begun(state, chosen)
        )
    try:
        with rpc_errors():
            plan = store.DirectPut(request, timeout=timeout)
    except NotFound:
        if not request.resume:
            raise
        # The uploads begun earlier are gone (finished, aborted or expired): begin anew.
        del request.resume[:]
        with rpc_errors():
            plan = store.DirectPut(request, timeout=timeout)
    if plan.HasField("stored"):
        return _checked(PutResult(BlobInfo.from_wire(plan.stored), False), sha256, b3, size)
    targets = _targets(plan, sha256, len(parts) if in_parts else None)
    if in_parts:
        _remember(state, targets, chosen)
    # Each part's request is checked when it starts; parts started after the vault's requests
    # ran out are sent again with new ones, the parts the stores hold skipped: at least one
    # part goes up in each window, so a slow link needs at most one window a part.
    for windows_left in range(len(parts), -1, -1):
        try:
            uploaded = _upload_all(targets, path, size, chosen, parts)
            break
        except presigned.Expired:
            if not windows_left:
                raise
            del request.resume[:]
            request.resume.extend(
                pb.DirectUploadRef(mirror=t.mirror, key=t.key, upload_id=t.upload_id)
                for t in targets
                if t.upload_id
            )
            with rpc_errors():
                plan = store.DirectPut(request, timeout=timeout)
            if plan.HasField("stored"):
                return _checked(PutResult(BlobInfo.from_wire(plan.stored), False), sha256, b3, size)
            targets = _targets(plan, sha256, len(parts) if in_parts else None)
            _remember(state, targets, chosen)
    first, *others = uploaded
    with rpc_errors():
        response = store.FinishDirectPut(
            pb.FinishDirectPutRequest(
                sha256=str(sha256),
                mirror=first.mirror,
                key=first.key,
                upload_id=first.upload_id,
                size=size,
                copies=[
                    pb.DirectUploadRef(mirror=t.mirror, key=t.key, upload_id=t.upload_id)
                    for t in others
                ],
            ),
            timeout=timeout,
        )
    if state is not None:
        state.unlink(missing_ok=True)
    sent = {t.mirror for t in uploaded}
    if not set(response.mirrors) <= sent or len(set(response.mirrors)) != len(response.mirrors):
        raise IntegrityError(
            f"the vault says {list(response.mirrors)} hold copies of {sha256}; the client "
            f"uploaded to {sorted(sent)}"
        )
    return _checked(
        PutResult(BlobInfo.from_wire(response.blob), response.created, tuple(response.mirrors)),
        sha256,
        b3,
        size,
    )


@dataclass(frozen=True, slots=True)
class _Target:
    """One mirror's upload in a plan."""

    mirror: str
    key: str
    url: str
    headers: dict[str, str]
    upload_id: str
    part_urls: list[str]
    present: frozenset[int]


def _targets(plan: pb.DirectPutPlan, sha256: Digest, parts: int | None) -> list[_Target]:
    """The plan's uploads, once checked to be uploads of this file: a plan for other bytes
    (one replayed, say) is refused before a byte is sent."""
    targets = [
        _Target(
            plan.mirror,
            plan.key,
            plan.url,
            dict(plan.headers),
            plan.upload_id,
            list(plan.part_urls),
            frozenset(plan.parts_present),
        )
    ]
    targets += [
        _Target(
            c.mirror,
            c.key,
            c.url,
            dict(c.headers),
            c.upload_id,
            list(c.part_urls),
            frozenset(c.parts_present),
        )
        for c in plan.copies
    ]
    if len({t.mirror for t in targets}) != len(targets) or len(targets) > MAX_COPIES:
        raise IntegrityError(f"the vault planned {len(targets)} uploads to the same mirrors")
    checksum = base64.b64encode(sha256.raw).decode()
    for target in targets:
        if parts is None:
            if target.upload_id or target.headers.get("x-amz-checksum-sha256") != checksum:
                raise IntegrityError(
                    f"the vault planned an upload to {target.mirror} that is not of {sha256}"
                )
        elif not target.upload_id or len(target.part_urls) != parts:
            raise IntegrityError(
                f"the vault planned {len(target.part_urls)} parts to {target.mirror} for the "
                f"client's {parts}"
            )
    return targets


def _upload_all(
    targets: list[_Target], path: Path, size: int, part_size: int, parts: list[bytes]
) -> list[_Target]:
    """Upload the file to every target at once; the targets that took it. A target whose
    store refuses or cannot be reached is left out (the vault's queue makes its copy); if
    every one fails, the first failure is raised."""

    def send(target: _Target) -> None:
        if not target.upload_id:
            _upload(target.url, target.headers, path, 0, size)
            return
        for number, url in enumerate(target.part_urls, start=1):
            if number not in target.present:
                offset = (number - 1) * part_size
                checksum = base64.b64encode(parts[number - 1]).decode()
                _upload(
                    url,
                    {"x-amz-checksum-sha256": checksum},
                    path,
                    offset,
                    min(part_size, size - offset),
                )

    if len(targets) == 1:
        send(targets[0])
        return targets
    with ThreadPoolExecutor(len(targets), thread_name_prefix="pinvault-direct") as pool:
        outcomes = list(zip(targets, [pool.submit(send, t) for t in targets], strict=True))
    taken: list[_Target] = []
    failures: list[BaseException] = []
    for target, outcome in outcomes:
        error = outcome.exception()
        if error is None:
            taken.append(target)
        elif isinstance(error, (IntegrityError, Unavailable)):
            failures.append(error)
        else:
            raise error
    if not taken:
        raise failures[0]
    return taken


def _begun(state: Path | None, part_size: int) -> list[tuple[str, str, str]]:
    """The uploads in parts of this file begun earlier with the same part size, if any."""
    if state is None:
        return []
    try:
        found = json.loads(state.read_text())
        if found["part_size"] != part_size:
            return []
        return [
            (str(upload["mirror"]), str(upload["key"]), str(upload["upload_id"]))
            for upload in found["uploads"]
        ][:MAX_COPIES]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _remember(state: Path | None, targets: list[_Target], part_size: int) -> None:
    if state is None:
        return
    state.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = state.with_name(f".{state.name}.{os.getpid()}")
    partial.write_text(
        json.dumps(
            {
                "uploads": [
                    {"mirror": t.mirror, "key": t.key, "upload_id": t.upload_id} for t in targets
                ],
                "part_size": part_size,
            }
        )
    )
    os.replace(partial, state)


def _remove_stale(uploads: Path) -> None:
    """Forget the uploads begun more than STALE_UPLOAD_SECONDS ago: the vault's mirrors have
    aborted them by then."""
    cutoff = time.time() - STALE_UPLOAD_SECONDS
    try:
        records = list(uploads.iterdir())
    except OSError:
        return
    for record in records:
        if record.name.endswith(".json") or ".json." in record.name:
            with contextlib.suppress(OSError):
                if record.lstat().st_mtime < cutoff:
                    record.unlink()


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


def _upload(url: str, headers: dict[str, str], path: Path, offset: int, length: int) -> None:
    """PUT `length` bytes of the file from `offset` to a presigned URL."""

    def pieces() -> Iterator[bytes]:
        with open(path, "rb") as file:
            file.seek(offset)
            left = length
            while left and (block := file.read(min(BLOCK, left))):
                yield block
                left -= len(block)

    try:
        presigned.put(url, headers, pieces(), length)
    except InvalidArgument:
        raise InvalidArgument(f"{path} changed while it was uploaded") from None


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
    connection, target = presigned.connection(plan.url)
    try:
        connection.request(
            "GET", target, headers={"Range": f"bytes={plan.offset}-{plan.offset + stored - 1}"}
        )
        response = connection.getresponse()
        if response.status != 206:
            refusal = response.read(REFUSAL_BYTES).decode(errors="replace")
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
