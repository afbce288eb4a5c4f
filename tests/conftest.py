"""Fixtures shared by every test: a clean environment, a real PostgreSQL started once per test
run on a private Unix socket, real S3 servers (MinIO, versitygw) started once per test run on
127.0.0.1, and real `vault serve` processes on port 0."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest
from sqlalchemy import make_url

from tests.services.postgres import PostgresServer
from tests.services.s3 import SERVERS, MinioServer, S3Endpoint, VersityGatewayServer
from tests.services.vault_server import VaultServer

# A fixture, for every test module that needs a full disk.
from tests.small_disk import small_disk  # noqa: F401

if TYPE_CHECKING:
    from playwright.sync_api import Browser

# -- environment ---------------------------------------------------------------------------

# A developer's real credentials or server settings must never reach a test, and a test must
# not pass only because they happen to be set.
STRIPPED_ENV_PREFIXES = ("AWS_", "PINVAULT_", "PG")
# With no credentials in the environment, boto3 would go on to read ~/.aws and then ask the
# EC2 metadata address; point it at nothing instead.
PINNED_ENV = {
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session", autouse=True)
def clean_environment() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(STRIPPED_ENV_PREFIXES):
                patch.delenv(name)
        for name, value in PINNED_ENV.items():
            patch.setenv(name, value)
        yield


# -- PostgreSQL ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server(clean_environment: None) -> Iterator[PostgresServer]:
    """One private cluster for the whole run; see tests/services/postgres.py."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty database, dropped after the test."""
    url = postgres_server.create_database()
    yield url
    database = make_url(url).database
    assert database is not None
    postgres_server.drop_database(database)


# -- S3 servers ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def minio_server(clean_environment: None) -> Iterator[MinioServer]:
    """One private MinIO for the whole run; see tests/services/s3.py."""
    with MinioServer() as server:
        yield server


@pytest.fixture(scope="session")
def versitygw_server(clean_environment: None) -> Iterator[VersityGatewayServer]:
    """One private versitygw for the whole run; see tests/services/s3.py."""
    with VersityGatewayServer() as server:
        yield server


@pytest.fixture(params=sorted(SERVERS))
def s3_endpoint(request: pytest.FixtureRequest) -> Iterator[S3Endpoint]:
    """A fresh, empty bucket on each S3 server in turn, deleted with its objects afterwards."""
    server = request.getfixturevalue(f"{request.param}_server")
    endpoint: S3Endpoint = server.create_bucket()
    yield endpoint
    server.delete_bucket(endpoint.bucket)


# -- vault servers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vault_server(
    clean_environment: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VaultServer]:
    """One `vault serve` on SQLite for a whole test module; its tests share its ledger."""
    with VaultServer(tmp_path_factory.mktemp("vault")) as server:
        yield server


StartVault = Callable[..., VaultServer]


@pytest.fixture
def start_vault(clean_environment: None, tmp_path: Path) -> Iterator[StartVault]:
    """Start servers of the test's own (see VaultServer for the arguments); all are stopped,
    and must exit cleanly on SIGTERM, when the test ends."""
    started: list[VaultServer] = []

    def start(name: str = "vault", **options: Any) -> VaultServer:
        base = tmp_path / name
        if base.exists():
            base = tmp_path / f"{name}-{len(started)}"
        server = VaultServer(base, **options)
        started.append(server)
        return server.start()

    yield start
    statuses = [server.stop() for server in started]
    assert statuses == [0] * len(started), f"vault serve exit statuses on SIGTERM: {statuses}"


# -- a browser -------------------------------------------------------------------------------

CHROMIUM: Final = "/usr/bin/chromium"
# Chromium as root in a sandbox-less container, with nothing reaching for the network.
CHROMIUM_ARGS: Final = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium, driven by Playwright (which downloads no browser of its
    own), for a test module's pages."""
    from playwright.sync_api import sync_playwright

    assert shutil.which("chromium") == CHROMIUM, "Debian's chromium is needed (scripts/test)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "s3: runs against real S3 servers started by the test set-up"
    )


# The longest test files, longest first: with the tests on several workers (scripts/test), they
# start first, so that no worker is left running one of them alone at the end.
LONGEST_FIRST: Final = (
    "test_scale_bench.py",
    "test_torch_checkpoints.py",
    "test_faults.py",
    "test_load.py",
    "test_balanced_ledger.py",
    "test_cold_tier.py",
    "test_registry.py",
    "test_registry_clients.py",
    "test_shared_blobs.py",
    "test_direct_copies.py",
    "test_http_edges.py",
    "test_mlflow_export.py",
    "test_mirror_add.py",
    "test_jax_checkpoints.py",
    "test_mirror.py",
    "test_slurm.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    # Lets `-m "not postgres"` or `-m "not s3"` leave those servers unstarted.
    s3_fixtures = {"s3_endpoint", *(f"{name}_server" for name in SERVERS)}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "postgres_server" in fixtures:
            item.add_marker(pytest.mark.postgres)
        if fixtures & s3_fixtures:
            item.add_marker(pytest.mark.s3)
