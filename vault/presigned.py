"""Requests the vault presigns for one object of an object store, sent as plain HTTP: a PUT
streamed from pieces of known total length (the store takes the bytes only if they have the
checksum the request is signed for), and the connection a ranged GET is sent on. The client's
direct transfers and the vault's own copies between mirrors send them alike."""

from __future__ import annotations

import http.client
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit

from vault.errors import IntegrityError, InvalidArgument, Unavailable

# What one send or receive moves at most.
BLOCK: Final = 1 << 20
# How long the store may leave a connection silent.
TIMEOUT: Final = 60.0
# What of an object store's refusal is shown.
REFUSAL_BYTES: Final = 2048


class Expired(Unavailable):
    """The store refused a presigned request because its time ran out: the vault signs new
    ones on asking."""


def connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    """A connection to the host of presigned `url`, and the request target to send on it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise IntegrityError(f"a presigned request is http(s), not {parts.scheme or 'nothing'}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return kind(parts.netloc, timeout=TIMEOUT, blocksize=BLOCK), target


def put(
    url: str, headers: dict[str, str], pieces: Iterable[bytes | memoryview], length: int
) -> None:
    """PUT the `length` bytes of `pieces` to presigned `url` with `headers`. IntegrityError if
    the store refuses them for their checksum; Unavailable if it cannot be reached or refuses
    otherwise; InvalidArgument if the pieces are not `length` bytes."""
    link, target = connection(url)
    try:
        link.putrequest("PUT", target, skip_accept_encoding=True)
        for name, value in headers.items():
            link.putheader(name, value)
        link.putheader("Content-Length", str(length))
        link.endheaders()
        left = length
        for piece in pieces:
            if len(piece) > left:
                raise InvalidArgument(f"more than the {length} bytes announced were sent")
            link.send(piece)
            left -= len(piece)
        if left:
            raise InvalidArgument(f"{length - left} of the {length} bytes announced were sent")
        response = link.getresponse()
        answer = response.read(REFUSAL_BYTES)
        if response.status != 200:
            refusal = answer.decode(errors="replace")
            kind: type[Exception] = Unavailable
            if "Checksum" in refusal or "BadDigest" in refusal:
                kind = IntegrityError
            elif response.status == 403 and "expired" in refusal.lower():
                kind = Expired
            raise kind(f"the object store refused the upload: HTTP {response.status} {refusal}")
    except OSError as exc:
        raise Unavailable(f"uploading to the object store failed: {exc}") from None
    finally:
        link.close()
