"""`vault serve`, which runs the vault server the config describes (vault/server/serve.py), and
`vault token create --offline`: the commands that open the vault's ledger on its own host."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from cli.commands import add_command

# The server loads only when a command here runs: every other `vault` command, the Slurm
# plugin's too, starts without it.
if TYPE_CHECKING:
    from vault.config import Config
    from vault.server.sequencer import Ahead
    from vault.server.serve import Serving


def add_serve_command(sub: Any) -> None:
    add_command(sub, "serve", _arguments, help="run the vault server")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", help="address to listen on (host:port, port 0 picks one; unix:PATH)")
    p.add_argument(
        "--tiles-http",
        metavar="[HOST:]PORT",
        help="also serve the ledger's tiles (C2SP tlog-tiles) read-only over HTTP "
        "(host 127.0.0.1 unless given; port 0 picks one)",
    )
    p.add_argument(
        "--metrics-port",
        metavar="[HOST:]PORT",
        help="also serve Prometheus metrics over HTTP at /metrics "
        "(host 127.0.0.1 unless given; port 0 picks one)",
    )
    p.add_argument(
        "--explorer-http",
        metavar="[HOST:]PORT",
        help="also serve the ledger explorer, a read-only web page that verifies what it "
        "shows in the browser (loopback only; port 0 picks one)",
    )
    p.set_defaults(func=_serve, moves_blobs=True)


def _serve(args: argparse.Namespace, config: Config) -> int:
    _check_listen(args.listen or config.server.listen)
    from vault.server.sequencer import Ahead

    # The ledger's sequencer process starts first, and imports its code while this one imports
    # the server's: start-up takes the longer of the two, not both.
    ahead = Ahead.start() if config.ledger.sequencer == "process" else None
    try:
        _serve_with(args, config, ahead)
    finally:
        if ahead is not None:
            ahead.discard()
    return 0


def _serve_with(args: argparse.Namespace, config: Config, ahead: Ahead | None) -> None:
    from vault.server.serve import serve

    tiles = None if args.tiles_http is None else _host_port("--tiles-http", args.tiles_http)
    metrics = None if args.metrics_port is None else _host_port("--metrics-port", args.metrics_port)
    explorer = (
        None if args.explorer_http is None else _host_port("--explorer-http", args.explorer_http)
    )
    serve(
        config,
        args.listen,
        started=_print_serving,
        stopping=_print_stopping,
        tiles_http=tiles,
        metrics_http=metrics,
        explorer_http=explorer,
        sequencer=ahead,
    )


def _check_listen(listen: str) -> None:
    """Refuse an address this host cannot listen on (a port in use, a host not its own) in one
    line, before anything is made for the server: its key, its sequencer, its database."""
    import socket

    from vault.errors import Unavailable

    host, sep, port = listen.rpartition(":")
    if listen.startswith("unix:") or not (sep and host and port.isdigit()) or int(port) == 0:
        # A Unix socket, any port, or an address the server refuses in its own words.
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, OverflowError) as exc:
        raise Unavailable(f"cannot listen on {listen}: {exc}") from None
    with socket.socket(family, kind, proto) as probe:
        # As gRPC binds: a port whose last server's connections linger is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise Unavailable(
                f"cannot listen on {listen}: {exc.strerror or exc} (is another server using "
                "it? choose another with --listen or server.listen)"
            ) from None


def _host_port(option: str, text: str) -> tuple[str, int]:
    from vault.errors import InvalidArgument

    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{option} {text!r}: expected [HOST:]PORT, PORT 0 to 65535")
    return host, int(port)


def _print_serving(serving: Serving) -> None:
    print(f"pinvault serving on {serving.address}", flush=True)
    print(
        f"  data {serving.data_path}  ledger {serving.engine} ({serving.entries} entries)  "
        f"checkpoint key {serving.verifier}",
        flush=True,
    )
    access = "credentials" if serving.credentials else "local mode (one user, no credential)"
    print(f"  access: {access}{', TLS' if serving.tls else ''}", flush=True)
    if serving.handoff_socket is not None:
        print(f"  handoff socket {serving.handoff_socket}", flush=True)
    if serving.tiles_url is not None:
        print(f"  tiles (C2SP tlog-tiles) at {serving.tiles_url}", flush=True)
    if serving.metrics_url is not None:
        print(f"  metrics (Prometheus) at {serving.metrics_url}", flush=True)
    if serving.explorer_url is not None:
        print(f"  explorer at {serving.explorer_url}", flush=True)
    if serving.fault is not None:
        print(
            f"  WARNING: the stored ledger fails its check ({serving.fault}); appends and proofs "
            "past that point are refused until it is repaired: run `vault verify`",
            flush=True,
        )


def _print_stopping() -> None:
    print("pinvault stopping", file=sys.stderr, flush=True)


def create_token_offline(config: Config, name: str, team: str, role: str) -> tuple[str, str, str]:
    """For `vault token create --offline` (cli/access.py): a token written straight into the
    vault's database; its id, its role and its secret."""
    from vault.server.tokens import create_offline

    info, secret = create_offline(config, name=name, team=team, role=role)
    return info.token_id, info.role, secret
