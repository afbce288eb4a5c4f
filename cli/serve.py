"""`vault serve`: compose the ledger, the content store and the gRPC services from the config."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from cli.config import Config
from tiers.hot import HotTier
from vault.checkpoint import SigningKey
from vault.content import Content
from vault.db import open_database
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


def serve(config: Config, listen: str | None = None) -> int:
    config.data_path.mkdir(parents=True, exist_ok=True)
    key = load_or_create_key(config)
    db = open_database(config.database_url)
    ledger = Ledger(
        db, key, origin=config.origin, checkpoint_interval=config.ledger.checkpoint_interval
    )
    content = Content(db, HotTier(config.hot_path))
    server, address = build_server(
        ledger, content, listen or config.server.listen, max_workers=config.server.workers
    )
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
