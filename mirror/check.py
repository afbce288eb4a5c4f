"""A new mirror's endpoint checked before it is configured: its bucket answers (or is created),
and its credentials may write, read back and delete an object under its prefix, so that a wrong
or read-only key is found by `vault mirror add`, not by the first replication."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

from mirror.mirrors import MirrorEndpoint, cold_tier
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    PermissionDenied,
    Unavailable,
    VaultError,
)

_MISSING_BUCKET: Final = frozenset({"NoSuchBucket", "NotFound", "404"})
_REFUSED_CREDENTIALS: Final = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "403",
    }
)
_OWNED: Final = frozenset({"BucketAlreadyOwnedByYou"})
_PROBE_FOLDER: Final = "pinvault-probe/"


@dataclass(frozen=True, slots=True)
class EndpointCheck:
    """What checking a mirror's endpoint found: whether it created the bucket."""

    bucket_created: bool


def check_endpoint(
    endpoint: MirrorEndpoint,
    *,
    credentials: tuple[str, str],
    create_bucket: bool,
    connect_timeout: float,
    read_timeout: float,
) -> EndpointCheck:
    """HEAD the bucket (with `create_bucket`, create it if it is missing), then write, read back
    and delete a small object under the prefix. `credentials` names the variables the keys
    came from, for the errors: PermissionDenied if the endpoint refuses the keys for any step,
    FailedPrecondition for a missing bucket, Unavailable if it does not answer."""
    tier = cold_tier(
        endpoint, connect_timeout=connect_timeout, read_timeout=read_timeout, attempts=1
    )
    with tier:
        probe = _Probe(endpoint, credentials, tier.client)
        created = probe.bucket(create=create_bucket)
        probe.write_read_delete(tier.prefix + _PROBE_FOLDER + secrets.token_hex(8))
    return EndpointCheck(bucket_created=created)


class _Probe:
    """The S3 calls of the check, on the tier's client, each failure made the project's error
    naming the mirror, what was being done and, for a refusal of the keys, where they came
    from."""

    def __init__(self, endpoint: MirrorEndpoint, credentials: tuple[str, str], client: Any):
        self.endpoint = endpoint
        self.client = client
        self.keys = " and ".join(credentials)

    def bucket(self, *, create: bool) -> bool:
        """Whether the bucket had to be created; FailedPrecondition if it is missing and may
        not be."""
        name, bucket, url = self.endpoint.name, self.endpoint.bucket, self.endpoint.url
        try:
            with self._errors(f"a HEAD of bucket {bucket}", tolerate=_MISSING_BUCKET):
                self.client.head_bucket(Bucket=bucket)
            return False
        except _Tolerated:
            pass
        if not create:
            raise FailedPrecondition(
                f"mirror {name}: bucket {bucket} does not exist on {url}: create it, "
                "or pass --create-bucket"
            )
        options: dict[str, Any] = {}
        if self.endpoint.region != "us-east-1":
            options["CreateBucketConfiguration"] = {"LocationConstraint": self.endpoint.region}
        try:
            with self._errors(f"creating bucket {bucket}", tolerate=_OWNED):
                self.client.create_bucket(Bucket=bucket, **options)
        except _Tolerated:
            return False  # made by this key since it was looked up
        return True

    def write_read_delete(self, key: str) -> None:
        data = b"pinvault mirror probe " + secrets.token_bytes(32)
        bucket = self.endpoint.bucket
        with self._errors(f"writing {key} in bucket {bucket}"):
            self.client.put_object(Bucket=bucket, Key=key, Body=data)
        try:
            with self._errors(f"reading {key} back"):
                response = self.client.get_object(Bucket=bucket, Key=key)
                with contextlib.closing(response["Body"]) as body:
                    found = body.read()
            if found != data:
                raise IntegrityError(
                    f"mirror {self.endpoint.name}: probe object {key} in bucket {bucket} reads "
                    f"back differently from what was written ({len(found)} bytes, {len(data)} "
                    "sent)"
                )
        finally:
            with self._errors(f"deleting {key}"):
                self.client.delete_object(Bucket=bucket, Key=key)

    @contextlib.contextmanager
    def _errors(self, what: str, *, tolerate: frozenset[str] = frozenset()) -> Iterator[None]:
        """An S3 error code in `tolerate` raised as _Tolerated; any other failure as the
        project's error."""
        try:
            yield
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in tolerate:
                raise _Tolerated(code) from None
            raise self._refused(what, error, code) from None
        except (BotoCoreError, OSError) as error:
            raise Unavailable(
                f"mirror {self.endpoint.name}: {self.endpoint.url} does not answer ({what}): "
                f"{error}"
            ) from None

    def _refused(self, what: str, error: Any, code: str) -> VaultError:
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = error.response.get("Error", {}).get("Message") or "no message"
        found = f"{code or 'error'}, HTTP {status}: {message}"
        if code in _REFUSED_CREDENTIALS or status in (401, 403):
            return PermissionDenied(
                f"mirror {self.endpoint.name}: {self.endpoint.url} refused the credentials in "
                f"{self.keys} for {what} ({found}); the vault needs keys that may write, read "
                f"and delete in bucket {self.endpoint.bucket}"
            )
        return Unavailable(f"mirror {self.endpoint.name}: {what} was refused ({found})")


class _Tolerated(Exception):
    """An S3 error the caller asked to handle itself."""
