"""Push and pull of one image (10 layers, 1 GiB of incompressible bytes) with `skopeo`, to and
from the vault's registry (a token asked for at its token endpoint, every blob put into the
content store and checked, the manifest pinned), beside the reference registry
(distribution/distribution's `registry`, filesystem storage, no auth) in the same run: each
round starts both afresh, so every push uploads every byte; the medians of the rounds, and
the vault's time over the reference's (goal: at most 1.5x).

    uv run python -m bench.registry [--size-mib 1024] [--layers 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from bench.common import row
from tests.services.distribution import DistributionRegistry
from tests.services.distribution import build as build_distribution
from tests.services.vault_server import VaultServer, run_vault
from vault.client import Credentials, VaultClient

GOAL = 1.5
_URL = re.compile(r"registry \(OCI distribution\) at http://(\S+)")
_PIECE = 1 << 20


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while piece := file.read(_PIECE):
            digest.update(piece)
    return f"sha256:{digest.hexdigest()}"


def _blob(layout: Path, path: Path) -> tuple[str, int]:
    digest = _sha256_file(path)
    target = layout / "blobs" / "sha256" / digest.removeprefix("sha256:")
    os.replace(path, target)
    return digest, target.stat().st_size


def write_image(layout: Path, size: int, layers: int) -> str:
    """An OCI image layout of `layers` uncompressed tar layers of random bytes, `size` in all
    (tar layers: skopeo copies them as they are, so both registries receive the same bytes)."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    described, diff_ids = [], []
    for i in range(layers):
        path = layout / f"layer-{i}.tar"
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(f"data/{i}.bin")
            info.size = size // layers
            with open("/dev/urandom", "rb") as random:
                tar.addfile(info, io.BufferedReader(random, _PIECE))
        digest, length = _blob(layout, path)
        diff_ids.append(digest)
        described.append(
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": digest,
                "size": length,
            }
        )
    config = layout / "config.json"
    config.write_text(
        json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
            }
        )
    )
    config_digest, config_size = _blob(layout, config)
    manifest = layout / "manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": config_size,
                },
                "layers": described,
            }
        )
    )
    manifest_digest, manifest_size = _blob(layout, manifest)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "annotations": {"org.opencontainers.image.ref.name": "v1"},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    return manifest_digest


class Skopeo:
    def __init__(self, home: Path) -> None:
        command = shutil.which("skopeo")
        if command is None:
            raise SystemExit("bench.registry needs skopeo (Debian's skopeo)")
        self.command = command
        self.policy = home / "policy.json"
        self.policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
        self.auth = home / "auth.json"
        self.auth.write_text('{"auths": {}}')

    def copy(self, source: str, destination: str, *options: str) -> float:
        """Seconds `skopeo copy` took."""
        began = time.perf_counter()
        subprocess.run(
            [
                self.command,
                "--policy",
                str(self.policy),
                "copy",
                "--quiet",
                "--retry-times=0",
                f"--authfile={self.auth}",
                *options,
                source,
                destination,
            ],
            check=True,
        )
        return time.perf_counter() - began


def _vault_registry(base: Path) -> tuple[VaultServer, str, str]:
    """A vault asking for credentials, with a registry; its address and a writer's token."""
    env = {"PINVAULT_AUTH_MODE": "credentials", "PINVAULT_REGISTRY_LISTEN": "127.0.0.1:0"}
    server = VaultServer(base, env=env)
    admin = run_vault(
        *("token", "create", "--offline", "--name", "root", "--team", "ops", "--role", "admin"),
        env={"PINVAULT_DATA_DIR": str(server.data_dir), **env},
        state_home=server.state_home,
    ).ok()
    server.start()
    with VaultClient(server.address, credentials=Credentials(token=admin.stdout.strip())) as c:
        writer = c.create_token(name="bench", team="ops", role="writer")[1]
    deadline = time.monotonic() + 10
    while not (found := _URL.search(server.log())):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the registry's address is not in the log:\n{server.log()}")
        time.sleep(0.05)
    return server, found.group(1), writer


def one_round(skopeo: Skopeo, binary: Path, image: Path, work: Path) -> dict[str, float]:
    """Push and pull once to a fresh vault and a fresh reference registry."""
    times: dict[str, float] = {}
    server, address, writer = _vault_registry(work / "vault")
    try:
        with DistributionRegistry(binary, work / "distribution") as reference:
            targets = {
                "vault": (
                    address,
                    (f"--dest-creds=bench:{writer}",),
                    (f"--src-creds=bench:{writer}",),
                ),
                "reference": (reference.address, (), ()),
            }
            for name, (host, push_creds, _) in targets.items():
                times[f"push {name}"] = skopeo.copy(
                    f"oci:{image}:v1",
                    f"docker://{host}/bench/image:v1",
                    "--dest-tls-verify=false",
                    "--preserve-digests",
                    *push_creds,
                )
            for name, (host, _, pull_creds) in targets.items():
                out = work / f"pulled-{name}"
                times[f"pull {name}"] = skopeo.copy(
                    f"docker://{host}/bench/image:v1",
                    f"oci:{out}:v1",
                    "--src-tls-verify=false",
                    *pull_creds,
                )
                shutil.rmtree(out)
    finally:
        server.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    binary = build_distribution()
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        base = Path(tmp)
        skopeo = Skopeo(base)
        image = base / "image"
        write_image(image, args.size_mib << 20, args.layers)
        rounds = []
        for i in range(args.rounds):
            work = base / f"round-{i}"
            work.mkdir()
            rounds.append(one_round(skopeo, binary, image, work))
            shutil.rmtree(work)
    print(
        f"skopeo copy of one image, {args.layers} layers, {args.size_mib} MiB, "
        f"median of {args.rounds} rounds"
    )
    print(row("", "vault", "reference", 1.0, "goal").replace("1.00x", "ratio"))
    for step in ("push", "pull"):
        vault = statistics.median(r[f"{step} vault"] for r in rounds)
        reference = statistics.median(r[f"{step} reference"] for r in rounds)
        print(
            row(
                f"{step} (s)",
                f"{vault:.2f}",
                f"{reference:.2f}",
                vault / reference,
                f"<= {GOAL}x",
            )
        )
    for i, r in enumerate(rounds):
        print(f"  round {i}: " + ", ".join(f"{k} {v:.2f}s" for k, v in r.items()))


if __name__ == "__main__":
    main()
