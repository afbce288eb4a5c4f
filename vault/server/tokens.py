"""Bearer tokens, kept as hashes in the vault's database and checked against a copy in memory
of every live token's hash, so that an unknown token costs a dict look-up and no query (see
`vault.server.auth` for what a token's role allows)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from vault.config import Config, check_name, check_role
from vault.errors import NotFound, QuotaExceeded, Unauthenticated, Unavailable, VaultError
from vault.ledger.db import Database, Writer
from vault.server.auth import TOKEN_PREFIX, Identity
from vault.server.database import open_ledger_database
from vault.server.failed_credentials import FailedCredentials
from vault.server.folder_lock import make_data_folder

log = logging.getLogger(__name__)

# The copy in memory is read again from the database when a call finds it older than this: a
# token created or revoked through another server (or offline) takes effect within this many
# seconds, and however many calls arrive, a server reads the tokens at most once in it.
TOKEN_REFRESH_SECONDS: Final = 1.0


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
    """Bearer tokens kept as hashes in the vault's database. Every live (unrevoked) token's
    hash and identity is copied in memory, read again at most every TOKEN_REFRESH_SECONDS:
    tokens are few, so a call never waits for a query of its own, and a flood of made-up
    tokens costs a dict look-up each. Failed credentials are counted per address in
    `failures`, which decides only how they are answered."""

    def __init__(self, db: Database, failures: FailedCredentials | None = None) -> None:
        self.db = db
        self.failures = failures or FailedCredentials()
        self._writer = Writer(db)
        self._lock = threading.Lock()
        # Held while the copy is read again: one reader at a time, the others wait for it.
        self._refresh_lock = threading.Lock()
        # Replaced whole, never changed in place, so a look-up needs no lock.
        self._live: dict[str, tuple[bytes, Identity]] = {}
        self._read_at = float("-inf")

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
        with self._refresh_lock:
            identity = Identity(info.name, info.team, info.role)
            self._live = {**self._live, info.token_id: (_hash(secret), identity)}
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
        # On this server at once; on the others at their next read of the tokens.
        with self._refresh_lock:
            self._live = {k: v for k, v in self._live.items() if k != token_id}

    @property
    def live(self) -> int:
        """How many tokens this server holds in memory now."""
        return len(self._live)

    def _fresh(self) -> dict[str, tuple[bytes, Identity]]:
        """The live tokens, read again from the database if the copy is older than
        TOKEN_REFRESH_SECONDS; a failed read refuses the call rather than trust an old copy
        (which might hold a revoked token)."""
        if time.monotonic() - self._read_at <= TOKEN_REFRESH_SECONDS:
            return self._live
        with self._refresh_lock:
            began = time.monotonic()
            if began - self._read_at <= TOKEN_REFRESH_SECONDS:
                return self._live
            try:
                rows = self.db.fetch(
                    "SELECT token_id, secret_hash, name, team, role FROM tokens "
                    "WHERE revoked IS NULL"
                )
            except Exception as exc:
                log.warning("cannot read the tokens from the database: %s", exc)
                raise Unavailable(
                    "cannot check credentials: the vault's database did not answer"
                ) from None
            self._live = {t: (bytes(h), Identity(n, tm, r)) for t, h, n, tm, r in rows}
            self._read_at = began
            return self._live

    def authenticate(self, token: str) -> Identity:
        """The identity `token` names: checked against the copy in memory, never a query of
        its own. Unknown, revoked or wrong: Unauthenticated, naming the token's public id and
        never its secret."""
        token_id, secret = split_token(token)
        found = self._fresh().get(token_id)
        # Compared in constant time, and hashed whether or not the id is known.
        wanted = _hash(secret)
        if found is None or not hmac.compare_digest(found[0], wanted):
            raise Unauthenticated(f"token {TOKEN_PREFIX}{token_id} is unknown or revoked")
        return found[1]

    def refused(self, address: str, error: Unauthenticated) -> VaultError:
        """What a failed credential from `address` is answered: `error`, or, once the address
        has failed too often, QuotaExceeded saying so."""
        if self.failures.failed(address):
            return error
        return QuotaExceeded(
            f"{error}; and this address has sent too many failed credentials: wait a few "
            "seconds before trying again"
        )


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
