"""What a new user and an operator meet in their first minute, against real `vault serve`s: a
server address without a port reaches the vault's port, the command's own options are
accepted after a command's name too, a port in use is refused in one line before anything is
made, a `uv tool` install is told how to add an extra with uv, and `vault repair` says what to
do while a server holds the warm tier and logs what it rewrote."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

from cli.main import build_parser
from tests.conftest import StartVault
from tests.services.vault_server import REPO_ROOT, VaultServer, command_env, run_vault
from tests.test_replay_check import seal_a_run
from vault.config import DEFAULT_PORT

UNAVAILABLE = 69


def test_a_server_address_without_a_port_reaches_the_vaults_own_port(
    start_vault: StartVault, tmp_path: Path
) -> None:
    # IPv6's loopback, which a local-mode vault may listen on and other tests leave alone.
    server = start_vault(listen=f"[::1]:{DEFAULT_PORT}")
    with server.client() as client:
        digest = str(client.put(b"reached without naming a port\n").blob.sha256)
    run = run_vault("stat", "--server", "::1", digest, state_home=tmp_path).ok()
    assert f"sha256     {digest}" in run.stdout
    config = tmp_path / "vault.toml"
    config.write_text('[client]\nserver = "[::1]"\n')
    run = run_vault("--config", str(config), "stat", digest, state_home=tmp_path).ok()
    assert f"sha256     {digest}" in run.stdout


def test_the_commands_own_options_are_accepted_after_a_commands_name(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    with vault_server.client() as client:
        digest = str(client.put(b"options after the command\n").blob.sha256)
    config = tmp_path / "vault.toml"
    config.write_text(f'[client]\nserver = "{vault_server.address}"\n')
    run = run_vault("stat", digest, "--config", str(config), state_home=tmp_path).ok()
    assert f"sha256     {digest}" in run.stdout
    # A host command two levels down: parsed, then refused for what it is (no mirror answers
    # there), not for its options.
    run = run_vault(
        "mirror",
        "add",
        "m",
        "--endpoint",
        "http://127.0.0.1:9",
        "--bucket",
        "b",
        "--config",
        str(config),
        "--data-dir",
        str(tmp_path / "data"),
        state_home=tmp_path,
    )
    assert run.returncode not in (0, 2), run.describe()
    assert "unrecognized arguments" not in run.stderr and "usage" not in run.error_line()
    # Given before the name, an option holds; a command's own option of the same spelling
    # stays its own.
    args = build_parser(lazy_commands=True).parse_args(["--config", "a.toml", "stat", digest])
    assert args.config == "a.toml"
    admit = ["admit", "--image", digest, "--dataset", digest, "--seed", "1", "--config", digest]
    args = build_parser(lazy_commands=True).parse_args(admit)
    assert args.config is None and args.run_config == digest


def test_serving_on_a_port_in_use_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = tmp_path / "data"
        run = run_vault(
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            env={"PINVAULT_DATA_DIR": str(data)},
            state_home=tmp_path / "state",
        )
    assert run.returncode == UNAVAILABLE, run.describe()
    assert run.error_line().startswith(f"vault: UNAVAILABLE: cannot listen on 127.0.0.1:{port}: ")
    assert run.stdout == ""
    # No key, no database, no sequencer: not even the data folder.
    assert not data.exists()


def test_a_uv_tool_install_is_told_to_add_an_extra_with_uv(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    sealed = seal_a_run(vault_server, tmp_path / "run")
    # An environment as `uv tool install pinvault` makes one: its receipt beside it. It sees
    # this checkout and the test environment's packages through a .pth file.
    tool = tmp_path / "tool"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tool)], check=True)
    (tool / "uv-receipt.toml").write_text('[tool]\nrequirements = [{ name = "pinvault" }]\n')
    site = Path(sysconfig.get_path("purelib", vars={"base": str(tool), "platbase": str(tool)}))
    (site / "test-environment.pth").write_text(
        f"{REPO_ROOT}\n{sysconfig.get_path('purelib')}\n{sysconfig.get_path('platlib')}\n"
    )
    # MLflow's client hidden, as in an install without the extra.
    hidden = tmp_path / "no-mlflow" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mlflow'\", name='mlflow')\n"
    )
    env = command_env(
        state_home=vault_server.state_home,
        extra={"PINVAULT_CLIENT_SERVER": vault_server.address, "PYTHONPATH": str(hidden.parent)},
    )
    export = ["run", "export", sealed.manifest, "--mlflow", "http://127.0.0.1:9"]
    done = subprocess.run(
        [str(tool / "bin" / "python"), "-m", "cli.main", *export],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 78, done.stderr
    assert done.stderr.strip().endswith(
        "uv tool install 'pinvault[mlflow]' (this vault was installed with uv tool)"
    ), done.stderr
    assert "pip install" not in done.stderr


def test_vault_repair_logs_what_it_rewrote_and_says_what_to_do_while_the_warm_tier_is_held(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    original = tmp_path / "blob.bin"
    original.write_bytes(random.randbytes(100_000))
    with server.client() as client:
        digest = str(client.put(original).blob.sha256)
    stored = server.blob_path(digest)
    damaged = bytearray(stored.read_bytes())
    damaged[500] ^= 0x01
    stored.write_bytes(damaged)
    host = {"PINVAULT_DATA_DIR": str(server.data_dir)}
    repaired = server.run("repair", digest, "--from", str(original), env=host).ok()
    logged = [line for line in repaired.stderr.splitlines() if " WARNING pinvault.tiers: " in line]
    assert len(logged) == 1, repaired.describe()
    assert (
        f"repair of {digest} from {original}: hot: stored copy of {digest} is damaged"
        in (logged[0])
    )
    assert stored.read_bytes() == original.read_bytes()

    warm = {"PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm")}
    held = start_vault("held", env=warm)
    held_host = {"PINVAULT_DATA_DIR": str(held.data_dir), **warm}
    with held.client() as client:
        digest = str(client.put(original).blob.sha256)
    refused = held.run("repair", digest, "--from", str(original), env=held_host)
    assert refused.returncode == UNAVAILABLE, refused.describe()
    line = refused.error_line()
    assert "a running `vault serve` holds the warm tier" in line
    assert "`vault scrub`" in line and f"vault repair {digest} --from {original}" in line
