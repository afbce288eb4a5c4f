"""Bearer tokens, kept as hashes in the vault's database (see `vault.server.auth` for what a
token's role allows)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from vault.config import Config, check_name, check_role
from vault.errors import NotFound, Unauthenticated
from vault.ledger.db import Database, Writer
from vault.server.auth import TOKEN_PREFIX, Identity
from vault.server.database import open_ledger_database

# A revocation reaches every server within this many seconds.
TOKEN_CACHE_SECONDS: Final = 5.0


@dataclass(frozen=True, slots=True)
class TokenInfo:
    token_id: str
    name: str
    team: str
    role: str
    created: str
    revoked: str


def _hash(secret: str) -> bytes:
    # The secret is 256 random bits, so one SHA-256 is as hard to reverse as any slow hash.
    return hashlib.sha256(secret.encode()).digest()


def split_token(token: str) -> tuple[str, str]:
    """A token's public id and its secret; `pv_<id>_<secret>`."""
    body = token.strip()
    if not body.startswith(TOKEN_PREFIX) or body.count("_") != 2:
        raise Unauthenticated("the credential is not a pinvault token (pv_<id>_<secret>)")
    _, token_id, secret = body.split("_")
    if len(token_id) != 12 or len(secret) != 64:
        raise Unauthenticated("the credential is not a pinvault token (pv_<id>_<secret>)")
    return token_id, secret


class TokenStore:
    """Bearer tokens kept as hashes in the vault's database; a server caches what it looked up
    for a few seconds so that a call costs no query."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._writer = Writer(db)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, bytes, Identity | None]] = {}

    def close(self) -> None:
        self._writer.close()

    def create(self, *, name: str, team: str, role: str) -> tuple[TokenInfo, str]:
        """A new token; the secret is returned once and never stored."""
        info = TokenInfo(
            token_id=secrets.token_hex(6),
            name=check_name("name", name),
            team=check_name("team", team),
            role=check_role(role),
            created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            revoked="",
        )
        secret = secrets.token_hex(32)
        with self._lock, self._writer.begin() as tx:
            tx.run(
                "INSERT INTO tokens (token_id, secret_hash, name, team, role, created) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (info.token_id, _hash(secret), info.name, info.team, info.role, info.created),
            )
        return info, f"{TOKEN_PREFIX}{info.token_id}_{secret}"

    def list(self) -> list[TokenInfo]:
        rows = self.db.fetch(
            "SELECT token_id, name, team, role, created, revoked FROM tokens ORDER BY created"
        )
        return [TokenInfo(t, n, tm, r, c, rv or "") for t, n, tm, r, c, rv in rows]

    def revoke(self, token_id: str) -> None:
        when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._lock, self._writer.begin() as tx:
            found = tx.all("SELECT revoked FROM tokens WHERE token_id = ?", (token_id,))
            if not found:
                raise NotFound(f"no token {TOKEN_PREFIX}{token_id}")
            if found[0][0] is None:
                tx.run("UPDATE tokens SET revoked = ? WHERE token_id = ?", (when, token_id))
        self._cache.pop(token_id, None)

    def authenticate(self, token: str) -> Identity:
        token_id, secret = split_token(token)
        now = time.monotonic()
        cached = self._cache.get(token_id)
        if cached is None or now - cached[0] > TOKEN_CACHE_SECONDS:
            rows = self.db.fetch(
                "SELECT secret_hash, name, team, role, revoked FROM tokens WHERE token_id = ?",
                (token_id,),
            )
            if rows and rows[0][4] is None:
                stored, name, team, role, _ = rows[0]
                cached = (now, bytes(stored), Identity(name, team, role))
            else:
                cached = (now, b"", None)
            self._cache[token_id] = cached
        _, stored_hash, identity = cached
        # Compared in constant time; the message names the token's public id, never its secret.
        if identity is None or not hmac.compare_digest(stored_hash, _hash(secret)):
            raise Unauthenticated(f"token {TOKEN_PREFIX}{token_id} is unknown or revoked")
        return identity


def create_offline(config: Config, *, name: str, team: str, role: str) -> tuple[TokenInfo, str]:
    """A new token written straight into the vault's database, no server asked: the first
    administrator's (`vault token create --offline`, on the vault's host)."""
    db = open_ledger_database(config)
    store = TokenStore(db)
    try:
        return store.create(name=name, team=team, role=role)
    finally:
        store.close()
        db.dispose()
