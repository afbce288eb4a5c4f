"""The cold tier's side of S3: one botocore client on one bucket, each call's failure turned into
the project's own error naming the endpoint, and the few object reads the tier builds on."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any, Final, NoReturn

import botocore.session  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]
from botocore.exceptions import ConnectionError as NotConnected

from vault.errors import IntegrityError, Unavailable
from vault.store.chunks import CHUNK_SIZE

MISSING: Final = frozenset({"NoSuchKey", "NotFound", "404"})
_CHECKSUM_REFUSED: Final = frozenset({"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest"})
_TRANSPORT_ERRORS = (BotoCoreError, OSError)
# The endpoint was not reached at all: its connection refused, or not made in time.
_CONNECT_ERRORS = (NotConnected,)


class Unreadable(IntegrityError):
    """An object the endpoint fails to hand out whole (its read refused with a server error, or
    cut short) while the endpoint answers other requests: the object is damaged, as when the
    server's own bitrot check fails on it. An endpoint that does not answer is Unavailable."""


class Refused(Exception):
    """An S3 error the caller asked to handle itself."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class S3Bucket:
    """One bucket of one S3 endpoint. `where` names the endpoint, bucket and prefix in every
    error. Failures to reach the endpoint, or refusals by it, are Unavailable; a refusal
    saying the server received other bytes than those sent is IntegrityError. Credentials,
    region, timeouts and retries are the ones given here: no profile, ~/.aws file or AWS_*
    credential variable is read."""

    def __init__(
        self,
        *,
        endpoint_url: str,
        bucket: str,
        where: str,
        access_key_id: str,
        secret_access_key: str,
        region: str,
        addressing_style: str,
        connect_timeout: float,
        read_timeout: float,
        max_attempts: int,
        max_connections: int,
    ) -> None:
        self.bucket = bucket
        self.where = where
        self.client: Any = _create_client(
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            region_name=region,
            config=Config(
                region_name=region,
                signature_version="s3v4",
                s3={"addressing_style": addressing_style},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": max_attempts, "mode": "standard"},
                max_pool_connections=max_connections,
                tcp_keepalive=True,
                # The checksums sent are the ones computed here (SHA-256, per object or part);
                # botocore's own trailing CRCs are not understood by every S3 server.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def close(self) -> None:
        self.client.close()

    def call(
        self, what: str, operation: str, *, tolerate: frozenset[str] = frozenset(), **params: Any
    ) -> Any:
        """One S3 call on the bucket. An error code in `tolerate` is raised as Refused for the
        caller to handle; anything else as the project's own error."""
        method = getattr(self.client, operation)
        with self.errors(what, tolerate):
            return method(Bucket=self.bucket, **params)

    @contextlib.contextmanager
    def errors(self, what: str, tolerate: frozenset[str] = frozenset()) -> Iterator[None]:
        try:
            yield
        except ClientError as error:
            self._refused(what, error, tolerate)
        except _TRANSPORT_ERRORS as error:
            raise Unavailable(f"cold tier {self.where}: {what} failed: {error}") from error

    @contextlib.contextmanager
    def reading(self, what: str, tolerate: frozenset[str] = frozenset()) -> Iterator[None]:
        """Like `errors`, around reading one object (its request and its body): a failure that
        is not a refused connection nor a refusal of the request itself (HTTP 4xx) is the
        object's damage (Unreadable) if the endpoint answers a probe right after, and an
        outage (Unavailable) if it does not."""
        try:
            yield
        except ClientError as error:
            if _status(error) >= 500 and _code(error) not in tolerate and self.answers():
                raise Unreadable(self._unreadable(what, _refusal(error))) from error
            self._refused(what, error, tolerate)
        except _CONNECT_ERRORS as error:
            raise Unavailable(f"cold tier {self.where}: {what} failed: {error}") from error
        except _TRANSPORT_ERRORS as error:
            if self.answers():
                raise Unreadable(self._unreadable(what, str(error))) from error
            raise Unavailable(f"cold tier {self.where}: {what} failed: {error}") from error

    def answers(self) -> bool:
        """Whether the endpoint answers a HEAD of the bucket now (within the timeouts)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (ClientError, *_TRANSPORT_ERRORS):
            return False
        return True

    def _unreadable(self, what: str, found: str) -> str:
        return (
            f"cold tier {self.where}: {what} failed while the endpoint answers other "
            f"requests: {' '.join(found.split())}"
        )

    def exists(self, key: str) -> bool:
        try:
            self.call(f"looking up {key}", "head_object", tolerate=MISSING, Key=key)
        except Refused:
            return False
        return True

    def get(self, key: str, start: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes of an object from `start`, and the object's whole size;
        Refused if the object is missing or shorter than `start`."""
        what = f"reading {key}"
        with self.reading(what, MISSING | {"InvalidRange"}):
            response = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
            )
        with self.reading(what), contextlib.closing(response["Body"]) as body:
            data: bytes = body.read()
        return data, object_size(response)

    def read_back(self, key: str, digests: list[bytes], sizes: list[int]) -> None:
        """Check a copy the server did not vouch for by reading it back: each run of `sizes`
        bytes must hash to the SHA-256 in `digests`."""
        what = f"reading back {key}"
        response = self.call(what, "get_object", Key=key)
        with self.errors(what), contextlib.closing(response["Body"]) as body:
            for number, (digest, size) in enumerate(zip(digests, sizes, strict=True), 1):
                sha = hashlib.sha256()
                left = size
                while left and (data := body.read(min(left, CHUNK_SIZE))):
                    sha.update(data)
                    left -= len(data)
                if left or sha.digest() != digest:
                    raise IntegrityError(
                        f"copy of {key} on {self.where} reads back differently from what was "
                        f"sent (part {number} of {len(sizes)})"
                    )
            if body.read(1):
                raise IntegrityError(
                    f"copy of {key} on {self.where} reads back longer than what was sent"
                )

    def _refused(self, what: str, error: Any, tolerate: frozenset[str]) -> NoReturn:
        code = _code(error)
        if code in tolerate:
            raise Refused(code) from None
        if code in _CHECKSUM_REFUSED:
            message = error.response.get("Error", {}).get("Message") or "no message"
            raise IntegrityError(
                f"cold tier {self.where}: {what}: the server received bytes other than those "
                f"sent ({code}: {message})"
            ) from error
        raise Unavailable(
            f"cold tier {self.where}: {what} was refused: {_refusal(error)}"
        ) from error


def _code(error: Any) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _status(error: Any) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _refusal(error: Any) -> str:
    """A refused request as the server explained it: code, HTTP status and message."""
    message = error.response.get("Error", {}).get("Message") or "no message"
    return f"{_code(error) or 'error'} (HTTP {_status(error) or None}): {message}"


def object_size(response: Any) -> int:
    """The whole object's size from a (ranged) GetObject response."""
    content_range = response.get("ContentRange")
    if content_range:
        return int(str(content_range).rsplit("/", 1)[1])
    return int(response["ContentLength"])


def b64(digest: bytes) -> str:
    """A SHA-256 as S3's checksum headers carry it."""
    return base64.b64encode(digest).decode("ascii")


# One botocore session for every tier: it caches the S3 service model, which takes a tenth of
# a second to load for each new session. It reads no profile, config or credentials file;
# every setting a client uses is passed to it.
_session: Any = None
_session_lock = threading.Lock()


def _create_client(**options: Any) -> Any:
    global _session
    # Clients are thread-safe once made, sessions are not while making them.
    with _session_lock:
        if _session is None:
            _session = botocore.session.Session(
                session_vars={
                    "profile": (None, None, None, None),
                    "config_file": (None, None, os.devnull, None),
                    "credentials_file": (None, None, os.devnull, None),
                    "data_path": (None, None, None, None),
                }
            )
        return _session.create_client("s3", **options)
