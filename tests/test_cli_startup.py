"""The `vault` command starts without what it does not need: `vault --help` and every command's
`--help` load no gRPC, protobuf, cryptography, SQLAlchemy, client or server module, and
`vault stat` against a real `vault serve` loads the client but nothing of the server. What each
run imported is read from `python -X importtime`, in a fresh interpreter running the command's
entry point (`cli.main:main`, as pyproject.toml declares it)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cli.main import build_parser
from tests.services.vault_server import REPO_ROOT, VaultServer, command_env
from tests.test_cli_json import commands

# The console script `vault`, run under -X importtime.
ENTRY_POINT = "import sys; from cli.main import main; sys.exit(main())"
# What a parser and its help texts must not load.
HEAVY = (
    "grpc",
    "google.protobuf",
    "cryptography",
    "sqlalchemy",
    "vault.client",
    "vault.server",
    "tiers",
    "mirror",
    "botocore",
)
# What `vault stat` must not load: the server and everything under it, and what only other
# commands use (the run library, the HTTP edge of the webhook, the store's caches).
NOT_FOR_STAT = (
    # It verifies no signature: the pins it lists are the vault's word (`lookup` proves them).
    "cryptography",
    "sqlalchemy",
    "psycopg",
    "vault.server",
    "tiers",
    "mirror",
    "botocore",
    "vault.runs",
    "vault.http_edge",
    "h11",
    "vault.store",
)


def imported(*args: str, server: str | None = None) -> tuple[int, str, set[str]]:
    """Run `vault ARGS…`; its exit status, its standard output and the modules it imported."""
    extra = {"PINVAULT_CLIENT_SERVER": server} if server else {}
    # A state of its own: the module's server is the first this command sees at its address.
    with tempfile.TemporaryDirectory(prefix="pinvault-startup-") as state:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", ENTRY_POINT, *args],
            capture_output=True,
            text=True,
            env=command_env(state_home=Path(state), extra=extra),
            cwd=REPO_ROOT,
            timeout=60,
            check=False,
        )
    modules = {
        line.rpartition("|")[2].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert modules, done.stderr[-2000:]
    out = done.stdout
    if done.returncode != 0:  # what the command said, for the assertion that then fails
        said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
        out += "\n[standard error]\n" + "\n".join(said[-40:])
    return done.returncode, out, modules


def loaded(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def test_vault_help_loads_no_client_server_or_crypto() -> None:
    status, out, modules = imported("--help")
    assert status == 0 and out.startswith("usage: vault"), out
    assert loaded(modules, HEAVY) == []
    # The parser alone: no command module beyond those that add commands.
    assert "cli.keys" not in modules and "cli.warm" not in modules


def test_every_commands_help_loads_no_client_server_or_crypto() -> None:
    lines = sorted(line for line in commands(build_parser()) if line)
    assert {"stat", "pin", "verify", "token create", "run export", "k8s-webhook"} <= set(lines)

    def check(line: str) -> tuple[str, int, list[str]]:
        status, out, modules = imported(*line.split(), "--help")
        assert out.startswith("usage: "), (line, out)
        return line, status, loaded(modules, HEAVY)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(check, lines))
    assert [(line, status) for line, status, _ in results if status != 0] == []
    assert {line: heavy for line, _, heavy in results if heavy} == {}


def test_vault_stat_loads_the_client_but_not_the_server_nor_other_commands_modules(
    vault_server: VaultServer,
) -> None:
    with vault_server.client() as client:
        digest = client.put(b"a blob to stat\n").blob.sha256
    status, out, modules = imported("stat", str(digest), server=vault_server.address)
    assert status == 0 and f"sha256     {digest}" in out, out
    assert "vault.client.client" in modules and "grpc" in modules
    assert loaded(modules, NOT_FOR_STAT) == []


def test_only_a_command_that_verifies_a_signature_loads_the_signature_code(
    vault_server: VaultServer,
) -> None:
    with vault_server.client() as client:
        digest = client.put(b"a blob to pin and stat\n").blob.sha256
        client.pin("dataset", [str(digest)])
    status, out, modules = imported("stat", str(digest), server=vault_server.address)
    assert status == 0 and "dataset" in out, out
    assert loaded(modules, ("cryptography",)) == []
    # A look-up proves the pins against the signed checkpoint: it needs the signature code.
    status, out, modules = imported("lookup", str(digest), server=vault_server.address)
    assert status == 0 and "dataset" in out, out
    assert "cryptography.hazmat.primitives.asymmetric.ed25519" in modules
