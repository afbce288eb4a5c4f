"""Admission against a real `vault serve`: a job is admitted only on pinned inputs whose content
is present and intact, the same inputs are the same run id, admission pins the run, and a team
runs at most two replays at once even when the requests race (on SQLite and PostgreSQL)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, run_vault
from vault.client import Admission, VaultClient
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
)
from vault.ledger.runid import RunInputs
from vault.runs.pins import check_input
from vault.store.image import MAX_LISTED_MANIFESTS
from vault.store.manifest import FileEntry, build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb

# Re-hash inputs on every admission, so a damaged byte is caught by the next job.
ALWAYS_VERIFY = {"PINVAULT_ADMISSION_VERIFY_INTERVAL": "0"}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Lab:
    """A vault with a pinned image and dataset, as a lab's would have before its first job."""

    def __init__(self, server: VaultServer, team: str = "vision") -> None:
        self.server = server
        self.client = self.client_for(team)
        self.image_bytes = b"image layers " + os.urandom(64)
        self.image = self.pinned("image", self.image_bytes)
        files = {"train.bin": os.urandom(5000), "labels.csv": b"a,1\nb,2\n"}
        entries = []
        for path, data in files.items():
            entries.append(FileEntry(path, len(data), 0o644, self.put(data)))
        self.dataset = self.pinned("dataset", encode_manifest(build_manifest(entries)))
        self.config = self.pinned("config", b"lr = 0.1\n")

    def client_for(self, team: str) -> VaultClient:
        return VaultClient(self.server.address, author=f"{team}-user", team=team, timeout=60)

    def put(self, data: bytes) -> str:
        return str(self.client.put(data).blob.sha256)

    def pinned(self, kind: str, data: bytes) -> str:
        digest = self.put(data)
        self.client.pin(kind, digest)
        return digest

    def admit(self, **changes: str | int) -> Admission:
        inputs: dict[str, str | int] = {
            "image": self.image,
            "dataset": self.dataset,
            "config": self.config,
            "seed": 0xC0FFEE,
        }
        inputs.update(changes)
        return self.client.admit(**inputs)  # type: ignore[arg-type]

    def blob_path(self, digest: str) -> Path:
        hex_ = digest.partition(":")[2]
        return self.server.data_dir / "hot" / "blobs" / hex_[:2] / hex_


@pytest.fixture
def lab(start_vault: StartVault) -> Iterator[Lab]:
    server = start_vault(env=ALWAYS_VERIFY)
    lab = Lab(server)
    yield lab
    lab.client.close()


# -- admitted -------------------------------------------------------------------------------


def test_a_job_on_pinned_inputs_is_admitted_and_its_run_pinned(lab: Lab) -> None:
    size_before = lab.client.checkpoint().size
    admission = lab.admit()

    inputs = RunInputs(lab.image, lab.dataset, 0xC0FFEE, lab.config)
    # The run id is the digest of the inputs with the vault's nonce: not the bare inputs'.
    assert admission.inputs.bare == inputs and len(admission.inputs.nonce) == 32
    assert admission.run_id == admission.inputs.run_id == sha256(admission.inputs.encode())
    assert admission.run_id != inputs.run_id
    assert admission.new and admission.seed == 0xC0FFEE and admission.lease == ""
    entry = admission.entry.entry
    assert entry.index == size_before
    assert entry.kind == "run"
    assert entry.subjects == (admission.run_id, lab.image, lab.dataset, lab.config)
    assert dict(entry.meta) == {"stage": "admitted", "seed": str(0xC0FFEE), "team": "vision"}
    assert entry.author == "vision-user"
    # The run id names a stored blob: the inputs document anyone can read back.
    assert lab.client.get(admission.run_id, lab.server.base / "inputs.json").sha256
    assert RunInputs.decode((lab.server.base / "inputs.json").read_bytes()) == admission.inputs
    assert [p.entry.index for p in lab.client.lookup(admission.run_id)] == [entry.index]


def test_the_same_inputs_are_the_same_experiment(lab: Lab) -> None:
    first = lab.admit()
    size = lab.client.checkpoint().size
    again = lab.admit(seed="0xc0ffee")  # the same seed, spelt another way

    assert again.run_id == first.run_id and not again.new
    assert again.entry.entry == first.entry.entry
    assert lab.client.checkpoint().size == size, "admitting the same run again pinned nothing"


@pytest.mark.parametrize("change", ["seed", "image", "dataset", "config"])
def test_any_changed_input_is_a_new_run(lab: Lab, change: str) -> None:
    first = lab.admit()
    other: str | int
    if change == "seed":
        other = 1
    elif change == "dataset":
        other = lab.pinned("dataset", encode_manifest(build_manifest([])))
    else:
        other = lab.pinned(change, f"another {change}".encode())
    second = lab.admit(**{change: other})

    assert second.new and second.run_id != first.run_id
    assert second.entry.entry.index > first.entry.entry.index


def test_the_config_is_optional(lab: Lab) -> None:
    admission = lab.admit(config="")
    assert admission.new
    assert admission.entry.entry.subjects == (admission.run_id, lab.image, lab.dataset)


def test_an_image_kept_in_a_registry_is_admitted_on_its_pin(lab: Lab) -> None:
    registry_image = sha256(b"an OCI manifest the vault never stored")
    lab.client.pin("image", registry_image, external=True)

    admission = lab.admit(image=registry_image)
    assert admission.new and admission.entry.entry.external


# -- refused --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("image", "", "no image digest"),
        ("dataset", "", "no dataset digest"),
        ("image", "ubuntu:22.04", "floating name"),
        ("image", "pytorch/pytorch:latest", "floating name"),
        ("dataset", "sha256:1234", "wrong length"),
        ("seed", "-1", "out of range"),
        ("seed", "lucky", "bad seed"),
    ],
)
def test_malformed_inputs_are_refused_naming_what_is_wrong(
    lab: Lab, field: str, value: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        lab.admit(**{field: value})


def test_the_server_refuses_malformed_inputs_too(lab: Lab) -> None:
    """A scheduler need not use this client: the server checks the same things itself."""
    request = pb.AdmitRequest(image="ubuntu:22.04", dataset=lab.dataset, seed="1", team="x")
    with pytest.raises(grpc.RpcError) as caught:
        lab.client.admission.Admit(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "floating name" in (caught.value.details() or "")


def test_an_unpinned_input_is_refused(lab: Lab) -> None:
    stored_not_pinned = lab.put(b"an image nobody pinned")
    with pytest.raises(FailedPrecondition, match=f"image {stored_not_pinned} is not pinned"):
        lab.admit(image=stored_not_pinned)
    never_seen = sha256(b"never seen")
    with pytest.raises(FailedPrecondition, match=f"dataset {never_seen} is not pinned"):
        lab.admit(dataset=never_seen)


def test_an_input_pinned_as_another_kind_is_refused(lab: Lab) -> None:
    with pytest.raises(FailedPrecondition, match="is not pinned as an image"):
        lab.admit(image=lab.dataset)


def test_an_input_whose_bytes_are_gone_is_refused(lab: Lab) -> None:
    lab.blob_path(lab.image).unlink()
    with pytest.raises(FailedPrecondition, match=f"image {lab.image} .*bytes are missing"):
        lab.admit()


def test_an_input_whose_bytes_fail_their_check_is_refused(lab: Lab) -> None:
    path = lab.blob_path(lab.config)
    damaged = bytearray(path.read_bytes())
    damaged[0] ^= 0x20
    path.chmod(0o644)
    path.write_bytes(damaged)
    with pytest.raises(IntegrityError, match=f"config {lab.config} fails its check"):
        lab.admit()


def test_a_dataset_missing_files_is_refused(lab: Lab) -> None:
    absent = FileEntry("shard-7.bin", 10, 0o644, sha256(b"never stored"))
    present = FileEntry("ok.txt", 3, 0o644, lab.put(b"ok\n"))
    dataset = lab.pinned("dataset", encode_manifest(build_manifest([absent, present])))
    with pytest.raises(FailedPrecondition, match=r"missing 1 of its 2 files.*shard-7\.bin"):
        lab.admit(dataset=dataset)


def test_a_run_id_that_does_not_match_the_inputs_is_refused(lab: Lab) -> None:
    claimed = lab.admit(seed=1).run_id
    with pytest.raises(InvalidArgument, match=f"run id {claimed} does not name these inputs"):
        lab.admit(seed=2, run_id=claimed)


# -- replays --------------------------------------------------------------------------------


def publish_manifest(lab: Lab, admission: Admission) -> str:
    """A published run manifest, as the run library pins one when a run finishes."""
    manifest = lab.put(b'{"run":"' + admission.run_id.encode() + b'"}')
    lab.client.pin("run", [manifest, admission.run_id], meta={"stage": "manifest"})
    return manifest


def race(calls: int, fn: object) -> list[object]:
    """Run `fn()` from `calls` threads released together; each result or exception."""
    barrier = threading.Barrier(calls)
    results: list[object] = [None] * calls

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn()  # type: ignore[operator]
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check_replay_quota(lab: Lab) -> None:
    original = lab.admit()
    manifest = publish_manifest(lab, original)

    results = race(6, lambda: lab.admit(replay_of=manifest))
    granted = [r for r in results if isinstance(r, Admission)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(granted) == 2 and len(refused) == 4, results
    assert all(g.run_id == original.run_id and g.lease for g in granted)
    assert "team 'vision' already runs 2 replays (at most 2 at once)" in str(refused[0])

    # Another team has its own two slots.
    other = lab.client_for("speech")
    assert other.admit(
        image=lab.image, dataset=lab.dataset, config=lab.config, seed=0xC0FFEE, replay_of=manifest
    ).lease

    # Only the team that holds a slot gives it back; then the next replay may start.
    with pytest.raises(PermissionDenied, match="another team"):
        other.release_replay(granted[0].lease)
    lab.client.release_replay(granted[0].lease)
    with pytest.raises(NotFound, match="no running replay"):
        lab.client.release_replay(granted[0].lease)
    assert lab.admit(replay_of=manifest).lease
    with pytest.raises(QuotaExceeded):
        lab.admit(replay_of=manifest)


def test_a_team_runs_at_most_two_replays_at_once(lab: Lab) -> None:
    check_replay_quota(lab)


@pytest.mark.postgres
def test_the_replay_quota_holds_across_servers_on_postgresql(
    start_vault: StartVault, postgres_url: str
) -> None:
    first = start_vault("a", database=postgres_url, env=ALWAYS_VERIFY)
    start_vault("b", database=postgres_url, env=ALWAYS_VERIFY)
    lab = Lab(first)
    check_replay_quota(lab)


def test_a_replay_must_name_a_published_manifest_of_its_run(lab: Lab) -> None:
    original = lab.admit()
    with pytest.raises(FailedPrecondition, match="is not a published run manifest"):
        lab.admit(replay_of=lab.dataset)
    manifest = publish_manifest(lab, original)
    with pytest.raises(InvalidArgument, match=f"manifest {manifest} is of run {original.run_id}"):
        lab.admit(seed=7, replay_of=manifest)


def test_an_expired_replay_gives_its_slot_back(start_vault: StartVault) -> None:
    lab = Lab(start_vault(env={"PINVAULT_ADMISSION_REPLAY_LEASE": "0.5"}))
    manifest = publish_manifest(lab, lab.admit())
    lab.admit(replay_of=manifest)
    lab.admit(replay_of=manifest)
    with pytest.raises(QuotaExceeded):
        lab.admit(replay_of=manifest)
    threading.Event().wait(0.6)
    assert lab.admit(replay_of=manifest).lease


# -- the command ----------------------------------------------------------------------------


def test_vault_admit_prints_its_run_on_one_line_for_a_scheduler(lab: Lab) -> None:
    args = ["--image", lab.image, "--dataset", lab.dataset, "--seed", "0xC0FFEE"]
    run = lab.server.run("admit", *args, "--team", "vision", "--porcelain").ok()
    expected = run.stdout.split()[0].removeprefix("run_id=")
    # The run and seed alone on the first line, which is all an earlier plugin reads.
    assert run.stdout == (
        f"run_id={expected} seed={0xC0FFEE}\nimage_blobs=0 image_external=false\n"
    )
    # The vault's nonce is in the run id: the bare inputs' digest is not it.
    assert expected != RunInputs(lab.image, lab.dataset, 0xC0FFEE).run_id

    shown = lab.server.run("admit", *args, "--team", "vision").ok().stdout
    assert expected in shown and "admitted before" in shown

    refused = lab.server.run(
        "admit", "--image", "ubuntu:22.04", "--dataset", lab.dataset, "--seed", "1", "--porcelain"
    )
    assert refused.error_line() == (
        "vault: INVALID_ARGUMENT: image 'ubuntu:22.04' is a floating name, not a digest: a tag "
        "can move, so a run names its image by sha256:<64 hex digits>"
    )
    assert refused.stdout == ""


def test_vault_admit_fails_closed_when_the_vault_is_down(tmp_path: Path) -> None:
    run = run_vault(
        "admit",
        "--image",
        sha256(b"i"),
        "--dataset",
        sha256(b"d"),
        "--seed",
        "1",
        server="127.0.0.1:1",
        state_home=tmp_path,
        env={"PINVAULT_CLIENT_TIMEOUT": "5"},
    )
    assert run.error_line().startswith("vault: UNAVAILABLE: ")
    assert run.stdout == ""


# -- the inputs document ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (b'{"dataset":"x"', "not UTF-8 JSON"),
        (b"[]", "not a JSON object"),
        (b'{"type":"pinvault.run-inputs","type":"x"}', "appears twice"),
        (b'{"type":"something else","v":1}', "not a pinvault.run-inputs document"),
        (b" " * 5000, "too large|at most"),
    ],
)
def test_a_malformed_inputs_document_is_refused(document: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        RunInputs.decode(document)


def test_only_the_canonical_inputs_document_is_accepted() -> None:
    inputs = RunInputs(sha256(b"i"), sha256(b"d"), 2**64 - 1, sha256(b"c"))
    assert RunInputs.decode(inputs.encode()) == inputs
    spaced = inputs.encode().replace(b",", b", ")
    with pytest.raises(InvalidArgument, match="not in canonical form"):
        RunInputs.decode(spaced)


# -- images held whole ----------------------------------------------------------------------

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def _descriptor(media_type: str, data: bytes) -> dict[str, str | int]:
    return {"mediaType": media_type, "digest": sha256(data), "size": len(data)}


def _image_manifest(config: bytes, layers: list[bytes]) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": _descriptor("application/vnd.oci.image.config.v1+json", config),
            "layers": [
                _descriptor("application/vnd.oci.image.layer.v1.tar+gzip", layer)
                for layer in layers
            ],
        }
    ).encode()


def test_an_image_pinned_as_an_oci_manifest_is_admitted_only_once_every_layer_is_held(
    lab: Lab,
) -> None:
    """What `vault run`, the webhook (both through check_input) and admission say of an image
    whose manifest names a layer the vault does not hold: refused, naming the layer; held
    whole once it is put."""
    config, held, absent = b'{"architecture":"amd64"}', os.urandom(3000), os.urandom(2000)
    lab.put(config)
    lab.put(held)
    manifest = _image_manifest(config, [held, absent])
    image = lab.pinned("image", manifest)

    with pytest.raises(FailedPrecondition) as refused:
        lab.admit(image=image)
    assert f"image {image} is not held whole" in str(refused.value)
    assert f"(first: layer {sha256(absent)}, 2000 bytes)" in str(refused.value)
    with pytest.raises(FailedPrecondition, match=f"first: layer {sha256(absent)}"):
        check_input(lab.client, "image", image)

    lab.put(absent)
    check_input(lab.client, "image", image)
    admitted = lab.admit(image=image)
    assert admitted.new
    # The admission says what it found: the config and both layers held.
    assert admitted.image_blobs == 3
    # Within the verify interval the image is not read again, and the answer says the same.
    assert lab.admit(image=image).image_blobs == 3


def test_a_manifest_stating_another_size_for_a_held_layer_is_not_held(lab: Lab) -> None:
    config, layer = b"{}", os.urandom(1000)
    lab.put(config)
    lab.put(layer)
    document = json.loads(_image_manifest(config, [layer]))
    document["layers"][0]["size"] = 999
    image = lab.pinned("image", json.dumps(document).encode())

    with pytest.raises(FailedPrecondition, match=f"first: layer {sha256(layer)}, 999 bytes"):
        lab.admit(image=image)


def test_an_image_index_is_held_only_when_every_manifest_it_lists_is(lab: Lab) -> None:
    config, layer, other_layer = b"{}", os.urandom(500), os.urandom(600)
    for data in (config, layer):
        lab.put(data)
    amd64 = _image_manifest(config, [layer])
    arm64 = _image_manifest(config, [other_layer])
    lab.put(amd64)
    lab.put(arm64)
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [_descriptor(OCI_MANIFEST, amd64), _descriptor(OCI_MANIFEST, arm64)],
        }
    ).encode()
    image = lab.pinned("image", index)

    # Every manifest is held, but one of them names a layer that is not.
    with pytest.raises(FailedPrecondition) as refused:
        lab.admit(image=image)
    assert f"blobs {sha256(arm64)} names are not in the store" in str(refused.value)
    assert f"first: layer {sha256(other_layer)}" in str(refused.value)
    with pytest.raises(FailedPrecondition, match=f"first: layer {sha256(other_layer)}"):
        check_input(lab.client, "image", image)

    lab.put(other_layer)
    admitted = lab.admit(image=image)
    assert admitted.new
    # Two manifests, and the config and layer each names.
    assert admitted.image_blobs == 6


def test_an_image_pinned_as_one_file_is_held_as_it_was(lab: Lab) -> None:
    """A SIF or tarball image is its one blob: nothing more is asked of it."""
    check_input(lab.client, "image", lab.image)
    admitted = lab.admit()
    assert admitted.new
    assert admitted.image_blobs == 0


def test_an_index_listing_more_manifests_than_a_check_reads_is_refused(lab: Lab) -> None:
    """A writer cannot make every admission read an unbounded number of manifests."""
    config = b"{}"
    lab.put(config)
    manifests = [_image_manifest(config, []) + b" " * n for n in range(MAX_LISTED_MANIFESTS + 1)]
    for manifest in manifests:
        lab.put(manifest)
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [_descriptor(OCI_MANIFEST, m) for m in manifests],
        }
    ).encode()
    image = lab.pinned("image", index)

    with pytest.raises(FailedPrecondition, match=f"lists more than {MAX_LISTED_MANIFESTS}"):
        lab.admit(image=image)
