"""The registry's bearer tokens, issued by its token endpoint as Docker and OCI clients expect
(`WWW-Authenticate: Bearer realm=…,service=…,scope=…`, then `GET /token`): short-lived, bound to
the repositories and actions the caller asked for and its role allows, and checked by any
server of the vault with no query, as they carry their own MAC under a key every server of the
vault derives from the checkpoint signing key they share."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from vault.errors import InvalidArgument, Unauthenticated
from vault.server.auth import Identity

# What clients name this registry in a challenge and in their token requests.
SERVICE: Final = "pinvault"
# Seconds a token is good for: what a client caches it for, and how long a revoked vault token
# still pulls or pushes through a registry token issued before its revocation.
LIFETIME: Final = 300
# Every registry token starts so, which tells it from a vault token (`pv_…`).
PREFIX: Final = "pvr1."
PULL: Final = "pull"
PUSH: Final = "push"
DELETE: Final = "delete"
# The permission of a role each action on a repository needs: a delete withdraws a name, which
# a writer may push again.
_GRANTS: Final = {PULL: "read", PUSH: "write", DELETE: "write"}
# What `*` asks for: every action (what `skopeo delete` asks for).
_EVERY: Final = "*"
# A token request asks for at most so many scopes: its work stays bounded.
MAX_SCOPES: Final = 16
_MAX_TOKEN: Final = 8192
_LABEL: Final = b"pinvault registry bearer tokens v1"
_SCOPE: Final = re.compile(r"repository:(?P<name>[^:\s]{1,255}):(?P<actions>[a-z*,]{1,64})")


class ExpiredToken(Unauthenticated):
    """A registry token this vault issued, past its time: the client's cue to ask again, not a
    failed credential."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What a registry token lets its bearer do: who it was issued to, and the actions it
    grants on each repository."""

    identity: Identity
    access: Mapping[str, frozenset[str]]
    expires: int

    def allows(self, name: str, action: str) -> bool:
        return action in self.access.get(name, frozenset())


def parse_scopes(texts: Iterable[str]) -> dict[str, frozenset[str]]:
    """The repositories and actions asked in `scope` parameters (each one or more
    `repository:NAME:ACTIONS`, space separated). Scopes of other kinds (`registry:catalog:*`)
    are ignored, as the spec lets a token service do; more than MAX_SCOPES is refused."""
    asked: dict[str, set[str]] = {}
    count = 0
    for text in texts:
        for scope in text.split():
            count += 1
            if count > MAX_SCOPES:
                raise InvalidArgument(f"a token request asks for at most {MAX_SCOPES} scopes")
            found = _SCOPE.fullmatch(scope)
            if found is None:
                continue
            named = set(found["actions"].split(","))
            actions = set(_GRANTS) if _EVERY in named else named & set(_GRANTS)
            if actions:
                asked.setdefault(found["name"], set()).update(actions)
    return {name: frozenset(actions) for name, actions in asked.items()}


def scope_of(name: str, action: str) -> str:
    """The scope a challenge names for `action` on `name` (a push asks for pull too, as
    clients read back what they push)."""
    return f"repository:{name}:{'pull,push' if action == PUSH else action}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class RegistryTokens:
    """Issues and checks registry tokens: `pvr1.<claims>.<MAC>`, the claims canonical JSON of
    who, what and until when, the MAC an HMAC-SHA256 under `secret`. `clock` gives seconds since
    the epoch (wall time, as the servers that check a token are not the one that issued it)."""

    def __init__(
        self, secret: bytes, *, lifetime: int = LIFETIME, clock: Callable[[], float] = time.time
    ) -> None:
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest()
        self.lifetime = lifetime
        self._clock = clock

    def issue(self, identity: Identity, asked: Mapping[str, frozenset[str]]) -> tuple[str, Grant]:
        """A token for `identity` granting of `asked` what its role allows (possibly nothing:
        the spec's answer to a scope the caller may not have is a token without it)."""
        access = {
            name: frozenset(a for a in sorted(actions) if identity.may(_GRANTS[a]))
            for name, actions in sorted(asked.items())
        }
        access = {name: actions for name, actions in access.items() if actions}
        expires = int(self._clock()) + self.lifetime
        claims = {
            "sub": identity.name,
            "team": identity.team,
            "role": identity.role,
            "access": {name: sorted(actions) for name, actions in access.items()},
            "exp": expires,
        }
        body = _b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
        token = f"{PREFIX}{body}.{_b64(self._mac(body))}"
        return token, Grant(identity, access, expires)

    def check(self, token: str) -> Grant:
        """What `token` grants; Unauthenticated if it was not issued under this vault's key
        (changed, truncated, made up) or has expired."""
        forged = Unauthenticated("the registry token is not one this vault issued")
        if len(token) > _MAX_TOKEN or not token.startswith(PREFIX):
            raise forged
        body, dot, mac = token[len(PREFIX) :].partition(".")
        try:
            given = _unb64(mac)
        except (binascii.Error, ValueError):
            raise forged from None
        if not dot or not hmac.compare_digest(given, self._mac(body)):
            raise forged
        claims = json.loads(_unb64(body))
        identity = Identity(claims["sub"], claims["team"], claims["role"])
        access = {name: frozenset(actions) for name, actions in claims["access"].items()}
        grant = Grant(identity, access, int(claims["exp"]))
        if self._clock() >= grant.expires:
            raise ExpiredToken("the registry token has expired: ask the token endpoint again")
        return grant

    def _mac(self, body: str) -> bytes:
        return hmac.new(self._key, body.encode(), hashlib.sha256).digest()


__all__ = [
    "DELETE",
    "LIFETIME",
    "PREFIX",
    "PULL",
    "PUSH",
    "SERVICE",
    "ExpiredToken",
    "Grant",
    "RegistryTokens",
    "parse_scopes",
    "scope_of",
]
