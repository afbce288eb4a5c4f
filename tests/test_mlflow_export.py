"""`vault run export RUN --mlflow URI`, against a real `vault serve` and a real MLflow tracking
server on a SQLite backend: a sealed run becomes one finished MLflow run with its inputs as
params, its metrics, tags that tie it to the vault and its outputs listed by digest (their bytes
stay in the vault); exporting it again writes nothing, and an export cut short is replaced. An
unsealed run, a manifest another team sealed, forged manifests, an unreachable server and a
missing MLflow client are refused with one line, and nothing is written in MLflow."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.services.mlflow_tracking import QUIET_MLFLOW, MlflowServer
from tests.services.vault_server import VaultServer, run_vault
from vault.client import Admission, VaultClient
from vault.ledger.entry import Entry
from vault.runs import RunManifest, start
from vault.runs.dataset import add_dataset
from vault.runs.manifest import Environment, FileRecord

SCRIPT = b"#!/bin/sh\npython train.py\n"
METRICS = b'{"accuracy": 0.97, "loss": [0.9, 0.5, 0.25]}\n'


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def millis(entry: Entry) -> int:
    return int(datetime.fromisoformat(entry.time).timestamp() * 1000)


@pytest.fixture(scope="module")
def mlflow_server(clean_environment: None) -> Iterator[MlflowServer]:
    with MlflowServer() as server:
        yield server


@pytest.fixture(scope="module")
def tracking(mlflow_server: MlflowServer) -> Iterator[Any]:
    """MLflow's own client of the tracking server, to read back what the command wrote."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in QUIET_MLFLOW.items():
            patch.setenv(name, value)
        from mlflow.tracking import MlflowClient

        yield MlflowClient(tracking_uri=mlflow_server.url)


@pytest.fixture(scope="module")
def pins(vault_server: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An image, a dataset and a config, stored and pinned, and a batch script, stored."""
    folder = tmp_path_factory.mktemp("dataset")
    (folder / "train.csv").write_bytes(b"x,y\n1,2\n3,4\n")
    with vault_server.client() as client:
        image = str(client.put(b"an image for the MLflow export tests").blob.sha256)
        client.pin("image", image, meta={"name": "trainer"})
        config = str(client.put(b"lr = 0.1\n").blob.sha256)
        client.pin("config", config, meta={"name": "train.toml"})
        return {
            "image": image,
            "dataset": add_dataset(client, folder, name="tiny").digest,
            "config": config,
            "script": str(client.put(SCRIPT).blob.sha256),
        }


@pytest.fixture
def client(vault_server: VaultServer) -> Iterator[VaultClient]:
    with vault_server.client() as c:
        yield c


def admit(client: VaultClient, pins: dict[str, str], team: str, **options: Any) -> Admission:
    seed = int.from_bytes(os.urandom(6))
    return client.admit(
        image=pins["image"], dataset=pins["dataset"], seed=seed, team=team, **options
    )


def seal(
    client: VaultClient,
    admission: Admission,
    folder: Path,
    outputs: dict[str, bytes],
    **env: str,
) -> str:
    """Run a job of the admitted run that writes `outputs`; the digest of its run manifest."""
    environ = {
        "PINVAULT_RUN_ID": admission.run_id,
        "PINVAULT_SEED": str(admission.seed),
        "PINVAULT_IMAGE": admission.inputs.image,
        "PINVAULT_DATASET": admission.inputs.dataset,
        "PINVAULT_CONFIG_DIGEST": admission.inputs.config,
        **env,
    }
    environ = {name: value for name, value in environ.items() if value}
    with start(client, environ=environ, output_dir=folder) as run:
        for path, data in outputs.items():
            with run.output(path) as f:
                f.write(data)
        run.checkpoint(2, {"model.bin": outputs.get("model.bin", b"weights")})
    return run.finish()


def export(vault_server: VaultServer, *args: str, env: dict[str, str] | None = None) -> Any:
    return vault_server.run("run", "export", *args, env=env)


def run_entries(client: VaultClient, run_id: str, manifest: str) -> tuple[Entry, Entry]:
    """The run's admission entry and its manifest's pin."""
    entries = [p.entry for p in client.lookup(run_id) if p.entry.kind == "run"]
    admitted = next(e for e in entries if e.meta.get("stage") == "admitted")
    sealed = next(e for e in entries if e.subjects[0] == manifest)
    return admitted, sealed


def all_runs(tracking: Any) -> list[Any]:
    """Every run the tracking server keeps, deleted ones included."""
    from mlflow.entities import ViewType

    ids = [e.experiment_id for e in tracking.search_experiments(view_type=ViewType.ALL)]
    return list(tracking.search_runs(ids, run_view_type=ViewType.ALL)) if ids else []


# ---------------------------------------------------------------------- exports


def test_a_sealed_run_becomes_one_mlflow_run_with_its_pins_metrics_and_outputs_by_digest(
    vault_server: VaultServer,
    mlflow_server: MlflowServer,
    tracking: Any,
    pins: dict[str, str],
    client: VaultClient,
    tmp_path: Path,
) -> None:
    admission = admit(client, pins, "vision", config=pins["config"])
    model = os.urandom(64 * 1024)
    with vault_server.client(author="ada@node7") as ada:
        manifest = seal(
            ada,
            admission,
            tmp_path / "out",
            {"metrics.json": METRICS, "model.bin": model},
            PINVAULT_SCRIPT=pins["script"],
            SLURM_JOB_ID="7781",
        )
    run_id = admission.run_id

    done = export(vault_server, run_id, "--mlflow", mlflow_server.url, "--json").ok()
    assert done.stderr == ""  # nothing of MLflow's own chatter
    shown = done.json()
    assert shown["created"] is True and shown["replaced"] == []
    assert (shown["run"], shown["manifest"], shown["team"]) == (run_id, manifest, "vision")
    assert shown["metric_values"] == 4 and shown["outputs"] == 2
    assert shown["metrics_skipped"] == ""
    mlflow_run_id = shown["mlflow"]["run_id"]
    assert shown["mlflow"]["experiment"] == "vision"
    assert shown["mlflow"]["url"] == (
        f"{mlflow_server.url}/#/experiments/{shown['mlflow']['experiment_id']}/runs/{mlflow_run_id}"
    )

    # What the lab sees in MLflow, read back with MLflow's own client.
    run = tracking.get_run(mlflow_run_id)
    assert tracking.get_experiment(run.info.experiment_id).name == "vision"
    assert run.info.run_name == run_id and run.info.status == "FINISHED"
    assert run.data.params == {
        "seed": str(admission.seed),
        "image": pins["image"],
        "dataset": pins["dataset"],
        "config": pins["config"],
        "batch_script": pins["script"],
    }
    assert shown["params"] == run.data.params
    tags = run.data.tags
    assert tags["pinvault.run_id"] == run_id
    assert tags["pinvault.manifest"] == manifest
    assert tags["pinvault.vault"] == vault_server.address
    assert tags["pinvault.team"] == "vision"
    assert tags["pinvault.replay"] == f"vault replay {manifest}"
    assert tags["pinvault.env.SLURM_JOB_ID"] == "7781"
    assert tags["pinvault.env.host"] == os.uname().nodename
    assert tags["mlflow.user"] == "ada@node7"
    assert manifest in tags["mlflow.note.content"]
    admitted, sealed = run_entries(client, run_id, manifest)
    assert (run.info.start_time, run.info.end_time) == (millis(admitted), millis(sealed))

    loss = tracking.get_metric_history(mlflow_run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(0, 0.9), (1, 0.5), (2, 0.25)]
    assert run.data.metrics == {"loss": 0.25, "accuracy": 0.97}

    # The outputs are listed by digest; their bytes are not copied into MLflow.
    listed = [a.path for a in tracking.list_artifacts(mlflow_run_id, "pinvault")]
    assert listed == ["pinvault/outputs.json", "pinvault/run-manifest.json"]
    folder = Path(tracking.download_artifacts(mlflow_run_id, "pinvault", str(tmp_path)))
    listing = json.loads((folder / "outputs.json").read_text())
    assert listing["run"] == run_id and listing["manifest"] == manifest
    assert listing["vault"] == vault_server.address
    assert listing["outputs"] == [
        {
            "path": "metrics.json",
            "size": len(METRICS),
            "sha256": sha256(METRICS),
            "uri": f"vault://{sha256(METRICS)}",
        },
        {
            "path": "model.bin",
            "size": len(model),
            "sha256": sha256(model),
            "uri": f"vault://{sha256(model)}",
        },
    ]
    (checkpoint,) = listing["checkpoints"]
    assert checkpoint["step"] == 2 and checkpoint["uri"] == f"vault://{checkpoint['manifest']}"
    assert sha256((folder / "run-manifest.json").read_bytes()) == manifest
    stored = [p for p in mlflow_server.artifacts.rglob("*") if p.is_file()]
    assert sorted(p.name for p in stored if mlflow_run_id in p.parts) == [
        "outputs.json",
        "run-manifest.json",
    ]
    assert not any(model in p.read_bytes() for p in stored)

    # Again, by the manifest's digest: found by its tag, nothing written.
    before = len(all_runs(tracking))
    again = export(vault_server, manifest, "--mlflow", mlflow_server.url).ok()
    lines = again.stdout.splitlines()
    assert lines[1].startswith("= already in MLflow")
    assert f"run {mlflow_run_id}  experiment vision  (exported before: nothing written)" in lines[1]
    assert lines[-1].split()[-1] == shown["mlflow"]["url"]
    assert len(all_runs(tracking)) == before
    assert tracking.get_run(mlflow_run_id).info.status == "FINISHED"


def test_an_export_cut_short_is_replaced_and_bad_metrics_are_left_out_saying_why(
    vault_server: VaultServer,
    mlflow_server: MlflowServer,
    tracking: Any,
    pins: dict[str, str],
    client: VaultClient,
    tmp_path: Path,
) -> None:
    admission = admit(client, pins, "nlp")
    manifest = seal(client, admission, tmp_path, {"metrics.json": b'{"loss": "low"}'})
    # What a killed export leaves: a run tagged with the manifest, never finished.
    experiment = tracking.create_experiment("nlp-pinned")
    left = tracking.create_run(experiment, tags={"pinvault.manifest": manifest}).info.run_id

    shown = export(
        vault_server, admission.run_id, "--mlflow", mlflow_server.url, "--experiment", "nlp-pinned"
    ).ok()
    lines = shown.stdout.splitlines()
    assert lines[1].split() == ["✓", "unfinished", "export", "deleted", "run", left]
    assert lines[2].startswith("✓ exported to MLflow")
    assert " ".join(lines[3].split()) == (
        "params 3 metrics 0 outputs 1 by digest in pinvault/outputs.json"
    )
    assert lines[4].split(maxsplit=4)[1:] == [
        "metrics",
        "not",
        "exported",
        "metrics.json: 'loss' is not a number or a list of numbers",
    ]
    (run,) = tracking.search_runs([experiment])
    assert run.info.run_id != left and run.info.status == "FINISHED"
    assert run.data.metrics == {} and run.data.params == {
        "seed": str(admission.seed),
        "image": pins["image"],
        "dataset": pins["dataset"],
    }
    assert tracking.get_run(left).info.lifecycle_stage == "deleted"
    assert tracking.get_experiment_by_name("nlp") is None


# ---------------------------------------------------------------------- refusals


def forged_manifest(admission: Admission, outputs: list[FileRecord]) -> RunManifest:
    return RunManifest.checked(
        inputs=admission.inputs,
        team="vision",
        environment=Environment("node1", "3.11.7", "Linux", {}),
        outputs=outputs,
        checkpoints=[],
    )


def test_refusals_name_the_problem_and_write_nothing_in_mlflow(
    vault_server: VaultServer,
    mlflow_server: MlflowServer,
    tracking: Any,
    pins: dict[str, str],
    client: VaultClient,
    tmp_path: Path,
) -> None:
    url = mlflow_server.url
    before = len(all_runs(tracking))

    def refused(*args: str, env: dict[str, str] | None = None) -> str:
        return str(export(vault_server, *args, env=env).error_line())

    # A run whose job has not finished.
    unsealed = admit(client, pins, "vision")
    assert refused(unsealed.run_id, "--mlflow", url) == (
        f"vault: FAILED_PRECONDITION: run {unsealed.run_id} is not sealed: team vision has "
        "published no run manifest for it (a run is sealed when its job finishes)"
    )
    # Digests that are no run.
    nothing = sha256(os.urandom(16))
    assert refused(nothing, "--mlflow", url) == (
        f"vault: NOT_FOUND: unknown run {nothing}: the vault holds no run with this id and no "
        "run manifest with this digest"
    )
    assert refused(pins["image"], "--mlflow", url) == (
        f"vault: NOT_FOUND: {pins['image']} is not a run id or a published run manifest: the "
        "vault pins it as image"
    )

    # Team speech replays vision's run and seals its replay: that manifest is not vision's.
    admission = admit(client, pins, "vision")
    original = seal(client, admission, tmp_path / "vision", {"result.txt": b"vision's\n"})
    replay = client.admit(
        image=pins["image"],
        dataset=pins["dataset"],
        seed=admission.seed,
        team="speech",
        replay_of=original,
    )
    with vault_server.client(author="mallory@speech") as mallory:
        theirs = seal(
            mallory,
            replay,
            tmp_path / "speech",
            {"result.txt": b"speech's\n"},
            PINVAULT_SEED="",
            PINVAULT_TEAM="speech",
            PINVAULT_REPLAY_OF=original,
            PINVAULT_REPLAY_LEASE=replay.lease,
        )
    _, sealed = run_entries(client, admission.run_id, theirs)
    assert refused(theirs, "--mlflow", url) == (
        f"vault: PERMISSION_DENIED: run manifest {theirs} was sealed by mallory@speech (team "
        f"speech, entry {sealed.index}), not by team vision, which run {admission.run_id} was "
        "admitted for: refusing to export it"
    )

    # A manifest of vision's run, pinned as the manifest of another of vision's runs.
    other = admit(client, pins, "vision")
    forged = forged_manifest(admission, [FileRecord("result.txt", sha256(b"forged"), 6)])
    digest = str(client.put(forged.encode()).blob.sha256)
    client.pin("run", [digest, other.run_id], meta={"stage": "manifest"})
    assert refused(digest, "--mlflow", url) == (
        f"vault: FAILED_PRECONDITION: {digest} is not a published run manifest: no `run` entry "
        f"with stage=manifest pins it for run {admission.run_id}"
    )
    # A manifest the run's team pinned for it, in bytes that are not its canonical form.
    loose = json.dumps(forged_manifest(other, []).as_json(), indent=1).encode()
    digest = str(client.put(loose).blob.sha256)
    client.pin("run", [digest, other.run_id], meta={"stage": "manifest"})
    for named in (digest, other.run_id):
        assert refused(named, "--mlflow", url) == (
            "vault: INVALID_ARGUMENT: run manifest is not in canonical form (RFC 8785 JSON, "
            "lists in their documented order)"
        )

    # The tracking server: not an HTTP address; nothing answering there.
    assert refused(original, "--mlflow", "file:///tmp/mlruns") == (
        "vault: INVALID_ARGUMENT: MLflow tracking URI 'file:///tmp/mlruns' is not the http:// "
        "or https:// address of a tracking server"
    )
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
        assert refused(original, "--mlflow", nowhere) == (
            f"vault: UNAVAILABLE: MLflow tracking server {nowhere} is unreachable: "
            "Connection refused"
        )

    # MLflow's client not installed (hidden by a package of that name that fails to import).
    hidden = tmp_path / "no-mlflow" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mlflow'\", name='mlflow')\n"
    )
    assert refused(original, "--mlflow", url, env={"PYTHONPATH": str(hidden.parent)}) == (
        "vault: FAILED_PRECONDITION: exporting to MLflow needs MLflow's client (No module named "
        "'mlflow'): pip install 'pinvault[mlflow]'"
    )

    assert len(all_runs(tracking)) == before

    # Asked by run id, vision's own manifest is exported, not the replay speech sealed.
    shown = export(vault_server, admission.run_id, "--mlflow", url, "--json").ok().json()
    assert shown["manifest"] == original
    assert tracking.get_run(shown["mlflow"]["run_id"]).data.tags["pinvault.manifest"] == original


def test_vault_run_and_its_export_each_take_only_their_own_arguments() -> None:
    run_id = sha256(b"a run")
    missing = run_vault("run", "--image", sha256(b"an image"), "--", "train.sbatch")
    assert missing.returncode == 2
    assert missing.error_line() == (
        "vault: the following arguments are required: --dataset, --seed (see vault run --help)"
    )
    mixed = run_vault("run", "--seed", "1", "export", run_id, "--mlflow", "http://127.0.0.1:1")
    assert mixed.returncode == 2
    assert mixed.error_line() == (
        "vault: --seed: options of `vault run`, not of `vault run export` "
        "(see vault run export --help)"
    )
    no_server = run_vault("run", "export", run_id)
    assert no_server.returncode == 2
    assert no_server.error_line() == (
        "vault: the following arguments are required: --mlflow (see vault run export --help)"
    )
