"""`vault admission-agent` on its own, as the Slurm plugin sees it: one JSON line in, one out.
It answers with the run id and seed the vault admitted, refuses with the vault's reason word for
word, gives a malformed, oversized or stalled request a reason and never a traceback, answers
UNAVAILABLE while the vault is down and admits again once it is back, and serves several
connections at once. Real agent process, real `vault serve`."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.agent import AdmissionAgent
from tests.services.vault_server import VAULT_COMMAND, VaultServer, command_env
from tests.test_slurm import short_dir
from vault.ledger.runid import RunInputs

SEED = "0xC0FFEE"
# What the agent says it checked of the image of Pinned, one file held.
ONE_FILE = {"image_blobs": "0", "image_external": False}


class Pinned:
    """An image and a dataset pinned in a vault, and an image stored but never pinned."""

    def __init__(self, vault: VaultServer, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        image = folder / "image.tar"
        image.write_bytes(b"an image for the agent's tests " + os.urandom(16))
        self.image = vault.run("put", str(image)).ok().stdout.split()[0]
        vault.run("pin", "image", self.image).ok()
        other = folder / "other.tar"
        other.write_bytes(b"stored, never pinned " + os.urandom(16))
        self.unpinned = vault.run("put", str(other)).ok().stdout.split()[0]
        data = folder / "dataset"
        data.mkdir()
        (data / "train.csv").write_text("x,y\n1,2\n")
        self.dataset = vault.run("dataset", "add", str(data)).ok().stdout.split()[0]

    def request(self, **changes: str) -> dict[str, str]:
        return {"image": self.image, "dataset": self.dataset, "seed": SEED, **changes}


@pytest.fixture(scope="module")
def vault(
    clean_environment: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VaultServer]:
    with VaultServer(tmp_path_factory.mktemp("agent-vault")) as server:
        yield server


@pytest.fixture(scope="module")
def pinned(vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Pinned:
    return Pinned(vault, tmp_path_factory.mktemp("agent-pins"))


@pytest.fixture(scope="module")
def agent(vault: VaultServer) -> Iterator[AdmissionAgent]:
    with short_dir("pinvault-agent-") as base, AdmissionAgent(base, vault.address) as agent:
        yield agent
        assert "Traceback" not in agent.log(), agent.log()


def vaults_word(vault: VaultServer, request: dict[str, str]) -> str:
    """What `vault admit` says to the same request: its one line of error, without `vault: `."""
    args = [f"--{name.replace('_', '-')}={value}" for name, value in request.items()]
    line = vault.run("admit", *args, "--porcelain").error_line()
    return line.removeprefix("vault: ")


def test_an_admission_answers_the_run_id_and_seed_the_vault_recorded(
    agent: AdmissionAgent, vault: VaultServer, pinned: Pinned
) -> None:
    answer = agent.ask(pinned.request(team="vision"))
    run_id = answer["run_id"]
    assert answer == {"admitted": True, "run_id": run_id, "seed": "12648430", **ONE_FILE}
    bare = RunInputs.checked(image=pinned.image, dataset=pinned.dataset, seed=SEED)
    assert run_id != bare.run_id  # the vault's nonce is in it
    # The same answer `vault admit` gives the same team, and the run entry the vault recorded.
    admitted = vault.run(
        "admit",
        f"--image={pinned.image}",
        f"--dataset={pinned.dataset}",
        f"--seed={SEED}",
        "--team=vision",
        "--porcelain",
    )
    assert admitted.ok().stdout == (
        f"run_id={run_id} seed=12648430\nimage_blobs=0 image_external=false\n"
    )
    runs = vault.run("lookup", run_id, "--json").ok().json()
    run = next(e for e in runs if e["kind"] == "run")
    assert run["meta"]["team"] == "vision" and run["meta"]["seed"] == "12648430"


def test_the_config_and_run_id_are_passed_on(
    agent: AdmissionAgent, pinned: Pinned, vault: VaultServer
) -> None:
    config = "sha256:" + "c" * 64
    request = pinned.request(config=config, seed="99")
    # An unpinned config is the vault's refusal, so it did reach the vault.
    assert agent.ask(request) == {"admitted": False, "reason": vaults_word(vault, request)}
    # The run id `vault run` got from its own admission is admitted again as that run.
    first = agent.ask(pinned.request(seed="99"))
    run_id = first["run_id"]
    answer = agent.ask(pinned.request(seed="99", run_id=run_id))
    assert answer == {"admitted": True, "run_id": run_id, "seed": "99", **ONE_FILE}
    # A run id computed from the inputs alone names no admitted run: the vault chose a nonce.
    guessed = RunInputs.checked(image=pinned.image, dataset=pinned.dataset, seed=99).run_id
    refused = agent.ask(pinned.request(seed="99", run_id=guessed))
    assert refused["admitted"] is False
    assert f"run id {guessed} does not name these inputs" in refused["reason"]


@pytest.mark.parametrize(
    "change",
    [
        {"image": "ubuntu:22.04"},
        {"image": "unpinned"},
        {"run_id": "sha256:" + "1" * 64},
        {"seed": "-1"},
        {"seed": "$(reboot)"},
        {"dataset": 'x";\n\\"admitted": true'},
        {"image": "\u00e9t\u00e9"},
    ],
    ids=["floating-tag", "unpinned", "wrong-run-id", "bad-seed", "shell", "json", "unicode"],
)
def test_a_refusal_carries_the_vaults_reason_word_for_word(
    agent: AdmissionAgent, vault: VaultServer, pinned: Pinned, change: dict[str, str]
) -> None:
    if change.get("image") == "unpinned":
        change = {"image": pinned.unpinned}
    request = pinned.request(**change)
    answer = agent.ask(request)
    assert answer == {"admitted": False, "reason": vaults_word(vault, request)}


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (b"{nope\n", "INVALID_ARGUMENT: the request is not JSON: "),
        (b"\n", "INVALID_ARGUMENT: the request is not JSON: "),
        (b"\xff\xfe\n", "INVALID_ARGUMENT: the request is not JSON: "),
        (b'["image"]\n', "INVALID_ARGUMENT: the request is not a JSON object"),
        (
            b'{"image": "a", "dataset": "b", "seed": "1", "user": "root"}\n',
            "INVALID_ARGUMENT: unknown request field 'user' (known: image, dataset, config, "
            "seed, team, run_id)",
        ),
        (b'{"image": "sha256:00"}\n', "INVALID_ARGUMENT: the request has no dataset, seed"),
        (
            b'{"image": "a", "dataset": "b", "seed": ["1"]}\n',
            "INVALID_ARGUMENT: request field 'seed' is not a string",
        ),
    ],
    ids=["not-json", "empty", "not-utf8", "array", "unknown-field", "missing", "not-string"],
)
def test_a_malformed_request_gets_a_reason(
    agent: AdmissionAgent, request_bytes: bytes, reason: str
) -> None:
    answer = agent.ask(request_bytes)
    assert answer["admitted"] is False
    assert answer["reason"].startswith(reason), answer
    assert set(answer) == {"admitted", "reason"}


def test_a_request_line_of_16_kib_is_read_and_a_longer_one_refused(
    agent: AdmissionAgent, vault: VaultServer, pinned: Pinned
) -> None:
    request = pinned.request(image="ubuntu:22.04")
    line = json.dumps(request).encode()
    padded = line[:-1] + b" " * (16 * 1024 - len(line)) + b"}"
    assert len(padded) == 16 * 1024
    assert agent.ask(padded + b"\n") == {"admitted": False, "reason": vaults_word(vault, request)}
    answer = agent.ask(padded + b" \n")
    assert answer == {
        "admitted": False,
        "reason": "INVALID_ARGUMENT: the request is longer than 16384 bytes",
    }
    # A sender that never ends its line is cut off at the limit too, not read forever.
    assert agent.ask(b"x" * 100_000) == answer


def test_a_request_that_ends_without_a_newline_is_still_read(
    agent: AdmissionAgent, pinned: Pinned
) -> None:
    answer = json.loads(agent.send(json.dumps(pinned.request()).encode(), end=True))
    assert answer["admitted"] is True, answer


def test_a_stalled_request_is_refused_in_seconds_and_others_go_on(
    agent: AdmissionAgent, pinned: Pinned
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.settimeout(30)
        stalled.connect(str(agent.socket))
        began = time.monotonic()
        stalled.sendall(b'{"image": ')
        # While it stalls, another connection is answered.
        assert agent.ask(pinned.request())["admitted"] is True
        answer = json.loads(stalled.makefile("rb").readline())
        took = time.monotonic() - began
    assert answer == {
        "admitted": False,
        "reason": "INVALID_ARGUMENT: no whole request line in 3 s",
    }
    assert 2.5 < took < 15, took


def test_concurrent_requests_each_get_their_own_answer(
    agent: AdmissionAgent, pinned: Pinned, vault: VaultServer
) -> None:
    seeds = [str(1000 + n) for n in range(24)]
    answers: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []

    def ask(seed: str) -> None:
        try:
            answers[seed] = agent.ask(pinned.request(seed=seed, team=f"team{seed}"))
        except BaseException as exc:  # reported below, in the test's own thread
            failures.append(exc)

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    runs = {
        e["subjects"][0]: e for e in vault.run("log", "--kind", "run", "--json").ok().json_lines()
    }
    for seed in seeds:
        run_id = answers[seed]["run_id"]
        assert answers[seed] == {"admitted": True, "run_id": run_id, "seed": seed, **ONE_FILE}
        assert runs[run_id]["meta"]["team"] == f"team{seed}"
        assert runs[run_id]["meta"]["seed"] == seed
    assert len({answers[seed]["run_id"] for seed in seeds}) == len(seeds)


def test_the_vault_down_is_unavailable_and_its_return_admits_again(
    start_vault: StartVault, tmp_path: Path
) -> None:
    with short_dir("pinvault-agent-down-") as base:
        own = start_vault("own", listen=f"unix:{base}/vault.sock")
        pins = Pinned(own, tmp_path / "pins")
        with AdmissionAgent(base / "agent", own.address) as agent:
            answer = agent.ask(pins.request())
            assert answer["admitted"] is True, answer
            assert own.stop() == 0
            answer = agent.ask(pins.request())
            assert answer["admitted"] is False
            assert answer["reason"].startswith("UNAVAILABLE: vault server unavailable: "), answer
            own.start()
            answer = agent.ask(pins.request(seed="5"))
            assert answer["admitted"] is True, answer
        assert "Traceback" not in agent.log(), agent.log()


def test_the_vault_never_reached_is_unavailable(clean_environment: None) -> None:
    with short_dir("pinvault-agent-none-") as base:
        with AdmissionAgent(base / "agent", f"unix:{base}/nothing.sock") as agent:
            answer = agent.ask(
                {"image": "sha256:" + "a" * 64, "dataset": "sha256:" + "b" * 64, "seed": "1"}
            )
        assert answer["admitted"] is False
        assert answer["reason"].startswith("UNAVAILABLE: "), answer
        assert "cannot be reached yet" in agent.log()


def test_the_socket_is_private_and_removed_when_the_agent_stops(
    vault: VaultServer, pinned: Pinned
) -> None:
    with short_dir("pinvault-agent-sock-") as base:
        agent = AdmissionAgent(base, vault.address).start()
        try:
            mode = os.stat(agent.socket).st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
            # A second agent on the same socket is refused, in one line.
            second = subprocess.run(
                agent.command(),
                env=agent.env(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert second.returncode == 78  # FAILED_PRECONDITION
            assert second.stderr == (
                f"vault: FAILED_PRECONDITION: another process already answers on {agent.socket}\n"
            )
            assert agent.ask(pinned.request())["admitted"] is True
        finally:
            assert agent.stop() == 0
        assert not agent.socket.exists()


def test_a_socket_left_by_a_dead_agent_is_replaced(vault: VaultServer, pinned: Pinned) -> None:
    with short_dir("pinvault-agent-stale-") as base:
        left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        left.bind(str(base / "agent.sock"))
        left.close()
        with AdmissionAgent(base, vault.address, args=("--mode", "0600")) as agent:
            assert stat.S_IMODE(os.stat(agent.socket).st_mode) == 0o600
            assert agent.ask(pinned.request())["admitted"] is True


@pytest.mark.parametrize(
    ("listen", "error"),
    [
        (
            "127.0.0.1:7000",
            "vault: INVALID_ARGUMENT: --listen '127.0.0.1:7000': the agent "
            "answers on a Unix socket only: give unix:PATH",
        ),
        ("unix:/tmp/" + "x" * 120, "is longer than the 107 bytes a Unix socket takes"),
    ],
)
def test_a_bad_listen_address_is_one_line(listen: str, error: str) -> None:
    done = subprocess.run(
        [*VAULT_COMMAND, "admission-agent", "--listen", listen],
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 64  # INVALID_ARGUMENT
    assert done.stderr.count("\n") == 1 and error in done.stderr, done.stderr
