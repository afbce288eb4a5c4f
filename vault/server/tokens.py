"""Bearer tokens, kept as hashes in the vault's database (see `vault.server.auth` for what a
token's role allows)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from vault.config import Config, check_name, check_role
from vault.errors import NotFound, QuotaExceeded, Unauthenticated
from vault.ledger.db import Database, Writer
from vault.server.auth import TOKEN_PREFIX, Identity
from vault.server.database import open_ledger_database
from vault.server.folder_lock import make_data_folder

# A revocation reaches every server within this many seconds.
TOKEN_CACHE_SECONDS: Final = 5.0
# Tokens a server remembers at once, the least recently used forgotten first. Only tokens that
# were found are remembered: an unknown one is looked up each time it is presented, which the
# gate's limit on failed credentials (vault/server/gatekeeper.py) keeps rare.
TOKEN_CACHE_ENTRIES: Final = 1024


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
        # The cache's own lock: a look-up never waits for a write.
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[float, bytes, Identity]] = OrderedDict()

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
        with self._cache_lock:
            self._cache.pop(token_id, None)

    @property
    def cached(self) -> int:
        """How many tokens this server remembers now."""
        return len(self._cache)

    def authenticate(self, token: str, *, may_look_up: bool = True) -> Identity:
        """The identity `token` names. A token remembered from a recent look-up costs no query;
        any other is looked up in the database, unless `may_look_up` is False (its address has
        failed too often) and the token is not remembered at all: then it is refused as
        QuotaExceeded without a query."""
        token_id, secret = split_token(token)
        now = time.monotonic()
        with self._cache_lock:
            cached = self._cache.get(token_id)
            if cached is not None:
                self._cache.move_to_end(token_id)
        if cached is None or now - cached[0] > TOKEN_CACHE_SECONDS:
            # A token found recently is looked up again whatever its address has failed.
            if cached is None and not may_look_up:
                raise QuotaExceeded(
                    "too many failed credentials from this address: wait a few seconds"
                )
            rows = self.db.fetch(
                "SELECT secret_hash, name, team, role, revoked FROM tokens WHERE token_id = ?",
                (token_id,),
            )
            if not rows or rows[0][4] is not None:
                with self._cache_lock:
                    self._cache.pop(token_id, None)
                raise Unauthenticated(f"token {TOKEN_PREFIX}{token_id} is unknown or revoked")
            stored, name, team, role, _ = rows[0]
            cached = (now, bytes(stored), Identity(name, team, role))
            with self._cache_lock:
                self._cache[token_id] = cached
                self._cache.move_to_end(token_id)
                while len(self._cache) > TOKEN_CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        _, stored_hash, identity = cached
        # Compared in constant time; the message names the token's public id, never its secret.
        if not hmac.compare_digest(stored_hash, _hash(secret)):
            raise Unauthenticated(f"token {TOKEN_PREFIX}{token_id} is unknown or revoked")
        return identity


def create_offline(config: Config, *, name: str, team: str, role: str) -> tuple[TokenInfo, str]:
    """A new token written straight into the vault's database, no server asked: the first
    administrator's (`vault token create --offline`, on the vault's host). On a host where the
    vault has not yet run, it makes the private data folder and the database that `vault serve`
    then starts from."""
    # As `vault serve` does: the database and its journals are for the vault's user only.
    umask = os.umask(0o077)
    try:
        make_data_folder(config.data_path)
        db = open_ledger_database(config)
    finally:
        os.umask(umask)
    store = TokenStore(db)
    try:
        return store.create(name=name, team=team, role=role)
    finally:
        store.close()
        db.dispose()
