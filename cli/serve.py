"""`vault serve`: compose the ledger, the content store and the gRPC services from the config."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from cli.mirror import mirrors_configured, open_replicating_store
from cli.tier import open_tiered_store, scrub_runner, start_tier_workers, warm_configured
from tiers.hot import HotTier
from vault.config import Config
from vault.errors import InvalidArgument, Unavailable
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import Database, open_database
from vault.ledger.log import Ledger
from vault.server.admission import AdmissionPolicy, Admitter
from vault.server.auth import MODES, Gate
from vault.server.content import Content
from vault.server.service import ScrubRunner, build_server
from vault.server.tokens import TokenStore
from vault.store.handoff import Desk
from vault.store.protocol import BlobStore, Closing

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


def content_store(config: Config) -> BlobStore:
    """The hot tier alone, or, with store.warm_dir or [mirrors] configured, the hot tier, the
    warm tier and the mirrors under the tier manager, with every put queued for replication
    when there are mirrors (cli/tier.py, cli/mirror.py)."""
    hot = HotTier(config.hot_path)
    if warm_configured(config):
        log.info("warm tier %s", config.store.warm_dir)
        return open_tiered_store(config, hot)
    if not mirrors_configured(config):
        return hot
    store = open_replicating_store(config, hot, promote=config.policy.promote_on_read)
    log.info(
        "mirrors %s, %d replicas of each blob",
        ", ".join(store.mirrors.names),
        store.mirrors.replicas,
    )
    return store


_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _read(what: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    auth = config.auth
    if not (auth.tls_cert or auth.tls_key):
        if auth.client_ca:
            raise InvalidArgument("auth.client_ca needs TLS: set auth.tls_cert and auth.tls_key")
        return None
    if not (auth.tls_cert and auth.tls_key):
        raise InvalidArgument("TLS needs both auth.tls_cert and auth.tls_key")
    pair = (_read("auth.tls_key", auth.tls_key), _read("auth.tls_cert", auth.tls_cert))
    client_ca = _read("auth.client_ca", auth.client_ca) if auth.client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def check_access(config: Config, listen: str) -> None:
    """Local mode serves one user and so only where no one else can connect."""
    if config.auth.mode not in MODES:
        raise InvalidArgument(
            f"unknown auth.mode {config.auth.mode!r}: expected one of {', '.join(MODES)}"
        )
    host = listen.rpartition(":")[0]
    if config.auth.mode == "local" and not listen.startswith("unix:") and host not in _LOOPBACK:
        raise InvalidArgument(
            f"auth.mode 'local' asks no credential, so it listens only on loopback or a "
            f"Unix socket, not {listen}: set auth.mode = 'credentials' and create tokens "
            "with `vault token create`"
        )


def open_desk(config: Config) -> Desk | None:
    """The handoff socket for clients on this host, unless turned off or impossible here."""
    if not config.server.handoff:
        return None
    try:
        return Desk(config.handoff_path)
    except OSError as exc:
        log.warning("no handoff socket, clients will stream: %s", exc)
        return None


def serve(config: Config, listen: str | None = None) -> int:
    listen = listen or config.server.listen
    check_access(config, listen)
    tls = server_credentials(config)
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
    store = content_store(config)
    content = Content(db, store)
    # The migration worker and the scrubber, when there are tiers to manage ([policy]).
    workers = start_tier_workers(config, store, db)
    admitter = Admitter(
        ledger,
        content,
        AdmissionPolicy(
            verify_interval=config.admission.verify_interval,
            replays_per_team=config.admission.replays_per_team,
            replay_lease=config.admission.replay_lease,
        ),
    )
    tokens = TokenStore(db) if config.auth.mode != "local" else None
    desk = open_desk(config)
    scrub = scrub_runner(store)
    try:
        asyncio.run(_serve(config, ledger, content, admitter, listen, tokens, tls, desk, scrub))
    finally:
        if desk is not None:
            desk.close()
        if tokens is not None:
            tokens.close()
        admitter.close()
        for worker in workers:
            worker.close()
        content.close()
        if isinstance(store, Closing):
            store.close()
        ledger.close()
        db.dispose()
    return 0


async def _serve(
    config: Config,
    ledger: Ledger,
    content: Content,
    admitter: Admitter,
    listen: str,
    tokens: TokenStore | None,
    tls: grpc.ServerCredentials | None,
    desk: Desk | None,
    scrub: ScrubRunner | None,
) -> None:
    loop = asyncio.get_running_loop()
    # Blocking work (disk, hashing, PostgreSQL) runs on these threads, off the event loop.
    loop.set_default_executor(
        ThreadPoolExecutor(max_workers=config.server.workers, thread_name_prefix="vault")
    )
    server, address = await build_server(
        ledger,
        content,
        listen,
        admitter=admitter,
        gate=Gate(config.auth.mode, tokens) if tokens else None,
        tokens=tokens,
        tls=tls,
        desk=desk,
        scrub=scrub,
    )
    await server.start()
    engine = ledger.db.read.dialect.name
    print(f"pinvault serving on {address}", flush=True)
    print(
        f"  data {config.data_path}  ledger {engine} ({ledger.size} entries)  "
        f"checkpoint key {ledger.verifier}",
        flush=True,
    )
    access = "credentials" if tokens else "local mode (one user, no credential)"
    print(f"  access: {access}{', TLS' if tls else ''}", flush=True)
    if desk is not None:
        print(f"  handoff socket {desk.path}", flush=True)
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
