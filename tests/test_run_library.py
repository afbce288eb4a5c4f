"""The run library (`vault.runs`) inside a job, against a real `vault serve`: the seed comes from
the admitted inputs, outputs are recorded by digest, a checkpoint exists entirely or not at all
(also across a killed process), and the published run manifest and `replicate.sh` say what the
run was; a tampered job environment and malformed manifests are refused."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import re
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

import vault.runs.manifest
from tests.services.vault_server import REPO_ROOT, VaultServer, command_env
from vault.canonical import canonical_json
from vault.client import Admission, VaultClient
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    VerificationError,
)
from vault.ledger.merkle import items_root
from vault.ledger.runid import RunInputs
from vault.runs import CheckpointManifest, Run, RunManifest, load_run_manifest, start
from vault.runs.dataset import add_dataset


def replayed_by(script: Path) -> str:
    """The run manifest a `replicate.sh` replays."""
    found = re.fullmatch(
        r'#!/bin/sh\nexec vault replay (sha256:[0-9a-f]{64}) "\$@"\n', script.read_text()
    )
    assert found, script.read_text()
    return found.group(1)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def pins(vault_server: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An image and a dataset, stored and pinned, as a job's inputs are before admission."""
    folder = tmp_path_factory.mktemp("dataset")
    (folder / "train.csv").write_bytes(b"x,y\n1,2\n3,4\n")
    with vault_server.client() as client:
        image = str(client.put(b"an image for the run library tests").blob.sha256)
        client.pin("image", image, meta={"name": "trainer"})
        dataset = add_dataset(client, folder, name="tiny").digest
    return {"image": image, "dataset": dataset}


@pytest.fixture
def client(vault_server: VaultServer) -> Iterator[VaultClient]:
    with vault_server.client() as c:
        yield c


def admit(client: VaultClient, pins: dict[str, str], seed: int, **options: str) -> Admission:
    return client.admit(image=pins["image"], dataset=pins["dataset"], seed=seed, **options)


def job_env(server: VaultServer, admission: Admission, state: Path, **extra: str) -> dict[str, str]:
    """What `vault run` gives a job, plus the client's trust state in the test's folder."""
    env = {
        "PINVAULT_RUN_ID": admission.run_id,
        "PINVAULT_SEED": str(admission.seed),
        "PINVAULT_IMAGE": admission.inputs.image,
        "PINVAULT_DATASET": admission.inputs.dataset,
        "PINVAULT_CLIENT_SERVER": server.address,
        "PINVAULT_CLIENT_STATE_FILE": str(state / "trust.json"),
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v}


def fresh_seed() -> int:
    # Each test admits a run of its own on the module's shared vault.
    return random.getrandbits(64)


def entries_of(client: VaultClient, run_id: str, kind: str) -> list[Any]:
    return [p.entry for p in client.lookup(run_id) if p.entry.kind == kind]


def files_in(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------- seed and inputs


def test_seed_and_run_come_from_the_job_environment(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    seed = fresh_seed()
    admission = admit(client, pins, seed, team="vision")
    env = job_env(vault_server, admission, tmp_path)
    with start(environ=env, output_dir=tmp_path / "out") as run:
        assert run.seed == seed
        assert run.run_id == admission.run_id == admission.inputs.run_id
        assert run.inputs.bare == RunInputs(**{**pins, "seed": seed})
        assert run.team == "vision"
        ours, reference = run.rng(), random.Random(seed)
        assert [ours.random() for _ in range(3)] == [reference.random() for _ in range(3)]


def test_a_replay_without_a_seed_gets_the_recorded_one(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    seed = fresh_seed()
    admission = admit(client, pins, seed)
    env = job_env(vault_server, admission, tmp_path, PINVAULT_SEED="")
    assert "PINVAULT_SEED" not in env
    run = start(environ=env, output_dir=tmp_path)
    try:
        assert run.seed == seed
    finally:
        run.close()


def test_a_tampered_job_environment_is_refused(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    good = job_env(vault_server, admission, tmp_path)

    other_seed = admission.seed ^ 1
    with pytest.raises(VerificationError) as refused:
        start(environ={**good, "PINVAULT_SEED": str(other_seed)}, output_dir=tmp_path)
    assert str(refused.value) == (
        f"PINVAULT_SEED is {other_seed} but run {admission.run_id} was admitted with "
        f"{admission.seed}"
    )

    # Without a seed to hash, the inputs are held to the document the vault stored.
    image = sha256(b"some other image")
    with pytest.raises(VerificationError, match=r"^PINVAULT_IMAGE is sha256:.* but run .* was "):
        start(environ={**good, "PINVAULT_SEED": "", "PINVAULT_IMAGE": image}, output_dir=tmp_path)

    # Consistent inputs that were never admitted: no inputs document under that run id.
    never = RunInputs(**{**pins, "seed": other_seed})
    with pytest.raises(FailedPrecondition, match=f"^run {never.run_id} was never admitted"):
        start(
            environ={**good, "PINVAULT_RUN_ID": never.run_id, "PINVAULT_SEED": str(other_seed)},
            output_dir=tmp_path,
        )

    missing = {k: v for k, v in good.items() if k != "PINVAULT_RUN_ID"}
    with pytest.raises(InvalidArgument, match=r"^PINVAULT_RUN_ID is not set"):
        start(environ=missing, output_dir=tmp_path)
    with pytest.raises(InvalidArgument, match=r"^unknown environment variable PINVAULT_CLIENT_"):
        start(environ={**good, "PINVAULT_CLIENT_SERVR": "x"}, output_dir=tmp_path)


def test_the_client_comes_from_the_same_settings_as_the_vault_command(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    env = job_env(vault_server, admission, tmp_path)
    del env["PINVAULT_CLIENT_SERVER"], env["PINVAULT_CLIENT_STATE_FILE"]
    config = tmp_path / "pinvault.toml"
    config.write_text(
        f'data_dir = "/unused"\n[client]\nserver = "{vault_server.address}"\n'
        f'state_file = "{tmp_path / "state.json"}"\n'
    )
    run = start(environ={**env, "PINVAULT_CONFIG": str(config)}, output_dir=tmp_path)
    run.close()
    assert (tmp_path / "state.json").exists()  # the trust state went where the file says

    config.write_text('[client]\nsever = "x"\n')
    with pytest.raises(InvalidArgument, match=r"^unknown config key 'client.sever' in "):
        start(environ={**env, "PINVAULT_CONFIG": str(config)}, output_dir=tmp_path)


# ---------------------------------------------------------------------- outputs


def test_an_output_is_hashed_on_the_way_stored_and_recorded(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    out = tmp_path / "out"
    data = os.urandom(3 * 1024 * 1024 + 17)
    run = start(environ=job_env(vault_server, admission, tmp_path), output_dir=out)
    with run.output("results/weights.bin") as f:
        for start_at in range(0, len(data), 1 << 20):
            f.write(data[start_at : start_at + (1 << 20)])
        assert not (out / "results" / "weights.bin").exists()  # only once complete
    run.close()

    assert (out / "results" / "weights.bin").read_bytes() == data
    assert files_in(out) == ["results/weights.bin"]  # no partial file left beside it
    assert f.artefact is not None and f.artefact.sha256 == sha256(data)
    (entry,) = entries_of(client, admission.run_id, "artefact")
    assert entry.subjects == (sha256(data), admission.run_id)
    # The team is the vault's record of who wrote it: the run's (in local mode, as claimed).
    # The chunk root of what was put lets a range of it be verified alone.
    chunks = [
        blake3.blake3(data[at : at + (1 << 20)]).digest() for at in range(0, len(data), 1 << 20)
    ]
    assert dict(entry.meta) == {
        "path": "results/weights.bin",
        "size": str(len(data)),
        "team": admission.team,
        "chunk-root": items_root(chunks).hex(),
    }
    copy = tmp_path / "copy"
    client.get(sha256(data), copy)
    assert copy.read_bytes() == data


def test_a_failed_output_leaves_no_file_and_no_record(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    out = tmp_path / "out"
    (out / "keep.txt").parent.mkdir(parents=True)
    (out / "keep.txt").write_bytes(b"an earlier version\n")
    run = start(environ=job_env(vault_server, admission, tmp_path), output_dir=out)

    with pytest.raises(RuntimeError), run.output("keep.txt") as f:
        f.write(b"half of a new vers")
        raise RuntimeError("the job failed while writing")
    unfinished = run.output("unfinished.bin")
    with pytest.raises(FailedPrecondition, match=r"^output unfinished.bin is still open"):
        run.finish()
    unfinished.abort()
    dropped = run.output("dropped.bin")
    dropped.write(b"never closed")
    del dropped
    gc.collect()

    assert files_in(out) == ["keep.txt"]
    assert (out / "keep.txt").read_bytes() == b"an earlier version\n"
    with pytest.raises(InvalidArgument, match="is not inside the run's output folder"):
        run.output("../escape.txt")
    with pytest.raises(InvalidArgument, match=r"^output replicate.sh is the name finish"):
        run.output("replicate.sh")
    assert run.outputs() == []
    assert entries_of(client, admission.run_id, "artefact") == []

    # A file written by other means is recorded by `record`.
    (out / "log.txt").write_bytes(b"epoch 1 done\n")
    recorded = run.record(out / "log.txt")
    assert (recorded.path, recorded.sha256, recorded.size) == (
        "log.txt",
        sha256(b"epoch 1 done\n"),
        13,
    )
    assert [a.path for a in run.outputs()] == ["log.txt"]
    run.close()


# ---------------------------------------------------------------------- checkpoints

JOB = textwrap.dedent(
    """
    import json, os, signal, sys
    import vault.runs

    run = vault.runs.start()
    action = sys.argv[1]
    if action == "crash":
        run.checkpoint(1, {"model.bin": b"weights at step 1", "opt/state.bin": b"adam 1"})
        with run.output("early.txt") as f:
            f.write(b"written before the preemption\\n")
        real_pin = run.client.pin

        def pin(kind, *args, **kwargs):
            if kind == "checkpoint":
                os.kill(os.getpid(), signal.SIGKILL)  # preempted between the puts and the pin
            return real_pin(kind, *args, **kwargs)

        run.client.pin = pin
        run.checkpoint(2, {"model.bin": b"weights at step 2", "opt/state.bin": b"adam 2"})
    else:
        latest = run.latest()
        restored = latest.restore("restored")
        with run:
            pass
        print(json.dumps({"step": latest.step, "files": sorted(restored)}))
    """
)


def run_job(env: dict[str, str], folder: Path, action: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder.parent / "job.py"
    script.write_text(JOB)
    return subprocess.run(
        [sys.executable, str(script), action],
        env=command_env(extra={**env, "PYTHONPATH": str(REPO_ROOT)}),
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_checkpoint_cut_short_by_a_kill_does_not_exist_for_the_next_process(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    env = job_env(vault_server, admission, tmp_path)
    folder = tmp_path / "job"

    killed = run_job(env, folder, "crash")
    assert killed.returncode == -9, killed.stderr
    # Its files did reach the store: only the pin that commits them was missing.
    assert client.find_missing([sha256(b"weights at step 2"), sha256(b"adam 2")]) == []

    resumed = run_job(env, folder, "resume")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout) == {"step": 1, "files": ["model.bin", "opt/state.bin"]}
    assert (folder / "restored" / "model.bin").read_bytes() == b"weights at step 1"
    assert (folder / "restored" / "opt" / "state.bin").read_bytes() == b"adam 1"

    # The run manifest the resumed process published counts what the killed one wrote.
    digest = replayed_by(folder / "replicate.sh")
    manifest = load_run_manifest(client, digest)
    assert [(o.path, o.sha256) for o in manifest.outputs] == [
        ("early.txt", sha256(b"written before the preemption\n"))
    ]
    assert [c.step for c in manifest.checkpoints] == [1]


def test_a_checkpoint_whose_pin_fails_is_not_the_latest(
    vault_server: VaultServer,
    pins: dict[str, str],
    client: VaultClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admission = admit(client, pins, fresh_seed())
    env = job_env(vault_server, admission, tmp_path)
    run = start(client, environ=env, output_dir=tmp_path)
    assert run.latest() is None
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(100_000))
    first = run.checkpoint(10, {"weights.bin": weights, "step.txt": b"10"})

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("the job was killed")

    with monkeypatch.context() as patch:
        patch.setattr(run.client, "pin", refuse)
        with pytest.raises(OSError):
            run.checkpoint(20, {"weights.bin": b"newer weights", "step.txt": b"20"})

    with vault_server.client() as other:
        again = start(other, environ=env, output_dir=tmp_path)
        latest = again.latest()
        assert latest is not None
        assert (latest.step, latest.digest) == (10, first.digest)
        assert [(f.path, f.size) for f in latest.manifest.files] == [
            ("step.txt", 2),
            ("weights.bin", 100_000),
        ]
        later = again.checkpoint(20, {"weights.bin": b"newer weights", "step.txt": b"20"})
        # Of equal steps the one committed last wins.
        same_step = again.checkpoint(20, {"weights.bin": b"newest", "step.txt": b"20"})
        latest = again.latest()
        assert latest is not None and latest.digest == same_step.digest != later.digest

        restored = latest.restore(tmp_path / "restore")
        assert restored == {
            "step.txt": tmp_path / "restore" / "step.txt",
            "weights.bin": tmp_path / "restore" / "weights.bin",
        }
        assert (tmp_path / "restore" / "weights.bin").read_bytes() == b"newest"

        # The manifest blob is exactly the documented canonical form.
        manifest = json.loads(
            vault.runs.manifest.load_checkpoint_manifest(other, first.digest).encode()
        )
        assert manifest == {
            "type": "pinvault.checkpoint",
            "v": 1,
            "run": admission.run_id,
            "step": 10,
            "files": [
                {"path": "step.txt", "sha256": sha256(b"10"), "size": 2},
                {"path": "weights.bin", "sha256": sha256(weights.read_bytes()), "size": 100_000},
            ],
        }
        (pin,) = [
            e
            for e in entries_of(other, admission.run_id, "checkpoint")
            if e.subjects[0] == first.digest
        ]
        assert pin.subjects == (first.digest, admission.run_id)
        assert dict(pin.meta) == {"step": "10", "team": admission.team}


def test_restore_refuses_a_file_whose_stored_bytes_are_corrupt(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    run = start(client, environ=job_env(vault_server, admission, tmp_path), output_dir=tmp_path)
    data = os.urandom(50_000)
    run.checkpoint(1, {"good.bin": b"fine", "bad.bin": data})
    stored = vault_server.blob_path(sha256(data))
    blob = bytearray(stored.read_bytes())
    blob[1234] ^= 0xFF
    stored.chmod(0o644)
    stored.write_bytes(bytes(blob))

    latest = run.latest()
    assert latest is not None
    with pytest.raises(IntegrityError):
        latest.restore(tmp_path / "restore")
    assert not (tmp_path / "restore" / "bad.bin").exists()
    assert [p.name for p in (tmp_path / "restore").iterdir()] == []


# ---------------------------------------------------------------------- the run manifest


def test_finish_publishes_the_manifest_and_a_one_line_replicate_sh(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    seed = fresh_seed()
    admission = admit(client, pins, seed, team="nlp")
    out = tmp_path / "out"
    env = job_env(
        vault_server,
        admission,
        tmp_path,
        SLURM_JOB_ID="4242",
        CUDA_VISIBLE_DEVICES="0,1",
        HF_TOKEN="hf_secret_value",
        PINVAULT_CLIENT_AUTHOR="ada@node7",
    )
    with start(environ=env, output_dir=out) as run:
        with run.output("metrics.json") as f:
            f.write(b'{"loss": 0.25}\n')
        with run.output("b/model.bin") as f:
            f.write(b"model bytes")
        checkpoint = run.checkpoint(5, {"model.bin": b"model bytes"})

    script = out / "replicate.sh"
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/sh" and len(lines) == 2
    command, digest, arguments = lines[1].rsplit(" ", 2)
    assert command == "exec vault replay" and arguments == '"$@"'
    assert stat.S_IMODE(script.stat().st_mode) == 0o755

    fetched = tmp_path / "manifest.json"
    vault_server.run("get", digest, "-o", str(fetched)).ok()
    data = fetched.read_bytes()
    assert sha256(data) == digest
    assert b"hf_secret_value" not in data
    manifest = json.loads(data)
    assert data == canonical_json(manifest)
    assert manifest["type"] == "pinvault.run-manifest" and manifest["v"] == 1
    assert manifest["run"] == admission.run_id
    assert manifest["inputs"] == {
        "type": "pinvault.run-inputs",
        "v": 1,
        "image": pins["image"],
        "dataset": pins["dataset"],
        "seed": str(seed),
        "nonce": admission.inputs.nonce,
    }
    assert sha256(canonical_json(manifest["inputs"])) == admission.run_id
    assert manifest["team"] == "nlp"
    assert manifest["outputs"] == [
        {"path": "b/model.bin", "sha256": sha256(b"model bytes"), "size": 11},
        {"path": "metrics.json", "sha256": sha256(b'{"loss": 0.25}\n'), "size": 15},
    ]
    assert manifest["checkpoints"] == [{"step": 5, "manifest": checkpoint.digest}]
    environment = manifest["environment"]
    assert environment["variables"] == {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "4242"}
    assert environment["host"] == os.uname().nodename
    assert environment["python"] == ".".join(map(str, sys.version_info[:3]))

    (pin,) = [e for e in entries_of(client, admission.run_id, "run") if e.subjects[0] == digest]
    assert pin.subjects == (digest, admission.run_id)
    assert dict(pin.meta) == {"stage": "manifest", "team": "nlp"} and pin.author == "ada@node7"
    loaded = load_run_manifest(client, digest)
    assert loaded.run_id == admission.run_id and loaded.seed == seed
    assert files_in(out) == ["b/model.bin", "metrics.json", "replicate.sh"]


def test_a_run_left_by_an_exception_publishes_no_manifest(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    admission = admit(client, pins, fresh_seed())
    env = job_env(vault_server, admission, tmp_path)
    with pytest.raises(ZeroDivisionError), start(environ=env, output_dir=tmp_path) as run:
        with run.output("partial-results.txt") as f:
            f.write(b"epoch 1\n")
        _ = 1 / 0
    assert not (tmp_path / "replicate.sh").exists()
    assert [e.meta["stage"] for e in entries_of(client, admission.run_id, "run")] == ["admitted"]
    # What it did record stays recorded: the next attempt's manifest includes it.
    with start(environ=env, output_dir=tmp_path) as run:
        pass
    digest = replayed_by(tmp_path / "replicate.sh")
    assert [o.path for o in load_run_manifest(client, digest).outputs] == ["partial-results.txt"]


def deterministic_job(run: Run) -> None:
    """A toy training job whose every byte follows from the run's seed."""
    rng = run.rng()
    assert run.latest() is None  # a replay starts from scratch, not from the original's end
    for step in (1, 2):
        weights = bytes(rng.getrandbits(8) for _ in range(4096))
        run.checkpoint(step, {"weights.bin": weights, "step": str(step).encode()})
    with run.output("predictions.csv") as f:
        f.write("".join(f"{i},{rng.random():.6f}\n" for i in range(100)).encode())


def test_a_replay_of_a_deterministic_run_gives_the_same_outputs_and_manifest(
    vault_server: VaultServer, pins: dict[str, str], client: VaultClient, tmp_path: Path
) -> None:
    seed = fresh_seed()
    admission = admit(client, pins, seed, team="replayers")
    env = job_env(vault_server, admission, tmp_path, SLURM_JOB_ID="100")
    with start(environ=env, output_dir=tmp_path / "first") as run:
        deterministic_job(run)
    original = run.finish()

    leases = []
    for n in range(3):
        replay = admit(client, pins, seed, team="replayers", replay_of=original)
        assert replay.run_id == admission.run_id and replay.lease
        leases.append(replay.lease)
        replay_env = job_env(
            vault_server,
            replay,
            tmp_path,
            PINVAULT_SEED="",
            PINVAULT_TEAM="replayers",
            PINVAULT_REPLAY_OF=original,
            PINVAULT_REPLAY_LEASE=replay.lease,
            SLURM_JOB_ID=f"{200 + n}",
        )
        # Each replay gives its slot back on finishing: a third one fits a quota of two.
        with start(environ=replay_env, output_dir=tmp_path / f"replay-{n}") as run:
            deterministic_job(run)
    replayed = run.finish()
    assert len(set(leases)) == 3

    first, again = load_run_manifest(client, original), load_run_manifest(client, replayed)
    assert first.outputs == again.outputs and first.checkpoints == again.checkpoints
    assert (tmp_path / "first" / "predictions.csv").read_bytes() == (
        tmp_path / "replay-2" / "predictions.csv"
    ).read_bytes()
    assert first.environment.variables == {"SLURM_JOB_ID": "100"}
    assert again.environment.variables == {"SLURM_JOB_ID": "202"}
    strip = {"environment"}
    assert {k: v for k, v in first.as_json().items() if k not in strip} == {
        k: v for k, v in again.as_json().items() if k not in strip
    }
    (pin,) = [e for e in entries_of(client, admission.run_id, "run") if e.subjects[0] == replayed]
    assert pin.meta["replay-of"] == original and pin.meta["replay"].startswith("sha256:")
    assert all(lease not in json.dumps(dict(pin.meta)) for lease in leases)

    # A different seed is a different run with different outputs.
    other = admit(client, pins, seed ^ 1)
    with start(environ=job_env(vault_server, other, tmp_path), output_dir=tmp_path / "o") as run:
        deterministic_job(run)
    assert load_run_manifest(client, run.finish()).outputs != first.outputs


# ---------------------------------------------------------------------- decoding


def valid_manifest() -> RunManifest:
    inputs = RunInputs(image=sha256(b"i"), dataset=sha256(b"d"), seed=7)
    return RunManifest.checked(
        inputs=inputs,
        team="t",
        environment=vault.runs.manifest.Environment("h", "3.11.7", "Linux", {"SLURM_JOB_ID": "1"}),
        outputs=[vault.runs.manifest.FileRecord("a.txt", sha256(b"a"), 1)],
        checkpoints=[vault.runs.manifest.CheckpointRef(3, sha256(b"c"))],
    )


def mutate(**changes: Any) -> bytes:
    doc = valid_manifest().as_json()
    doc.update(changes)
    return canonical_json(doc)


BAD_MANIFESTS: list[tuple[str, bytes, str]] = [
    (
        "not canonical",
        json.dumps(valid_manifest().as_json(), indent=1).encode(),
        "^run manifest is not in canonical form",
    ),
    ("not UTF-8", b'{"v":1,"x":"\xff"}', "^run manifest is not UTF-8 JSON"),
    ("not an object", b"[]", "^run manifest is not a JSON object"),
    (
        "duplicate key",
        canonical_json(valid_manifest().as_json())[:-1] + b',"v":1}',
        "^run manifest: key 'v' appears twice",
    ),
    ("unknown field", mutate(extra=1), "^run manifest: unknown field 'extra'"),
    ("wrong version", mutate(v=2), "^run manifest: version 2 is not 1"),
    ("wrong type", mutate(type="pinvault.checkpoint"), "^run manifest: type is"),
    ("run not its inputs", mutate(run=sha256(b"x")), "but its inputs make run"),
    (
        "escaping path",
        mutate(outputs=[{"path": "../a", "sha256": sha256(b"a"), "size": 1}]),
        "^run manifest: path '../a' has a '..' component",
    ),
    (
        "bad digest",
        mutate(outputs=[{"path": "a", "sha256": "sha256:AB", "size": 1}]),
        "has bad digest",
    ),
    (
        "size too large",
        mutate(outputs=[{"path": "a", "sha256": sha256(b"a"), "size": 2**53}]),
        "size is 9007199254740992, expected an integer",
    ),
    (
        "unsorted outputs",
        mutate(
            outputs=[
                {"path": "b", "sha256": sha256(b"a"), "size": 1},
                {"path": "a", "sha256": sha256(b"a"), "size": 1},
            ]
        ),
        "^run manifest is not in canonical form",
    ),
    (
        "step twice",
        mutate(checkpoints=[{"manifest": sha256(b"c"), "step": 1}] * 2),
        "checkpoint step 1 is listed twice",
    ),
    ("NaN", canonical_json(valid_manifest().as_json())[:-1] + b',"x":NaN}', "NaN is not JSON"),
    ("nested", b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not a JSON object"),
]


@pytest.mark.parametrize(
    ("data", "message"), [(d, m) for _, d, m in BAD_MANIFESTS], ids=[n for n, _, _ in BAD_MANIFESTS]
)
def test_run_manifest_decode_refuses_malformed_bytes(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        RunManifest.decode(data)


def test_manifests_round_trip_and_oversized_ones_are_refused_before_reading(
    vault_server: VaultServer, client: VaultClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = valid_manifest()
    assert RunManifest.decode(manifest.encode()) == manifest
    with monkeypatch.context() as patch:
        patch.setattr(vault.runs.manifest, "MAX_RUN_MANIFEST_BYTES", 64)
        with pytest.raises(InvalidArgument, match=r"^run manifest is 65 bytes \(at most 64\)"):
            RunManifest.decode(b" " * 65)

    checkpoint = CheckpointManifest.checked(
        run=sha256(b"r"), step=1, files=[vault.runs.manifest.FileRecord("a/b", sha256(b"x"), 1)]
    )
    assert CheckpointManifest.decode(checkpoint.encode()) == checkpoint
    with pytest.raises(InvalidArgument, match="'a' is a file and also the folder of 'a/b'"):
        CheckpointManifest.checked(
            run=sha256(b"r"),
            step=1,
            files=[
                vault.runs.manifest.FileRecord("a/b", sha256(b"x"), 1),
                vault.runs.manifest.FileRecord("a", sha256(b"x"), 1),
            ],
        )
    with pytest.raises(InvalidArgument, match="a checkpoint needs at least one file"):
        CheckpointManifest.decode(canonical_json({**checkpoint.as_json(), "files": []}))

    # Through the vault: a stored manifest too large is refused from its size alone, and one
    # never pinned as a run's manifest is not a published one.
    monkeypatch.setattr(vault.runs.manifest, "MAX_RUN_MANIFEST_BYTES", 2**20)
    unpublished = str(client.put(manifest.encode()).blob.sha256)
    with pytest.raises(FailedPrecondition, match=f"^{unpublished} is not a published run"):
        load_run_manifest(client, unpublished)
    monkeypatch.setattr(vault.runs.manifest, "MAX_RUN_MANIFEST_BYTES", 100)
    with pytest.raises(InvalidArgument, match=f"^run manifest {unpublished} is .* bytes"):
        load_run_manifest(client, unpublished)
