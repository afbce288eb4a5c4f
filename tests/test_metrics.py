"""Prometheus metrics from a real `vault serve --metrics-port`: calls by method and status code
and their latency, admission verdicts, the ledger, the tiers and scrubbing, as a scrape shows
them after real calls; the scrape, the shipped alerting rules and the Grafana dashboard checked
with the real `promtool` and against the names the server exports."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import StartVault
from tests.services.vault_server import REPO_ROOT, VaultServer, run_vault
from vault.errors import FailedPrecondition, NotFound

RULES = REPO_ROOT / "deploy" / "prometheus" / "pinvault-rules.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "pinvault.json"
NAME = re.compile(r"\bpinvault_[a-z_]+")
# A warm tier puts the store under the tier manager, whose placement record the tier metrics
# read; migration passes are an hour apart, so that none moves a copy during the test.
TIERED = {"PINVAULT_POLICY_MIGRATE_INTERVAL": "3600"}


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is not installed: scripts/test installs Debian's prometheus package"
    return found


class Scrape:
    """One scrape of /metrics: its text, and its samples by name and labels."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            self.content_type = response.headers["Content-Type"]
            self.text = response.read().decode()
        self.families = list(text_string_to_metric_families(self.text))

    def value(self, name: str, **labels: str) -> float:
        found = [
            sample.value
            for family in self.families
            for sample in family.samples
            if sample.name == name and sample.labels == labels
        ]
        assert len(found) == 1, f"{name}{labels}: {found}\n{self.text}"
        return found[0]

    def has(self, name: str) -> bool:
        """Whether the scrape has a sample of the series `name` with no labels."""
        return any(
            sample.name == name and not sample.labels
            for family in self.families
            for sample in family.samples
        )

    def exported_names(self) -> set[str]:
        """Every series name the server exports, families with no sample yet included."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names = set()
        for family in self.families:
            names.add(family.name)
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
            names.update(sample.name for sample in family.samples)
        return names


def metrics_url(server: VaultServer) -> str:
    (url,) = [line.split(" at ", 1)[1] for line in server.banner if "metrics (Prometheus)" in line]
    return url


@pytest.fixture
def vault(start_vault: StartVault, tmp_path: Path) -> Iterator[VaultServer]:
    env = {**TIERED, "PINVAULT_STORE_WARM_DIR": str(tmp_path / "warm")}
    yield start_vault(env=env, serve_args=("--metrics-port", "0"))


def test_a_scrape_shows_what_the_calls_did(vault: VaultServer, tmp_path: Path) -> None:
    url = metrics_url(vault)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), url
    data = os.urandom(300_000)
    other = b"a config nobody pinned"
    with vault.client() as client:
        digest = str(client.put(data).blob.sha256)
        client.put(other)
        client.get(digest, tmp_path / "copy")
        client.pin("config", digest)
        unknown = "sha256:" + "0" * 64
        with pytest.raises(NotFound):
            client.stat(unknown)
        unpinned = str(client.put(other).blob.sha256)
        with pytest.raises(FailedPrecondition, match="is not pinned"):
            client.admit(image=unpinned, dataset=digest, seed=1, team="vision")
        *_, scrubbed = client.scrub()
    assert (tmp_path / "copy").read_bytes() == data

    scrape = Scrape(url)
    assert scrape.content_type.startswith("text/plain; version=0.0.4")
    rpcs = "pinvault_rpc_requests_total"
    assert scrape.value(rpcs, method="Store.Put", code="OK") == 3
    assert scrape.value(rpcs, method="Store.Get", code="OK") == 1
    assert scrape.value(rpcs, method="Ledger.Pin", code="OK") == 1
    assert scrape.value(rpcs, method="Store.Stat", code="NOT_FOUND") == 1
    assert scrape.value(rpcs, method="Admission.Admit", code="FAILED_PRECONDITION") == 1
    assert scrape.value(rpcs, method="Store.Scrub", code="OK") == 1
    latency = "pinvault_rpc_duration_seconds"
    assert scrape.value(f"{latency}_count", method="Store.Put") == 3
    assert scrape.value(f"{latency}_bucket", method="Store.Put", le="+Inf") == 3
    assert 0 < scrape.value(f"{latency}_sum", method="Store.Put") < 60
    assert scrape.value(f"{latency}_count", method="Store.Stat") == 1

    verdicts = "pinvault_admissions_total"
    assert scrape.value(verdicts, verdict="refused", reason="FailedPrecondition") == 1

    assert scrape.value("pinvault_ledger_entries") == 1
    assert scrape.value("pinvault_ledger_appended_entries_total") == 1
    # The pin returned once a signed checkpoint covered it.
    assert scrape.value("pinvault_ledger_checkpoint_entries") == 1
    assert 0 <= scrape.value("pinvault_ledger_checkpoint_age_seconds") < 60

    # Two blobs (the second put twice), both on the hot tier and nowhere else yet.
    assert scrape.value("pinvault_tier_blobs", tier="hot") == 2
    assert scrape.value("pinvault_tier_bytes", tier="hot") == len(data) + len(other)
    assert scrape.value("pinvault_migration_pending_moves") == 0

    # The scrub checked both copies, found nothing wrong, and is done.
    assert scrubbed.finished and scrubbed.copies == 2
    assert scrape.value("pinvault_scrub_checked_copies_total") == 2
    assert scrape.value("pinvault_scrub_checked_bytes_total") == len(data) + len(other)
    assert scrape.value("pinvault_scrub_running") == 0
    assert scrape.value("pinvault_scrub_done_bytes") == len(data) + len(other)
    assert scrape.value("pinvault_scrub_total_bytes") == len(data) + len(other)
    assert scrape.value("pinvault_scrub_faults_total") == 0
    assert scrape.value("pinvault_copies_damaged_total") == 0

    check = subprocess.run(
        [promtool(), "check", "metrics"], input=scrape.text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_damaged_copy_found_by_scrub_is_counted(vault: VaultServer) -> None:
    data = os.urandom(200_000)
    with vault.client() as client:
        digest = str(client.put(data).blob.sha256)
        hex_ = digest.partition(":")[2]
        path = vault.data_dir / "hot" / "blobs" / hex_[:2] / hex_
        damaged = bytearray(path.read_bytes())
        damaged[1000] ^= 0xFF
        path.chmod(0o600)
        path.write_bytes(bytes(damaged))
        *_, scrubbed = client.scrub()
    assert scrubbed.faults == 1
    scrape = Scrape(metrics_url(vault))
    assert scrape.value("pinvault_scrub_faults_total") == 1
    assert scrape.value("pinvault_copies_damaged_total") >= 1
    # The only copy: nothing to repair it from.
    assert scrape.value("pinvault_copies_unrepairable_total") >= 1
    assert scrape.value("pinvault_copies_repaired_total") == 0
    lines = [line for line in vault.log().splitlines() if f"damaged copy of {digest}" in line]
    assert len(lines) == 1, vault.log()
    assert f"damaged copy of {digest} on tier hot, with no good copy anywhere" in lines[0]


def test_a_vault_with_one_tier_counts_its_blobs_from_the_catalogue(
    start_vault: StartVault,
) -> None:
    server = start_vault(serve_args=("--metrics-port", "127.0.0.1:0"))
    with server.client() as client:
        client.put(b"x" * 1000)
    scrape = Scrape(metrics_url(server))
    assert scrape.value("pinvault_tier_blobs", tier="hot") == 1
    assert scrape.value("pinvault_tier_bytes", tier="hot") == 1000
    # No tier manager: the hot tier's journal counts its damage; no scrub runs in the server.
    assert scrape.value("pinvault_copies_damaged_total") == 0
    assert "pinvault_scrub_faults_total" in scrape.exported_names()


def flip_a_byte(server: VaultServer, digest: str, at: int = 1000) -> None:
    """Damage the stored copy of a blob on disk, as bit rot would."""
    path = server.blob_path(digest)
    damaged = bytearray(path.read_bytes())
    damaged[at] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(damaged))


DAMAGE_SERIES = (
    "pinvault_copies_damaged_total",
    "pinvault_copies_repaired_total",
    "pinvault_copies_unrepairable_total",
    "pinvault_copy_rewrites_failed_total",
    "pinvault_scrub_faults_total",
)


def scrub_fault_fires(
    tmp_path: Path, before: Scrape, after: Scrape
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` on the shipped rules, fed every damage series the vault exported
    with a sample, as two scrapes of it showed them, ten minutes apart: the test expects
    PinvaultScrubFault to fire five minutes after the second."""
    rules = yaml.safe_load(RULES.read_text())
    (alert,) = [
        r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "PinvaultScrubFault"
    ]
    instance = "vault:9100"
    series = []
    for name in DAMAGE_SERIES:
        values = [s.value(name) for s in (before, after) if s.has(name)]
        if len(values) == 2:
            first, second = (int(v) for v in values)
            series.append(
                {
                    "series": f'{name}{{instance="{instance}"}}',
                    "values": " ".join([str(first)] * 10 + [str(second)] * 10),
                }
            )
    annotations = {
        key: text.replace("{{ $labels.instance }}", instance)
        for key, text in alert["annotations"].items()
    }
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "PinvaultScrubFault", "exp_alerts": []},
                    {
                        "eval_time": "15m",
                        "alertname": "PinvaultScrubFault",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical", "instance": instance},
                                "exp_annotations": annotations,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "scrub-fault.test.yml"
    path.write_text(yaml.safe_dump(test))
    return subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True)


def test_damage_a_read_meets_on_the_default_vault_is_counted_and_logged(
    start_vault: StartVault, tmp_path: Path
) -> None:
    """The default vault keeps one hot tier and no tier manager: a get that meets a damaged
    copy fails with DATA_LOSS, and the damage is counted in the series the tier manager's
    repairs use, logged once naming the blob and the tier, and fires PinvaultScrubFault."""
    server = start_vault(serve_args=("--metrics-port", "0"))
    url = metrics_url(server)
    data = os.urandom(300_000)
    with server.client() as client:
        digest = str(client.put(data).blob.sha256)
    before = Scrape(url)
    assert before.value("pinvault_copies_damaged_total") == 0
    assert before.value("pinvault_copies_unrepairable_total") == 0
    flip_a_byte(server, digest)

    for _ in range(2):
        got = server.run("get", digest, "-o", str(tmp_path / "copy"))
        assert got.returncode != 0
        assert got.error_line().startswith(f"vault: DATA_LOSS: stored copy of {digest}"), (
            got.describe()
        )
    assert not (tmp_path / "copy").exists()

    after = Scrape(url)
    # Found once: the second get met damage already known, which is nothing new.
    assert after.value("pinvault_copies_damaged_total") == 1
    assert after.value("pinvault_copies_unrepairable_total") == 1
    assert after.value("pinvault_copies_repaired_total") == 0
    lines = [line for line in server.log().splitlines() if f"damaged copy of {digest}" in line]
    assert len(lines) == 1, server.log()
    assert f"damaged copy of {digest} on tier hot" in lines[0]

    fired = scrub_fault_fires(tmp_path, before, after)
    assert fired.returncode == 0, fired.stdout + fired.stderr


def test_damage_verify_and_scrub_find_on_the_default_vault_is_counted(
    start_vault: StartVault,
) -> None:
    """`vault verify --blobs` and `vault scrub` (which runs in its own process beside the
    server on a vault of one tier) journal what they find where the server counts it."""
    server = start_vault(serve_args=("--metrics-port", "0"))
    url = metrics_url(server)
    with server.client() as client:
        digest = str(client.put(os.urandom(100_000)).blob.sha256)
        client.pin("config", digest)
    flip_a_byte(server, digest)

    verified = server.run("verify", "--blobs")
    assert verified.returncode != 0, verified.describe()
    assert Scrape(url).value("pinvault_copies_damaged_total") == 1
    assert f"damaged copy of {digest} on tier hot" in server.log()

    scrubbed = run_vault("scrub", env=server.env())
    assert "1 faults, 0 repaired, 1 unrepairable" in scrubbed.stdout, scrubbed.describe()
    assert scrubbed.error_line(alone=False) == (
        "vault: DATA_LOSS: 1 copies have no good copy anywhere"
    ), scrubbed.describe()
    assert f"damaged copy of {digest} on tier hot" in scrubbed.stderr, scrubbed.describe()
    scrape = Scrape(url)
    assert scrape.value("pinvault_copies_damaged_total") == 2
    assert scrape.value("pinvault_copies_unrepairable_total") == 2


def test_the_rules_and_the_dashboard_use_only_names_the_server_exports(
    vault: VaultServer,
) -> None:
    check = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 3 rules found" in check.stdout

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    rules = RULES.read_text()
    used = {n for e in exprs for n in NAME.findall(e)}
    used_by_rules = set(NAME.findall(rules))
    assert used_by_rules >= {
        "pinvault_mirror_queue_copies",
        "pinvault_copies_repaired_total",
        "pinvault_ledger_checkpoint_age_seconds",
    }
    exported = Scrape(metrics_url(vault)).exported_names()
    assert used - exported == set(), f"the dashboard names what is not exported: {used - exported}"
    assert used_by_rules - exported == set(), (
        f"the rules name what is not exported: {used_by_rules - exported}"
    )
    # Every panel the dashboard promises is there.
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "Call rate by method",
        "Errors by status code",
        "Latency p50 by method",
        "Latency p99 by method",
        "Ledger entries",
        "Append rate",
        "Checkpoint age",
        "Bytes per tier",
        "Blobs per tier",
        "Queue depths",
        "Scrub progress",
        "Copies damaged and repaired",
        "Admission verdicts",
    } <= titles


def test_a_bad_metrics_port_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {"PINVAULT_DATA_DIR": str(tmp_path / "data")}
    result = run_vault("serve", "--listen", "127.0.0.1:0", "--metrics-port", "nope", env=env)
    assert result.error_line() == (
        "vault: INVALID_ARGUMENT: --metrics-port 'nope': expected [HOST:]PORT, PORT 0 to 65535"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_vault("serve", "--listen", "127.0.0.1:0", "--metrics-port", str(port), env=env)
    line = result.error_line(alone=False)
    assert line.startswith(f"vault: UNAVAILABLE: cannot serve metrics on 127.0.0.1:{port}: "), line


def test_callers_who_open_connections_and_send_nothing_hold_nothing(
    start_vault: StartVault,
) -> None:
    """The metrics endpoint asks nobody who they are: connections that never send a request
    hold no thread, a scrape from the same address is answered at once beside them (the oldest
    silent one makes way for it), and the server still answers its gRPC callers."""
    server = start_vault(serve_args=("--metrics-port", "0"))
    url = metrics_url(server)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        for _ in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            started = time.monotonic()
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            text = response.read()
            conn.close()
            assert response.status == 200 and b"pinvault_ledger_entries" in text
            assert time.monotonic() - started < 2
        with server.client() as client:
            assert client.checkpoint().size >= 0
    finally:
        for connection in idle:
            connection.close()
