"""`vault serve`: compose the ledger, the content store and the gRPC services from the config."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from cli.config import Config
from tiers.hot import HotTier
from vault.checkpoint import SigningKey
from vault.content import Content
from vault.db import Database, open_database
from vault.errors import InvalidArgument, Unavailable
from vault.ledger import Ledger
from vault.service import build_server

log = logging.getLogger("pinvault")


def load_or_create_key(config: Config) -> SigningKey:
    path = config.key_path
    if path.exists():
        return SigningKey.load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate(config.origin)
    key.save(path)
    log.info("created checkpoint signing key %s", path)
    return key


def connect(url: str) -> Database:
    """The ledger's database, or one line that says why it cannot be opened."""
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        raise InvalidArgument(f"ledger.database {url!r} is not a SQLAlchemy URL") from None
    try:
        return open_database(url)
    except (SQLAlchemyError, ImportError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise Unavailable(f"cannot open the ledger database {shown}: {reason}") from None


def serve(config: Config, listen: str | None = None) -> int:
    config.data_path.mkdir(parents=True, exist_ok=True)
    key = load_or_create_key(config)
    db = connect(config.database_url)
    ledger = Ledger(
        db, key, origin=config.origin, checkpoint_interval=config.ledger.checkpoint_interval
    )
    content = Content(db, HotTier(config.hot_path))
    server, address = build_server(
        ledger, content, listen or config.server.listen, max_workers=config.server.workers
    )
    # Threads coming back from the database or the network wait for the GIL at most this long.
    sys.setswitchinterval(0.0002)
    server.start()
    engine = db.read.dialect.name
    print(f"pinvault serving on {address}", flush=True)
    print(
        f"  data {config.data_path}  ledger {engine} ({ledger.size} entries)  "
        f"checkpoint key {ledger.verifier}",
        flush=True,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    print("pinvault stopping", file=sys.stderr, flush=True)
    server.stop(grace=5).wait()
    ledger.close()
    db.dispose()
    return 0
