"""Proof bundles: `vault bundle` writes what proves a run (its entries, their inclusion proofs in
one checkpoint, the checkpoint with a real witness's cosignature, the keys, the inputs document,
the run manifest and replicate.sh) from a real `vault serve`; `vault bundle verify` checks the
file once the vault and the witness are stopped, and refuses every altered field, naming it."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultRun, VaultServer, run_vault
from tests.services.witness import WitnessServer
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.runs import start
from vault.runs.dataset import add_dataset

ORIGIN = "bundle.test/ledger"
EXIT_INVALID = 64
EXIT_INTEGRITY = 65
EXIT_NOT_FOUND = 66
EXIT_IO = 74


@dataclass(frozen=True)
class Proved:
    """A sealed run and the bundles written of it, its dataset and one entry, by a vault and a
    witness that are both stopped by the time a test reads this."""

    folder: Path
    address: str
    run_id: str
    manifest: str
    dataset: str
    replicate_sh: bytes
    verifier_key: str
    # The vault's signing key, kept to forge what only a vault that forks could sign.
    signing_key: str
    witness_key: str
    run_entries: int
    dataset_entries: int
    size: int
    wrote: str

    @property
    def run_bundle(self) -> Path:
        return self.folder / "run.bundle"

    def verify(self, path: Path, *args: str, trusted: bool = True) -> VaultRun:
        """`vault bundle verify PATH`, naming the vault's key and the witness unless not
        `trusted`, aimed at the stopped vault's address."""
        keys = ("--key", self.verifier_key, "--witness", self.witness_key) if trusted else ()
        return run_vault(
            "bundle",
            "verify",
            str(path),
            *keys,
            *args,
            server=self.address,
            state_home=self.folder / "reviewer",
        )

    def altered(self, change: Callable[[dict[str, Any]], None]) -> Path:
        """A copy of the run's bundle with `change` made to its JSON."""
        bundle = json.loads(self.run_bundle.read_bytes())
        change(bundle)
        path = self.folder / f"altered-{random.getrandbits(32):08x}.bundle"
        path.write_text(json.dumps(bundle))
        return path


@pytest.fixture(scope="module")
def proved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proved]:
    with proved_run(tmp_path_factory.mktemp("bundle")) as made:
        yield made


@contextlib.contextmanager
def proved_run(folder: Path) -> Iterator[Proved]:
    """A vault with a witness, a sealed run made on it, and its bundles written; the vault is
    stopped before this yields and the witness when it ends."""
    server = VaultServer(folder / "vault")
    key = SigningKey.generate(ORIGIN)
    server.data_dir.mkdir(parents=True)
    key.save(server.key_path)
    with WitnessServer({ORIGIN: str(key.verifier())}) as witness:
        server.extra_env.update(
            {
                "PINVAULT_LEDGER_ORIGIN": ORIGIN,
                "PINVAULT_WITNESSES_ENDPOINTS": witness.endpoint,
                "PINVAULT_WITNESSES_TIMEOUT": "10",
            }
        )
        with server:
            yield _make_run(server, folder, str(witness.key))


def _make_run(server: VaultServer, folder: Path, witness_key: str) -> Proved:
    """A run as a job makes it (a dataset pinned under a name, the run admitted, two outputs
    and a checkpoint recorded, the manifest and replicate.sh published), then its bundles
    written by the command with the witness required, then the vault stopped."""
    data = folder / "dataset"
    data.mkdir()
    (data / "train.csv").write_bytes(b"x,y\n1,2\n")
    seed = random.getrandbits(64)
    with server.client() as client:
        image = str(client.put(b"an image for the bundle tests").blob.sha256)
        client.pin("image", image)
        dataset = add_dataset(client, data, name="tiny").digest
        admission = client.admit(image=image, dataset=dataset, seed=seed, team="vision")
    out = folder / "out"
    env = {
        "PINVAULT_RUN_ID": admission.run_id,
        "PINVAULT_SEED": str(seed),
        "PINVAULT_IMAGE": image,
        "PINVAULT_DATASET": dataset,
        "PINVAULT_CLIENT_SERVER": server.address,
        "PINVAULT_CLIENT_STATE_FILE": str(folder / "job-trust.json"),
    }
    with start(environ=env, output_dir=out) as run:
        with run.output("predictions.csv") as f:
            f.write(b"id,label\n1,cat\n")
        with run.output("metrics.json") as f:
            f.write(b'{"accuracy": 0.5}')
        run.checkpoint(3, {"model.bin": b"weights at step 3"})
    replicate_sh = (out / "replicate.sh").read_bytes()
    with server.client() as client:
        run_entries = len(client.lookup(admission.run_id))
        dataset_entries = len(client.lookup(dataset))
    witnessed = {"PINVAULT_CLIENT_WITNESSES": witness_key}
    wrote = server.run("bundle", admission.run_id, "-o", str(folder / "run.bundle"), env=witnessed)
    server.run("bundle", "tiny", "-o", str(folder / "dataset.bundle"), env=witnessed).ok()
    server.run("bundle", "#0", "-o", str(folder / "entry.bundle"), env=witnessed).ok()
    with server.client() as client:
        size = client.checkpoint().size
    # A reviewer who once checked this vault: their trust state holds its key and checkpoint.
    server.run("checkpoint", state_home=folder / "trusting-reviewer").ok()
    server.stop()
    return Proved(
        folder=folder,
        address=server.address,
        run_id=admission.run_id,
        manifest=replicate_sh.split()[4].decode(),
        dataset=dataset,
        replicate_sh=replicate_sh,
        verifier_key=str(server.signing_key().verifier()),
        signing_key=str(server.signing_key()),
        witness_key=witness_key,
        run_entries=run_entries,
        dataset_entries=dataset_entries,
        size=size,
        wrote=wrote.ok().stdout,
    )


def _labels(proved: Proved) -> tuple[str, str]:
    # A key's label is its name and key id: the base64 after them may hold "+" too.
    key = "+".join(proved.verifier_key.split("+")[:2])
    witness = "+".join(proved.witness_key.split("+")[:2])
    return key, witness


def test_a_runs_bundle_is_verified_with_the_vault_and_the_witness_stopped(proved: Proved) -> None:
    key, witness = _labels(proved)
    proven = (
        f"run {proved.run_id}: {proved.run_entries} entries proven in checkpoint {proved.size} "
        f"of {ORIGIN} signed by {key}, cosigned by witness {witness}; inputs document, run "
        "manifest, replicate.sh match"
    )
    assert proved.wrote == f"wrote {proved.run_bundle}: {proven}\n"
    run = proved.verify(proved.run_bundle).ok()
    assert run.stdout == proven + "\n"
    assert run.stderr == ""
    # The file is the documented format, holding the very replicate.sh the run library wrote
    # and the run's inputs document, whose digest is the run id.
    bundle = json.loads(proved.run_bundle.read_bytes())
    assert bundle["mediaType"] == "application/vnd.pinvault.bundle.v1+json"
    assert bundle["subject"] == {"type": "run", "digest": proved.run_id}
    documents = {k: base64.b64decode(v) for k, v in bundle["documents"].items()}
    assert documents["replicateScript"] == proved.replicate_sh
    assert "sha256:" + hashlib.sha256(documents["runInputs"]).hexdigest() == proved.run_id
    assert "sha256:" + hashlib.sha256(documents["runManifest"]).hexdigest() == proved.manifest
    assert len(bundle["tlogEntries"]) == proved.run_entries == 5

    answer = proved.verify(proved.run_bundle, "--json").ok().json()
    assert answer["entries"] == [e["logIndex"] for e in bundle["tlogEntries"]]
    assert answer["checkpoint"] == {"origin": ORIGIN, "size": proved.size}
    assert answer["cosigned_by"] == [witness]
    assert answer["key_from_bundle"] is False


def test_a_datasets_and_an_entrys_bundles_are_verified_too(proved: Proved) -> None:
    key, witness = _labels(proved)
    signed = (
        f"in checkpoint {proved.size} of {ORIGIN} signed by {key}, cosigned by witness {witness}"
    )
    run = proved.verify(proved.folder / "dataset.bundle").ok()
    assert run.stdout == (
        f"dataset {proved.dataset}: {proved.dataset_entries} entries proven {signed}; dataset "
        "manifest match\n"
    )
    run = proved.verify(proved.folder / "entry.bundle").ok()
    assert run.stdout == f"entry 0: 1 entry proven {signed}\n"


def test_without_a_key_named_the_bundle_is_said_to_vouch_only_for_itself(proved: Proved) -> None:
    run = proved.verify(proved.run_bundle, trusted=False).ok()
    assert run.stdout.startswith(f"run {proved.run_id}: {proved.run_entries} entries proven")
    key, _ = _labels(proved)
    warnings = run.stderr.splitlines()
    assert warnings[0] == (
        f"vault: warning: the checkpoint key {key} was taken from the bundle itself: this shows "
        "the bundle is consistent, not that the vault signed it; name the vault's key with "
        "--key (or client.verifier_key), or verify where your trust state holds this vault"
    )
    assert warnings[1].startswith("vault: warning: the witness keys were taken from the bundle")
    # A key the reviewer keeps in the client's configuration anchors it as --key does.
    run = run_vault(
        "bundle",
        "verify",
        str(proved.run_bundle),
        env={
            "PINVAULT_CLIENT_VERIFIER_KEY": proved.verifier_key,
            "PINVAULT_CLIENT_WITNESSES": proved.witness_key,
        },
        state_home=proved.folder / "reviewer",
    ).ok()
    assert run.stderr == ""


def _verify_as(proved: Proved, reviewer: str, path: Path) -> VaultRun:
    """`vault bundle verify PATH` naming no key, by a reviewer keeping their trust state in the
    folder `reviewer`."""
    return run_vault(
        "bundle", "verify", str(path), server=proved.address, state_home=proved.folder / reviewer
    )


def _resigned(proved: Proved, key: SigningKey, root: bytes | None = None) -> Path:
    """The run's bundle with its checkpoint signed again by `key` (over another root if given),
    and that key's verifier named in it as the vault's."""
    bundle = json.loads(proved.run_bundle.read_bytes())
    body = _note(bundle).split("\n\n")[0] + "\n"
    checkpoint = Checkpoint.parse_body(body)
    forged = Checkpoint(checkpoint.origin, checkpoint.size, root or checkpoint.root)
    _set_note(bundle, key.sign(forged))
    bundle["verificationMaterial"]["verifierKey"] = str(key.verifier())
    bundle["verificationMaterial"]["witnessKeys"] = []
    path = proved.folder / f"resigned-{random.getrandbits(32):08x}.bundle"
    path.write_text(json.dumps(bundle))
    return path


def test_a_trust_state_that_holds_the_vault_anchors_the_key_and_catches_a_forgery(
    proved: Proved,
) -> None:
    # Held in the reviewer's trust state, the vault's key needs no --key: no warning of it
    # (only of the witnesses, which this reviewer named none of).
    run = _verify_as(proved, "trusting-reviewer", proved.run_bundle).ok()
    assert run.stdout.startswith(f"run {proved.run_id}: {proved.run_entries} entries proven")
    assert [line.split(":")[1] for line in run.stderr.splitlines()] == [" warning"]
    assert "the witness keys were taken from the bundle itself" in run.stderr
    # A bundle whose maker signed its checkpoint with a key of their own (same origin, same
    # entries and proofs) is consistent by itself, which is all a reader without a key can
    # learn, and is said to be so; a reader whose trust state holds the vault refuses it.
    forged = _resigned(proved, SigningKey.generate(ORIGIN))
    run = _verify_as(proved, "reviewer", forged).ok()
    assert "was taken from the bundle itself" in run.stderr
    run = _verify_as(proved, "trusting-reviewer", forged)
    assert run.returncode == EXIT_INTEGRITY
    key, _ = _labels(proved)
    assert run.error_line().startswith(f"vault: checkpoint is not signed by key {key} ")
    # The vault's own key over another root at the size the reviewer verified: two histories.
    fork = _resigned(proved, SigningKey.from_string(proved.signing_key), bytes(32))
    run = _verify_as(proved, "trusting-reviewer", fork)
    assert run.returncode == EXIT_INTEGRITY
    assert run.error_line().endswith(
        f"but the checkpoint of that size you verified before has root "
        f"{_root(proved).hex()}: the vault has shown two different histories"
    )


def _root(proved: Proved) -> bytes:
    bundle = json.loads(proved.run_bundle.read_bytes())
    return Checkpoint.parse_body(_note(bundle).split("\n\n")[0] + "\n").root


def _body(bundle: dict[str, Any], kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bundle's first entry of `kind`, and its body decoded."""
    for item in bundle["tlogEntries"]:
        body = json.loads(base64.b64decode(item["canonicalizedBody"]))
        if body["kind"] == kind:
            return item, body
    raise AssertionError(f"no {kind} entry")


def _change_entry_byte(bundle: dict[str, Any]) -> None:
    item, _ = _body(bundle, "artefact")
    body = base64.b64decode(item["canonicalizedBody"])
    item["canonicalizedBody"] = base64.b64encode(
        body.replace(b"predictions", b"predictionz")
    ).decode()


def _change_proof_hash(bundle: dict[str, Any]) -> None:
    item, _ = _body(bundle, "checkpoint")
    first = bytearray(base64.b64decode(item["inclusionProof"][0]))
    first[0] ^= 1
    item["inclusionProof"][0] = base64.b64encode(bytes(first)).decode()


def _note(bundle: dict[str, Any]) -> str:
    note: str = bundle["verificationMaterial"]["checkpoint"]
    return note


def _set_note(bundle: dict[str, Any], note: str) -> None:
    bundle["verificationMaterial"]["checkpoint"] = note


def _change_signature(bundle: dict[str, Any]) -> None:
    text, signatures = _note(bundle).split("\n\n")
    lines = signatures.splitlines()
    name, encoded = lines[0].rsplit(" ", 1)
    raw = bytearray(base64.b64decode(encoded))
    raw[-1] ^= 1
    lines[0] = f"{name} {base64.b64encode(bytes(raw)).decode()}"
    _set_note(bundle, text + "\n\n" + "\n".join(lines) + "\n")


def _change_size(bundle: dict[str, Any]) -> None:
    origin, size, rest = _note(bundle).split("\n", 2)
    _set_note(bundle, f"{origin}\n{int(size) + 1}\n{rest}")


def _remove_cosignature(bundle: dict[str, Any]) -> None:
    text, signatures = _note(bundle).split("\n\n")
    _set_note(bundle, text + "\n\n" + signatures.splitlines()[0] + "\n")


def _change_document(role: str, old: bytes, new: bytes) -> Callable[[dict[str, Any]], None]:
    def change(bundle: dict[str, Any]) -> None:
        data = base64.b64decode(bundle["documents"][role])
        assert old in data
        bundle["documents"][role] = base64.b64encode(data.replace(old, new, 1)).decode()

    return change


def _remove_manifest_pin(bundle: dict[str, Any]) -> None:
    bundle["tlogEntries"] = [
        item
        for item in bundle["tlogEntries"]
        if json.loads(base64.b64decode(item["canonicalizedBody"]))["meta"].get("stage")
        != "manifest"
    ]


def _remove_admission(bundle: dict[str, Any]) -> None:
    item, _ = _body(bundle, "run")
    bundle["tlogEntries"].remove(item)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (_change_entry_byte, r"entry \d+ is not proven in checkpoint \d+: inclusion proof"),
        (_change_proof_hash, r"entry \d+ is not proven in checkpoint \d+: inclusion proof"),
        (_change_signature, r"signature by key \S+ does not verify"),
        (_change_size, r"signature by key \S+ does not verify"),
        (_remove_cosignature, r"cosigned by 0 of the witnesses required \(1 of 1\)"),
        (
            _change_document("runInputs", b'"seed":"', b'"seed":"1'),
            r"the run inputs document hashes to sha256:\w+, not to the run id",
        ),
        (
            _change_document("runManifest", b'"path":"metrics.json"', b'"path":"metrics.jsom"'),
            r"the run manifest hashes to sha256:\w+, which no entry of the bundle pins",
        ),
        (
            _change_document("replicateScript", b"exec vault replay", b"exec vault  replay"),
            r"replicate.sh is not the script that replays run manifest sha256:\w+",
        ),
        (_remove_manifest_pin, r"the run manifest hashes to sha256:\w+, which no entry"),
        (_remove_admission, r"the bundle holds no admission entry of run sha256:\w+"),
    ],
    ids=[
        "entry-byte",
        "proof-hash",
        "checkpoint-signature",
        "checkpoint-size",
        "cosignature-removed",
        "inputs-document",
        "run-manifest",
        "replicate-sh",
        "manifest-pin-removed",
        "admission-removed",
    ],
)
def test_every_altered_field_is_refused_naming_what_is_wrong(
    proved: Proved, change: Callable[[dict[str, Any]], None], refusal: str
) -> None:
    run = proved.verify(proved.altered(change))
    assert run.returncode == EXIT_INTEGRITY, run.describe()
    line = run.error_line()
    assert re.search(refusal, line), line


def test_a_key_that_is_not_the_vaults_is_refused(proved: Proved) -> None:
    other = str(SigningKey.generate(ORIGIN).verifier())
    run = run_vault(
        "bundle",
        "verify",
        str(proved.run_bundle),
        "--key",
        other,
        state_home=proved.folder / "reviewer",
    )
    assert run.returncode == EXIT_INTEGRITY
    key, _ = _labels(proved)
    other_label = "+".join(other.split("+")[:2])
    assert run.error_line() == (
        f"vault: checkpoint is not signed by key {other_label} (signed only by {key}, "
        f"{_labels(proved)[1]})"
    )


def test_a_dataset_bundle_with_another_manifest_is_refused(proved: Proved) -> None:
    bundle = json.loads((proved.folder / "dataset.bundle").read_bytes())
    data = base64.b64decode(bundle["documents"]["datasetManifest"])
    bundle["documents"]["datasetManifest"] = base64.b64encode(data + b" ").decode()
    path = proved.folder / "dataset-altered.bundle"
    path.write_text(json.dumps(bundle))
    run = proved.verify(path)
    assert run.returncode == EXIT_INTEGRITY
    assert f"not to {proved.dataset}: it was altered" in run.error_line()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not json at all", "is not UTF-8 JSON"),
        (b"[1, 2]", "is not a JSON object"),
        (b'{"mediaType": "application/json"}', "not a pinvault bundle: mediaType"),
        (
            b'{"mediaType": "application/vnd.pinvault.bundle.v2+json"}',
            "bundle format version 2 is not supported: this vault reads version 1",
        ),
        (
            b'{"mediaType": "application/vnd.pinvault.bundle.v1+json", "subject": {}}',
            "field 'documents' is missing",
        ),
    ],
    ids=["not-json", "not-object", "other-media-type", "version-2", "missing-field"],
)
def test_a_file_that_is_no_bundle_is_one_line(
    proved: Proved, content: bytes, expected: str
) -> None:
    path = proved.folder / "bad.bundle"
    path.write_bytes(content)
    run = proved.verify(path)
    assert run.returncode == EXIT_INVALID
    line = run.error_line()
    assert line.startswith(f"vault: INVALID_ARGUMENT: {path}: ")
    assert expected in line


def test_a_bundle_with_bad_base64_or_a_bad_index_is_one_line(proved: Proved) -> None:
    def bad_base64(bundle: dict[str, Any]) -> None:
        bundle["tlogEntries"][1]["inclusionProof"][0] = "not base64!"

    def bad_index(bundle: dict[str, Any]) -> None:
        bundle["tlogEntries"][0]["logIndex"] = -1

    run = proved.verify(proved.altered(bad_base64))
    assert run.returncode == EXIT_INVALID
    assert "tlogEntries[1].inclusionProof[0]: not standard base64" in run.error_line()
    run = proved.verify(proved.altered(bad_index))
    assert run.returncode == EXIT_INVALID
    assert "tlogEntries[0].logIndex: expected an integer 0 to 2^53-1, found -1" in run.error_line()
    run = proved.verify(proved.folder / "absent.bundle")
    assert run.returncode == EXIT_IO
    assert run.error_line().startswith("vault: No such file or directory")


def test_what_the_vault_cannot_bundle_is_one_line(start_vault: StartVault, tmp_path: Path) -> None:
    server = start_vault()
    out = str(tmp_path / "x.bundle")
    unknown = "sha256:" + "ab" * 32
    run = server.run("bundle", unknown, "-o", out)
    assert run.returncode == EXIT_NOT_FOUND
    assert run.error_line() == f"vault: NOT_FOUND: the vault holds no entry naming {unknown}"
    run = server.run("bundle", "#7", "-o", out)
    assert run.returncode == EXIT_NOT_FOUND
    assert run.error_line() == (
        "vault: NOT_FOUND: no entry 7: the ledger holds no entry at that index"
    )
    run = server.run("bundle", unknown)
    assert run.returncode == EXIT_INVALID
    assert "say where to write the bundle with -o FILE" in run.error_line()
    assert not (tmp_path / "x.bundle").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "vault"]


def test_a_run_not_yet_sealed_is_bundled_with_its_inputs_alone(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.csv").write_bytes(b"x\n1\n")
    with server.client() as client:
        image = str(client.put(b"an unsealed run's image").blob.sha256)
        client.pin("image", image)
        dataset = add_dataset(client, tmp_path / "data", name="x").digest
        run_id = client.admit(image=image, dataset=dataset, seed=5, team="vision").run_id
    path = tmp_path / "unsealed.bundle"
    server.run("bundle", run_id, "-o", str(path)).ok()
    server.stop()
    bundle = json.loads(path.read_bytes())
    assert sorted(bundle["documents"]) == ["runInputs"]
    key = str(server.signing_key().verifier())
    run = run_vault("bundle", "verify", str(path), "--key", key, state_home=tmp_path / "r").ok()
    assert run.stdout.startswith(f"run {run_id}: 1 entry proven in checkpoint ")
    assert run.stdout.endswith("; inputs document match\n")
