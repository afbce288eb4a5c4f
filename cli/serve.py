"""`vault serve`: compose the ledger, the content store and the gRPC services from the config."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

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
        db,
        key,
        origin=config.origin,
        checkpoint_interval=config.ledger.checkpoint_interval,
        commit_window=config.ledger.commit_window,
    )
    content = Content(db, HotTier(config.hot_path))
    try:
        asyncio.run(_serve(config, ledger, content, listen or config.server.listen))
    finally:
        content.close()
        ledger.close()
        db.dispose()
    return 0


async def _serve(config: Config, ledger: Ledger, content: Content, listen: str) -> None:
    loop = asyncio.get_running_loop()
    # Blocking work (disk, hashing, PostgreSQL) runs on these threads, off the event loop.
    loop.set_default_executor(
        ThreadPoolExecutor(max_workers=config.server.workers, thread_name_prefix="vault")
    )
    server, address = await build_server(ledger, content, listen)
    await server.start()
    engine = ledger.db.read.dialect.name
    print(f"pinvault serving on {address}", flush=True)
    print(
        f"  data {config.data_path}  ledger {engine} ({ledger.size} entries)  "
        f"checkpoint key {ledger.verifier}",
        flush=True,
    )
    if ledger.fault is not None:
        print(
            f"  WARNING: the stored ledger fails its check ({ledger.fault}); appends and proofs "
            "past that point are refused until it is repaired: run `vault verify`",
            flush=True,
        )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    print("pinvault stopping", file=sys.stderr, flush=True)
    await server.stop(grace=5)
