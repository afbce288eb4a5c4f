"""The deployments under deploy/ as an operator would apply them: the Kubernetes manifests parse,
their selectors find their pods, their ports are the ones the vault is configured to listen on,
every name they reference exists, their configuration is one the vault accepts, and their
probes ask for a path a real `vault serve` answers; the systemd units pass systemd's own
check."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import StartVault
from tests.services.vault_server import REPO_ROOT, VAULT_COMMAND
from vault import config as vault_config

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
SYSTEMD = REPO_ROOT / "deploy" / "systemd"
VAULT_YAML = KUBERNETES / "vault.yaml"
IMAGE_UID = int(
    re.search(r"^UID_GID=(\d+)$", (REPO_ROOT / "scripts" / "build-image").read_text(), re.M)[1]  # type: ignore[index]
)


def documents(path: Path) -> list[dict[str, Any]]:
    loaded = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for document in loaded:
        assert {"apiVersion", "kind", "metadata"} <= document.keys(), document
    return loaded


def one(kind: str, docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    assert isinstance(found, dict)
    return found


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def vault_docs() -> list[dict[str, Any]]:
    return documents(VAULT_YAML)


def vault_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one("Deployment", docs)["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_manifest_parses_and_names_its_namespace() -> None:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in documents(path):
            if document["kind"] not in ("Namespace", "ValidatingWebhookConfiguration"):
                assert document["metadata"]["namespace"] == "pinvault-system", (path, document)


def test_every_container_of_the_image_runs_the_command_it_names() -> None:
    """The image's entry point is `vault serve`: a container that runs another `vault`
    command names the command itself, and one that serves passes options only."""
    entrypoint = re.search(
        r"--config.entrypoint (\S+) --config.entrypoint serve",
        (REPO_ROOT / "scripts" / "build-image").read_text(),
    )
    assert entrypoint is not None
    containers = [
        container
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for document in documents(path)
        if document["kind"] == "Deployment"
        for container in document["spec"]["template"]["spec"]["containers"]
    ]
    assert len(containers) == 2
    for container in containers:
        if "command" in container:
            assert container["command"] == [entrypoint[1]]
            assert not container["args"][0].startswith("-")
        else:
            assert all(arg.startswith("--") for arg in container["args"][::2])


def test_the_vault_deployment_has_replicas_a_service_and_a_disruption_budget(
    vault_docs: list[dict[str, Any]],
) -> None:
    kinds = sorted(d["kind"] for d in vault_docs)
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "ServiceAccount",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
        ]
    )
    deployment = one("Deployment", vault_docs)
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 3
    assert matches(spec["selector"]["matchLabels"], labels)
    assert matches(one("Service", vault_docs)["spec"]["selector"], labels)
    budget = one("PodDisruptionBudget", vault_docs)["spec"]
    assert matches(budget["selector"]["matchLabels"], labels)
    # A drain leaves more than one replica serving.
    assert spec["replicas"] - budget["maxUnavailable"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] <= budget["maxUnavailable"]
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one("ServiceAccount", vault_docs)["metadata"]["name"]
    # The image's own user, not root.
    assert pod["securityContext"]["runAsUser"] == IMAGE_UID
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = vault_container(vault_docs)
    assert re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", container["image"])


def test_the_ports_are_the_ones_the_vault_listens_on(vault_docs: list[dict[str, Any]]) -> None:
    container = vault_container(vault_docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config_map = one("ConfigMap", vault_docs)
    listen = tomllib.loads(config_map["data"]["vault.toml"])["server"]["listen"]
    args = container["args"]
    assert ports == {
        "grpc": int(listen.rpartition(":")[2]),
        "tiles": int(option(args, "--tiles-http").rpartition(":")[2]),
        "metrics": int(option(args, "--metrics-port").rpartition(":")[2]),
    }
    service = one("Service", vault_docs)["spec"]["ports"]
    assert {p["targetPort"] for p in service} == set(ports)
    assert {p["name"]: p["port"] for p in service} == ports


def test_the_configuration_is_one_the_vault_accepts(
    vault_docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The ConfigMap's file with the variables the Deployment sets, as `vault` loads them: no
    key or variable the vault does not know (an unknown one is an error there)."""
    config_map = one("ConfigMap", vault_docs)
    container = vault_container(vault_docs)
    pod = one("Deployment", vault_docs)["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == set(volumes)

    environ: dict[str, str] = {}
    for variable in container["env"]:
        source = variable.get("valueFrom", {})
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] == config_map["metadata"]["name"]
            environ[variable["name"]] = config_map["data"][ref["key"]]
        elif "secretKeyRef" in source:
            environ[variable["name"]] = "postgresql+psycopg://pinvault:secret@db1/pinvault"
        else:
            environ[variable["name"]] = variable["value"]
    (config_volume,) = [v for v in volumes.values() if "configMap" in v]
    assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]
    config_dir = mounts[config_volume["name"]]
    for item in config_volume["configMap"]["items"]:
        assert item["key"] in config_map["data"]
        assert environ["PINVAULT_CONFIG"] == f"{config_dir}/{item['path']}"
        (tmp_path / item["path"]).write_text(config_map["data"][item["key"]])
    environ["PINVAULT_CONFIG"] = str(tmp_path / "vault.toml")

    loaded = vault_config.load(environ=environ)
    assert loaded.auth.mode == "credentials"
    assert loaded.ledger.database.startswith("postgresql")
    assert loaded.mirrors.endpoints == config_map["data"]["mirrors"]
    # Every file the configuration names is in a volume the container mounts.
    for path in (loaded.ledger.key_file, loaded.auth.tls_cert, loaded.auth.tls_key):
        assert any(path.startswith(f"{mount}/") for mount in mounts.values()), path
    # The data folder the image sets is the volume that holds it.
    assert mounts["data"] == "/var/lib/pinvault"


def test_the_probes_ask_for_what_the_vault_serves(
    vault_docs: list[dict[str, Any]], start_vault: StartVault
) -> None:
    """Each probe, sent to a real `vault serve` started with the Deployment's options: an HTTP
    probe's path answers 200 with the vault's metrics, and the port a TCP probe connects to
    is the one whose gRPC health service says SERVING."""
    container = vault_container(vault_docs)
    server = start_vault(
        serve_args=("--tiles-http", "127.0.0.1:0", "--metrics-port", "127.0.0.1:0")
    )
    addresses = {"grpc": server.address}
    for line in server.banner:
        if match := re.search(r"tiles \(C2SP tlog-tiles\) at http://([^/\s]+)", line):
            addresses["tiles"] = match[1]
        if match := re.search(r"metrics \(Prometheus\) at http://([^/\s]+)", line):
            addresses["metrics"] = match[1]
    probes = [container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert any("httpGet" in probe for probe in probes)
    for probe in probes:
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{addresses[get['port']]}{get['path']}"
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
                assert "pinvault_ledger_entries" in response.read().decode()
        else:
            port = probe["tcpSocket"]["port"]
            with grpc.insecure_channel(addresses[port]) as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=10
                )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    # A path the vault does not serve is refused, so a probe on it would fail.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{addresses['metrics']}/healthz", timeout=10)
    refused.value.close()
    assert refused.value.code == 404


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is not installed (Debian's systemd package has it)")
    return found


@pytest.mark.parametrize("unit", ["pinvault.service", "pinvault-container.service"])
def test_the_systemd_units_pass_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    """systemd's own check of each unit. The native unit's command is where the unit says
    it is installed (/opt/pinvault); here it is checked with the path of this checkout's own
    `vault` in its place."""
    text = (SYSTEMD / unit).read_text()
    text = text.replace("/opt/pinvault/bin/vault", VAULT_COMMAND[0])
    copy = tmp_path / unit
    copy.write_text(text)
    verified = subprocess.run(
        [systemd_analyze(), "verify", str(copy)], capture_output=True, text=True, check=False
    )
    assert verified.returncode == 0, verified.stderr
    assert verified.stderr == "", verified.stderr


def test_a_broken_unit_fails_the_check(tmp_path: Path) -> None:
    """The check above can fail: a misspelt directive is reported."""
    copy = tmp_path / "pinvault-container.service"
    copy.write_text(
        (SYSTEMD / "pinvault-container.service").read_text().replace("RestartSec", "RestartSecs")
    )
    verified = subprocess.run(
        [systemd_analyze(), "verify", str(copy)], capture_output=True, text=True, check=False
    )
    assert "RestartSecs" in verified.stderr
