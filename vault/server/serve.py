"""A whole vault server from a Config: the ledger, the content store and its background
workers, admission, credentials and the handoff desk, composed and served over gRPC until
SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from vault.config import Config
from vault.errors import ConfigError, InvalidArgument
from vault.ledger.checkpoint import SigningKey
from vault.ledger.log import Ledger
from vault.server.admission import AdmissionPolicy, Admitter
from vault.server.assembly import open_content_store
from vault.server.auth import MODES, Gate
from vault.server.content import Content
from vault.server.database import open_ledger_database
from vault.server.explorer import ExplorerServer
from vault.server.failed_credentials import FailedCredentials
from vault.server.folder_lock import make_data_folder, only_server
from vault.server.gatekeeper import Gatekeeper, Limits
from vault.server.gc_worker import start_gc
from vault.server.metrics import ScrubWatch, Sources, serve_metrics
from vault.server.released import ReleasingContent
from vault.server.sequencer import Ahead, linked_sequencer
from vault.server.service import build_server
from vault.server.store_service import ScrubRunner
from vault.server.tiles_http import TilesServer
from vault.server.tokens import TokenStore
from vault.server.witnessing import Witness, Witnessing, configured_witnesses, start_witnessing
from vault.server.workers import scrub_runner, start_tier_workers
from vault.store.handoff import Desk
from vault.store.protocol import Closing

# The last checkpoint this server signed, kept outside the database (see Ledger).
LAST_SIGNED: Final = "last-checkpoint"
# The ledger's tree as C2SP tlog-tiles (vault/ledger/tiles.py), in the data folder.
TILES: Final = "tiles"

log = logging.getLogger("pinvault")

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True, slots=True)
class Serving:
    """What a server that has started listening tells its command to say."""

    address: str
    data_path: Path
    # The ledger's database engine ("sqlite", "postgresql") and its size at start.
    engine: str
    entries: int
    verifier: str
    # Whether callers must present a credential, and whether the channel is TLS.
    credentials: bool
    tls: bool
    handoff_socket: Path | None
    # Why the stored ledger fails its check, if it does.
    fault: str | None
    # Where the tiles are served over HTTP, if they are.
    tiles_url: str | None = None
    # Where the Prometheus metrics are served over HTTP, if they are.
    metrics_url: str | None = None
    # Where the ledger explorer's page is served over HTTP, if it is.
    explorer_url: str | None = None


def load_or_create_key(config: Config) -> SigningKey:
    path = config.key_path
    if path.exists():
        try:
            return SigningKey.load(path)
        except InvalidArgument as exc:
            # A configuration the server cannot start with, told as such (one line, exit 2).
            raise ConfigError(f"ledger.key_file: {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate(config.origin)
    key.save(path)
    log.info("created checkpoint signing key %s", path)
    return key


def _read(what: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    auth = config.auth
    if not (auth.tls_cert or auth.tls_key):
        if auth.client_ca:
            raise ConfigError("auth.client_ca needs TLS: set auth.tls_cert and auth.tls_key")
        return None
    if not (auth.tls_cert and auth.tls_key):
        raise ConfigError("TLS needs both auth.tls_cert and auth.tls_key")
    pair = (_read("auth.tls_key", auth.tls_key), _read("auth.tls_cert", auth.tls_cert))
    client_ca = _read("auth.client_ca", auth.client_ca) if auth.client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def check_access(config: Config, listen: str) -> None:
    """Local mode serves one user and so only where no one else can connect; credentials cross
    the network only inside TLS."""
    if config.auth.mode not in MODES:
        raise ConfigError(
            f"unknown auth.mode {config.auth.mode!r}: expected one of {', '.join(MODES)}"
        )
    host = listen.rpartition(":")[0]
    local = listen.startswith("unix:") or host in _LOOPBACK
    if config.auth.mode == "local" and not local:
        raise ConfigError(
            f"auth.mode 'local' asks no credential, so it listens only on loopback or a "
            f"Unix socket, not {listen}: set auth.mode = 'credentials' and create tokens "
            "with `vault token create`"
        )
    if local or config.auth.tls_cert or config.auth.tls_key:
        return
    if not config.server.allow_plaintext_credentials:
        raise ConfigError(
            f"auth.mode 'credentials' on {listen} would send bearer tokens in plain text: set "
            "auth.tls_cert and auth.tls_key (`vault keys init` makes them), or listen on "
            "loopback or a Unix socket"
        )
    log.warning(
        "SERVING CREDENTIALS IN PLAIN TEXT on %s (server.allow_plaintext_credentials): anyone "
        "on the network path can read and replay every bearer token",
        listen,
    )


def check_explorer_access(config: Config, host: str) -> None:
    """The explorer is plain HTTP: in local mode it asks nobody who they are, and with
    credentials the bearer tokens its callers send would cross the network in plain text, so it
    listens on loopback only (reach it from elsewhere through an SSH tunnel), unless
    server.allow_plaintext_credentials says that is accepted."""
    if host in _LOOPBACK:
        return
    if config.auth.mode == "local":
        raise ConfigError(
            f"the explorer shows the whole ledger to whoever connects, so in auth.mode 'local' "
            f"it listens only on loopback, not {host}: use an SSH tunnel, or set "
            "auth.mode = 'credentials'"
        )
    if not config.server.allow_plaintext_credentials:
        raise ConfigError(
            f"the explorer on {host} would receive bearer tokens over plain HTTP: listen on "
            "loopback and reach it through an SSH tunnel"
        )
    log.warning("SERVING THE EXPLORER'S BEARER TOKENS IN PLAIN TEXT on %s", host)


def open_desk(config: Config) -> Desk | None:
    """The handoff socket for clients on this host, unless turned off or impossible here."""
    if not config.server.handoff:
        return None
    try:
        return Desk(config.handoff_path)
    except OSError as exc:
        log.warning("no handoff socket, clients will stream: %s", exc)
        return None


def serve(
    config: Config,
    listen: str | None,
    *,
    started: Callable[[Serving], None],
    stopping: Callable[[], None],
    tiles_http: tuple[str, int] | None = None,
    metrics_http: tuple[str, int] | None = None,
    explorer_http: tuple[str, int] | None = None,
    sequencer: Ahead | None = None,
) -> None:
    """Serve the vault `config` describes on `listen` (default server.listen) until SIGTERM or
    SIGINT, its tiles read-only over HTTP on `tiles_http` (host, port) if given, its
    Prometheus metrics on `metrics_http` and the ledger explorer on `explorer_http` if given;
    `started` is told where once it listens, `stopping` when a signal came. With
    ledger.sequencer = "process", `sequencer` is its process if one was started ahead."""
    listen = listen or config.server.listen
    check_access(config, listen)
    if explorer_http is not None:
        check_explorer_access(config, explorer_http[0])
    if config.registry.listen:
        from vault.server.registry import check_registry_access

        check_registry_access(config)
    if config.ledger.sequencer not in ("process", "thread"):
        raise ConfigError(
            f"unknown ledger.sequencer {config.ledger.sequencer!r}: expected process or thread"
        )
    tls = server_credentials(config)
    witnesses = configured_witnesses(config)
    # Nothing the vault writes (its database and journals, keys, blobs, the handoff socket) is
    # for other users of the host; other users' clients, who cannot reach the handoff socket
    # then, stream instead.
    os.umask(0o077)
    # Before anything in the folder is touched: a second server would take over the first
    # one's handoff socket and write beside it.
    with only_server(config.data_path):
        make_data_folder(config.data_path)
        _serve_folder(
            config,
            listen,
            tls,
            witnesses,
            started=started,
            stopping=stopping,
            tiles_http=tiles_http,
            metrics_http=metrics_http,
            explorer_http=explorer_http,
            sequencer=sequencer,
        )


def _serve_folder(
    config: Config,
    listen: str,
    tls: grpc.ServerCredentials | None,
    witnesses: list[Witness],
    *,
    started: Callable[[Serving], None],
    stopping: Callable[[], None],
    tiles_http: tuple[str, int] | None,
    metrics_http: tuple[str, int] | None,
    explorer_http: tuple[str, int] | None,
    sequencer: Ahead | None,
) -> None:
    key = load_or_create_key(config)
    db = open_ledger_database(config)
    ledger = Ledger(
        db,
        key,
        origin=config.origin,
        checkpoint_interval=config.ledger.checkpoint_interval,
        commit_window=config.ledger.commit_window,
        fold_rows=config.ledger.subject_fold_rows,
        last_signed=config.data_path / LAST_SIGNED,
        tiles=config.data_path / TILES,
        # With a sequencer process, appends wait for its link (opened on the event loop).
        writer=config.ledger.sequencer == "thread",
    )
    witnessing = start_witnessing(config, ledger, witnesses) if witnesses else None
    # The entry bundles name every entry, which only an auditor may list when callers need
    # credentials: then only the hash tiles and the checkpoint are served.
    tiles = None
    if tiles_http is not None:
        tiles = TilesServer(
            config.data_path / TILES,
            *tiles_http,
            entries=config.auth.mode == "local",
            checked=None if ledger.served_tiles is None else ledger.served_tiles.served_bytes,
        ).start()
    store = open_content_store(config)
    # Content that knows the blobs the gc released ([retention], docs/retention.md).
    content = ReleasingContent(db, store, folder=config.hot_path)
    # The migration worker and the scrubber, when there are tiers to manage ([policy]).
    workers = start_tier_workers(config, store, db)
    gc = start_gc(config, db, content, store, ledger)
    admitter = Admitter(
        ledger,
        content,
        AdmissionPolicy(
            verify_interval=config.admission.verify_interval,
            replays_per_team=config.admission.replays_per_team,
            replay_lease=config.admission.replay_lease,
            max_manifest_bytes=config.admission.max_manifest_bytes,
        ),
    )
    tokens = (
        TokenStore(db, FailedCredentials.from_config(config))
        if config.auth.mode != "local"
        else None
    )
    desk = open_desk(config)
    scrub = scrub_runner(store)
    watch = ScrubWatch()
    if scrub is not None and metrics_http is not None:
        scrub = watch.watch(scrub)
    metrics = None
    explorer = None
    registry = None
    try:
        if config.registry.listen:
            # Imported only when configured: a vault without a registry loads none of it.
            from vault.server.registry import RegistryServer

            registry = RegistryServer(config, ledger, content, tokens).start()
        if metrics_http is not None:
            metrics = serve_metrics(Sources(ledger, content, store, workers, watch), metrics_http)
        if explorer_http is not None:
            explorer = ExplorerServer(ledger, content, *explorer_http, tokens=tokens).start()
        asyncio.run(
            _serve(
                config,
                ledger,
                content,
                admitter,
                listen,
                tokens,
                tls,
                desk,
                scrub,
                witnessing,
                started=started,
                stopping=stopping,
                tiles_url=None if tiles is None else tiles.url,
                metrics_url=None if metrics is None else metrics.url,
                explorer_url=None if explorer is None else explorer.url,
                sequencer=sequencer,
            )
        )
    finally:
        if registry is not None:
            registry.stop()
        if explorer is not None:
            explorer.stop()
        if metrics is not None:
            metrics.stop()
        if tiles is not None:
            tiles.stop()
        if desk is not None:
            desk.close()
        if tokens is not None:
            tokens.close()
        admitter.close()
        if gc is not None:
            gc.close()
        for worker in workers:
            worker.close()
        content.close()
        if isinstance(store, Closing):
            store.close()
        if witnessing is not None:
            witnessing.close()
        ledger.close()
        db.dispose()


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
    witnessing: Witnessing | None,
    *,
    started: Callable[[Serving], None],
    stopping: Callable[[], None],
    tiles_url: str | None,
    metrics_url: str | None,
    explorer_url: str | None,
    sequencer: Ahead | None,
) -> None:
    loop = asyncio.get_running_loop()
    # Blocking work (disk, hashing, PostgreSQL) runs on these threads, off the event loop.
    loop.set_default_executor(
        ThreadPoolExecutor(max_workers=config.server.workers, thread_name_prefix="vault")
    )
    async with contextlib.AsyncExitStack() as stack:
        if config.ledger.sequencer == "process":
            await stack.enter_async_context(
                linked_sequencer(
                    config.database_url,
                    commit_window=config.ledger.commit_window,
                    fold_rows=config.ledger.subject_fold_rows,
                    ledger=ledger,
                    ahead=sequencer,
                )
            )
        gatekeeper = Gatekeeper(
            Gate(config.auth.mode, tokens) if tokens else Gate(), Limits.from_config(config)
        )
        server, address = await build_server(
            ledger,
            content,
            listen,
            admitter=admitter,
            gatekeeper=gatekeeper,
            tokens=tokens,
            tls=tls,
            desk=desk,
            scrub=scrub,
            metered=metrics_url is not None,
            witnessing=witnessing,
        )
        await server.start()
        started(
            Serving(
                address=address,
                data_path=config.data_path,
                engine=ledger.db.read.dialect.name,
                entries=ledger.size,
                verifier=str(ledger.verifier),
                credentials=tokens is not None,
                tls=tls is not None,
                handoff_socket=None if desk is None else desk.path,
                fault=None if ledger.fault is None else str(ledger.fault),
                tiles_url=tiles_url,
                metrics_url=metrics_url,
                explorer_url=explorer_url,
            )
        )
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        stopping()
        await server.stop(grace=5)
        gatekeeper.close()
