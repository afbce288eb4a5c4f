"""The `vault` command's exit status says what kind of failure it met (docs/cli.md), and with
`--json` its error is one JSON object on standard error. Each kind is met for real: the command
against a real `vault serve` (in credentials mode for the refusals), a blob damaged on its disk,
a server that is not there."""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cli.main import build_parser
from tests.conftest import StartVault
from tests.services.vault_server import VaultRun, VaultServer, run_vault
from tests.test_access import CREDENTIALS, first_admin_token
from tests.test_cli_json import commands, takes_json
from vault.errors import NotFound

NOT_FOUND, INVALID, INTEGRITY, UNAVAILABLE, PERMISSION, PRECONDITION = 66, 64, 65, 69, 77, 78


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def json_error(run: VaultRun, kind: str, status: int) -> str:
    """The one JSON object a failed `--json` command wrote on standard error, after checking its
    kind, its exit status and that nothing else was written there; its message."""
    assert run.returncode == status, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.describe()
    error = json.loads(lines[0])
    assert set(error) == {"error"} and set(error["error"]) == {"kind", "message", "exit"}
    assert (error["error"]["kind"], error["error"]["exit"]) == (kind, status), run.describe()
    message: str = error["error"]["message"]
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="module")
def stored(vault_server: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sha256 digest of a blob the module's vault holds (and no entry pins)."""
    path = tmp_path_factory.mktemp("stored") / "blob.bin"
    path.write_bytes(b"stored, never pinned\n")
    return str(vault_server.run("put", str(path), "--json").ok().json()["sha256"])


def test_stat_of_a_digest_never_stored_is_not_found(vault_server: VaultServer) -> None:
    absent = sha256(b"never stored")
    run = vault_server.run("stat", absent)
    assert run.returncode == NOT_FOUND, run.describe()
    assert run.error_line() == f"vault: NOT_FOUND: blob {absent} is not in the store"
    assert run.output == b""

    run = vault_server.run("stat", absent, "--json")
    assert json_error(run, "not_found", NOT_FOUND) == f"blob {absent} is not in the store"
    assert run.output == b""


def test_a_malformed_digest_is_invalid_input(vault_server: VaultServer) -> None:
    run = vault_server.run("stat", "sha256:abc")
    assert run.returncode == INVALID, run.describe()
    assert run.error_line().startswith("vault: INVALID_ARGUMENT: wrong length for sha256 digest")

    message = json_error(vault_server.run("get", "md5:abc", "--json"), "invalid_input", INVALID)
    assert "md5" in message
    # Refused by the vault itself rather than the client: the same kind.
    refused = vault_server.run("pin", "image", sha256(b"x"), "--external", "--meta", "=v", "--json")
    json_error(refused, "invalid_input", INVALID)


def test_a_bad_command_line_is_a_usage_error_in_json_too(vault_server: VaultServer) -> None:
    run = vault_server.run("stat")
    assert run.returncode == 2 and run.error_line().startswith("vault: the following argument")
    message = json_error(vault_server.run("stat", "--json"), "usage", 2)
    assert message == "the following arguments are required: digest (see vault stat --help)"


def test_a_vault_that_is_not_there_is_unavailable(tmp_path: Path) -> None:
    # A Unix socket path that nothing listens on: no port is guessed.
    nowhere = f"unix:{tmp_path / 'absent.sock'}"
    env = {"PINVAULT_CLIENT_TIMEOUT": "5"}
    run = run_vault("stat", sha256(b"x"), server=nowhere, state_home=tmp_path, env=env)
    assert run.returncode == UNAVAILABLE, run.describe()
    assert run.error_line().startswith("vault: UNAVAILABLE: vault server unavailable")
    run = run_vault("lookup", sha256(b"x"), "--json", server=nowhere, state_home=tmp_path, env=env)
    json_error(run, "unavailable", UNAVAILABLE)
    assert run.output == b""


def test_a_credential_without_the_right_is_a_permission_failure(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(env=CREDENTIALS)
    admin = {"PINVAULT_CLIENT_TOKEN": first_admin_token(server)}
    created = server.run(
        "token", "create", "--name", "rita", "--team", "vision", "--role", "reader", env=admin
    ).ok()
    reader = {"PINVAULT_CLIENT_TOKEN": created.stdout.strip()}
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"written by the administrator\n")
    digest = server.run("put", str(blob), "--json", env=admin).ok().json()["sha256"]

    # A reader may read, but not pin.
    server.run("stat", digest, env=reader).ok()
    run = server.run("pin", "artefact", digest, env=reader)
    assert run.returncode == PERMISSION, run.describe()
    assert run.error_line().startswith("vault: PERMISSION_DENIED: ")
    json_error(server.run("pin", "artefact", digest, "--json", env=reader), "permission", 77)
    # No credential at all: the same kind.
    run = server.run("stat", digest, "--json")
    assert "credential" in json_error(run, "permission", PERMISSION)


def test_a_damaged_blob_is_an_integrity_failure(vault_server: VaultServer, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    (tmp_path / "blob.bin").write_bytes(data)
    digest = vault_server.run("put", str(tmp_path / "blob.bin"), "--json").ok().json()["sha256"]
    stored = vault_server.blob_path(digest)
    damaged = bytearray(stored.read_bytes())
    damaged[1000] ^= 0x01
    stored.write_bytes(damaged)

    run = vault_server.run("get", digest, "-o", str(tmp_path / "copy.bin"))
    assert run.returncode == INTEGRITY, run.describe()
    assert "DATA_LOSS" in run.error_line() and digest in run.error_line()
    assert not (tmp_path / "copy.bin").exists()
    run = vault_server.run("get", digest, "-o", str(tmp_path / "copy.bin"), "--json")
    assert digest in json_error(run, "integrity", INTEGRITY)
    assert run.output == b""


def test_pinning_a_blob_the_vault_does_not_hold_is_a_failed_precondition(
    vault_server: VaultServer,
) -> None:
    absent = sha256(b"not stored, not external")
    run = vault_server.run("pin", "artefact", absent)
    assert run.returncode == PRECONDITION, run.describe()
    assert run.error_line().startswith("vault: FAILED_PRECONDITION: ")
    json_error(vault_server.run("pin", "artefact", absent, "--json"), "precondition", 78)


def test_lookup_of_a_digest_never_pinned_is_not_found_with_no_entries(
    vault_server: VaultServer, stored: str
) -> None:
    run = vault_server.run("lookup", stored)
    assert run.returncode == NOT_FOUND, run.describe()
    assert run.output == b""
    # A proven answer: the client checked that none of the signed ledger's entries pins it.
    proven = rf"no entry pins {stored} \(proven for the \d+ entries of the signed ledger\)"
    assert re.fullmatch(f"vault: NOT_FOUND: {proven}", run.error_line()), run.describe()

    run = vault_server.run("lookup", stored, "--json")
    assert run.json() == []
    assert re.fullmatch(proven, json_error(run, "not_found", NOT_FOUND)), run.describe()

    # Pinned, it is found: entries, exit 0.
    vault_server.run("pin", "artefact", stored).ok()
    assert [e["subjects"] for e in vault_server.run("lookup", stored, "--json").ok().json()] == [
        [stored]
    ]
    # The library, as docs/python.md says: NotFound from lookup, [] from lookup_many.
    never = sha256(b"never pinned anywhere")
    with vault_server.client() as client:
        with pytest.raises(NotFound, match="no entry pins"):
            client.lookup(never)
        assert client.lookup_many([never]) == {never: []}


def test_find_missing_exits_not_found_when_any_is_missing(
    vault_server: VaultServer, stored: str
) -> None:
    absent = sha256(b"missing from the store")
    vault_server.run("find-missing", stored).ok()
    run = vault_server.run("find-missing", stored, absent, "--json")
    assert run.returncode == NOT_FOUND, run.describe()
    assert run.json() == {"missing": [absent]} and run.stderr == ""


# Arguments that make each command fail at once against a vault that is not there, without
# reaching anything of the vault's host; the rest are checked by their usage errors only.
CLIENT_COMMANDS: dict[str, tuple[str, ...]] = {
    "put": ("{file}",),
    "get": ("{digest}", "-o", "{out}"),
    "stat": ("{digest}",),
    "find-missing": ("{digest}",),
    "pin": ("image", "{digest}"),
    "lookup": ("{digest}",),
    "log": (),
    "checkpoint": (),
    "proof inclusion": ("0",),
    "proof consistency": ("1", "1"),
    "verify": (),
    "dataset ls": (),
    "dataset show": ("name",),
    "dataset checkout": ("{digest}", "{out}"),
    "dataset diff": ("{digest}", "{digest}"),
    "dataset add": ("{folder}",),
    "admit": ("--image", "{digest}", "--dataset", "{digest}", "--seed", "1"),
    "replay": ("{digest}",),
    "token list": (),
    "token create": ("--name", "a", "--team", "t", "--role", "reader"),
    "token revoke": ("pv_abc",),
}


def test_every_command_that_takes_json_reports_its_errors_in_json(tmp_path: Path) -> None:
    lines = sorted(line for line in commands(build_parser()) if line and takes_json(line))
    assert set(CLIENT_COMMANDS) <= set(lines)
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a").write_bytes(b"a")
    names = {
        "file": str(tmp_path / "file"),
        "folder": str(tmp_path / "folder"),
        "out": str(tmp_path / "out"),
        "digest": sha256(b"x"),
    }
    nowhere = f"unix:{tmp_path / 'absent.sock'}"
    env = {"PINVAULT_CLIENT_TIMEOUT": "5", "PINVAULT_DATA_DIR": str(tmp_path / "data")}

    def failed(args: tuple[str, ...]) -> Any:
        return run_vault(*args, server=nowhere, state_home=tmp_path / "state", env=env)

    def check(line: str) -> None:
        usage = failed((*line.split(), "--json", "--no-such-option"))
        assert json_error(usage, "usage", 2).endswith(" --help)")
        if line in CLIENT_COMMANDS:
            args = tuple(a.format(**names) for a in CLIENT_COMMANDS[line])
            json_error(failed((*line.split(), *args, "--json")), "unavailable", UNAVAILABLE)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(check, lines))
    assert not (tmp_path / "out").exists()
