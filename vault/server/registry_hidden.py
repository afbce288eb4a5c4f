"""The blobs a registry DELETE has hidden from one repository, until they are pushed or mounted
there again. Registry state, not pins: the bytes stay in the content store (retention decides
what is released) and the ledger is not touched. The rows live in the ledger's database, beside
its tables, so that every server of one vault (one PostgreSQL) answers alike at once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from sqlalchemy import text

from vault.ledger.db import Database, placeholders

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS registry_hidden_blobs (
    repository TEXT NOT NULL,
    digest TEXT NOT NULL,
    PRIMARY KEY (repository, digest)
)"""
# The advisory lock key under which a server creates the table.
_CREATING: Final = 7302017
# Digests asked about in one query (a manifest names at most a few hundred).
_QUERY_BATCH: Final = 500


class HiddenBlobs:
    """(repository, digest) rows: the blob is unknown in that repository."""

    def __init__(self, db: Database) -> None:
        self.db = db
        with db.write.begin() as conn:
            if not db.is_sqlite:
                # Servers starting together must not race to create the same table (as the
                # placement record's tables, tiers/placements.py).
                conn.execute(text(f"SELECT pg_advisory_xact_lock({_CREATING})"))
            conn.execute(text(_SCHEMA + (" WITHOUT ROWID" if db.is_sqlite else "")))

    def hide(self, repository: str, digest: str) -> None:
        with self.db.write.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO registry_hidden_blobs (repository, digest) "
                    "VALUES (:repository, :digest) ON CONFLICT DO NOTHING"
                ),
                {"repository": repository, "digest": digest},
            )

    def show(self, repository: str, digests: Iterable[str]) -> None:
        """Make `digests` known in `repository` again (pushed or mounted there); a no-op
        without a write for those never hidden, the common case."""
        hidden = self.hidden(repository, list(digests))
        if not hidden:
            return
        with self.db.write.begin() as conn:
            conn.execute(
                text(
                    "DELETE FROM registry_hidden_blobs "
                    "WHERE repository = :repository AND digest = :digest"
                ),
                [{"repository": repository, "digest": d} for d in sorted(hidden)],
            )

    def hidden(self, repository: str, digests: Sequence[str]) -> set[str]:
        """Those of `digests` hidden from `repository`."""
        found: set[str] = set()
        for start in range(0, len(digests), _QUERY_BATCH):
            part = digests[start : start + _QUERY_BATCH]
            rows = self.db.fetch(
                "SELECT digest FROM registry_hidden_blobs WHERE repository = ? "
                f"AND digest IN ({placeholders(len(part))})",
                [repository, *part],
            )
            found.update(digest for (digest,) in rows)
        return found


__all__ = ["HiddenBlobs"]
