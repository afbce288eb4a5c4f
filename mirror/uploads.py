"""The record of the uploads the vault has handed to clients and not yet adopted: an object a
client uploaded and never finished, or one the vault refused, would otherwise stay on the
mirror, and be billed, for ever. Each presigned upload is recorded before the client learns its
key; adopting it removes the row; the replicator deletes what a row still names once it is
older than any upload still being sent or resumed. The rows live beside the replication queue,
in the placement record's database, so that any server of the vault collects what another
handed out."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from sqlalchemy import text

from tiers.placements import Journal
from vault.digest import Digest

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS direct_uploads (
    mirror TEXT NOT NULL,
    object_key TEXT NOT NULL,
    digest TEXT NOT NULL,
    upload_id TEXT NOT NULL DEFAULT '',
    issued DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (mirror, object_key)
)"""
_INDEXES: Final = (
    "CREATE INDEX IF NOT EXISTS direct_uploads_age ON direct_uploads (mirror, issued)",
    "CREATE INDEX IF NOT EXISTS direct_uploads_blob ON direct_uploads (digest)",
)
# The most rows one sweep of a mirror takes: the next takes the rest.
SWEEP_LIMIT: Final = 1000


@dataclass(frozen=True, slots=True)
class Issued:
    """One upload handed to a client: the object it goes to on `mirror`, of blob `digest`
    (and its upload in parts, if `upload_id`)."""

    mirror: str
    key: str
    digest: Digest
    upload_id: str = ""


class IssuedUploads:
    """The uploads handed out and not adopted, in the database of `placements`."""

    def __init__(self, placements: Journal) -> None:
        self.placements = placements
        with placements.writing() as db:
            db.execute(text(_SCHEMA + (" WITHOUT ROWID" if placements.sqlite else "")))
            for index in _INDEXES:
                db.execute(text(index))

    def issued(self, uploads: Iterable[Issued]) -> None:
        """Record uploads about to be handed out (a resumed one is dated again), durably."""
        rows = [
            {
                "mirror": u.mirror,
                "key": u.key,
                "digest": str(u.digest),
                "upload_id": u.upload_id,
                "now": time.time(),
            }
            for u in uploads
        ]
        if not rows:
            return
        with self.placements.writing() as db:
            db.execute(
                text(
                    "INSERT INTO direct_uploads (mirror, object_key, digest, upload_id, issued) "
                    "VALUES (:mirror, :key, :digest, :upload_id, :now) "
                    "ON CONFLICT (mirror, object_key) DO UPDATE SET issued = excluded.issued"
                ),
                rows,
            )

    def adopted(self, uploads: Iterable[tuple[str, str]]) -> None:
        """Forget uploads (mirror, key) that are now a copy of their blob, or deleted."""
        rows = [{"mirror": mirror, "key": key} for mirror, key in uploads]
        if not rows:
            return
        with self.placements.writing() as db:
            db.execute(
                text("DELETE FROM direct_uploads WHERE mirror = :mirror AND object_key = :key"),
                rows,
            )

    def handed_out(
        self, digest: Digest, uploads: Iterable[tuple[str, str]]
    ) -> set[tuple[str, str]]:
        """Which of `uploads` (mirror, key) were handed out for blob `digest` and not yet
        adopted."""
        wanted = set(uploads)
        rows = self.placements.query(
            "SELECT mirror, object_key FROM direct_uploads WHERE digest = :digest",
            {"digest": str(digest)},
        )
        return {(m, k) for m, k in rows} & wanted

    def abandoned(self, mirror: str, older_than: float) -> list[Issued]:
        """The uploads to `mirror` handed out more than `older_than` seconds ago and never
        adopted, oldest first, at most SWEEP_LIMIT."""
        rows = self.placements.query(
            "SELECT mirror, object_key, digest, upload_id FROM direct_uploads "
            "WHERE mirror = :mirror AND issued < :cutoff ORDER BY issued LIMIT :limit",
            {"mirror": mirror, "cutoff": time.time() - older_than, "limit": SWEEP_LIMIT},
        )
        return [Issued(m, k, Digest.parse(d), u) for m, k, d, u in rows]

    def count(self, mirror: str) -> int:
        """How many uploads to `mirror` are handed out and not adopted."""
        rows = self.placements.query(
            "SELECT count(*) FROM direct_uploads WHERE mirror = :mirror", {"mirror": mirror}
        )
        return int(rows[0][0])
