"""The mirror set: N S3 endpoints, each a `tiers.cold.ColdTier` (encrypted for the mirrors the
config names), which of them should hold a given blob, and what was last seen of each one's
health."""

from __future__ import annotations

import hashlib
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tiers.cold import ColdTier, KeyRing
from vault.digest import Digest
from vault.errors import ConfigError, IntegrityError, InvalidArgument, NotFound, Unavailable
from vault.store.protocol import Closing

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_SEPARATORS = re.compile(r"[\s,]+")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
ACCESS_KEY_SUFFIX: Final = "_ACCESS_KEY_ID"
SECRET_KEY_SUFFIX: Final = "_SECRET_ACCESS_KEY"


@dataclass(frozen=True, slots=True)
class MirrorEndpoint:
    """Where one mirror is and how to sign requests to it."""

    name: str
    url: str
    bucket: str
    prefix: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"


def credential_variables(prefix: str, name: str) -> tuple[str, str]:
    """The environment variables holding a mirror's access key id and secret key."""
    stem = prefix + name.upper().replace("-", "_")
    return stem + ACCESS_KEY_SUFFIX, stem + SECRET_KEY_SUFFIX


@dataclass(frozen=True, slots=True)
class MirrorLocation:
    """Where one mirror is, as `mirrors.endpoints` names it: `NAME=URL/BUCKET[/PREFIX]`."""

    name: str
    url: str
    bucket: str
    prefix: str

    @property
    def item(self) -> str:
        """The mirror as an item of `mirrors.endpoints`."""
        return f"{self.name}={self.url}/{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


def check_name(name: str) -> str:
    """`name` if it may name a mirror; InvalidArgument if not."""
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"mirror name {name!r} must be 1 to 32 lowercase letters, digits and dashes, "
            "not starting with a dash"
        )
    return name


def new_location(name: str, url: str, bucket: str, prefix: str) -> MirrorLocation:
    """A mirror to add, from its parts as a user gives them; InvalidArgument naming the part
    that cannot be one."""
    check_name(name)
    parts = urllib.parse.urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.netloc
        or parts.path.strip("/")
        or parts.query
        or parts.fragment
        or _SEPARATORS.search(url)
    ):
        raise InvalidArgument(
            f"endpoint {url!r} is not http(s)://HOST[:PORT] (the bucket and prefix are given apart)"
        )
    if not _BUCKET.fullmatch(bucket):
        raise InvalidArgument(
            f"bucket {bucket!r} is not an S3 bucket name: 3 to 63 lowercase letters, digits, "
            "dots and dashes, beginning and ending with a letter or digit"
        )
    prefix = prefix.strip("/")
    if _SEPARATORS.search(prefix) or "//" in prefix:
        raise InvalidArgument(f"prefix {prefix!r} holds a space, a comma or an empty folder")
    return MirrorLocation(name, f"{parts.scheme}://{parts.netloc}", bucket, prefix)


def parse_locations(text: str) -> list[MirrorLocation]:
    """Mirrors from `NAME=http(s)://HOST[:PORT]/BUCKET[/PREFIX]` items separated by spaces or
    commas; InvalidArgument naming what is wrong."""
    locations: list[MirrorLocation] = []
    for item in _SEPARATORS.split(text.strip()):
        if not item:
            continue
        name, equals, url = item.partition("=")
        if not equals or not _NAME.fullmatch(name):
            raise InvalidArgument(
                f"mirrors.endpoints: {item!r} is not NAME=URL/BUCKET with a NAME of lowercase "
                "letters, digits and dashes"
            )
        parts = urllib.parse.urlsplit(url)
        bucket, _, prefix = parts.path.strip("/").partition("/")
        if parts.scheme not in ("http", "https") or not parts.netloc or not bucket:
            raise InvalidArgument(
                f"mirrors.endpoints: mirror {name} has {url!r}, expected "
                "http(s)://HOST[:PORT]/BUCKET[/PREFIX]"
            )
        if any(location.name == name for location in locations):
            raise InvalidArgument(f"mirrors.endpoints: mirror {name} is named twice")
        locations.append(MirrorLocation(name, f"{parts.scheme}://{parts.netloc}", bucket, prefix))
    return locations


def parse_endpoints(
    text: str, *, environ: Mapping[str, str], credentials_prefix: str, region: str
) -> list[MirrorEndpoint]:
    """The mirrors of `parse_locations`, each with its keys from the environment;
    InvalidArgument naming the variables missing."""
    endpoints: list[MirrorEndpoint] = []
    for location in parse_locations(text):
        name = location.name
        access_variable, secret_variable = credential_variables(credentials_prefix, name)
        missing = [v for v in (access_variable, secret_variable) if not environ.get(v)]
        if missing:
            raise InvalidArgument(
                f"mirror {name}: set {' and '.join(missing)} to its S3 credentials"
            )
        endpoints.append(
            MirrorEndpoint(
                name=name,
                url=location.url,
                bucket=location.bucket,
                prefix=location.prefix,
                access_key_id=environ[access_variable],
                secret_access_key=environ[secret_variable],
                region=region,
            )
        )
    return endpoints


@dataclass(frozen=True, slots=True)
class Health:
    """What was last seen of a mirror: None until it has been tried."""

    reachable: bool | None = None
    since: float = 0.0
    error: str = ""


@dataclass(slots=True)
class Rekeyed:
    """What `Mirror.rekey` did: copies sealed anew, copies already under the current key, and
    the copies it could not read (each error), which `vault mirror repair` rewrites."""

    rewritten: int = 0
    current: int = 0
    unreadable: list[str] = field(default_factory=list)


class Mirror:
    """One mirror: its name, its cold tier, and its health as last seen by this process."""

    def __init__(self, name: str, tier: ColdTier) -> None:
        self.name = name
        self.tier = tier
        self._health = Health()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Mirror({self.name!r}, {self.tier!r})"

    @property
    def where(self) -> str:
        return f"{self.tier.endpoint_url.rstrip('/')}/{self.tier.bucket}/{self.tier.prefix}"

    @property
    def health(self) -> Health:
        with self._lock:
            return self._health

    def seen_up(self) -> None:
        with self._lock:
            if self._health.reachable is not True:
                self._health = Health(True, time.time())

    def seen_down(self, error: str) -> None:
        with self._lock:
            since = self._health.since if self._health.reachable is False else time.time()
            self._health = Health(False, since, error)

    @property
    def encrypted(self) -> bool:
        """Whether the mirror's copies are encrypted: no client may put or read them directly."""
        return self.tier.encrypted

    def rekey(self, progress: Callable[[Digest], None] | None = None) -> Rekeyed:
        """Seal every copy on this encrypted mirror that is under an older key anew, under the
        key ring's first key, so that the older key can then be dropped from the ring."""
        report = Rekeyed()
        for digest in self.tier.sealed_digests():
            if isinstance(digest, IntegrityError):
                report.unreadable.append(str(digest))
                continue
            try:
                if self.tier.rekey(digest):
                    report.rewritten += 1
                else:
                    report.current += 1
            except NotFound:
                continue  # deleted meanwhile
            except IntegrityError as error:
                report.unreadable.append(str(error))
            if progress is not None:
                progress(digest)
        return report

    def probe(self) -> Health:
        """Ask the endpoint now (one HEAD, bounded by the tier's timeouts)."""
        try:
            self.tier.probe()
        except Unavailable as error:
            self.seen_down(str(error))
        else:
            self.seen_up()
        return self.health


class MirrorSet(Closing):
    """The mirrors, and which `replicas` of them hold each blob: the ones ranking highest for
    the digest by rendezvous hashing, so every process agrees without a table, and adding a
    mirror moves only the copies that now rank on it."""

    def __init__(self, mirrors: Sequence[Mirror], *, replicas: int) -> None:
        if not mirrors:
            raise InvalidArgument("a mirror set needs at least one mirror")
        if not 1 <= replicas <= len(mirrors):
            raise InvalidArgument(
                f"mirrors.replicas is {replicas}, expected 1 to the {len(mirrors)} mirrors "
                "configured (each copy goes to a different mirror)"
            )
        self.mirrors = list(mirrors)
        self.replicas = replicas

    def close(self) -> None:
        for mirror in self.mirrors:
            mirror.tier.close()

    def __iter__(self) -> Iterator[Mirror]:
        return iter(self.mirrors)

    def __len__(self) -> int:
        return len(self.mirrors)

    @property
    def names(self) -> list[str]:
        return [mirror.name for mirror in self.mirrors]

    def get(self, name: str) -> Mirror:
        for mirror in self.mirrors:
            if mirror.name == name:
                return mirror
        raise InvalidArgument(f"no mirror named {name!r} (mirrors: {', '.join(self.names)})")

    def assigned(self, digest: Digest) -> list[Mirror]:
        """The mirrors that should hold `digest`."""
        if self.replicas == len(self.mirrors):
            return list(self.mirrors)
        ranked = sorted(
            self.mirrors,
            key=lambda mirror: hashlib.sha256(f"{mirror.name}\0{digest}".encode()).digest(),
            reverse=True,
        )
        return ranked[: self.replicas]


def open_mirrors(
    endpoints: Sequence[MirrorEndpoint],
    *,
    replicas: int,
    connect_timeout: float,
    read_timeout: float,
    attempts: int,
    encrypted: str = "",
    encryption_keys: str = "",
) -> MirrorSet:
    """A MirrorSet with one ColdTier per endpoint (no request is made yet), those `encrypted`
    names (see encrypted_mirrors) sealing their copies with the key ring in file
    `encryption_keys`."""
    names = encrypted_mirrors(encrypted, encryption_keys, [e.name for e in endpoints])
    keys = KeyRing.load(Path(encryption_keys).expanduser()) if names else None
    mirrors = [
        Mirror(
            endpoint.name,
            cold_tier(
                endpoint,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                attempts=attempts,
                keys=keys if endpoint.name in names else None,
            ),
        )
        for endpoint in endpoints
    ]
    return MirrorSet(mirrors, replicas=replicas)


def encrypted_mirrors(encrypted: str, encryption_keys: str, names: Sequence[str]) -> set[str]:
    """The mirrors `mirrors.encrypted` names (`*`: all of `names`); ConfigError if it names
    one not configured, or if it and `mirrors.encryption_keys` are not both set or both
    empty."""
    items = [item for item in _SEPARATORS.split(encrypted.strip()) if item]
    if bool(items) != bool(encryption_keys.strip()):
        raise ConfigError(
            "mirrors.encrypted and mirrors.encryption_keys go together: "
            + (
                "set encryption_keys to the key ring file"
                if items
                else "set encrypted to the mirrors to encrypt (or *)"
            )
        )
    if items == ["*"]:
        return set(names)
    unknown = [item for item in items if item not in names]
    if unknown:
        raise ConfigError(
            f"mirrors.encrypted names {', '.join(unknown)}, not among the mirrors "
            f"({', '.join(names)})"
        )
    return set(items)


def cold_tier(
    endpoint: MirrorEndpoint,
    *,
    connect_timeout: float,
    read_timeout: float,
    attempts: int,
    keys: KeyRing | None = None,
) -> ColdTier:
    """The cold tier that holds a mirror's copies at `endpoint` (no request is made yet),
    encrypted under `keys` if given."""
    return ColdTier(
        endpoint_url=endpoint.url,
        bucket=endpoint.bucket,
        prefix=endpoint.prefix,
        access_key_id=endpoint.access_key_id,
        secret_access_key=endpoint.secret_access_key,
        region=endpoint.region,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_attempts=attempts,
        keys=keys,
    )
