"""The vault's registry with the clients people use: `skopeo`, `podman` and `oras`, each against a
real `vault serve` over plain HTTP on loopback, each through the registry's token endpoint (a
401 with a Bearer challenge, a token for the vault token as Basic's password); and a tampering
proxy in front of the registry, whose changed layer byte each client's own digest check must
catch with nothing written as good."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services import oras
from tests.services.registry_proxy import TamperingRegistryProxy
from tests.test_registry import CREDENTIALS, Vault, _vault, sha256

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG = "application/vnd.oci.image.config.v1+json"
RUN_TIMEOUT = 300.0


@dataclass(frozen=True)
class Layout:
    """An OCI image layout on disk, with the digests of what it holds."""

    folder: Path
    tag: str
    manifest: str
    config: str
    layers: tuple[str, ...]

    @property
    def blobs(self) -> set[str]:
        return {self.manifest, self.config, *self.layers}

    @property
    def reference(self) -> str:
        return f"oci:{self.folder}:{self.tag}"


def _blob(folder: Path, data: bytes) -> str:
    digest = sha256(data)
    path = folder / "blobs" / "sha256" / digest.removeprefix("sha256:")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _layer(name: str, content: bytes) -> tuple[bytes, bytes]:
    """A tar holding one file, and its gzip (both made the same way every time)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(content), 0, 0o644
        tar.addfile(info, io.BytesIO(content))
    return raw.getvalue(), gzip.compress(raw.getvalue(), mtime=0)


def write_layout(folder: Path, tag: str, contents: Sequence[bytes]) -> Layout:
    """An image of one gzipped tar layer per item of `contents`, as an OCI image layout."""
    (folder / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (folder / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    diff_ids, layers = [], []
    for i, content in enumerate(contents):
        raw, packed = _layer(f"data/{i}.bin", content)
        diff_ids.append(sha256(raw))
        layers.append({"mediaType": LAYER, "digest": _blob(folder, packed), "size": len(packed)})
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": CONFIG, "digest": _blob(folder, config), "size": len(config)},
            "layers": layers,
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": _blob(folder, manifest),
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (folder / "index.json").write_text(json.dumps(index))
    return Layout(
        folder,
        tag,
        sha256(manifest),
        sha256(config),
        tuple(str(layer["digest"]) for layer in layers),
    )


def read_layout(folder: Path, tag: str) -> tuple[str, set[str]]:
    """The manifest digest `tag` names in the layout at `folder`, and every blob it holds, each
    checked against its name."""
    index = json.loads((folder / "index.json").read_text())
    (manifest,) = [
        m
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag
    ]
    return manifest["digest"], held_blobs(folder)


def held_blobs(folder: Path) -> set[str]:
    """The blobs of a layout, each asserted to hold the bytes its name is the digest of."""
    held = set()
    for path in (folder / "blobs" / "sha256").glob("*"):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name, path
        held.add(f"sha256:{path.name}")
    return held


def _run(
    command: Sequence[str], env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


class Skopeo:
    """`skopeo` with a policy of its own (this test checks digests, not signatures) and no
    credentials of the machine's user."""

    def __init__(self, home: Path) -> None:
        command = shutil.which("skopeo")
        assert command, "skopeo is needed (Debian's skopeo; scripts/test installs it)"
        home.mkdir(parents=True, exist_ok=True)
        self.policy = home / "policy.json"
        self.policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
        self.auth = home / "auth.json"
        self.auth.write_text('{"auths": {}}')
        self.command = command

    def copy(
        self, source: str, destination: str, *options: str
    ) -> subprocess.CompletedProcess[str]:
        return _run(
            [
                self.command,
                "--policy",
                str(self.policy),
                "copy",
                "--retry-times=0",
                f"--authfile={self.auth}",
                *options,
                source,
                destination,
            ],
            env={"REGISTRY_AUTH_FILE": str(self.auth)},
        )

    def delete(self, reference: str, *options: str) -> subprocess.CompletedProcess[str]:
        return _run(
            [
                self.command,
                "--policy",
                str(self.policy),
                "delete",
                "--retry-times=0",
                f"--authfile={self.auth}",
                *options,
                reference,
            ],
            env={"REGISTRY_AUTH_FILE": str(self.auth)},
        )


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vault]:
    with _vault(tmp_path_factory.mktemp("registry-clients"), CREDENTIALS) as vault:
        yield vault


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    contents = [hashlib.sha256(b"%d" % i).digest() * (32768 * (i + 1)) for i in range(3)]
    return write_layout(tmp_path_factory.mktemp("image") / "layout", "v1", contents)


def test_skopeo_copies_an_image_into_the_vault_and_back_digest_for_digest(
    vault: Vault, image: Layout, tmp_path: Path
) -> None:
    skopeo = Skopeo(tmp_path / "skopeo")
    address = vault.registry.address
    pushed = skopeo.copy(
        image.reference,
        f"docker://{address}/lab/skopeo:v1",
        "--preserve-digests",
        "--dest-tls-verify=false",
        f"--dest-creds=pusher:{vault.writer}",
    )
    assert pushed.returncode == 0, pushed.stderr
    (pinned,) = vault.admin.lookup(image.manifest)
    assert pinned.entry.kind == "image" and pinned.entry.author == "pusher"
    assert dict(pinned.entry.meta)["repository"] == "lab/skopeo"

    out = tmp_path / "pulled"
    pulled = skopeo.copy(
        f"docker://{address}/lab/skopeo:v1",
        f"oci:{out}:v1",
        "--src-tls-verify=false",
        f"--src-creds=puller:{vault.reader}",
    )
    assert pulled.returncode == 0, pulled.stderr
    manifest, blobs = read_layout(out, "v1")
    assert manifest == image.manifest
    assert blobs == image.blobs


def test_skopeo_deletes_an_image_it_pushed_and_the_vault_keeps_the_pin_and_bytes(
    vault: Vault, image: Layout, tmp_path: Path
) -> None:
    skopeo = Skopeo(tmp_path / "skopeo")
    target = f"docker://{vault.registry.address}/lab/skopeo-delete:v1"
    pushed = skopeo.copy(
        image.reference,
        target,
        "--preserve-digests",
        "--dest-tls-verify=false",
        f"--dest-creds=pusher:{vault.writer}",
    )
    assert pushed.returncode == 0, pushed.stderr
    # skopeo asks the token endpoint for `*`: a reader's token grants it pull alone.
    denied = skopeo.delete(target, "--tls-verify=false", f"--creds=puller:{vault.reader}")
    assert denied.returncode != 0, denied.stderr
    assert vault.registry.request("HEAD", "/v2/lab/skopeo-delete/manifests/v1").status == 200

    deleted = skopeo.delete(target, "--tls-verify=false", f"--creds=pusher:{vault.writer}")
    assert deleted.returncode == 0, deleted.stderr
    for reference in ("v1", image.manifest):
        head = vault.registry.request("HEAD", f"/v2/lab/skopeo-delete/manifests/{reference}")
        assert head.status == 404, reference
    # skopeo deletes by digest: the manifest is withdrawn from the repository, by the caller;
    # its pin and every byte stay.
    withdrawn = [p.entry for p in vault.admin.lookup(image.manifest) if p.entry.kind == "withdraw"]
    assert [(e.author, dict(e.meta)) for e in withdrawn] == [
        ("pusher", {"repository": "lab/skopeo-delete"})
    ]
    assert vault.admin.find_missing(sorted(image.blobs)) == []


def test_skopeo_with_a_wrong_token_is_refused_and_nothing_is_pinned(
    vault: Vault, tmp_path: Path
) -> None:
    skopeo = Skopeo(tmp_path / "skopeo")
    other = write_layout(tmp_path / "other", "v1", [b"a layer never let in" * 1000])
    address = vault.registry.address
    forged = vault.writer[:-8] + "00000000"
    refused = skopeo.copy(
        other.reference,
        f"docker://{address}/lab/refused:v1",
        "--dest-tls-verify=false",
        f"--dest-creds=pusher:{forged}",
    )
    assert refused.returncode != 0
    assert "unauthorized" in refused.stderr.lower() or "401" in refused.stderr, refused.stderr
    # A reader's token is let in and may pull, but not push.
    denied = skopeo.copy(
        other.reference,
        f"docker://{address}/lab/refused:v1",
        "--dest-tls-verify=false",
        f"--dest-creds=puller:{vault.reader}",
    )
    assert denied.returncode != 0, denied.stderr
    assert vault.admin.find_missing(sorted(other.blobs)) == sorted(other.blobs)
    tags = vault.registry.request("GET", "/v2/lab/refused/tags/list")
    assert tags.status == 404


def test_a_layer_changed_on_the_way_fails_skopeos_digest_check_and_nothing_is_kept(
    vault: Vault, image: Layout, tmp_path: Path
) -> None:
    skopeo = Skopeo(tmp_path / "skopeo")
    pushed = skopeo.copy(
        image.reference,
        f"docker://{vault.registry.address}/lab/tampered:v1",
        "--preserve-digests",
        "--dest-tls-verify=false",
        f"--dest-creds=pusher:{vault.writer}",
    )
    assert pushed.returncode == 0, pushed.stderr
    layer = image.layers[1]
    out = tmp_path / "pulled"
    with TamperingRegistryProxy(vault.registry.address) as proxy:
        proxy.tamper(layer)
        pulled = skopeo.copy(
            f"docker://{proxy.address}/lab/tampered:v1",
            f"oci:{out}:v1",
            "--src-tls-verify=false",
            f"--src-creds=puller:{vault.reader}",
        )
    assert proxy.served == [layer], (proxy.served, pulled.stderr)
    # skopeo was sent to the token endpoint (through the proxy: the realm is where it called).
    assert any(path.startswith("/token?") for path in proxy.paths), proxy.paths
    assert pulled.returncode != 0
    assert "digest did not match" in pulled.stderr.lower(), pulled.stderr
    assert layer in pulled.stderr
    # Nothing is in the destination as good: no tag names the image, and whatever blobs were
    # written hold the bytes their names are the digests of (so not the changed layer's).
    index = out / "index.json"
    if index.exists():
        assert json.loads(index.read_text()).get("manifests", []) == []
    if (out / "blobs").exists():
        assert layer not in held_blobs(out)


class Podman:
    """`podman` with a store of its own (the vfs driver, which needs no mounts) under `root`,
    its run folder `run` (podman wants that path short), and no credentials or configuration
    of the machine's user. Pulls and pushes run no container."""

    def __init__(self, root: Path, run: Path, policy: Path) -> None:
        command = shutil.which("podman")
        assert command, "podman is needed (Debian's podman; scripts/test installs it)"
        self.command = command
        self.root = root
        self.run = run
        self.policy = policy
        root.mkdir(parents=True, exist_ok=True)
        self.auth = root / "auth.json"
        self.auth.write_text('{"auths": {}}')
        self.registries = root / "registries.conf"
        self.registries.write_text("unqualified-search-registries = []\n")

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _run(
            [
                self.command,
                "--root",
                str(self.root / "storage"),
                "--runroot",
                str(self.run),
                "--storage-driver",
                "vfs",
                "--events-backend",
                "none",
                "--cgroup-manager",
                "cgroupfs",
                *args,
            ],
            env={
                "REGISTRY_AUTH_FILE": str(self.auth),
                "CONTAINERS_REGISTRIES_CONF": str(self.registries),
                "CONTAINERS_POLICY_JSON": str(self.policy),
                "XDG_RUNTIME_DIR": str(self.run),
            },
        )


def test_podman_pulls_an_image_from_the_vault_and_pushes_it_back(
    vault: Vault, image: Layout, tmp_path: Path
) -> None:
    skopeo = Skopeo(tmp_path / "skopeo")
    address = vault.registry.address
    pushed = skopeo.copy(
        image.reference,
        f"docker://{address}/lab/podman:v1",
        "--preserve-digests",
        "--dest-tls-verify=false",
        f"--dest-creds=pusher:{vault.writer}",
    )
    assert pushed.returncode == 0, pushed.stderr
    run = Path(tempfile.mkdtemp(prefix="pv-podman-"))
    try:
        _podman_round_trip(vault, image, Podman(tmp_path / "podman", run, skopeo.policy))
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _podman_round_trip(vault: Vault, image: Layout, podman: Podman) -> None:
    address = vault.registry.address
    pulled = podman(
        "pull",
        "--tls-verify=false",
        f"--creds=puller:{vault.reader}",
        f"docker://{address}/lab/podman:v1",
    )
    assert pulled.returncode == 0, pulled.stderr
    inspected = podman("image", "inspect", f"{address}/lab/podman:v1")
    assert inspected.returncode == 0, inspected.stderr
    (described,) = json.loads(inspected.stdout)
    assert described["Digest"] == image.manifest
    config = json.loads((image.folder / "blobs" / image.config.replace(":", "/")).read_bytes())
    assert described["RootFS"]["Layers"] == config["rootfs"]["diff_ids"]

    again = podman(
        "push",
        "--tls-verify=false",
        f"--creds=pusher:{vault.writer}",
        f"{address}/lab/podman:v1",
        f"docker://{address}/lab/podman-again:v1",
    )
    assert again.returncode == 0, again.stderr
    manifest = vault.registry.request("GET", "/v2/lab/podman-again/manifests/v1")
    assert manifest.status == 200, manifest
    (pinned,) = vault.admin.lookup(manifest.headers["docker-content-digest"])
    assert pinned.entry.author == "pusher"
    assert dict(pinned.entry.meta)["repository"] == "lab/podman-again"


def test_oras_pushes_an_artifact_attaches_a_referrer_and_discovers_it(
    vault: Vault, tmp_path: Path
) -> None:
    binary = oras.build()
    home = tmp_path / "oras"
    home.mkdir()
    (home / "weights.bin").write_bytes(b"model weights " * 4096)
    (home / "sbom.json").write_text('{"packages": []}')
    address = vault.registry.address
    login = ("--plain-http", "--username", "pusher", "--password", vault.writer)
    pushed = oras.run(
        binary,
        home,
        "push",
        *login,
        "--artifact-type",
        "application/vnd.pinvault.test.model",
        f"{address}/lab/model:v1",
        "weights.bin:application/octet-stream",
    )
    assert pushed.returncode == 0, pushed.stderr
    subject = vault.registry.request("HEAD", "/v2/lab/model/manifests/v1")
    assert subject.status == 200, subject
    subject_digest = subject.headers["docker-content-digest"]
    assert vault.admin.find_missing([sha256(b"model weights " * 4096)]) == []

    attached = oras.run(
        binary,
        home,
        "attach",
        *login,
        "--artifact-type",
        "application/vnd.pinvault.test.sbom",
        f"{address}/lab/model:v1",
        "sbom.json:application/json",
        "--format",
        "json",
    )
    assert attached.returncode == 0, attached.stderr
    referrer = json.loads(attached.stdout)["digest"]
    (pinned,) = vault.admin.lookup(referrer)
    assert dict(pinned.entry.meta)["subject"] == subject_digest

    reader = ("--plain-http", "--username", "puller", "--password", vault.reader)
    discovered = oras.run(
        binary, home, "discover", *reader, "--format", "json", f"{address}/lab/model:v1"
    )
    assert discovered.returncode == 0, discovered.stderr
    listed = json.loads(discovered.stdout)
    assert listed["digest"] == subject_digest
    (found,) = listed["referrers"]
    assert found["digest"] == referrer
    assert found["artifactType"] == "application/vnd.pinvault.test.sbom"
    # Asked for that artifact type only, and for another.
    for kind, expected in (("application/vnd.pinvault.test.sbom", 1), ("application/x-other", 0)):
        filtered = oras.run(
            binary,
            home,
            "discover",
            *reader,
            "--format",
            "json",
            "--artifact-type",
            kind,
            f"{address}/lab/model:v1",
        )
        assert filtered.returncode == 0, filtered.stderr
        assert len(json.loads(filtered.stdout)["referrers"]) == expected
