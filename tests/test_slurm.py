"""The lab's rule in a real Slurm: sbatch refuses a job whose pins the vault does not admit and
shows the vault's reason; an admitted job runs with its run id and seed in its environment and
its run id on its record. slurm/job_submit.lua runs in a private one-node cluster (see
tests/services/slurm.py) and asks a real `vault serve` through the real `vault admit`, and
again through a real `vault admission-agent` on a Unix socket; when the agent is down, silent or
talks nonsense, the job is refused with a reason. Either way an admitted job's submitter is told
what the vault checked of its image, and a job on an OCI image the vault does not hold whole is
refused naming the blob it lacks.

Then the whole loop: `vault run` checks, pins and submits a job; the job records its outputs
and checkpoint with the run library and publishes its run manifest and replicate.sh; `vault
replay` runs it again from the manifest with the same outputs; a team's third concurrent replay
is refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.agent import AdmissionAgent
from tests.services.installed import install_vault
from tests.services.slurm import FINISHED_STATES, SlurmCluster
from tests.services.vault_server import VAULT_COMMAND, VaultRun, VaultServer
from tests.test_admission import OCI_INDEX, OCI_MANIFEST, _descriptor, _image_manifest, sha256
from vault.client import VaultClient
from vault.runs import load_run_manifest

REPO_ROOT = Path(__file__).resolve().parents[1]
PLUGIN = REPO_ROOT / "slurm" / "job_submit.lua"
SEED = "0xC0FFEE"
# The job prints what it was given, one NAME=value a line.
SHOW_PINS = "#!/bin/sh\nenv | grep '^PINVAULT_' | sort\n"
# The vault command as slurmctld runs it: an executable path (the venv's `vault` script).
VAULT_EXECUTABLE = VAULT_COMMAND[0] if len(VAULT_COMMAND) == 1 else None
# What the plugin tells the submitter of an admitted job on an image pinned as one file.
ONE_FILE = "image held: one file, verified when stored"


@dataclass(frozen=True)
class Pins:
    image: str
    dataset: str
    unpinned_image: str

    def env(self, **changes: str) -> dict[str, str]:
        pins = {"PINVAULT_IMAGE": self.image, "PINVAULT_DATASET": self.dataset}
        return {**pins, "PINVAULT_SEED": SEED, **changes}


@contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    """A folder with a path short enough for a Unix socket in it (pytest's may not be)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def plugin_files(client: Path, vault_socket: str, state: Path) -> dict[str, str]:
    """pinvault.conf for the plugin and the vault client's config it names."""
    client.write_text(f'[client]\nserver = "{vault_socket}"\n')
    assert VAULT_EXECUTABLE is not None, "the `vault` script is not installed in the venv"
    conf = (
        f"vault = {VAULT_EXECUTABLE}\n"
        f"client_config = {client}\n"
        f"state_dir = {state}\n"
        # A loaded 2-core test machine can take seconds to start Python.
        "timeout = 8\n"
    )
    return {"pinvault.conf": conf}


@pytest.fixture(scope="module")
def vault(clean_environment: None) -> Iterator[VaultServer]:
    """A real `vault serve` on a Unix socket: the cluster lives in a network namespace of its
    own (no port of this machine's), and a socket's path reaches into it where 127.0.0.1
    does not."""
    with (
        short_dir("pinvault-slurm-vault-") as base,
        VaultServer(base, listen=f"unix:{base}/vault.sock") as server,
    ):
        yield server


@pytest.fixture(scope="module")
def cluster(vault: VaultServer) -> Iterator[SlurmCluster]:
    folder = Path(vault.base) / "controller"
    folder.mkdir()
    files = plugin_files(folder / "client.toml", vault.address, folder / "state")
    with SlurmCluster(job_submit=PLUGIN, files=files) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pins(vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Pins:
    folder = tmp_path_factory.mktemp("pins")
    image = folder / "image.tar"
    image.write_bytes(b"an OCI image, as far as this test cares\n")
    other = folder / "other.tar"
    other.write_bytes(b"an image that was stored but never pinned\n")
    dataset = folder / "dataset"
    dataset.mkdir()
    (dataset / "train.csv").write_text("x,y\n1,2\n")
    image_digest = put(vault, image)
    vault.run("pin", "image", image_digest).ok()
    dataset_digest = vault.run("dataset", "add", str(dataset)).ok().stdout.split()[0]
    return Pins(image_digest, dataset_digest, put(vault, other))


@dataclass(frozen=True)
class OciImage:
    """An image pinned as an OCI manifest (a config and two layers) or as an index listing one,
    with every blob held or one left out; `refusal` is the vault's reason for the latter."""

    digest: str
    blobs: int
    refusal: str


def pin_oci_image(client: VaultClient, left_out: str = "") -> OciImage:
    """An OCI image put and pinned through `client`, without the blob `left_out` names: its
    `config`, a `layer`, or (the image then an index listing it) its `manifest`."""
    # Bytes of each image's own: a blob another image put would be held.
    config = json.dumps(
        {"architecture": "amd64", "os": "linux", "id": os.urandom(8).hex()}
    ).encode()
    layers = [os.urandom(3000), os.urandom(2000)]
    manifest = _image_manifest(config, layers)
    blobs = {"config": config, "layer": layers[1], "manifest": manifest}
    for data in (config, *layers, manifest):
        if data is not blobs.get(left_out):
            client.put(data)
    image, named = manifest, 3
    if left_out == "manifest":
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [_descriptor(OCI_MANIFEST, manifest)],
        }
        image, named = json.dumps(index).encode(), 1
        client.put(image)
    digest = str(client.pin("image", sha256(image)).entry.subjects[0])
    refusal = ""
    if left_out:
        missing = blobs[left_out]
        refusal = (
            f"FAILED_PRECONDITION: image {digest} is not held whole: 1 of the {named} blobs "
            f"{digest} names are not in the store (first: {left_out} {sha256(missing)}, "
            f"{len(missing)} bytes)"
        )
    return OciImage(digest, named, refusal)


@pytest.fixture(scope="module")
def images(vault: VaultServer) -> dict[str, OciImage]:
    """OCI images pinned in the module's vault: one held whole, and one lacking each kind of
    blob an image names."""
    with VaultClient(vault.address, timeout=60) as client:
        return {
            left_out or "held": pin_oci_image(client, left_out)
            for left_out in ("", "config", "layer", "manifest")
        }


def admitted_line(stderr: str) -> str:
    """What the plugin told the submitter of an admitted job: one line on sbatch's standard
    error, and nothing else."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    found = re.fullmatch(r"sbatch: (pinvault: admitted as run sha256:[0-9a-f]{64}; .*)", lines[0])
    assert found, stderr
    return found.group(1)


def put(vault: VaultServer, path: Path) -> str:
    digest = vault.run("put", str(path)).ok().stdout.split()[0]
    assert digest.startswith("sha256:")
    return digest


def admit(vault: VaultServer, pins: dict[str, str], team: str) -> VaultRun:
    """`vault admit` as a user would run it, for the vault's own answer to compare with."""
    args = [
        f"--image={pins['PINVAULT_IMAGE']}",
        f"--dataset={pins['PINVAULT_DATASET']}",
        f"--seed={pins['PINVAULT_SEED']}",
        f"--team={team}",
    ]
    if "PINVAULT_RUN_ID" in pins:
        args.append(f"--run-id={pins['PINVAULT_RUN_ID']}")
    return vault.run("admit", *args, "--porcelain")


@contextmanager
def plugin_conf(cluster: SlurmCluster, text: str) -> Iterator[None]:
    """The plugin reads pinvault.conf at every submission: swap it for a while."""
    conf = cluster.conf_dir / "pinvault.conf"
    kept = conf.read_text()
    conf.write_text(text)
    try:
        yield
    finally:
        conf.write_text(kept)


def refusal(stderr: str) -> str:
    """The reason sbatch showed, after checking it showed it as one line of error and no
    job id and no traceback."""
    assert "Traceback" not in stderr, stderr
    found: list[str] = re.findall(
        r"^sbatch: error: pinvault: job refused: (.*)$", stderr, re.MULTILINE
    )
    assert len(found) == 1, stderr
    assert "Batch job submission failed" in stderr, stderr
    return found[0]


def test_a_job_without_pins_is_refused(cluster: SlurmCluster) -> None:
    submitted = cluster.sbatch([], script="#!/bin/sh\ntrue\n")
    assert submitted.returncode != 0, submitted.describe()
    assert submitted.stdout == ""
    reason = refusal(submitted.stderr)
    assert "PINVAULT_IMAGE, PINVAULT_DATASET, PINVAULT_SEED not set" in reason


def test_a_job_missing_its_seed_is_refused(cluster: SlurmCluster, pins: Pins) -> None:
    env = pins.env()
    del env["PINVAULT_SEED"]
    submitted = cluster.sbatch([], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    assert "(PINVAULT_SEED not set)" in refusal(submitted.stderr)


def test_a_floating_tag_is_refused_with_the_vaults_reason(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    env = pins.env(PINVAULT_IMAGE="ubuntu:22.04")
    submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    vaults_word = admit(vault, env, "vision").error_line()
    assert vaults_word.startswith("vault: INVALID_ARGUMENT: ")
    assert "ubuntu:22.04" in vaults_word
    assert refusal(submitted.stderr) == vaults_word.removeprefix("vault: ")
    assert "Batch job submission failed: Access/permission denied" in submitted.stderr


def test_an_image_that_is_not_pinned_is_refused(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    env = pins.env(PINVAULT_IMAGE=pins.unpinned_image)
    submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    vaults_word = admit(vault, env, "vision").error_line()
    assert vaults_word.startswith("vault: FAILED_PRECONDITION: ")
    assert pins.unpinned_image in vaults_word
    assert refusal(submitted.stderr) == vaults_word.removeprefix("vault: ")


def test_a_run_id_that_does_not_match_the_pins_is_refused(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    env = pins.env(PINVAULT_RUN_ID="sha256:" + "1" * 64)
    submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    vaults_word = admit(vault, env, "vision").error_line()
    assert refusal(submitted.stderr) == vaults_word.removeprefix("vault: ")


def test_pins_reach_the_vault_as_data_never_as_shell(
    cluster: SlurmCluster, pins: Pins, tmp_path: Path
) -> None:
    # slurmctld runs the vault command through a shell, with values the user chose.
    marker = tmp_path / "ran"
    env = pins.env(
        PINVAULT_DATASET=f"x';touch {marker};'",
        PINVAULT_SEED=f"$(touch {marker})",
        PINVAULT_RUN_ID=f"`touch {marker}`",
    )
    submitted = cluster.sbatch([], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    assert refusal(submitted.stderr).startswith("INVALID_ARGUMENT: ")
    assert not marker.exists()


def test_a_pinned_job_runs_with_the_run_id_the_vault_recorded(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    submitted = cluster.sbatch(["--account=vision"], pins.env(), script=SHOW_PINS)
    assert submitted.returncode == 0, submitted.describe()
    told = admitted_line(submitted.stderr)
    job_id = submitted.job_id

    record = cluster.wait(job_id)
    assert record["job_state"] == "COMPLETED", cluster.output(job_id)
    seen = dict(line.split("=", 1) for line in cluster.output(job_id).splitlines())
    run_id = seen["PINVAULT_RUN_ID"]
    assert told == f"pinvault: admitted as run {run_id}; {ONE_FILE}"

    # What the vault wrote: a run entry naming this run id, its inputs, seed and team.
    runs = vault.run("log", "--kind", "run", "--json").ok().json_lines()
    entry = next(e for e in runs if e["subjects"][0] == run_id)
    assert entry["subjects"][1:] == [pins.image, pins.dataset]
    assert entry["meta"]["team"] == "vision"
    assert seen["PINVAULT_SEED"] == entry["meta"]["seed"] == str(int(SEED, 16))
    assert seen["PINVAULT_IMAGE"] == pins.image

    # What anyone sees of the job: its run id on its record.
    shown = cluster.run("scontrol", "show", "job", str(job_id))
    assert shown.returncode == 0, shown.stderr
    expected = f"AdminComment=pinvault run={run_id} seed={entry['meta']['seed']}"
    assert expected in shown.stdout, shown.stdout


def test_the_run_id_of_vault_run_is_admitted_again(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    # `vault run` admits first and hands the job its run id; the plugin's second admission
    # must agree with it.
    first = admit(vault, pins.env(), "vision").ok().stdout.split()[0]
    run_id = first.removeprefix("run_id=")
    env = pins.env(PINVAULT_RUN_ID=run_id)
    submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode == 0, submitted.describe()
    job_id = submitted.job_id
    assert cluster.wait(job_id)["job_state"] == "COMPLETED"
    assert f"PINVAULT_RUN_ID={run_id}" in cluster.output(job_id).splitlines()


def test_the_team_is_the_submitting_user_without_an_account(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    before = len(vault.run("log", "--json").ok().json_lines())
    # A seed of its own makes a run no other test admitted, so the vault records it anew.
    submitted = cluster.sbatch([], pins.env(PINVAULT_SEED="4242"), script=SHOW_PINS)
    assert submitted.returncode == 0, submitted.describe()
    assert cluster.wait(submitted.job_id)["job_state"] == "COMPLETED"
    seen = dict(line.split("=", 1) for line in cluster.output(submitted.job_id).splitlines())
    (entry,) = vault.run("log", "--json").ok().json_lines()[before:]
    assert entry["kind"] == "run"
    assert entry["subjects"][0] == seen["PINVAULT_RUN_ID"]
    assert entry["meta"]["seed"] == "4242"
    assert entry["meta"]["team"] == "root"  # the tests run as root, and so submit as root


def test_sbatch_refuses_when_the_vault_is_down(
    cluster: SlurmCluster, start_vault: StartVault, pins: Pins
) -> None:
    # A vault of this test's own, so that stopping it leaves the module's vault running.
    with short_dir("pinvault-slurm-down-") as base:
        own = start_vault("down", listen=f"unix:{base}/vault.sock")
        files = plugin_files(base / "client.toml", own.address, base / "state")
        with plugin_conf(cluster, files["pinvault.conf"]):
            # It is this vault that is asked: the module's pins are unknown to it.
            submitted = cluster.sbatch([], pins.env(), script=SHOW_PINS)
            assert "FAILED_PRECONDITION" in refusal(submitted.stderr)

            assert own.stop() == 0
            submitted = cluster.sbatch([], pins.env(), script=SHOW_PINS)
            assert submitted.returncode != 0, submitted.describe()
            assert refusal(submitted.stderr).startswith("UNAVAILABLE: ")
            assert "Batch job submission failed: Unspecified error" in submitted.stderr


def test_a_misconfigured_plugin_refuses_and_says_so(cluster: SlurmCluster, pins: Pins) -> None:
    conf = cluster.conf_dir / "pinvault.conf"
    with plugin_conf(cluster, conf.read_text().replace("vault =", "vualt =")):
        submitted = cluster.sbatch([], pins.env(), script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    assert refusal(submitted.stderr) == (
        f"admission is misconfigured on the controller: {conf}:1: unknown key vualt"
    )


def test_an_admitted_job_keeps_the_account_it_was_admitted_for(
    cluster: SlurmCluster, pins: Pins
) -> None:
    submitted = cluster.sbatch(["--hold", "--account=vision"], pins.env(), script=SHOW_PINS)
    assert submitted.returncode == 0, submitted.describe()
    job_id = submitted.job_id
    try:
        update = cluster.run("scontrol", "update", f"JobId={job_id}", "Account=audio")
        assert update.returncode != 0
        assert "Access/permission denied" in update.stderr
        assert cluster.job(job_id)["account"] == "vision"
    finally:
        cluster.run("scancel", str(job_id))


# -- through the admission agent -------------------------------------------------------------


@pytest.fixture(scope="module")
def agent(vault: VaultServer) -> Iterator[AdmissionAgent]:
    """A real `vault admission-agent` beside slurmctld, asking the module's vault."""
    with short_dir("pinvault-slurm-agent-") as base, AdmissionAgent(base, vault.address) as agent:
        yield agent
        assert "Traceback" not in agent.log(), agent.log()


def agent_conf(socket_path: Path, timeout: int = 8) -> str:
    """pinvault.conf naming an agent and no client_config: a plugin that ran the vault command
    instead of asking the agent would refuse every job as misconfigured."""
    return f"agent = {socket_path}\ntimeout = {timeout}\n"


@pytest.mark.parametrize(
    "change",
    [
        {"PINVAULT_IMAGE": "ubuntu:22.04"},
        {"PINVAULT_IMAGE": "unpinned"},
        {"PINVAULT_RUN_ID": "sha256:" + "1" * 64},
        # What JSON must escape, and what a shell would run.
        {"PINVAULT_DATASET": 'a"b\\c\td\u00e9\'};{"admitted": true}'},
        {"PINVAULT_SEED": "$(touch /tmp/pinvault-agent-injected)"},
    ],
    ids=["floating-tag", "unpinned", "wrong-run-id", "json-escapes", "shell"],
)
def test_through_the_agent_a_refusal_shows_the_vaults_reason(
    cluster: SlurmCluster,
    vault: VaultServer,
    agent: AdmissionAgent,
    pins: Pins,
    change: dict[str, str],
) -> None:
    if change.get("PINVAULT_IMAGE") == "unpinned":
        change = {"PINVAULT_IMAGE": pins.unpinned_image}
    env = pins.env(**change)
    with plugin_conf(cluster, agent_conf(agent.socket)):
        submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    vaults_word = admit(vault, env, "vision").error_line()
    assert refusal(submitted.stderr) == vaults_word.removeprefix("vault: ")
    assert "Batch job submission failed: Access/permission denied" in submitted.stderr
    assert not Path("/tmp/pinvault-agent-injected").exists()


def test_through_the_agent_a_pinned_job_runs_with_its_run_id_and_seed(
    cluster: SlurmCluster, vault: VaultServer, agent: AdmissionAgent, pins: Pins
) -> None:
    env = pins.env(PINVAULT_SEED="0xA9E47")
    with plugin_conf(cluster, agent_conf(agent.socket)):
        submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode == 0, submitted.describe()
    told = admitted_line(submitted.stderr)
    job_id = submitted.job_id
    assert cluster.wait(job_id)["job_state"] == "COMPLETED", cluster.output(job_id)
    seen = dict(line.split("=", 1) for line in cluster.output(job_id).splitlines())
    assert told == f"pinvault: admitted as run {seen['PINVAULT_RUN_ID']}; {ONE_FILE}"

    # The vault's own answer to the same pins: the same run, recorded for team vision.
    answer = admit(vault, env, "vision").ok().stdout.strip()
    assert answer == (
        f"run_id={seen['PINVAULT_RUN_ID']} seed={int('0xA9E47', 16)}\n"
        "image_blobs=0 image_external=false"
    )
    assert seen["PINVAULT_SEED"] == str(int("0xA9E47", 16))
    runs = vault.run("log", "--kind", "run", "--json").ok().json_lines()
    entry = next(e for e in runs if e["subjects"][0] == seen["PINVAULT_RUN_ID"])
    assert entry["meta"]["team"] == "vision"
    shown = cluster.run("scontrol", "show", "job", str(job_id))
    expected = f"AdminComment=pinvault run={seen['PINVAULT_RUN_ID']} seed={seen['PINVAULT_SEED']}"
    assert expected in shown.stdout, shown.stdout
    assert f"admitted run {seen['PINVAULT_RUN_ID']} for team vision" in agent.log()


def test_without_lua_socket_the_vault_command_is_asked(
    vault: VaultServer, agent: AdmissionAgent, pins: Pins, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = Path(vault.base) / "controller-without-lua-socket"
    folder.mkdir()
    files = plugin_files(folder / "client.toml", vault.address, folder / "state")
    with_command = f"agent = {agent.socket}\n" + files["pinvault.conf"]
    # slurmctld's Lua looks for C modules, lua-socket's among them, on LUA_CPATH: here nowhere.
    monkeypatch.setenv("LUA_CPATH", "/nonexistent/?.so")
    with SlurmCluster(job_submit=PLUGIN, files={"pinvault.conf": with_command}) as cluster:
        env = pins.env(PINVAULT_SEED="0x5EED")
        submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
        shown = cluster.run("scontrol", "show", "job", str(submitted.job_id)).stdout
        with plugin_conf(cluster, agent_conf(agent.socket)):
            without_command = cluster.sbatch([], pins.env(), script=SHOW_PINS)
        log = (cluster.log_dir / "slurmctld.log").read_text(errors="replace")
    run_id, seed, *_ = admit(vault, env, "vision").ok().stdout.split()
    assert f"AdminComment=pinvault {run_id.replace('_id=', '=')} {seed}" in shown, shown
    assert run_id.removeprefix("run_id=") not in agent.log()
    assert "lua-socket cannot be loaded, so admissions run the vault command" in log
    assert refusal(without_command.stderr) == (
        "admission is misconfigured on the controller: lua-socket cannot be loaded to ask the "
        "agent, and pinvault.conf sets no client_config for the vault command"
    )


@contextmanager
def fake_agent(path: Path, answer: bytes | None) -> Iterator[None]:
    """Something on the agent's socket that reads the request and then sends `answer`, or,
    with None, never answers."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    listener.settimeout(0.1)
    done = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(connection)
            connection.recv(65536)
            if answer is not None:
                connection.sendall(answer)
                connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)
        for connection in held:
            connection.close()
        listener.close()


def test_sbatch_refuses_when_the_agent_is_down(
    cluster: SlurmCluster, vault: VaultServer, pins: Pins
) -> None:
    with short_dir("pinvault-slurm-agent-down-") as base:
        own = AdmissionAgent(base, vault.address).start()
        with plugin_conf(cluster, agent_conf(own.socket)):
            assert cluster.sbatch([], pins.env(), script=SHOW_PINS).returncode == 0
            assert own.stop() == 0
            submitted = cluster.sbatch([], pins.env(), script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    assert refusal(submitted.stderr).startswith(
        f"UNAVAILABLE: the admission agent at {own.socket} cannot be reached: "
    )
    assert "Batch job submission failed: Unspecified error" in submitted.stderr


def test_sbatch_refuses_when_the_agent_does_not_answer_in_time(
    cluster: SlurmCluster, pins: Pins
) -> None:
    with (
        short_dir("pinvault-slurm-agent-mute-") as base,
        fake_agent(base / "agent.sock", None),
        plugin_conf(cluster, agent_conf(base / "agent.sock", timeout=2)),
    ):
        began = time.monotonic()
        submitted = cluster.sbatch([], pins.env(), script=SHOW_PINS)
        took = time.monotonic() - began
    assert submitted.returncode != 0, submitted.describe()
    assert refusal(submitted.stderr) == (
        f"UNAVAILABLE: no answer from the admission agent at {base / 'agent.sock'} in 2 s"
    )
    assert 2 <= took < 8, took


@pytest.mark.parametrize(
    "answer",
    [
        b"hello\n",
        b'{"admitted": true, "run_id": "sha256:abc", "seed": "1"}\n',
        b'{"admitted": true, "run_id": "sha256:' + b"a" * 64 + b'", "seed": "1", }\n',
        b'{"admitted": false}\n',
        b'{"admitted": true, "run_id": "sha256:' + b"a" * 64 + b'", "seed": "1"}',
        b'{"admitted": true, "run_id": "sha256:' + b"a" * 64 + b'", "seed": "1", '
        b'"image_blobs": 2.5}\n',
        b'{"admitted": true, "run_id": "sha256:' + b"a" * 64 + b'", "seed": "1", '
        b'"image_blobs": 07}\n',
    ],
    ids=[
        "not-json",
        "short-run-id",
        "trailing-comma",
        "no-reason",
        "no-newline",
        "fraction",
        "leading-zero",
    ],
)
def test_sbatch_refuses_an_answer_it_does_not_understand(
    cluster: SlurmCluster, pins: Pins, answer: bytes
) -> None:
    with (
        short_dir("pinvault-slurm-agent-odd-") as base,
        fake_agent(base / "agent.sock", answer),
        plugin_conf(cluster, agent_conf(base / "agent.sock")),
    ):
        submitted = cluster.sbatch([], pins.env(), script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    reason = refusal(submitted.stderr)
    where = f"the admission agent at {base / 'agent.sock'}"
    assert reason in (
        f"{where} gave an answer that was not understood: {answer.decode().strip()}",
        # An answer without its newline is not a line: the connection closed first.
        f"UNAVAILABLE: {where} closed the connection without an answer",
    ), reason


# -- what was checked of the image ------------------------------------------------------------


def ask_by(path: str, cluster: SlurmCluster, agent: AdmissionAgent) -> str:
    """pinvault.conf for asking the agent, or (the module's own) for running `vault admit`."""
    if path == "agent":
        return agent_conf(agent.socket)
    return (cluster.conf_dir / "pinvault.conf").read_text()


@pytest.mark.parametrize("path", ["agent", "command"])
def test_a_job_on_a_held_oci_image_is_told_how_many_blobs_were_checked(
    cluster: SlurmCluster,
    vault: VaultServer,
    agent: AdmissionAgent,
    images: dict[str, OciImage],
    pins: Pins,
    path: str,
) -> None:
    image = images["held"]
    # A seed of each path's own: each admits a new run.
    env = pins.env(PINVAULT_IMAGE=image.digest, PINVAULT_SEED=str(len(path)))
    with plugin_conf(cluster, ask_by(path, cluster, agent)):
        submitted = cluster.sbatch(["--account=vision", "--hold"], env, script=SHOW_PINS)
    try:
        assert submitted.returncode == 0, submitted.describe()
        shown = cluster.run("scontrol", "show", "job", str(submitted.job_id)).stdout
        recorded = re.search(r"AdminComment=pinvault run=(sha256:[0-9a-f]{64})", shown)
        assert recorded, shown
        run_id = recorded.group(1)
        assert admitted_line(submitted.stderr) == (
            f"pinvault: admitted as run {run_id}; image held: 3 blobs, each verified when stored"
        )
    finally:
        cluster.run("scancel", str(submitted.job_id))
    # `vault admit` says the same to a machine, with the same count.
    answer = admit(vault, env, "vision").ok().stdout.split()
    assert answer[2:] == ["image_blobs=3", "image_external=false"]
    if path == "agent":
        assert (
            agent.ask(
                {"image": image.digest, "dataset": pins.dataset, "seed": "5", "team": "vision"}
            )["image_blobs"]
            == "3"
        )


@pytest.mark.parametrize("path", ["agent", "command"])
def test_a_job_on_an_external_image_is_told_it_was_recorded_not_fetched(
    cluster: SlurmCluster, vault: VaultServer, agent: AdmissionAgent, pins: Pins, path: str
) -> None:
    elsewhere = sha256(f"an image only a registry holds ({path})".encode())
    vault.run("pin", "image", elsewhere, "--external").ok()
    env = pins.env(PINVAULT_IMAGE=elsewhere)
    with plugin_conf(cluster, ask_by(path, cluster, agent)):
        submitted = cluster.sbatch(["--account=vision", "--hold"], env, script=SHOW_PINS)
    try:
        assert submitted.returncode == 0, submitted.describe()
        assert admitted_line(submitted.stderr).endswith(
            "; image recorded, not fetched (external)"
        ), submitted.stderr
    finally:
        cluster.run("scancel", str(submitted.job_id))
    answer = admit(vault, env, "vision").ok().stdout.split()
    assert answer[2:] == ["image_blobs=0", "image_external=true"]


@pytest.mark.parametrize("left_out", ["config", "layer", "manifest"])
@pytest.mark.parametrize("path", ["agent", "command"])
def test_a_job_on_an_image_not_held_whole_is_refused_naming_the_missing_blob(
    cluster: SlurmCluster,
    vault: VaultServer,
    agent: AdmissionAgent,
    images: dict[str, OciImage],
    pins: Pins,
    path: str,
    left_out: str,
) -> None:
    image = images[left_out]
    env = pins.env(PINVAULT_IMAGE=image.digest)
    with plugin_conf(cluster, ask_by(path, cluster, agent)):
        submitted = cluster.sbatch(["--account=vision"], env, script=SHOW_PINS)
    assert submitted.returncode != 0, submitted.describe()
    assert refusal(submitted.stderr) == image.refusal
    assert "Batch job submission failed: Access/permission denied" in submitted.stderr


def test_an_agent_that_says_nothing_of_the_image_admits_with_the_run_alone(
    cluster: SlurmCluster, pins: Pins
) -> None:
    """An agent older than the plugin: the job is admitted, and the line names only the run."""
    run_id = "sha256:" + "a" * 64
    answer = b'{"admitted": true, "run_id": "' + run_id.encode() + b'", "seed": "1"}\n'
    with (
        short_dir("pinvault-slurm-agent-old-") as base,
        fake_agent(base / "agent.sock", answer),
        plugin_conf(cluster, agent_conf(base / "agent.sock")),
    ):
        submitted = cluster.sbatch(["--hold"], pins.env(), script=SHOW_PINS)
    try:
        assert submitted.returncode == 0, submitted.describe()
        assert submitted.stderr == f"sbatch: pinvault: admitted as run {run_id}\n"
    finally:
        cluster.run("scancel", str(submitted.job_id))


# -- the whole loop: vault run, the run library in the job, vault replay ----------------------

# A deterministic job: its outputs depend on its seed and its dataset only.
JOB = f"""#!/bin/sh
#SBATCH --account=vision
mkdir -p "run-$SLURM_JOB_ID" && cd "run-$SLURM_JOB_ID" || exit 1
exec {sys.executable} - <<'PY'
import vault.runs

with vault.runs.start() as run:
    rng = run.rng()
    weights = bytes(rng.getrandbits(8) for _ in range(50_000))
    run.checkpoint(1, {{"weights.bin": weights}})
    with run.output("result.txt") as out:
        out.write(f"seed {{run.seed}} score {{sum(weights) % 9973}}\\n".encode())
PY
"""


class Lab:
    def __init__(self, vault: VaultServer, cluster: SlurmCluster, folder: Path) -> None:
        self.vault = vault
        self.cluster = cluster
        self.state = folder / "state"
        image = folder / "image.tar"
        image.write_bytes(b"an OCI image for the deterministic job\n")
        self.image = vault.run("put", str(image)).ok().stdout.split()[0]
        vault.run("pin", "image", self.image).ok()
        data = folder / "dataset"
        data.mkdir()
        (data / "train.csv").write_text("x,y\n1,2\n3,4\n")
        self.dataset = vault.run("dataset", "add", str(data)).ok().stdout.split()[0]
        self.script = folder / "job.sbatch"
        self.script.write_text(JOB)

    def vault_command(self, *args: str) -> tuple[int, str, str]:
        """A `vault` command inside the cluster's network, where `sbatch` reaches it."""
        done = self.cluster.run(
            *VAULT_COMMAND,
            *args,
            env={
                "PINVAULT_CLIENT_SERVER": self.vault.address,
                "PINVAULT_CLIENT_STATE_FILE": str(self.state / "trust.json"),
            },
            timeout=120,
        )
        return done.returncode, done.stdout, done.stderr

    def run_job(self, seed: str) -> str:
        """`vault run` of the deterministic job for team vision; what it printed."""
        status, stdout, stderr = self.vault_command(
            "run",
            "--image",
            self.image,
            "--dataset",
            self.dataset,
            "--seed",
            seed,
            "--team",
            "vision",
            "--",
            str(self.script),
        )
        assert status == 0, stderr
        return stdout

    def finished(self, stdout: str) -> tuple[int, str]:
        """The job a `vault run|replay` launched, waited for; its id and its manifest."""
        job_id = int(re.search(r"→ launching on cluster\s+job (\d+)", stdout).group(1))  # type: ignore[union-attr]
        record = self.cluster.wait(job_id, timeout=120)
        log = self.cluster.jobs_dir / f"slurm-{job_id}.out"
        assert record["job_state"] == "COMPLETED", log.read_text(errors="replace")
        replicate = (self.cluster.jobs_dir / f"run-{job_id}" / "replicate.sh").read_text()
        lines = replicate.splitlines()
        assert lines[0].startswith("#!") and len(lines) == 2, replicate
        manifest = re.fullmatch(r'exec vault replay (sha256:[0-9a-f]{64}) "\$@"', lines[1])
        assert manifest, replicate
        return job_id, manifest.group(1)


@pytest.fixture(scope="module")
def lab(vault: VaultServer, cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return Lab(vault, cluster, tmp_path_factory.mktemp("lab"))


def test_vault_run_says_an_external_image_was_recorded_and_not_fetched(lab: Lab) -> None:
    # An image kept in a registry is pinned --external: the vault holds no bytes of it, so
    # `vault run` must not claim to have verified it.
    elsewhere = "sha256:" + hashlib.sha256(b"an image only a registry holds").hexdigest()
    lab.vault.run("pin", "image", elsewhere, "--external").ok()
    status, stdout, stderr = lab.vault_command(
        "run", "--image", elsewhere, "--dataset", lab.dataset, "--seed", "7",
        "--team", "vision", "--", str(lab.script),
    )  # fmt: skip
    assert status == 0, stderr
    assert "✓ image pinned, external: recorded, not fetched" in stdout, stdout
    assert "image pinned, proof verified" not in stdout
    assert "✓ dataset pinned, proof verified" in stdout, stdout
    lab.finished(stdout)


def test_vault_run_pins_submits_and_the_job_publishes_its_manifest(lab: Lab) -> None:
    stdout = lab.run_job("0xC0FFEE")
    for step in (
        "✓ image pinned, proof verified",
        "✓ dataset pinned, proof verified",
        "✓ pin vault entry created",
    ):
        assert step in stdout, stdout
    run_id = re.search(r"→ run id\s+(sha256:\S+)", stdout).group(1)  # type: ignore[union-attr]

    job_id, manifest_digest = lab.finished(stdout)
    with VaultClient(lab.vault.address, timeout=60) as client:
        manifest = load_run_manifest(client, manifest_digest)
        assert manifest.run_id == run_id and manifest.seed == 0xC0FFEE
        assert manifest.team == "vision"
        assert manifest.environment.variables["SLURM_JOB_ID"] == str(job_id)
        (result,) = manifest.outputs
        assert result.path == "result.txt"
        written = (lab.cluster.jobs_dir / f"run-{job_id}" / "result.txt").read_bytes()
        assert written.startswith(b"seed 12648430 score ")
        kinds = sorted(p.entry.kind for p in client.lookup(run_id))
        assert kinds == ["artefact", "checkpoint", "run", "run"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the `vault` that `uv tool install` of this checkout puts on a PATH."""
    return install_vault(tmp_path_factory.mktemp("installed"))


def test_a_reviewer_replays_through_replicate_sh_with_only_the_installed_vault(
    lab: Lab, installed: Path
) -> None:
    job_id, original = lab.finished(lab.run_job("11"))
    replicate = lab.cluster.jobs_dir / f"run-{job_id}" / "replicate.sh"
    # A reviewer's shell outside the checkout: the installed `vault` and the system's programs.
    env = {
        "PATH": f"{installed}:/usr/local/bin:/usr/bin:/bin",
        "PINVAULT_CLIENT_SERVER": lab.vault.address,
        "PINVAULT_CLIENT_STATE_FILE": str(lab.state / "reviewer.json"),
    }
    found = lab.cluster.run("sh", "-c", "command -v vault", env=env)
    assert found.stdout.strip() == str(installed / "vault"), found.stderr

    done = lab.cluster.run(str(replicate), "--team", "vision", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "✓ run manifest published" in done.stdout
    _, replayed = lab.finished(done.stdout)
    with VaultClient(lab.vault.address, timeout=60) as client:
        first = load_run_manifest(client, original)
        again = load_run_manifest(client, replayed)
    assert replayed != original
    assert again.run_id == first.run_id and again.outputs == first.outputs


def test_a_replay_makes_the_same_outputs_and_quotas_hold(lab: Lab) -> None:
    stdout = lab.run_job("7")
    _, original = lab.finished(stdout)

    # replicate.sh's one line, as a reviewer runs it: the script comes from the manifest.
    status, stdout, stderr = lab.vault_command("replay", original, "--team", "vision")
    assert status == 0, stderr
    assert "✓ run manifest published" in stdout
    _, replayed = lab.finished(stdout)
    with VaultClient(lab.vault.address, timeout=60) as client:
        first = load_run_manifest(client, original)
        again = load_run_manifest(client, replayed)
    assert again.run_id == first.run_id and again.seed == 7
    assert again.outputs == first.outputs
    assert [c.manifest for c in again.checkpoints] == [c.manifest for c in first.checkpoints]
    assert replayed != original  # its own manifest: where and when it ran differ

    # Two held replays fill the team's slots; a third is refused with the reason. With --json
    # each prints one object and none of the steps.
    held = []
    for _ in range(2):
        status, stdout, stderr = lab.vault_command(
            "replay", original, "--team", "vision", "--json", "--", "--hold"
        )
        assert status == 0, stderr
        record = json.loads(stdout)
        assert (record["run_id"], record["replay_of"], record["sealed_by"]) == (
            first.run_id,
            original,
            "vision",
        )
        assert record["script"] == first.environment.variables["PINVAULT_SCRIPT"]
        held.append(record["job"])
    # The same inputs submitted again are the same run, found, not a new one.
    status, stdout, stderr = lab.vault_command(
        "run", "--image", lab.image, "--dataset", lab.dataset, "--seed", "7",
        "--team", "vision", "--json", "--", "--hold", str(lab.script),
    )  # fmt: skip
    assert status == 0, stderr
    record = json.loads(stdout)
    held.append(record["job"])
    assert (record["run_id"], record["new"], record["seed"]) == (first.run_id, False, "7")
    assert record["pins"]["image"] == {
        "digest": lab.image,
        "entry": record["pins"]["image"]["entry"],
        "proof_verified": True,
        "external": False,
    }
    assert record["pins"]["dataset"]["digest"] == lab.dataset
    try:
        status, stdout, stderr = lab.vault_command(
            "replay", original, "--team", "vision", "--", "--hold"
        )
        # EX_TEMPFAIL: no quota now, retry later.
        assert status == 75, stdout
        assert stderr.strip().splitlines()[-1] == (
            "vault: RESOURCE_EXHAUSTED: team 'vision' already runs 2 replays (at most 2 at "
            "once): wait for one to finish"
        )
    finally:
        lab.cluster.run("scancel", *held)


# -- job arrays: each task resumes only its own work --------------------------------------------

# Each task reports the checkpoint it resumed from, then commits one of its own at a step of
# its own number: task 2's step is higher, so a `latest()` that crossed tasks would find it.
ARRAY_JOB = f"""#!/bin/sh
#SBATCH --account=vision
#SBATCH --array=1-2
folder="array-$SLURM_ARRAY_JOB_ID-$SLURM_ARRAY_TASK_ID"
mkdir -p "$folder" && cd "$folder" || exit 1
exec {sys.executable} - <<'PY'
import os
import vault.runs

task = os.environ["SLURM_ARRAY_TASK_ID"]
with vault.runs.start() as run:
    resume = run.latest()
    seen = "none"
    if resume is not None:
        seen = resume.restore("ckpt")["owner.txt"].read_text()
    run.checkpoint(int(task), {{"owner.txt": f"task {{task}}".encode()}})
    with run.output("resumed.txt") as out:
        out.write(seen.encode())
PY
"""


def wait_for_array(cluster: SlurmCluster, array_id: int, tasks: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 120
    while True:
        done = cluster.run("squeue", "--json", "--states=all")
        assert done.returncode == 0, done.stderr
        records = [
            job
            for job in json.loads(done.stdout)["jobs"]
            if job.get("array_job_id") == array_id and job.get("array_task_id") is not None
        ]
        # A task still COMPLETING has not finished: its state is not yet its last.
        finished = [r for r in records if r["job_state"] in FINISHED_STATES]
        if len(finished) == tasks:
            return finished
        assert time.monotonic() < deadline, records
        time.sleep(0.2)


def test_tasks_of_a_job_array_never_resume_from_each_other(lab: Lab) -> None:
    script = lab.script.with_name("array.sbatch")
    script.write_text(ARRAY_JOB)
    arguments = ["--image", lab.image, "--dataset", lab.dataset, "--seed", "0xA77A"]
    run_ids = []
    resumed: dict[tuple[int, int], str] = {}
    for submission in range(2):
        status, stdout, stderr = lab.vault_command(
            "run", *arguments, "--team", "vision", "--", str(script)
        )
        assert status == 0, stderr
        run_ids.append(re.search(r"→ run id\s+(sha256:\S+)", stdout).group(1))  # type: ignore[union-attr]
        array_id = int(re.search(r"job (\d+)", stdout).group(1))  # type: ignore[union-attr]
        for record in wait_for_array(lab.cluster, array_id, 2):
            task = int(record["array_task_id"])  # type: ignore[call-overload]
            log = lab.cluster.jobs_dir / f"slurm-{array_id}_{task}.out"
            assert record["job_state"] == "COMPLETED", log.read_text(errors="replace")
            folder = lab.cluster.jobs_dir / f"array-{array_id}-{task}"
            resumed[submission, task] = (folder / "resumed.txt").read_text()

    # The same inputs of the same team are one run, across both arrays and their tasks...
    assert run_ids[0] == run_ids[1]
    # ...but a task resumes only from its own checkpoint, never from the other task's.
    assert resumed[0, 1] == "none" and resumed[0, 2] == "none"
    assert resumed[1, 1] == "task 1" and resumed[1, 2] == "task 2"

    # Each task's entries say which task wrote them.
    with VaultClient(lab.vault.address, timeout=60) as client:
        steps = {
            (p.entry.meta.get("task"), p.entry.meta["step"])
            for p in client.lookup(run_ids[0])
            if p.entry.kind == "checkpoint"
        }
    assert steps == {("1", "1"), ("2", "2")}
