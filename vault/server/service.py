"""The vault's gRPC server: the Store, Ledger, Admission and Tokens services with health and
reflection, listening on one address."""

from __future__ import annotations

import resource
from typing import Any, Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from vault.errors import InvalidArgument, Unavailable
from vault.ledger.log import Ledger
from vault.server import reflection
from vault.server.admission import Admitter
from vault.server.admission_service import AdmissionService
from vault.server.auth import Gate
from vault.server.content import Content
from vault.server.edge import Metering, Service
from vault.server.gatekeeper import Gatekeeper, Limits
from vault.server.ledger_service import LedgerService
from vault.server.store_service import ScrubRunner, StoreService
from vault.server.tokens import TokenStore
from vault.server.tokens_service import TokensService
from vault.server.witnessing import Witnessing
from vault.store.handoff import Desk
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

# The largest message the vault reads. Bulk bytes come in streams of small messages (a put's
# are 1 MiB, a batch put's about 4 MiB plus its digests); the largest unary requests are a
# LookupBatch of 100,000 digests (7.3 MB) and a PinBatch of small pins. A message past this is
# refused by gRPC from its length alone, before it is read.
MAX_RECEIVE: Final = 8 * 1024 * 1024
# What the vault sends may be larger: a batch look-up's proofs.
MAX_SEND: Final = 64 * 1024 * 1024

# How many bytes one stream may send before the server has read them.
STREAM_WINDOW: Final = 4 * 1024 * 1024

SERVER_OPTIONS: Final = [
    ("grpc.max_receive_message_length", MAX_RECEIVE),
    ("grpc.max_send_message_length", MAX_SEND),
    ("grpc.so_reuseport", 0),
    # A fixed window of what a connection may send ahead of being read. gRPC's default grows
    # it by measuring the link (BDP probing) up to many MiB a connection, and bytes within it
    # are taken in and held before a call is refused: 96 refused 60 MiB calls raised a
    # server's peak memory by 57 to 306 MiB; with this window, by about 40. 4 MiB is 4 of a
    # put's messages in flight: through a link of 4 ms round trip a put was as fast with it as
    # with probing, and 1.2 to 1.5x slower with 1 MiB (bench.slow_link).
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW),
]

# What the server keeps of its open-file limit for its own files (the ledger's database,
# tiles, blobs being written, mirrors' sockets), whatever callers do: a quarter, at least this.
FILES_KEPT: Final = 256
# The longest a new connection may take to finish its handshake.
HANDSHAKE_TIMEOUT: Final = 10.0


def open_files_limit() -> int:
    """This process's limit of open files, first raised as far as it may be (to its hard
    limit, up to 65,536), as Go's runtime does for every server."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65_536 if hard == resource.RLIM_INFINITY else min(hard, 65_536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return 65_536 if soft == resource.RLIM_INFINITY else soft


def max_connections(limits: Limits, open_files: int) -> int:
    """The connections the server holds at once: as configured, and never so many that its
    own files could not be opened."""
    return max(1, min(limits.max_connections, open_files - max(FILES_KEPT, open_files // 4)))


def server_options(limits: Limits, open_files: int) -> list[tuple[str, Any]]:
    """SERVER_OPTIONS with the bounds on connections: how many, how long one may stay with no
    call open, and how long one may take to finish its handshake (a caller that connects and
    sends nothing is closed then)."""
    idle_ms = max(1, round(limits.connection_idle_timeout * 1000))
    return [
        *SERVER_OPTIONS,
        ("grpc.max_allowed_incoming_connections", max_connections(limits, open_files)),
        ("grpc.max_connection_idle_ms", idle_ms),
        ("grpc.server_handshake_timeout_ms", min(idle_ms, round(HANDSHAKE_TIMEOUT * 1000))),
    ]


async def build_server(
    ledger: Ledger,
    content: Content,
    listen: str,
    *,
    admitter: Admitter | None = None,
    gatekeeper: Gatekeeper | None = None,
    tokens: TokenStore | None = None,
    tls: grpc.ServerCredentials | None = None,
    desk: Desk | None = None,
    scrub: ScrubRunner | None = None,
    metered: bool = False,
    witnessing: Witnessing | None = None,
) -> tuple[grpc.aio.Server, str]:
    """An asyncio gRPC server with the vault's services, health and reflection; returns it and
    where it listens (the real port when `listen` asked for port 0); `await server.start()`
    next. `gatekeeper` names every caller before its request is read and bounds its streams
    (without one, local mode with the default limits); with `tokens`, administrators
    manage them over the Tokens service; with `desk`, clients on this host may hand files over
    (vault/store/handoff.py); with `scrub`, Store.Scrub checks every tier on demand; `metered`
    counts and times every call for the metrics (only when someone may scrape them: it costs
    each call a little); with `witnessing`, checkpoints are served with witnesses'
    cosignatures."""
    gatekeeper = gatekeeper or Gatekeeper(Gate())
    gate = gatekeeper.gate
    # Metering first, so that it counts the calls the gatekeeper refuses too.
    interceptors = [Metering(), gatekeeper] if metered else [gatekeeper]
    options = server_options(gatekeeper.limits, open_files_limit())
    server = grpc.aio.server(options=options, interceptors=interceptors)
    ledger_service = LedgerService(ledger, content, witnessing)
    servicers: list[Service] = [StoreService(content, ledger, desk, scrub), ledger_service]
    if admitter is not None:
        servicers.append(AdmissionService(admitter, ledger_service))
    # Without tokens (local mode) its calls say they need credentials mode.
    servicers.append(TokensService(tokens))
    for servicer in servicers:
        servicer.gate = gate
        getattr(rpc, f"add_{servicer.rpc_service}Servicer_to_server")(servicer, server)
    services = [s.rpc_service for s in servicers]
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in services]
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable(server, (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    host, sep, port_text = listen.rpartition(":")
    if not listen.startswith("unix:") and not (
        sep and host and port_text.isdigit() and int(port_text) <= 65535
    ):
        raise InvalidArgument(
            f"cannot listen on {listen!r}: expected HOST:PORT with a port from 0 to 65535, "
            "or unix:PATH"
        )
    try:
        port = server.add_secure_port(listen, tls) if tls else server.add_insecure_port(listen)
    except RuntimeError:  # gRPC's way of saying the bind failed
        port = 0
    if port == 0:
        raise Unavailable(f"cannot listen on {listen}: the address is in use or not available")
    if listen.startswith("unix:"):
        return server, listen
    return server, f"{host}:{port}"
