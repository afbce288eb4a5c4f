"""The container image scripts/build-image makes: its config runs `vault serve` as a user that
is not root, with the data folder as a volume and only the runtime environment installed; run
from its own root file system by runc, as the OCI runtime config umoci derives from the image
says, it serves a client of the project over gRPC (a pin, a get), as that user, writing only to
the volume; and its default listen address, off loopback, is refused in local mode with one
line saying what to set."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services.vault_server import REPO_ROOT
from vault.client import VaultClient

BUILD = REPO_ROOT / "scripts" / "build-image"
IMAGE_UID = 10001
DATA = "/var/lib/pinvault"
BANNER = re.compile(r"pinvault serving on (\S+)")
START_TIMEOUT = 60.0

# A cold build (Debian packages, the locked wheels) takes minutes; scripts/test builds the
# image before the tests, so here it is found in the cache in well under a second.
pytestmark = pytest.mark.timeout(1800)


@dataclass(frozen=True)
class Image:
    layout: Path
    rootfs: Path
    runtime_config: dict[str, Any]

    def config(self) -> dict[str, Any]:
        """The image's config (the OCI image config, not the runtime's)."""
        index = json.loads((self.layout / "index.json").read_text())
        (manifest_ref,) = index["manifests"]
        assert manifest_ref["annotations"]["org.opencontainers.image.ref.name"] == "pinvault"
        manifest = json.loads(self._blob(manifest_ref["digest"]))
        config: dict[str, Any] = json.loads(self._blob(manifest["config"]["digest"]))
        return config

    def _blob(self, digest: str) -> bytes:
        algorithm, _, hex_digest = digest.partition(":")
        data = (self.layout / "blobs" / algorithm / hex_digest).read_bytes()
        assert hashlib.sha256(data).hexdigest() == hex_digest
        return data


@pytest.fixture(scope="module")
def image() -> Image:
    if os.geteuid() != 0:
        pytest.fail("the image is built and run as root (mmdebstrap, runc): run the tests as root")
    built = subprocess.run(
        [str(BUILD)], capture_output=True, text=True, timeout=1500, cwd=REPO_ROOT, check=False
    )
    assert built.returncode == 0, f"scripts/build-image failed:\n{built.stderr}"
    layout = Path(built.stdout.strip().splitlines()[-1])
    unpacked = layout.parent / "unpacked"
    return Image(layout, unpacked / "rootfs", json.loads((unpacked / "config.json").read_text()))


def print_key(tree: Path) -> str:
    run = subprocess.run(
        [str(tree / "scripts" / "build-image"), "--print-key"],
        capture_output=True,
        text=True,
        cwd=tree,
        check=True,
    )
    return run.stdout.strip()


def test_the_cache_key_is_the_sources_not_what_a_run_leaves_beside_them(tmp_path: Path) -> None:
    """A fresh clone of this tree finds the image built here; bytecode, caches and a virtual
    environment do not change the key, an edit of a package source does."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True)
    # The build's own files as this tree has them (a clone has them as last committed).
    shutil.copy2(BUILD, clone / "scripts" / "build-image")
    shutil.rmtree(clone / "image", ignore_errors=True)
    shutil.copytree(REPO_ROOT / "image", clone / "image")
    key = print_key(clone)
    assert re.fullmatch(r"[0-9a-f]{32}", key)

    (clone / "vault" / "__pycache__").mkdir(exist_ok=True)
    (clone / "vault" / "__pycache__" / "config.cpython-311.pyc").write_bytes(b"bytecode")
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".cache" / "test").mkdir(parents=True)
    (clone / ".cache" / "test" / "run.log").write_text("a run")
    assert print_key(clone) == key

    source = clone / "vault" / "config.py"
    source.write_text(source.read_text() + "\n# an edit\n")
    assert print_key(clone) != key


@dataclass
class Container:
    """One `runc run` of the image in the foreground, its output in files."""

    name: str
    bundle: Path
    process: subprocess.Popen[bytes]

    @property
    def stdout(self) -> str:
        return (self.bundle / "stdout").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return (self.bundle / "stderr").read_text(errors="replace")

    def pid(self) -> int:
        state = subprocess.run(
            ["runc", "state", self.name], capture_output=True, text=True, check=True
        )
        pid: int = json.loads(state.stdout)["pid"]
        return pid

    def wait_serving(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            match = BANNER.search(self.stdout)
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                pytest.fail(
                    f"the image's vault serve exited with {self.process.returncode}:\n"
                    f"{self.stdout}{self.stderr}"
                )
            time.sleep(0.05)
        pytest.fail(f"the image's vault serve did not serve in {START_TIMEOUT}s:\n{self.stderr}")

    def stop(self) -> int:
        """SIGTERM, as a container engine stops it; its exit status."""
        subprocess.run(["runc", "kill", self.name, "TERM"], capture_output=True, check=False)
        try:
            return self.process.wait(timeout=60)
        finally:
            subprocess.run(["runc", "delete", "--force", self.name], capture_output=True)


@pytest.fixture
def run_image(image: Image, tmp_path: Path) -> Iterator[Any]:
    runc = shutil.which("runc")
    if runc is None:
        pytest.fail("runc is not installed (scripts/test installs it: apt-get install runc)")
    started: list[Container] = []

    def run(env: dict[str, str], data: Path) -> Container:
        """The image as its runtime config says (user, entry point, environment, working
        folder), on its own read-only root, with `data` as its volume and `env` over the
        image's environment."""
        config = json.loads(json.dumps(image.runtime_config))
        config["root"] = {"path": str(image.rootfs), "readonly": True}
        process = config["process"]
        process["terminal"] = False
        # This host's limits as they are: raising one needs CAP_SYS_RESOURCE, which the
        # test machines' sandbox does not grant even to root.
        process.pop("rlimits", None)
        names = {item.split("=", 1)[0]: item for item in process["env"]}
        names.update({name: f"{name}={value}" for name, value in env.items()})
        process["env"] = list(names.values())
        # The host's loopback: the test's client reaches the server there.
        config["linux"]["namespaces"] = [
            n for n in config["linux"]["namespaces"] if n["type"] != "network"
        ]
        mounts = [m for m in config["mounts"] if m["destination"] != DATA]
        mounts.append(
            {"destination": DATA, "type": "bind", "source": str(data), "options": ["rbind", "rw"]}
        )
        mounts.append(
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777"],
            }
        )
        config["mounts"] = mounts
        bundle = tmp_path / f"bundle-{len(started)}"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(config))
        name = f"pinvault-test-{uuid.uuid4().hex[:12]}"
        with open(bundle / "stdout", "wb") as out, open(bundle / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [runc, "run", "--bundle", str(bundle), name],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        container = Container(name, bundle, proc)
        started.append(container)
        return container

    yield run
    for container in started:
        if container.process.poll() is None:
            container.stop()
        subprocess.run(["runc", "delete", "--force", container.name], capture_output=True)


def volume(tmp_path: Path) -> Path:
    """A data folder the image's user owns, as a volume's would be."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, IMAGE_UID, IMAGE_UID)
    return data


def test_the_image_config_runs_vault_serve_as_a_user_that_is_not_root(image: Image) -> None:
    config = image.config()["config"]
    assert config["Entrypoint"] == ["/opt/pinvault/bin/vault", "serve"]
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert DATA in config["Volumes"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PINVAULT_DATA_DIR"] == DATA
    assert env["PINVAULT_SERVER_LISTEN"] == "0.0.0.0:7411"
    passwd = (image.rootfs / "etc" / "passwd").read_text().splitlines()
    assert f"pinvault:x:{IMAGE_UID}:{IMAGE_UID}::{DATA}:/usr/sbin/nologin" in passwd
    volume_folder = (image.rootfs / DATA.lstrip("/")).stat()
    assert (volume_folder.st_uid, volume_folder.st_mode & 0o777) == (IMAGE_UID, 0o700)


def test_the_image_holds_the_locked_runtime_environment_only(image: Image) -> None:
    site = image.rootfs / "opt" / "pinvault" / "lib" / "python3.11" / "site-packages"
    installed = {p.name.split("-", 1)[0].lower() for p in site.glob("*.dist-info") if p.is_dir()}
    for runtime in ("pinvault", "grpcio", "protobuf", "sqlalchemy", "psycopg", "cryptography"):
        assert runtime in installed, f"{runtime} is missing from the image"
    for dev_only in ("pytest", "mypy", "ruff", "torch", "jax", "boto3", "playwright"):
        assert dev_only not in installed, f"{dev_only} (a dev or optional package) is in the image"
    locked = (REPO_ROOT / "uv.lock").read_text()
    grpc = next(p for p in site.glob("grpcio-*.dist-info"))
    version = grpc.name.removeprefix("grpcio-").removesuffix(".dist-info")
    assert f'name = "grpcio"\nversion = "{version}"' in locked


def test_the_image_serves_pins_and_blobs_to_the_projects_client(
    run_image: Any, tmp_path: Path
) -> None:
    data = volume(tmp_path)
    container = run_image({"PINVAULT_SERVER_LISTEN": "127.0.0.1:0"}, data)
    address = container.wait_serving()

    status = (Path("/proc") / str(container.pid()) / "status").read_text()
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert uids == [str(IMAGE_UID)] * 4, status

    payload = os.urandom(300_000) + b"from the image"
    with VaultClient(address, timeout=60) as client:
        put = client.put(payload, handoff=False)
        entry = client.pin("artefact", str(put.blob.sha256), meta={"name": "from-the-image"})
        target = tmp_path / "got"
        client.get(str(put.blob.sha256), target, handoff=False)
        found = client.lookup(str(put.blob.sha256))
    assert target.read_bytes() == payload
    assert [e.entry.meta["name"] for e in found] == ["from-the-image"]
    assert entry.entry.kind == "artefact"

    assert container.stop() == 0, container.stderr
    # Everything the server wrote is in the volume, owned by the image's user.
    written = [p for p in data.rglob("*")]
    assert any(p.name == "vault.db" for p in written)
    assert {p.lstat().st_uid for p in written} == {IMAGE_UID}


def test_the_default_listen_address_needs_credentials(run_image: Any, tmp_path: Path) -> None:
    container = run_image({}, volume(tmp_path))
    assert container.process.wait(timeout=60) != 0
    lines = container.stderr.strip().splitlines()
    assert "Traceback" not in container.stderr
    assert "auth.mode 'local' asks no credential" in lines[-1]
    assert "0.0.0.0:7411" in lines[-1]
