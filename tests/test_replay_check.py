"""`vault replay --check` (and `./replicate.sh --check`) as a reviewer without Slurm runs it,
against a real `vault serve`: a sealed run's manifest, inputs document, inputs, outputs and
checkpoints are each verified, what a replay would submit is printed, nothing is submitted or
appended; a damaged output, an unknown run and a missing batch script are refused in one line
with the exit status of their kind."""

from __future__ import annotations

import hashlib
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services.vault_server import VAULT_COMMAND, VaultServer, command_env
from vault.config import ENV_SCRIPT
from vault.runs import start
from vault.runs.dataset import add_dataset

SCRIPT = b"#!/bin/sh\n#SBATCH --time=5\npython train.py\n"
INTEGRITY, NOT_FOUND, PRECONDITION = 65, 66, 78


@dataclass(frozen=True)
class Sealed:
    manifest: str
    run_id: str
    output: str
    replicate: Path


def seal_a_run(server: VaultServer, folder: Path, *, script: bool = True) -> Sealed:
    """A run admitted, trained (an output and a checkpoint) and sealed by the run library, as a
    job would do it."""
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.csv").write_bytes(b"x,y\n1,2\n")
    with server.client() as client:
        image = str(client.put(b"an image for replay checks").blob.sha256)
        client.pin("image", image)
        dataset = add_dataset(client, folder / "data", name="replay-check").digest
        admission = client.admit(image=image, dataset=dataset, seed=random.getrandbits(64))
        env = {
            "PINVAULT_RUN_ID": admission.run_id,
            "PINVAULT_SEED": str(admission.seed),
            "PINVAULT_IMAGE": image,
            "PINVAULT_DATASET": dataset,
            "PINVAULT_CLIENT_SERVER": server.address,
            "PINVAULT_CLIENT_STATE_FILE": str(folder / "trust.json"),
        }
        if script:
            env[ENV_SCRIPT] = str(client.put(SCRIPT).blob.sha256)
        with start(environ=env, output_dir=folder / "out") as run:
            with run.output("model.bin") as out:
                out.write(b"weights " * 1000)
            run.checkpoint(1, {"state.bin": b"step one"})
            output = run.outputs()[0].sha256
        manifest = run.finish()
    return Sealed(manifest, admission.run_id, output, folder / "out" / "replicate.sh")


@pytest.fixture(scope="module")
def sealed(vault_server: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Sealed:
    return seal_a_run(vault_server, tmp_path_factory.mktemp("run"))


def ledger_size(server: VaultServer) -> int:
    with server.client() as client:
        return client.checkpoint().size


def test_a_reviewer_without_slurm_checks_a_run_and_sees_what_would_be_submitted(
    vault_server: VaultServer, sealed: Sealed, tmp_path: Path
) -> None:
    before = ledger_size(vault_server)
    # No sbatch anywhere on PATH: the check needs none.
    run = vault_server.run("replay", "--check", sealed.manifest, env={"PATH": "/usr/bin:/bin"})
    out = run.ok().stdout
    for step in (
        "✓ run manifest",
        "✓ inputs document",
        "✓ image",
        "✓ dataset",
        "✓ output model.bin",
        "✓ checkpoint 1",
        "✓ batch script",
    ):
        assert step in out, out
    assert "1 files, 8 bytes" in out, out
    assert "→ would submit                      sbatch --parsable replay.sbatch" in out, out
    assert f"PINVAULT_REPLAY_OF={sealed.manifest}" in out
    assert "python train.py" in out and "nothing was submitted" in out
    # Nothing appended: no admission, no replay slot, no pin.
    assert ledger_size(vault_server) == before

    # By run id too, and as one JSON object.
    run = vault_server.run("replay", "--check", sealed.run_id, "--json").ok()
    found = run.json()
    assert found["submitted"] is False and found["manifest"] == sealed.manifest
    assert found["sbatch"] == ["sbatch", "--parsable", "replay.sbatch"]
    assert {c["what"] for c in found["checked"]} >= {"output model.bin", "checkpoint 1", "image"}
    assert found["script_text"] == SCRIPT.decode()


def test_replicate_sh_checks_with_only_the_installed_vault(
    vault_server: VaultServer, sealed: Sealed
) -> None:
    # A reviewer's shell: the installed `vault` and the system's programs, no sbatch.
    bin_dir = Path(VAULT_COMMAND[0]).parent
    assert (bin_dir / "vault").exists()
    env = command_env(
        state_home=vault_server.state_home,
        extra={"PINVAULT_CLIENT_SERVER": vault_server.address, "PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    done = subprocess.run(
        [str(sealed.replicate), "--check"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "✓ output model.bin" in done.stdout and "would submit" in done.stdout


def test_a_script_given_after_the_separator_is_shown_not_stored(
    vault_server: VaultServer, sealed: Sealed, tmp_path: Path
) -> None:
    mine = tmp_path / "mine.sbatch"
    mine.write_bytes(b"#!/bin/sh\necho a script of my own\n")
    run = vault_server.run("replay", "--check", sealed.manifest, "--", "--hold", str(mine)).ok()
    assert f"sbatch --parsable --hold {mine}" in run.stdout
    assert "echo a script of my own" in run.stdout
    with vault_server.client() as client:
        digest = "sha256:" + hashlib.sha256(mine.read_bytes()).hexdigest()
        assert client.find_missing([digest]) == [digest]


def test_a_damaged_output_is_refused_naming_it(vault_server: VaultServer, tmp_path: Path) -> None:
    damaged = seal_a_run(vault_server, tmp_path)
    stored = vault_server.blob_path(damaged.output)
    data = bytearray(stored.read_bytes())
    data[10] ^= 0x01
    stored.write_bytes(data)
    run = vault_server.run("replay", "--check", damaged.manifest)
    assert run.returncode == INTEGRITY, run.describe()
    assert "output model.bin" in run.error_line(alone=False), run.describe()
    assert "would submit" not in run.stdout


def test_an_unknown_run_and_a_run_without_a_script_are_refused(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    run = vault_server.run("replay", "--check", "sha256:" + "ab" * 32)
    assert run.returncode == NOT_FOUND, run.describe()
    assert "unknown run" in run.error_line()
    unscripted = seal_a_run(vault_server, tmp_path, script=False)
    run = vault_server.run("replay", "--check", unscripted.manifest)
    assert run.returncode == PRECONDITION, run.describe()
    assert "records no batch script" in run.error_line(alone=False)
