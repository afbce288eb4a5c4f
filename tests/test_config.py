"""How `vault` is configured: the embedded default needs nothing, a TOML file overrides the
defaults, PINVAULT_* variables override the file, command-line options override both, and an
unknown key or variable stops the command with one line that names it."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import stat
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import run_vault


def test_the_embedded_default_needs_no_configuration(start_vault: StartVault) -> None:
    server = start_vault(data_dir_from_config=True)
    data = server.base / "xdg-data" / "pinvault"
    assert server.banner[1].split()[:5] == ["data", str(data), "ledger", "sqlite", "(0"]
    server.data_dir = data

    key_mode = stat.S_IMODE(server.key_path.stat().st_mode)
    assert key_mode == 0o600, oct(key_mode)
    with sqlite3.connect(server.db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert (data / "hot" / "blobs").is_dir()

    key = server.run("checkpoint", "--key").ok().stdout
    origin = server.run("checkpoint").ok().stdout.splitlines()[0]
    assert origin == f"pinvault/{socket.gethostname()}"
    assert key.startswith(f"{origin}+")
    server.restart()
    assert server.run("checkpoint", "--key").ok().stdout == key, "the key is made only once"


def test_a_config_file_and_the_environment_override_the_defaults(
    start_vault: StartVault, tmp_path: Path
) -> None:
    config = tmp_path / "vault.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "from-file"}"\n'
        "[server]\n"
        'listen = "127.0.0.1:0"\n'
        "workers = 4\n"
        "[ledger]\n"
        'origin = "file.example/vault"\n'
        "checkpoint_interval = 0.5\n"
    )
    from_file = start_vault(
        "file", data_dir_from_config=True, listen=None, args=["--config", str(config)]
    )
    assert from_file.address.startswith("127.0.0.1:") and not from_file.address.endswith(":7411")
    assert (tmp_path / "from-file" / "checkpoint.key").exists()
    assert from_file.run("checkpoint").ok().stdout.startswith("file.example/vault\n")

    socket_path = tmp_path / "vault.sock"
    from_env = start_vault(
        "env",
        data_dir_from_config=True,
        listen=None,
        env={
            "PINVAULT_CONFIG": str(config),
            "PINVAULT_DATA_DIR": str(tmp_path / "from-env"),
            "PINVAULT_LEDGER_ORIGIN": "env.example/vault",
            "PINVAULT_SERVER_LISTEN": f"unix:{socket_path}",
        },
    )
    assert from_env.address == f"unix:{socket_path}"
    assert (tmp_path / "from-env" / "checkpoint.key").exists()
    assert from_env.run("checkpoint").ok().stdout.startswith("env.example/vault\n")

    # The command's own options beat both.
    with_flag = start_vault(
        "flag",
        data_dir_from_config=True,
        env={"PINVAULT_CONFIG": str(config), "PINVAULT_DATA_DIR": str(tmp_path / "from-env-2")},
        args=["--data-dir", str(tmp_path / "from-flag")],
    )
    assert (tmp_path / "from-flag" / "checkpoint.key").exists()
    assert not (tmp_path / "from-env-2").exists()
    assert with_flag.address.startswith("127.0.0.1:")


def test_client_settings_come_from_the_file_the_environment_and_the_command_line(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    config = tmp_path / "client.toml"
    config.write_text(f'[client]\nserver = "{server.address}"\nauthor = "from-file@lab"\n')
    digest = "sha256:" + "ab" * 32
    state = tmp_path / "state"

    def pin_author(*args: str, env: dict[str, str] | None = None) -> str:
        run = run_vault(
            *args, "pin", "image", digest, "--external", "--json", env=env, state_home=state
        )
        author = run.ok().json()["author"]
        assert isinstance(author, str)
        return author

    assert pin_author("--config", str(config)) == "from-file@lab"
    env = {"PINVAULT_CONFIG": str(config), "PINVAULT_CLIENT_AUTHOR": "from-env@lab"}
    assert pin_author(env=env) == "from-env@lab"

    unreachable = {"PINVAULT_CLIENT_SERVER": "127.0.0.1:1", **env}
    line = run_vault("checkpoint", env=unreachable, state_home=state).error_line()
    assert line.startswith("vault: UNAVAILABLE: vault server unavailable")
    assert pin_author("--server", server.address, env=unreachable) == "from-env@lab"

    state_file = tmp_path / "elsewhere" / "trust.json"
    env = {**env, "PINVAULT_CLIENT_STATE_FILE": str(state_file)}
    run_vault("checkpoint", env=env, state_home=state).ok()
    assert json.loads(state_file.read_text())["size"] == 3


BAD_CONFIGS = {
    "unknown top-level key": ('colour = "blue"\n', {}, "unknown config key 'colour'"),
    "unknown key in a section": (
        '[ledger]\norign = "x"\n',
        {},
        "unknown config key 'ledger.orign'",
    ),
    "unknown section": ('[ledgr]\norigin = "x"\n', {}, "unknown config key 'ledgr'"),
    "a value of the wrong type": (
        '[server]\nworkers = "many"\n',
        {},
        "server.workers: expected int, found 'many'",
    ),
    "not TOML": ("[server\n", {}, "is not valid TOML"),
    "unknown variable in a section": (
        "",
        {"PINVAULT_LEDGER_ORIGN": "x"},
        "unknown environment variable PINVAULT_LEDGER_ORIGN",
    ),
    "unknown variable": (
        "",
        {"PINVAULT_COLOUR": "blue"},
        "unknown environment variable PINVAULT_COLOUR",
    ),
    "a variable of the wrong type": (
        "",
        {"PINVAULT_SERVER_WORKERS": "many"},
        "PINVAULT_SERVER_WORKERS: server.workers: expected int, found 'many'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_setting_stops_the_command_with_one_line_naming_it(tmp_path: Path, case: str) -> None:
    text, variables, named = BAD_CONFIGS[case]
    config = tmp_path / "vault.toml"
    config.write_text(text)
    env = {"PINVAULT_CONFIG": str(config), "XDG_DATA_HOME": str(tmp_path / "data"), **variables}
    for command in (["serve", "--listen", "127.0.0.1:0"], ["checkpoint"]):
        run = run_vault(*command, env=env, state_home=tmp_path / "state", timeout=30)
        line = run.error_line()
        assert line.startswith("vault: INVALID_ARGUMENT: ") and named in line, line
    assert sorted(os.listdir(tmp_path)) == ["vault.toml"], "nothing was created"


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    line = run_vault("--config", str(missing), "checkpoint").error_line()
    assert f"cannot read config file {missing}" in line


def test_an_unusable_data_folder_or_listen_address_is_one_line_from_serve(
    start_vault: StartVault, tmp_path: Path
) -> None:
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    running = start_vault()
    for variables, named in (
        ({"PINVAULT_DATA_DIR": str(not_a_folder)}, str(not_a_folder)),
        ({"PINVAULT_SERVER_LISTEN": running.address}, running.address),
        ({"PINVAULT_SERVER_LISTEN": "127.0.0.1:99999"}, "127.0.0.1:99999"),
    ):
        env = {"PINVAULT_DATA_DIR": str(tmp_path / "data"), **variables}
        run = run_vault("serve", env=env, state_home=tmp_path / "state", timeout=30)
        assert named in run.error_line(alone=False)


def test_serve_stops_cleanly_on_sigterm(start_vault: StartVault) -> None:
    server = start_vault()
    server.run("checkpoint").ok()
    assert server.stop() == 0
    assert "pinvault stopping" in server.log()
    line = server.run("checkpoint").error_line()
    assert "UNAVAILABLE" in line


def test_everything_serve_creates_in_the_data_folder_is_private(
    start_vault: StartVault, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    previous = os.umask(0o022)
    try:
        server = start_vault(data_dir=data)
    finally:
        os.umask(previous)
    with server.client() as client:
        digest = str(client.put(os.urandom(3 << 20)).blob.sha256)
        client.pin("artefact", digest)
    created = [data, *data.rglob("*")]
    names = {p.relative_to(data).as_posix() for p in created}
    assert {"vault.db", "vault.db-wal", "vault.db-shm", "checkpoint.key", "handoff.sock"} <= names
    assert any(p.is_file() and p.parent.parent.name == "blobs" for p in created), names
    open_to_others = {
        p.relative_to(data).as_posix() or ".": oct(stat.S_IMODE(p.lstat().st_mode))
        for p in created
        if p.lstat().st_mode & 0o077
    }
    assert open_to_others == {}, f"readable by other users under umask 022: {open_to_others}"
