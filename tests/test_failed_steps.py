"""A command that fails appends nothing. `vault pin` refuses a vault whose key it does not trust
before it asks for the pin; `vault run` asks everything that can refuse the job (the pins, then
sbatch itself with `--test-only`) before admission appends the run, and a run whose job sbatch
refuses after that is recorded as not submitted, so that its admission does not read as a run
that ran. Against a real `vault serve`, and a real `sbatch` in a real one-node Slurm with and
without the pinvault plugin (tests/services/slurm.py)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.slurm import SlurmCluster
from tests.services.vault_server import VAULT_COMMAND, VaultRun, VaultServer
from tests.test_slurm import PLUGIN, plugin_files, short_dir
from vault.ledger.checkpoint import SigningKey, Verifier

ORIGIN = "failed-steps.test/ledger"
# A job that does nothing, on the cluster's one partition.
JOB = "#!/bin/sh\ntrue\n"
_seeds = itertools.count(1000)


def ledger_size(vault: VaultServer) -> int:
    return len(vault.run("log", "--json").ok().json_lines())


# -- vault pin --------------------------------------------------------------------------------


def test_pin_appends_nothing_when_the_vault_key_is_not_the_one_trusted(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(env={"PINVAULT_LEDGER_ORIGIN": ORIGIN})
    with server.client() as client:
        blob = str(client.put(b"a dataset manifest").blob.sha256)
    real = str(server.signing_key().verifier())
    other = str(SigningKey.generate(ORIGIN).verifier())
    size = ledger_size(server)

    # A key configured on first contact that is not the vault's.
    first_use = tmp_path / "first-use"
    line = server.run(
        "pin", "dataset", blob, env={"PINVAULT_CLIENT_VERIFIER_KEY": other}, state_home=first_use
    ).error_line()
    assert line == f"vault: the vault's checkpoint key is {real}, not the configured {other}"
    assert ledger_size(server) == size

    # A client that trusts the vault's key, configured with another.
    pinned = tmp_path / "pinned"
    server.run("pin", "dataset", blob, state_home=pinned).ok()
    size += 1
    line = server.run(
        "pin", "dataset", blob, env={"PINVAULT_CLIENT_VERIFIER_KEY": other}, state_home=pinned
    ).error_line()
    assert f"the client state trusts key {real}, not the configured {other}" in line
    assert ledger_size(server) == size

    # The vault comes back signing with a new key: the client that trusts the old one refuses
    # it, and the pin it asked for is not in the ledger.
    server.stop()
    server.key_path.unlink()
    server.restart()
    assert str(server.signing_key().verifier()) != real
    line = server.run("pin", "dataset", blob, state_home=pinned).error_line()
    assert f"checkpoint is not signed by key {Verifier.from_string(real).label}" in line
    assert ledger_size(server) == size


# -- vault run --------------------------------------------------------------------------------


class Submitter:
    """Pins stored in the module's vault, and `vault run` of a job on them inside a cluster's
    network (where its sbatch reaches the controller), as a user on a submit host runs it."""

    def __init__(self, vault: VaultServer, folder: Path) -> None:
        self.vault = vault
        self.folder = folder
        image = folder / "image.tar"
        image.write_bytes(b"an OCI image for jobs that fail to start\n")
        self.image = vault.run("put", str(image)).ok().stdout.split()[0]
        vault.run("pin", "image", self.image).ok()
        data = folder / "dataset"
        data.mkdir()
        (data / "train.csv").write_text("x,y\n1,2\n")
        self.dataset = vault.run("dataset", "add", str(data)).ok().stdout.split()[0]
        self.script = folder / "job.sbatch"
        self.script.write_text(JOB)

    def run(self, cluster: SlurmCluster, *sbatch_args: str, seed: int, **options: str) -> VaultRun:
        args = ["run", "--image", self.image, "--dataset", self.dataset, "--seed", str(seed)]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", value]
        args += ["--team", "vision", "--", "--account=vision", *sbatch_args, str(self.script)]
        done = cluster.run(
            *VAULT_COMMAND,
            *args,
            env={
                "PINVAULT_CLIENT_SERVER": self.vault.address,
                "PINVAULT_CLIENT_STATE_FILE": str(self.folder / "trust.json"),
            },
            timeout=120,
        )
        return VaultRun(tuple(args), done.returncode, done.stdout.encode(), done.stderr)


@pytest.fixture(scope="module")
def vault(clean_environment: None) -> Iterator[VaultServer]:
    """On a Unix socket, which reaches into the clusters' network namespaces."""
    with (
        short_dir("pinvault-failed-") as base,
        VaultServer(base, listen=f"unix:{base}/vault.sock") as server,
    ):
        yield server


@pytest.fixture(scope="module")
def submitter(vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Submitter:
    return Submitter(vault, tmp_path_factory.mktemp("submitter"))


@pytest.fixture(scope="module")
def plain(vault: VaultServer) -> Iterator[SlurmCluster]:
    """Slurm as it comes: sbatch --test-only checks the whole job."""
    with SlurmCluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def guarded(vault: VaultServer) -> Iterator[SlurmCluster]:
    """Slurm with the pinvault plugin, which admits every job before Slurm checks the rest."""
    folder = Path(vault.base) / "guarded"
    folder.mkdir()
    files = plugin_files(folder / "client.toml", vault.address, folder / "state")
    with SlurmCluster(job_submit=PLUGIN, files=files) as cluster:
        yield cluster


def run_entries(vault: VaultServer, run_id: str) -> list[dict[str, str]]:
    """The `run` entries naming a run, as `vault lookup` shows them (with proofs)."""
    found = vault.run("lookup", run_id, "--json").ok().json()
    return [entry["meta"] for entry in found if entry["kind"] == "run"]


def test_vault_run_off_a_submit_host_appends_nothing(
    vault: VaultServer, submitter: Submitter, tmp_path: Path
) -> None:
    config = tmp_path / "train.toml"
    config.write_text("lr = 0.1\n")
    size = ledger_size(vault)
    args = ["--image", submitter.image, "--dataset", submitter.dataset, "--seed", "1"]
    shown = vault.run(
        "run",
        *args,
        "--config",
        str(config),
        "--",
        str(submitter.script),
        env={"PATH": str(tmp_path)},
    )
    assert (
        shown.error_line()
        == "vault: UNAVAILABLE: sbatch is not on PATH: is this a Slurm submit host?"
    )
    assert shown.stdout == ""
    assert ledger_size(vault) == size


@pytest.mark.parametrize("where", ["plain", "guarded"])
def test_an_option_sbatch_refuses_appends_nothing(
    where: str, submitter: Submitter, request: pytest.FixtureRequest
) -> None:
    cluster: SlurmCluster = request.getfixturevalue(where)
    size = ledger_size(submitter.vault)
    shown = submitter.run(cluster, "--bogus", seed=next(_seeds))
    line = shown.error_line()
    assert line.startswith("vault: FAILED_PRECONDITION: sbatch refused the job: "), line
    assert line.endswith(
        """sbatch: unrecognized option '--bogus' Try "sbatch --help" for more information"""
    )
    assert "pin vault entry" not in shown.stdout
    assert ledger_size(submitter.vault) == size


def test_a_job_slurm_refuses_appends_nothing_and_a_good_one_runs(
    plain: SlurmCluster, submitter: Submitter, tmp_path: Path
) -> None:
    config = tmp_path / "train.toml"
    config.write_text("lr = 0.2\n")
    seed = next(_seeds)
    size = ledger_size(submitter.vault)
    shown = submitter.run(plain, "--partition=nope", seed=seed, config=str(config))
    assert shown.error_line() == (
        "vault: FAILED_PRECONDITION: sbatch refused the job: sbatch: error: invalid partition "
        "specified: nope allocation failure: Invalid partition name specified"
    )
    assert "pin vault entry" not in shown.stdout and "config pinned" not in shown.stdout
    assert ledger_size(submitter.vault) == size

    # Checking first costs a job that sbatch takes nothing: it is admitted and runs.
    shown = submitter.run(plain, "--partition=debug", seed=seed, config=str(config)).ok()
    assert "✓ pin vault entry created" in shown.stdout
    job = re.search(r"→ launching on cluster\s+job (\d+)", shown.stdout)
    assert job is not None, shown.stdout
    assert plain.wait(int(job.group(1)))["job_state"] == "COMPLETED"
    # The config's pin and the run's admission.
    assert ledger_size(submitter.vault) == size + 2


def test_a_job_refused_after_admission_is_recorded_as_not_submitted(
    guarded: SlurmCluster, submitter: Submitter
) -> None:
    # The plugin admits a job before Slurm checks its partition, so only the submission itself
    # can find that out, after `vault run` admitted the run.
    seed = next(_seeds)
    size = ledger_size(submitter.vault)
    shown = submitter.run(guarded, "--partition=nope", seed=seed)
    assert "✓ pin vault entry created" in shown.stdout
    line = shown.error_line()
    found = re.fullmatch(
        r"vault: FAILED_PRECONDITION: sbatch refused the job: (sbatch: error: invalid partition "
        r"specified: nope .*); run (sha256:[0-9a-f]{64}) is recorded as not submitted "
        r"\(entry (\d+)\)",
        line,
    )
    assert found is not None, line
    reason, run_id, index = found.groups()
    assert int(index) == size + 1 and ledger_size(submitter.vault) == size + 2
    admitted, not_submitted = run_entries(submitter.vault, run_id)
    assert admitted["stage"] == "admitted"
    assert not_submitted == {
        "stage": "not-submitted",
        "reason": f"sbatch refused the job: {reason}",
        "team": "vision",
    }

    # The same inputs submitted again are the same run, which now starts; nothing more is
    # appended for it (the plugin admits it again by its run id).
    shown = submitter.run(guarded, "--partition=debug", seed=seed).ok()
    assert "✓ pin vault entry found (same experiment)" in shown.stdout
    assert re.search(rf"→ run id\s+{run_id}$", shown.stdout, re.MULTILINE), shown.stdout
    job = re.search(r"→ launching on cluster\s+job (\d+)", shown.stdout)
    assert job is not None, shown.stdout
    assert guarded.wait(int(job.group(1)))["job_state"] == "COMPLETED"
    assert ledger_size(submitter.vault) == size + 2


def test_a_rerun_that_sbatch_refuses_appends_nothing(
    guarded: SlurmCluster, submitter: Submitter
) -> None:
    # A run admitted before: its admission appends nothing, so neither does the failure.
    seed = next(_seeds)
    submitter.run(guarded, seed=seed).ok()
    size = ledger_size(submitter.vault)
    shown = submitter.run(guarded, "--partition=nope", seed=seed)
    assert "✓ pin vault entry found (same experiment)" in shown.stdout
    assert shown.error_line().startswith(
        "vault: FAILED_PRECONDITION: sbatch refused the job: sbatch: error: invalid partition"
    )
    assert "recorded" not in shown.stderr
    assert ledger_size(submitter.vault) == size
