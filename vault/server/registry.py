"""The OCI Distribution API (pull and push) served from the vault's content store, on the bounded
HTTP edge: every blob, config and manifest is a blob of the store by its sha256 digest, checked
when it is written and whenever it is read, and every manifest pushed is pinned as an `image`
entry whose metadata names its repository and tag. A tag is resolved through the ledger (the
newest `image` entry naming it in that repository), never trusted as identity.

A DELETE of a manifest or tag is a `withdraw` entry: the name leaves the repository, the pin
and the bytes stay. A DELETE of a blob hides it from that repository alone (`HiddenBlobs`).

A pushed body goes to a sink of the edge's (`_UploadBody`, `_ManifestBody`), given each piece on
a worker thread once the edge has read it, so a caller dripping an upload holds no thread; a
body that fails leaves no part of itself in an upload session or the store."""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import os
import re
import secrets
import shutil
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs, urlsplit

from vault.config import Config, RegistryConfig
from vault.digest import Digest, sha256_of
from vault.errors import (
    ConfigError,
    DiskFull,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    VaultError,
)
from vault.files import fsync_dir
from vault.http_edge import BodyError, Edge, Limits, Request, Response, Sink
from vault.ledger.entry import WITHDRAW, Entry, check_author, check_meta
from vault.ledger.log import Ledger
from vault.ledger.records import PinSpec
from vault.server.auth import LOCAL, Authenticator, Gate, Identity
from vault.server.content import Content
from vault.server.failed_credentials import caller_address
from vault.server.registry_hidden import HiddenBlobs
from vault.server.registry_names import (
    KIND,
    MEDIA_TYPE,
    REPOSITORY,
    SUBJECT,
    TAG,
    RepositoryNames,
)
from vault.server.registry_token import (
    DELETE,
    PREFIX,
    PULL,
    PUSH,
    SERVICE,
    ExpiredToken,
    RegistryTokens,
    parse_scopes,
    scope_of,
)

log = logging.getLogger("pinvault")
_R = TypeVar("_R")

# Where open uploads keep their bytes, in the data folder; emptied at every start.
UPLOADS: Final = "registry-uploads"

OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX: Final = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST: Final = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST: Final = "application/vnd.docker.distribution.manifest.list.v2+json"
_INDEXES: Final = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES: Final = frozenset({OCI_MANIFEST, DOCKER_MANIFEST}) | _INDEXES
# The spec's suggested bound on a manifest a registry accepts.
MAX_MANIFEST_BYTES: Final = 4 * 1024 * 1024
_JSON: Final = "application/json"
_OCTETS: Final = "application/octet-stream"
_API: Final = (("Docker-Distribution-API-Version", "registry/2.0"),)
# What the token endpoint asks of a caller without credentials.
_BASIC_CHALLENGE: Final = (("WWW-Authenticate", f'Basic realm="{SERVICE}"'),)
_TOKEN_PATH: Final = "/token"
# A Host header the token endpoint's realm may be built from: a name or address and a port.
_HOST: Final = re.compile(r"(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(?::\d{1,5})?")
_LOOPBACK: Final = ("127.0.0.1", "localhost", "::1", "[::1]")
_FILE_PIECE: Final = 1024 * 1024

# The spec's grammar for repository names, tags and (sha256) digests.
_NAME: Final = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*"
_TAG: Final = re.compile(r"[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}")
_SHA256: Final = re.compile(r"sha256:[a-f0-9]{64}")
_ROUTE: Final = re.compile(
    rf"/v2/(?P<name>{_NAME})/(?:"
    r"blobs/uploads/(?P<upload>[A-Za-z0-9_-]*)"
    r"|blobs/(?P<blob>[^/]+)"
    r"|manifests/(?P<reference>[^/]+)"
    r"|(?P<tags>tags/list)"
    r"|referrers/(?P<referrers>[^/]+))"
)
_RANGE: Final = re.compile(r"bytes=(\d*)-(\d*)")
_CONTENT_RANGE: Final = re.compile(r"(?:bytes )?(\d+)-(\d+)(?:/\d+|/\*)?")
_MAX_NAME: Final = 255


class Refusal(Exception):
    """An answer in the spec's error JSON: `status`, one of its `code`s and a message."""

    def __init__(
        self, status: int, code: str, message: str, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers

    def response(self) -> Response:
        body = {"errors": [{"code": self.code, "message": str(self), "detail": {}}]}
        return Response(
            self.status,
            json.dumps(body).encode(),
            _JSON,
            headers=(*_API, *self.headers),
            close=self.status in (400, 408, 413, 416),
        )


def _refusal(error: VaultError) -> Refusal:
    if isinstance(error, Unauthenticated):
        return Refusal(401, "UNAUTHORIZED", str(error), _BASIC_CHALLENGE)
    if isinstance(error, PermissionDenied):
        return Refusal(403, "DENIED", str(error))
    if isinstance(error, QuotaExceeded):
        return Refusal(429, "TOOMANYREQUESTS", str(error), (("Retry-After", "5"),))
    if isinstance(error, DiskFull):
        return Refusal(507, "UNSUPPORTED", str(error))
    if isinstance(error, NotFound):
        return Refusal(404, "BLOB_UNKNOWN", str(error))
    if isinstance(error, IntegrityError):
        return Refusal(500, "UNKNOWN", f"the vault's copy failed its check: {error}")
    if isinstance(error, InvalidArgument):
        return Refusal(400, "UNSUPPORTED", str(error))
    return Refusal(503, "UNAVAILABLE", str(error), (("Retry-After", "1"),))


def sha256_digest(text: str, code: str = "DIGEST_INVALID") -> Digest:
    """A sha256 digest as OCI spells it (the vault keeps blobs by sha256), or a 400."""
    if not _SHA256.fullmatch(text):
        raise Refusal(400, code, f"{text[:80]!r} is not a sha256 digest (sha256:<64 hex>)")
    return Digest.parse(text)


@dataclass(eq=False)
class Upload:
    """A blob upload in progress: its bytes in a file of the uploads folder until it is put."""

    id: str
    owner: str
    repository: str
    path: Path
    size: int = 0
    touched: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Uploads:
    """The open uploads, bounded in number per caller and in size each, and dropped once idle
    for `timeout` seconds."""

    def __init__(self, folder: Path, settings: RegistryConfig) -> None:
        self.folder = folder
        self.per_caller = settings.uploads_per_caller
        self.max_bytes = settings.max_upload_bytes
        self.timeout = settings.upload_timeout
        self._open: dict[str, Upload] = {}
        self._lock = threading.Lock()
        # An upload's bytes do not outlive the server that took them.
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700, parents=True)
        fsync_dir(folder.parent)

    def open(self, owner: str, repository: str) -> Upload:
        with self._lock:
            self._sweep()
            mine = sum(1 for u in self._open.values() if u.owner == owner)
            if mine >= self.per_caller:
                raise Refusal(
                    429,
                    "TOOMANYREQUESTS",
                    f"{owner} has {mine} uploads open, the most one caller may: finish or "
                    "cancel one first",
                    (("Retry-After", "5"),),
                )
            upload = self.scratch(owner, repository)
            self._open[upload.id] = upload
            return upload

    def scratch(self, owner: str, repository: str) -> Upload:
        """An upload of one request's body (a monolithic push), which no other request finds
        and which the request closes whatever comes of it."""
        upload_id = secrets.token_urlsafe(24)
        path = self.folder / upload_id
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        os.close(fd)
        return Upload(upload_id, owner, repository, path)

    def get(self, upload_id: str, owner: str, repository: str) -> Upload:
        with self._lock:
            self._sweep()
            upload = self._open.get(upload_id)
            # Another caller's upload is as unknown as one that never was.
            if upload is None or upload.owner != owner or upload.repository != repository:
                raise Refusal(404, "BLOB_UPLOAD_UNKNOWN", f"no upload {upload_id[:64]!r} here")
            upload.touched = time.monotonic()
            return upload

    def too_large(self, upload: Upload) -> Refusal:
        """Cancel `upload`, which would pass its size bound, and say why."""
        self.close(upload)
        return Refusal(
            413,
            "SIZE_INVALID",
            f"an upload is at most {self.max_bytes} bytes: this one is cancelled",
        )

    def append(self, upload: Upload, piece: bytes) -> None:
        """Add `piece` to the upload's file, within its size bound."""
        if upload.size + len(piece) > self.max_bytes:
            raise self.too_large(upload)
        with open(upload.path, "ab", buffering=0) as file:
            file.write(piece)
        upload.size += len(piece)
        upload.touched = time.monotonic()

    def cut(self, upload: Upload, size: int) -> None:
        """Drop what was appended to `upload` past `size` bytes (a request's body that failed)."""
        os.truncate(upload.path, size)
        upload.size = size

    def pieces(self, upload: Upload) -> Iterator[bytes]:
        with open(upload.path, "rb", buffering=0) as file:
            while piece := file.read(_FILE_PIECE):
                yield piece

    def close(self, upload: Upload) -> None:
        with self._lock:
            self._open.pop(upload.id, None)
        upload.path.unlink(missing_ok=True)

    def _sweep(self) -> None:
        old = time.monotonic() - self.timeout
        for upload in [u for u in self._open.values() if u.touched < old]:
            # One a request is writing stays until that request ends.
            if upload.lock.acquire(blocking=False):
                try:
                    del self._open[upload.id]
                    upload.path.unlink(missing_ok=True)
                finally:
                    upload.lock.release()

    def count(self) -> int:
        with self._lock:
            return len(self._open)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A manifest as pushed: its bytes, digest, media type, the blobs it names (digest and
    size) and the manifest it refers to, if any."""

    body: bytes
    digest: Digest
    media_type: str
    blobs: tuple[tuple[str, int], ...]
    subject: str


def parse_manifest(body: bytes, content_type: str) -> Manifest:
    """Check a pushed manifest or index: JSON, schema version 2, a known media type, and every
    descriptor well formed. MANIFEST_INVALID names what is wrong."""

    def invalid(why: str) -> Refusal:
        return Refusal(400, "MANIFEST_INVALID", f"the manifest is invalid: {why}")

    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise invalid("not a JSON object")
    if document.get("schemaVersion") != 2:
        raise invalid("schemaVersion is not 2")
    declared = document.get("mediaType")
    given = content_type.split(";")[0].strip()
    media_type = declared if isinstance(declared, str) else given
    if declared is not None and given and given != declared:
        raise invalid(f"it says it is {declared!r} but was sent as {given!r}")
    if media_type not in MANIFEST_TYPES:
        if "manifests" in document:
            media_type = OCI_INDEX
        elif "config" in document:
            media_type = OCI_MANIFEST
        else:
            raise invalid(f"unknown media type {media_type!r}")

    def descriptor(value: Any, where: str) -> tuple[str, int]:
        if not isinstance(value, dict):
            raise invalid(f"{where} is not a descriptor")
        digest, size = value.get("digest"), value.get("size")
        if not isinstance(value.get("mediaType"), str):
            raise invalid(f"{where} has no mediaType")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise invalid(f"{where} has no sha256 digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise invalid(f"{where} has no size")
        return digest, size

    named: list[tuple[str, int]] = []
    if media_type in _INDEXES:
        manifests = document.get("manifests")
        if not isinstance(manifests, list):
            raise invalid("an index needs a list of manifests")
        named += [descriptor(m, f"manifests[{i}]") for i, m in enumerate(manifests)]
    else:
        named.append(descriptor(document.get("config"), "config"))
        layers = document.get("layers")
        if not isinstance(layers, list):
            raise invalid("an image manifest needs a list of layers")
        named += [descriptor(layer, f"layers[{i}]") for i, layer in enumerate(layers)]
    subject = ""
    if "subject" in document:
        subject = descriptor(document["subject"], "subject")[0]
    return Manifest(body, sha256_of(body), media_type, tuple(dict.fromkeys(named)), subject)


class Registry:
    """The API's requests, answered from `content` and `ledger`. `tokens`: the vault's bearer
    tokens (None in local mode, where every caller is the one local user); `bearer`: the
    registry tokens its token endpoint issues (by default under a key of this process alone);
    `scheme`: what the token endpoint's realm is reached by (http or https)."""

    def __init__(
        self,
        ledger: Ledger,
        content: Content,
        settings: RegistryConfig,
        uploads: Path,
        *,
        tokens: Authenticator | None = None,
        bearer: RegistryTokens | None = None,
        scheme: str = "http",
    ) -> None:
        self.ledger = ledger
        self.content = content
        self.settings = settings
        self.tokens = tokens
        self.bearer = bearer or RegistryTokens(secrets.token_bytes(32))
        self.scheme = scheme
        # host:port this registry listens on, once it does.
        self.origin = ""
        self.uploads = Uploads(uploads, settings)
        self.hidden = HiddenBlobs(ledger.db)
        self.names = RepositoryNames(ledger)

    # -- the edge's handler

    def respond(self, request: Request) -> Response | Sink:
        """The answer to `request`, or, for one that pushes bytes, the sink its body goes to."""
        return _answered(lambda: self._respond(request))

    def _respond(self, request: Request) -> Response | Sink:
        parts = urlsplit(request.target)
        path = parts.path
        if self.tokens is None and not _loopback_host(request.header("Host")):
            raise Refusal(403, "DENIED", "this registry answers only to loopback host names")
        if path == _TOKEN_PATH and self.tokens is not None:
            if request.method != "GET":
                raise _method(request.method)
            # Its query may repeat `scope`, which the API's own queries may not.
            return self._token(request, parts.query)
        query = _query(parts.query)
        if path in ("/v2", "/v2/"):
            self._identify(request, PULL)
            return Response(200, b"{}", _JSON, headers=_API)
        route = _ROUTE.fullmatch(path)
        if route is None or len(route["name"]) > _MAX_NAME:
            raise Refusal(404, "NAME_INVALID", f"no such registry path {path[:120]!r}")
        name, method = route["name"], request.method
        if route["upload"] is not None:
            who = self._identify(request, PUSH, name)
            if route["upload"] == "":
                if method != "POST":
                    raise _method(method)
                return self._start_upload(request, who, name, query)
            return self._upload(request, who, name, route["upload"], query)
        if route["blob"] is not None:
            if method == "DELETE":
                who = self._identify(request, DELETE, name)
                return self._delete_blob(who, name, route["blob"])
            if method not in ("GET", "HEAD"):
                raise _method(method)
            self._identify(request, PULL, name)
            return self._blob(request, name, route["blob"])
        if route["reference"] is not None:
            if method == "PUT":
                who = self._identify(request, PUSH, name)
                return self._put_manifest(request, who, name, route["reference"])
            if method == "DELETE":
                who = self._identify(request, DELETE, name)
                return self._delete_manifest(who, name, route["reference"])
            if method not in ("GET", "HEAD"):
                raise _method(method)
            self._identify(request, PULL, name)
            return self._manifest(name, route["reference"])
        if route["tags"] is not None:
            if method != "GET":
                raise _method(method)
            self._identify(request, PULL, name)
            return self._tags(name, query)
        if method != "GET":
            raise _method(method)
        self._identify(request, PULL, name)
        return self._referrers(name, route["referrers"], query)

    def _identify(self, request: Request, action: str, name: str = "") -> Identity:
        """Who is calling, after checking they may `action` (pull, push, delete) on repository
        `name` (none: the API's root, which any caller with a credential may reach). A caller
        without one, or whose registry token lacks the scope, is challenged to the token
        endpoint."""
        if self.tokens is None:
            return LOCAL
        permission = _permission(action)
        given = request.header("Authorization")
        if not given and action == PULL and self.settings.anonymous_pull:
            return Identity("anonymous", "", "reader")
        challenge = self._challenge(request, action, name)
        if len(given) != 1:
            raise Refusal(
                401,
                "UNAUTHORIZED",
                "this registry needs a credential: a token from its token endpoint, or a vault "
                "token (`Authorization: Bearer <token>`, or as the password of Basic)",
                challenge,
            )
        scheme, _, value = given[0].strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip().startswith(PREFIX):
            who = self._granted(request, value.strip(), action, name, challenge)
        else:
            who = self._vault_identity(request, scheme, value.strip(), challenge)
        if not who.may(permission):
            raise PermissionDenied(f"{who.name} (role {who.role}) may not {action}")
        return who

    def _granted(
        self,
        request: Request,
        token: str,
        action: str,
        name: str,
        challenge: tuple[tuple[str, str], ...],
    ) -> Identity:
        """The identity a registry token was issued to, if it grants `action` on `name`."""
        try:
            grant = self.bearer.check(token)
        except ExpiredToken as exc:
            raise Refusal(401, "UNAUTHORIZED", str(exc), challenge) from None
        except Unauthenticated as exc:
            assert self.tokens is not None
            refused = self.tokens.refused(caller_address(request.peer), exc)
            if not isinstance(refused, Unauthenticated):
                raise refused from None
            raise Refusal(401, "UNAUTHORIZED", str(exc), challenge) from None
        if name and not grant.allows(name, action):
            if not grant.identity.may(_permission(action)):
                raise PermissionDenied(
                    f"{grant.identity.name} (role {grant.identity.role}) may not {action}"
                )
            # A scope the caller's role allows but did not ask for: ask the endpoint for it.
            raise Refusal(
                401,
                "UNAUTHORIZED",
                f"the registry token does not grant {action} on {name}",
                challenge,
            )
        return grant.identity

    def _vault_identity(
        self, request: Request, scheme: str, value: str, challenge: tuple[tuple[str, str], ...]
    ) -> Identity:
        """The identity of a vault token, sent as Bearer or as Basic's password (the name is
        not checked: the token says who it is)."""
        assert self.tokens is not None
        token = value
        if scheme.lower() == "basic":
            try:
                token = base64.b64decode(token, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                token = ""
        elif scheme.lower() != "bearer":
            token = ""
        try:
            return Gate("credentials", self.tokens).identify(
                [("authorization", f"Bearer {token}")], {}, address=caller_address(request.peer)
            )
        except Unauthenticated as exc:
            raise Refusal(401, "UNAUTHORIZED", str(exc), challenge) from None

    def _challenge(self, request: Request, action: str, name: str) -> tuple[tuple[str, str], ...]:
        """`WWW-Authenticate: Bearer …`, sending the client to the token endpoint for the scope
        this request needs."""
        params = f'realm="{self._realm(request)}",service="{SERVICE}"'
        if name:
            params += f',scope="{scope_of(name, action)}"'
        return (("WWW-Authenticate", f"Bearer {params}"),)

    def _realm(self, request: Request) -> str:
        # The token endpoint is on this listener: the address the client reached it by. A
        # caller can point only its own challenge elsewhere, by a Host of its own.
        hosts = request.header("Host")
        host = hosts[0].strip() if len(hosts) == 1 else ""
        if not _HOST.fullmatch(host):
            host = self.origin or "localhost"
        return f"{self.scheme}://{host}{_TOKEN_PATH}"

    def _token(self, request: Request, query_text: str) -> Response:
        """The token endpoint: a caller's vault token (Basic's password, or Bearer) exchanged
        for a registry token granting the scopes asked that its role allows; without a
        credential, a pull-only one when anonymous pulls are on."""
        try:
            query = parse_qs(query_text, keep_blank_values=True)
        except ValueError:
            raise Refusal(400, "UNSUPPORTED", "the query is malformed") from None
        service = query.get("service", [SERVICE])
        if service != [SERVICE]:
            raise Refusal(
                400, "UNSUPPORTED", f"this token endpoint serves {SERVICE!r}, not {service[:2]}"
            )
        try:
            asked = parse_scopes(query.get("scope", []))
        except InvalidArgument as exc:
            raise Refusal(400, "UNSUPPORTED", str(exc)) from None
        given = request.header("Authorization")
        if not given and self.settings.anonymous_pull:
            who = Identity("anonymous", "", "reader")
        elif len(given) != 1:
            raise Refusal(
                401,
                "UNAUTHORIZED",
                "the token endpoint needs a vault token as the password of Basic credentials",
                _BASIC_CHALLENGE,
            )
        else:
            scheme, _, value = given[0].strip().partition(" ")
            who = self._vault_identity(request, scheme, value.strip(), _BASIC_CHALLENGE)
        token, grant = self.bearer.issue(who, asked)
        issued = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(grant.expires - self.bearer.lifetime)
        )
        body = {
            "token": token,
            "access_token": token,
            "expires_in": self.bearer.lifetime,
            "issued_at": issued,
        }
        return Response(
            200,
            json.dumps(body).encode(),
            _JSON,
            headers=(*_API, ("Cache-Control", "no-store")),
        )

    # -- blobs

    def _blob(self, request: Request, name: str, text: str) -> Response:
        digest = sha256_digest(text)
        blob = self.content.find(digest)
        if blob is None:
            raise Refusal(404, "BLOB_UNKNOWN", f"blob {digest} is not in the vault")
        if self.hidden.hidden(name, [str(digest)]):
            raise Refusal(404, "BLOB_UNKNOWN", f"blob {digest} was deleted from {name}")
        size = blob.info.size
        headers = [*_API, ("Docker-Content-Digest", str(digest)), ("Accept-Ranges", "bytes")]
        offset, length, status = 0, size, 200
        ranges = request.header("Range")
        if ranges and request.method == "GET":
            first, last = _byte_range(ranges[0], size)
            if last < first:
                raise Refusal(
                    416,
                    "BLOB_UNKNOWN",
                    f"range {ranges[0][:80]!r} is not within the blob's {size} bytes",
                    (("Content-Range", f"bytes */{size}"),),
                )
            offset, length, status = first, last - first + 1, 206
            headers.append(("Content-Range", f"bytes {first}-{last}/{size}"))
        if request.method == "HEAD":
            return Response(
                200, content_type=_OCTETS, headers=tuple(headers), stream=iter(()), length=size
            )
        _, chunks = self.content.read(blob, offset, length)
        return Response(
            status,
            content_type=_OCTETS,
            headers=tuple(headers),
            stream=_ranged(chunks, offset, length),
            length=length,
        )

    def _delete_blob(self, who: Identity, name: str, text: str) -> Response:
        """Hide a blob from repository `name`: it is unknown there until pushed or mounted there
        again. Its bytes stay, for every other repository and every pin that names them."""
        digest = str(sha256_digest(text))
        if self.content.find(Digest.parse(digest)) is None or self.hidden.hidden(name, [digest]):
            raise Refusal(404, "BLOB_UNKNOWN", f"no blob {digest} in {name}")
        self.hidden.hide(name, digest)
        log.info("registry: %s deleted blob %s from %s", who.name, digest, name)
        return Response(202, headers=_API)

    def _start_upload(
        self, request: Request, who: Identity, name: str, query: Mapping[str, str]
    ) -> Response | Sink:
        mounted = query.get("mount")
        if mounted is not None:
            # Every blob of the vault is in every repository it was not deleted from: a mount
            # is a look-up.
            digest = sha256_digest(mounted)
            source = query.get("from")
            if self.content.find(digest) is not None and not (
                source and self.hidden.hidden(source, [str(digest)])
            ):
                self.hidden.show(name, [str(digest)])
                return _created(name, digest)
        if "digest" in query:
            digest = sha256_digest(query["digest"])
            upload = self.uploads.scratch(who.name, name)
            upload.lock.acquire()
            return _UploadBody(
                self.uploads,
                upload,
                functools.partial(self._put_upload, name, digest, upload),
                session=False,
            )
        upload = self.uploads.open(who.name, name)
        return _upload_state(name, upload, 202)

    def _upload(
        self, request: Request, who: Identity, name: str, upload_id: str, query: Mapping[str, str]
    ) -> Response | Sink:
        upload = self.uploads.get(upload_id, who.name, name)
        method = request.method
        if method == "DELETE":
            self.uploads.close(upload)
            return Response(204, headers=_API)
        if method == "GET":
            return _upload_state(name, upload, 204)
        if method not in ("PATCH", "PUT"):
            raise _method(method)
        ranges = request.header("Content-Range")
        if ranges:
            stated = _CONTENT_RANGE.fullmatch(ranges[0].strip())
            if stated is None or int(stated[1]) != upload.size:
                raise Refusal(
                    416,
                    "BLOB_UPLOAD_INVALID",
                    f"this upload has {upload.size} bytes: a chunk must start there",
                    _range_header(upload),
                )
        if method == "PATCH":
            then = functools.partial(_upload_state, name, upload, 202)
        elif "digest" not in query:
            raise Refusal(400, "DIGEST_INVALID", "the closing PUT needs ?digest=")
        else:
            digest = sha256_digest(query["digest"])
            then = functools.partial(self._put_upload, name, digest, upload)
        # Held until the body has been taken or given up, whichever thread that ends on.
        if not upload.lock.acquire(blocking=False):
            raise Refusal(416, "BLOB_UPLOAD_INVALID", "another request is writing to this upload")
        return _UploadBody(self.uploads, upload, then)

    def _put_upload(self, name: str, digest: Digest, upload: Upload) -> Response:
        """Put the upload's bytes as the blob `digest`, and close the upload whatever comes."""
        try:
            self.content.put(self.uploads.pieces(upload), digest)
        except IntegrityError as exc:
            raise Refusal(400, "DIGEST_INVALID", str(exc)) from None
        finally:
            self.uploads.close(upload)
        self.hidden.show(name, [str(digest)])
        return _created(name, digest)

    # -- manifests

    def _put_manifest(self, request: Request, who: Identity, name: str, reference: str) -> Sink:
        return _ManifestBody(lambda body: self._pin_manifest(request, who, name, reference, body))

    def _pin_manifest(
        self, request: Request, who: Identity, name: str, reference: str, body: bytes
    ) -> Response:
        types = request.header("Content-Type")
        manifest = parse_manifest(body, types[0] if types else "")
        tag = ""
        if _SHA256.fullmatch(reference):
            if reference != str(manifest.digest):
                raise Refusal(
                    400,
                    "DIGEST_INVALID",
                    f"the manifest's bytes are {manifest.digest}, not {reference}",
                )
        elif _TAG.fullmatch(reference):
            tag = reference
        else:
            raise Refusal(400, "MANIFEST_INVALID", f"{reference[:80]!r} is not a tag or digest")
        named = [digest for digest, _ in manifest.blobs]
        held = self.content.find_many(named)
        hidden = self.hidden.hidden(name, named)
        for digest, size in manifest.blobs:
            blob = held.get(digest)
            if blob is None:
                raise Refusal(
                    400, "MANIFEST_BLOB_UNKNOWN", f"the manifest names {digest}, not in the vault"
                )
            if digest in hidden:
                raise Refusal(
                    400,
                    "MANIFEST_BLOB_UNKNOWN",
                    f"the manifest names {digest}, which was deleted from {name}: push it again",
                )
            if blob.info.size != size:
                raise Refusal(
                    400,
                    "MANIFEST_INVALID",
                    f"the manifest gives {digest} {size} bytes; it has {blob.info.size}",
                )
        self.content.put([manifest.body], manifest.digest)
        meta = {REPOSITORY: name, MEDIA_TYPE: manifest.media_type}
        if tag:
            meta[TAG] = tag
        if manifest.subject:
            meta[SUBJECT] = manifest.subject
        spec = PinSpec.checked(
            kind=KIND, subjects=[str(manifest.digest)], author=who.author("registry"), meta=meta
        )
        (entry,) = self.ledger.append([spec])
        log.info("registry: %s pinned %s@%s as entry %d", who.name, name, reference, entry.index)
        headers = (*_API, *_created(name, manifest.digest, kind="manifests").headers)
        if manifest.subject:
            headers = (*headers, ("OCI-Subject", manifest.subject))
        return Response(201, headers=headers)

    def _manifest(self, name: str, reference: str) -> Response:
        entry = self._resolve(name, reference)
        if entry is None:
            raise Refusal(404, "MANIFEST_UNKNOWN", f"no manifest {reference} in {name}")
        digest = entry.subjects[0]
        blob = self.content.get(Digest.parse(digest))
        _, chunks = self.content.read(blob)
        body = b"".join(chunk.data for chunk in chunks)
        return Response(
            200,
            body,
            entry.meta.get(MEDIA_TYPE, OCI_MANIFEST),
            headers=(*_API, ("Docker-Content-Digest", digest)),
        )

    def _delete_manifest(self, who: Identity, name: str, reference: str) -> Response:
        """Withdraw a tag (the manifest stays, by digest and by its other tags) or a manifest
        (and with it every tag of it) from repository `name`: a `withdraw` entry, after which
        the name resolves to nothing on every server of the vault. Pushing it again brings it
        back."""
        entry = self._resolve(name, reference)
        if entry is None:
            raise Refusal(404, "MANIFEST_UNKNOWN", f"no manifest {reference} in {name}")
        meta = {REPOSITORY: name}
        if not _SHA256.fullmatch(reference):
            meta[TAG] = reference
        # Not `PinSpec.checked`, which refuses this kind to every caller.
        spec = PinSpec(
            WITHDRAW,
            (entry.subjects[0],),
            check_author(who.author("registry")),
            check_meta(meta),
        )
        (withdrawn,) = self.ledger.append([spec])
        log.info(
            "registry: %s deleted %s@%s as entry %d", who.name, name, reference, withdrawn.index
        )
        return Response(202, headers=_API)

    def _resolve(self, name: str, reference: str) -> Entry | None:
        """The `image` entry that `reference` (a digest or a tag) names in repository `name`,
        or None (see `RepositoryNames`)."""
        if _SHA256.fullmatch(reference):
            return self.names.by_digest(name, reference)
        if not _TAG.fullmatch(reference):
            raise Refusal(400, "MANIFEST_INVALID", f"{reference[:80]!r} is not a tag or digest")
        return self.names.by_tag(name, reference)

    def _tags(self, name: str, query: Mapping[str, str]) -> Response:
        listed = self.names.tags(name)
        if listed is None:
            raise Refusal(404, "NAME_UNKNOWN", f"no repository {name} in this registry")
        last = query.get("last")
        if last is not None:
            listed = [tag for tag in listed if tag > last]
        headers: tuple[tuple[str, str], ...] = _API
        if "n" in query:
            if not query["n"].isdigit():
                raise Refusal(400, "UNSUPPORTED", "n is a number of tags")
            n = int(query["n"])
            if len(listed) > n:
                link = f'</v2/{name}/tags/list?n={n}&last={listed[n - 1] if n else ""}>; rel="next"'
                headers = (*headers, ("Link", link))
            listed = listed[:n]
        return Response(
            200, json.dumps({"name": name, "tags": listed}).encode(), _JSON, headers=headers
        )

    def _referrers(self, name: str, text: str, query: Mapping[str, str]) -> Response:
        subject = str(sha256_digest(text))
        wanted = query.get("artifactType")
        manifests: dict[str, dict[str, Any]] = {}
        for entry in self.names.manifests(name):
            digest = entry.subjects[0]
            if entry.meta.get(SUBJECT) != subject:
                continue
            blob = self.content.find(Digest.parse(digest))
            if blob is None:
                continue
            _, chunks = self.content.read(blob)
            document = json.loads(b"".join(chunk.data for chunk in chunks))
            kind = document.get("artifactType") or document.get("config", {}).get("mediaType")
            if wanted is not None and kind != wanted:
                continue
            described: dict[str, Any] = {
                "mediaType": entry.meta.get(MEDIA_TYPE, OCI_MANIFEST),
                "digest": digest,
                "size": blob.info.size,
            }
            if kind:
                described["artifactType"] = kind
            if isinstance(document.get("annotations"), dict):
                described["annotations"] = document["annotations"]
            manifests[digest] = described
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list(manifests.values())}
        headers = _API if wanted is None else (*_API, ("OCI-Filters-Applied", "artifactType"))
        return Response(200, json.dumps(index).encode(), OCI_INDEX, headers=headers)


def _byte_range(text: str, size: int) -> tuple[int, int]:
    """The first and last byte a Range header asks of `size` bytes (RFC 9110: FIRST-LAST,
    FIRST- or -SUFFIX), or (1, 0) when it asks for none of them."""
    asked = _RANGE.fullmatch(text.strip())
    if asked is None or not (asked[1] or asked[2]):
        return 1, 0
    if not asked[1]:
        return max(0, size - int(asked[2])), size - 1
    first = int(asked[1])
    last = min(int(asked[2]), size - 1) if asked[2] else size - 1
    return (first, last) if first < size else (1, 0)


def _permission(action: str) -> str:
    """The permission of a role an action on a repository needs."""
    return "read" if action == PULL else "write"


def _method(method: str) -> Refusal:
    return Refusal(405, "UNSUPPORTED", f"{method} is not supported here")


def _answered(work: Callable[[], _R]) -> _R | Response:
    """What `work` returns, or the answer to the refusal or vault error it raised."""
    try:
        return work()
    except Refusal as refusal:
        return refusal.response()
    except VaultError as error:
        return _refusal(error).response()


def _body_refused(error: BodyError) -> Response:
    code = "SIZE_INVALID" if error.status == 413 else "BLOB_UPLOAD_INVALID"
    return Refusal(error.status, code, str(error)).response()


class _UploadBody:
    """A pushed blob's bytes, appended to `upload` as they come (the edge's sink), then `then`
    answers. A body that fails leaves an upload session as it was before it (one past the
    upload's bound cancels it) and closes a request's own upload, so no part of a cut-off body
    is ever taken for a chunk or a blob. Holds the upload's lock, taken for it, until it
    answers or is aborted."""

    def __init__(
        self,
        uploads: Uploads,
        upload: Upload,
        then: Callable[[], Response],
        *,
        session: bool = True,
    ) -> None:
        self._uploads = uploads
        self._upload = upload
        self._began = upload.size
        self._then = then
        self._session = session

    def write(self, piece: bytes) -> Response | None:
        try:
            self._uploads.append(self._upload, piece)
        except Refusal as refusal:
            self._upload.lock.release()
            return refusal.response()
        return None

    def finish(self) -> Response:
        try:
            return _answered(self._then)
        finally:
            self._upload.lock.release()

    def abort(self, error: BodyError) -> Response:
        try:
            if error.status == 413:
                return self._uploads.too_large(self._upload).response()
            if self._session:
                self._uploads.cut(self._upload, self._began)
            else:
                self._uploads.close(self._upload)
        finally:
            self._upload.lock.release()
        return _body_refused(error)


class _ManifestBody:
    """A pushed manifest's bytes, kept in memory (within the spec's bound) as they come, then
    given to `then`."""

    def __init__(self, then: Callable[[bytes], Response]) -> None:
        self._body = bytearray()
        self._then = then

    def write(self, piece: bytes) -> Response | None:
        self._body += piece
        if len(self._body) > MAX_MANIFEST_BYTES:
            self._body.clear()
            return Refusal(
                413, "SIZE_INVALID", f"a manifest is at most {MAX_MANIFEST_BYTES} bytes"
            ).response()
        return None

    def finish(self) -> Response:
        return _answered(lambda: self._then(bytes(self._body)))

    def abort(self, error: BodyError) -> Response:
        self._body.clear()
        return _body_refused(error)


def _created(name: str, digest: Digest, *, kind: str = "blobs") -> Response:
    return Response(
        201,
        headers=(
            *_API,
            ("Location", f"/v2/{name}/{kind}/{digest}"),
            ("Docker-Content-Digest", str(digest)),
        ),
    )


def _range_header(upload: Upload) -> tuple[tuple[str, str], ...]:
    # The spec's Range of an upload is inclusive, and "0-0" for an empty one.
    return (("Range", f"0-{max(upload.size - 1, 0)}"),)


def _upload_state(name: str, upload: Upload, status: int) -> Response:
    return Response(
        status,
        headers=(
            *_API,
            ("Location", f"/v2/{name}/blobs/uploads/{upload.id}"),
            ("Docker-Upload-UUID", upload.id),
            *_range_header(upload),
        ),
    )


def _ranged(chunks: Iterator[Any], offset: int, length: int) -> Iterator[bytes]:
    """The bytes [offset, offset + length) of verified whole chunks that cover them."""
    end = offset + length
    for chunk in chunks:
        data = chunk.data
        start = max(0, offset - chunk.offset)
        stop = min(len(data), end - chunk.offset)
        if stop > start:
            yield bytes(memoryview(data)[start:stop])


def _query(text: str) -> dict[str, str]:
    try:
        parsed = parse_qs(text, keep_blank_values=True, strict_parsing=bool(text))
    except ValueError:
        raise Refusal(400, "UNSUPPORTED", "the query is malformed") from None
    if any(len(values) > 1 for values in parsed.values()):
        raise Refusal(400, "UNSUPPORTED", "a query parameter is given twice")
    return {key: values[0] for key, values in parsed.items()}


def _loopback_host(hosts: Sequence[str]) -> bool:
    if len(hosts) != 1:
        return False
    name = hosts[0].strip().lower()
    name = name[: name.find("]") + 1] if name.startswith("[") else name.partition(":")[0]
    return name in _LOOPBACK or name.startswith("127.")


# -- on the edge


def check_registry_access(config: Config) -> tuple[str, int]:
    """The registry's host and port, once its listening there is safe: in local mode (no
    credentials) on loopback only, and tokens off loopback only inside TLS."""
    listen = config.registry.listen
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"registry.listen is HOST:PORT, not {listen!r}")
    loopback = host in _LOOPBACK
    if config.auth.mode == "local" and not loopback:
        raise ConfigError(
            f"auth.mode 'local' asks no credential, so the registry listens only on loopback, "
            f"not {listen}: set auth.mode = 'credentials'"
        )
    tls = bool(config.auth.tls_cert and config.auth.tls_key)
    if not loopback and not tls and not config.server.allow_plaintext_credentials:
        raise ConfigError(
            f"the registry on {listen} would receive tokens in plain text: set auth.tls_cert "
            "and auth.tls_key, or listen on loopback"
        )
    return host, int(port)


def _tls_context(config: Config) -> ssl.SSLContext | None:
    if not (config.auth.tls_cert and config.auth.tls_key):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(
        Path(config.auth.tls_cert).expanduser(), Path(config.auth.tls_key).expanduser()
    )
    return context


class RegistryServer:
    """The registry on its own port of the bounded HTTP edge."""

    def __init__(
        self, config: Config, ledger: Ledger, content: Content, tokens: Authenticator | None
    ) -> None:
        host, port = check_registry_access(config)
        settings = config.registry
        self.tls = _tls_context(config)
        # Every server of one vault signs with one key, so each checks the registry tokens
        # any of them issued: a client behind a balancer keeps its token from server to server.
        bearer = RegistryTokens(str(ledger.key).encode())
        self.registry = Registry(
            ledger,
            content,
            settings,
            config.data_path / UPLOADS,
            tokens=tokens,
            bearer=bearer,
            scheme="https" if self.tls else "http",
        )
        limits = Limits(
            head_seconds=10.0,
            body_seconds=30.0,
            work_seconds=300.0,
            max_body_bytes=settings.max_upload_bytes,
            min_body_rate=settings.min_upload_rate,
            per_address=32,
            connections=256,
            workers=8,
            queue=64,
            methods=frozenset({"GET", "HEAD", "POST", "PATCH", "PUT", "DELETE"}),
        )
        self.host = host
        self._edge = Edge(
            "registry", self.registry.respond, host, port, limits=limits, tls=self.tls
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self._edge.port}"

    def start(self) -> RegistryServer:
        self._edge.start()
        self.registry.origin = self.url.partition("://")[2]
        log.info("registry (OCI distribution) at %s", self.url)
        return self

    def stop(self) -> None:
        self._edge.stop()


__all__ = [
    "KIND",
    "Manifest",
    "Refusal",
    "Registry",
    "RegistryServer",
    "check_registry_access",
    "parse_manifest",
]
