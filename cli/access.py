"""`vault token create|list|revoke` and `vault keys init|issue` (cli/keys.py): the credentials
of a vault that asks for them (auth.mode = 'credentials'). Tokens are managed over gRPC by an
administrator; `--offline` writes the first one straight into the vault's database, on the
vault's host."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from cli.commands import add_command
from cli.output import print_json, shown

if TYPE_CHECKING:
    from vault.client import VaultClient
    from vault.config import Config

    Connect = Callable[[Config], VaultClient]
    # `vault token create --offline`, which writes into the vault's database on its host
    # (cli/serve.py): given the config, name, team and role, the token's id, role and secret.
    CreateOffline = Callable[[Config, str, str, str], tuple[str, str, str]]


def add_access_commands(sub: Any, connect: Connect, create_offline: CreateOffline) -> None:
    add_command(
        sub,
        "token",
        partial(_token_arguments, connect=connect, create_offline=create_offline),
        help="create, list and revoke bearer tokens (administrators)",
    )
    add_command(sub, "keys", _keys_arguments, help="a CA and certificates for TLS and mutual TLS")


def _token_arguments(
    p: argparse.ArgumentParser, *, connect: Connect, create_offline: CreateOffline
) -> None:
    from vault.config import ROLES

    commands = p.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    q = commands.add_parser("create", help="print a new token's secret (shown once)")
    q.add_argument("--name", required=True, help="who holds it; recorded as the author")
    q.add_argument("--team", required=True)
    q.add_argument("--role", required=True, choices=sorted(ROLES))
    q.add_argument(
        "--offline",
        action="store_true",
        help="write into the vault's database directly (on its host; for the first admin token)",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_create, connect=connect, create_offline=create_offline))
    q = commands.add_parser("list", help="every token: id, holder, team, role, state")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_list, connect=connect))
    q = commands.add_parser("revoke", help="revoke a token by its id (pv_<id> or <id>)")
    q.add_argument("token_id", metavar="ID")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_revoke, connect=connect))


def _keys_arguments(p: argparse.ArgumentParser) -> None:
    from vault.config import ROLES

    commands = p.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    q = commands.add_parser("init", help="a new CA, and a server certificate signed by it")
    q.add_argument("folder", metavar="DIR")
    q.add_argument(
        "--host", action="append", default=[], help="a name or address of the server (repeat)"
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_keys_init)
    q = commands.add_parser("issue", help="a client certificate: CN name, O team, OU role")
    q.add_argument("folder", metavar="DIR", help="the folder `keys init` made")
    q.add_argument("--name", required=True)
    q.add_argument("--team", required=True)
    q.add_argument("--role", required=True, choices=sorted(ROLES))
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_keys_issue)


# ---------------------------------------------------------------------- tokens


def _create(
    args: argparse.Namespace, config: Config, *, connect: Connect, create_offline: CreateOffline
) -> int:
    from vault.config import check_name, check_role

    if args.offline:
        token_id, role, secret = create_offline(config, args.name, args.team, args.role)
    else:
        check_name("name", args.name)
        check_name("team", args.team)
        check_role(args.role)
        with connect(config) as client:
            token, secret = client.create_token(name=args.name, team=args.team, role=args.role)
        token_id, role = token.token_id, token.role
    if args.json:
        print_json({"token_id": token_id, "role": role, "token": secret})
    else:
        print(secret)
    return 0


def _list(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    with connect(config) as client:
        tokens = client.list_tokens()
    if args.json:
        print_json(
            [
                {
                    "token_id": t.token_id,
                    "name": t.name,
                    "team": t.team,
                    "role": t.role,
                    "created": t.created,
                    "revoked": t.revoked,
                }
                for t in tokens
            ]
        )
        return 0
    for t in tokens:
        state = f"revoked {t.revoked}" if t.revoked else "valid"
        # The server's text: escaped, so that a hostile server cannot forge a line.
        print(shown(f"pv_{t.token_id}  {t.name:<16} {t.team:<12} {t.role:<9} {t.created}  {state}"))
    return 0


def _revoke(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    token_id = args.token_id.removeprefix("pv_").split("_")[0]
    with connect(config) as client:
        client.revoke_token(token_id)
    if args.json:
        print_json({"token_id": token_id, "revoked": True})
    else:
        print(f"revoked pv_{shown(token_id)}")
    return 0


# ---------------------------------------------------------------------- keys


def _keys_init(args: argparse.Namespace, config: Config) -> int:
    from pathlib import Path

    from cli.keys import init  # cryptography's x509 is slow to import; only these need it

    made = init(Path(args.folder), args.host)
    if args.json:
        print_json(made)
        return 0
    folder = Path(made["folder"])
    print(f"CA and server certificate for {', '.join(made['hosts'])} in {folder}")
    print(
        f"  server: auth.tls_cert = {made['server_cert']}, auth.tls_key = "
        f"{made['server_key']}, auth.client_ca = {made['ca_cert']}"
    )
    print(f"  clients: client.ca_file = {made['ca_cert']}")
    return 0


def _keys_issue(args: argparse.Namespace, config: Config) -> int:
    from pathlib import Path

    from cli.keys import issue

    made = issue(Path(args.folder), name=args.name, team=args.team, role=args.role)
    if args.json:
        print_json(made)
        return 0
    print(
        f"client certificate for {made['name']} (team {made['team']}, {made['role']}) in "
        f"{args.folder}"
    )
    print(f"  client.cert_file = {made['cert']}, client.key_file = {made['key']}")
    return 0
