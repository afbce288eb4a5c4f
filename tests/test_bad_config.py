"""A configuration is checked whole before `vault serve` starts: a setting out of its range (or
not a number at all: nan, infinities), a file that is not TOML text, each stops the command
with exit status 2 and one line naming the file or variable, the key, the value and what is
allowed, and nothing is created."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest

from tests.services.vault_server import run_vault
from vault import config
from vault.errors import ConfigError

# What the file holds, and what the one line of error must say after "config FILE: ".
OUT_OF_RANGE = {
    "a checkpoint interval of 0": (
        "[ledger]\ncheckpoint_interval = 0\n",
        "ledger.checkpoint_interval: expected 0.01 to 86400, found 0",
    ),
    "a negative checkpoint interval": (
        "[ledger]\ncheckpoint_interval = -1\n",
        "ledger.checkpoint_interval: expected 0.01 to 86400, found -1",
    ),
    "a checkpoint interval that is not a number": (
        "[ledger]\ncheckpoint_interval = nan\n",
        "ledger.checkpoint_interval: expected 0.01 to 86400, found nan",
    ),
    "a commit window of 31 years": (
        "[ledger]\ncommit_window = 1e9\n",
        "ledger.commit_window: expected 0 to 1, found 1000000000.0",
    ),
    "no workers": ("[server]\nworkers = 0\n", "server.workers: expected 1 to 4096, found 0"),
    "an infinite idle timeout": (
        "[server]\nstream_idle_timeout = inf\n",
        "server.stream_idle_timeout: expected 0.1 to 86400, found inf",
    ),
    "a number past any float": (
        f"[admission]\nverify_interval = {10**400}\n",
        f"admission.verify_interval: expected 0 to 31536000, found {'1' + '0' * 39}…",
    ),
    "a migration pass every millisecond": (
        "[policy]\nmigrate_interval = 0.001\n",
        "policy.migrate_interval: expected 0 (off) or 0.1 to 31536000, found 0.001",
    ),
    "no copy kept elsewhere": (
        "[policy]\nmin_copies = 0\n",
        "policy.min_copies: expected 1 to 64, found 0",
    ),
    "a high water mark past full": (
        "[policy]\nhot_high_water = 1.5\n",
        "policy.hot_high_water: expected 0.01 to 1, found 1.5",
    ),
    "no attempts at a mirror": (
        "[mirrors]\nattempts = 0\n",
        "mirrors.attempts: expected 1 to 100, found 0",
    ),
}


def serve(tmp_path: Path, env: dict[str, str]) -> str:
    """`vault serve` with `env`: the one line it prints, after checking it exits 2 having
    printed nothing else, no traceback, and created nothing."""
    env = {"XDG_DATA_HOME": str(tmp_path / "data"), **env}
    run = run_vault(
        "serve", "--listen", "127.0.0.1:0", env=env, state_home=tmp_path / "state", timeout=30
    )
    assert run.returncode == 2, run.describe()
    line = run.error_line()
    assert run.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["vault.toml"], "nothing was created"
    return line


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_a_setting_out_of_its_range_stops_serve_with_one_line(tmp_path: Path, case: str) -> None:
    text, said = OUT_OF_RANGE[case]
    file = tmp_path / "vault.toml"
    file.write_text(text)
    line = serve(tmp_path, {"PINVAULT_CONFIG": str(file)})
    assert line == f"vault: INVALID_ARGUMENT: config {file}: {said}"


def test_a_variable_out_of_its_range_is_named(tmp_path: Path) -> None:
    (tmp_path / "vault.toml").write_text("")
    line = serve(tmp_path, {"PINVAULT_LEDGER_COMMIT_WINDOW": "inf"})
    assert line == (
        "vault: INVALID_ARGUMENT: config environment variable PINVAULT_LEDGER_COMMIT_WINDOW: "
        "ledger.commit_window: expected 0 to 1, found 'inf'"
    )


def test_a_binary_config_file_is_named_with_its_line(tmp_path: Path) -> None:
    file = tmp_path / "vault.toml"
    file.write_bytes(b'[server]\nlisten = "127.0.0.1:0"\n\x89PNG\r\n\x1a\n\x00\x00\xff')
    line = serve(tmp_path, {"PINVAULT_CONFIG": str(file)})
    assert line == (
        f"vault: INVALID_ARGUMENT: config file {file} is not TOML text: line 3 holds byte 0x89, "
        "which is not UTF-8"
    )


def test_a_malformed_config_file_is_named_with_its_line(tmp_path: Path) -> None:
    file = tmp_path / "vault.toml"
    file.write_text('[server]\nlisten = "127.0.0.1:0"\nworkers = 4 4\n')
    line = serve(tmp_path, {"PINVAULT_CONFIG": str(file)})
    assert line.startswith(f"vault: INVALID_ARGUMENT: config file {file} is not valid TOML: ")
    assert line.endswith("(at line 3, column 13)")


def test_the_command_line_option_config_is_checked_too(tmp_path: Path) -> None:
    file = tmp_path / "vault.toml"
    file.write_bytes(b"\x00\x01\x02")
    run = run_vault("--config", str(file), "checkpoint", state_home=tmp_path / "state")
    assert run.returncode == 2, run.describe()
    assert run.error_line().startswith(f"vault: INVALID_ARGUMENT: config file {file} ")


def numeric_settings() -> list[tuple[str, str, float]]:
    """Every numeric setting: its section, its name, its default."""
    return [
        (section.name, item.name, getattr(getattr(config.Config(), section.name), item.name))
        for section in fields(config.Config)
        if section.name != "data_dir"
        for item in fields(getattr(config.Config(), section.name))
        if type(getattr(getattr(config.Config(), section.name), item.name)) in (int, float)
    ]


@pytest.mark.parametrize(("section", "name", "default"), numeric_settings())
def test_every_numeric_setting_has_a_range_its_default_lies_in(
    section: str, name: str, default: float
) -> None:
    variable = f"PINVAULT_{section.upper()}_{name.upper()}"
    loaded = config.load(environ={variable: str(default)})
    assert getattr(getattr(loaded, section), name) == default
    huge = "1" + "0" * 30
    for wrong in (
        huge,
        f"-{huge}",
        *(("nan", "-inf", "inf") if isinstance(default, float) else ()),
    ):
        with pytest.raises(ConfigError, match=rf"{section}\.{name}: expected .* to .*, found"):
            config.load(environ={variable: wrong})


def test_a_client_without_a_server_address_is_told_which_setting_to_give(tmp_path: Path) -> None:
    digest = "sha256:" + "0" * 64
    run = run_vault("stat", digest, env={"PINVAULT_CLIENT_SERVER": " "}, state_home=tmp_path)
    assert run.returncode == 2, run.describe()
    assert run.stderr.strip() == (
        "vault: INVALID_ARGUMENT: no vault server to connect to: set client.server (or "
        "PINVAULT_CLIENT_SERVER) to HOST:PORT or unix:PATH"
    )
