"""The ledger's database as the config names it (ledger.database, or SQLite in the data folder),
or one line that says why it cannot be opened."""

from __future__ import annotations

from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from vault.config import Config
from vault.errors import InvalidArgument, Unavailable
from vault.ledger.db import Database, open_database


def open_ledger_database(config: Config) -> Database:
    url = config.database_url
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        raise InvalidArgument(f"ledger.database {url!r} is not a SQLAlchemy URL") from None
    try:
        return open_database(url)
    except (SQLAlchemyError, ImportError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise Unavailable(f"cannot open the ledger database {shown}: {reason}") from None
