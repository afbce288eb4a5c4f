"""The registry off loopback speaks only TLS: `skopeo` pushes and pulls an image through it with the
lab's CA, a client without the CA is refused by its own certificate check, and plain HTTP gets
no answer an HTTP client can read."""

from __future__ import annotations

import http.client
import re
import time
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.test_access import first_admin_token, start_tls_vault
from tests.test_registry_clients import Skopeo, read_layout, write_layout

_URL = re.compile(r"registry \(OCI distribution\) at (https://\S+)")


def _registry_port(log: str) -> int:
    found = _URL.search(log)
    assert found, f"no TLS registry in the log:\n{log}"
    return int(found.group(1).rstrip("/").rsplit(":", 1)[1])


def test_skopeo_pushes_and_pulls_over_tls_off_loopback(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server, ca = start_tls_vault(start_vault, tmp_path, PINVAULT_REGISTRY_LISTEN="0.0.0.0:0")
    deadline = time.monotonic() + 10
    while not _URL.search(server.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    port = _registry_port(server.log())
    token = first_admin_token(server)
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "ca.crt").write_bytes(ca)
    image = write_layout(tmp_path / "layout", "v1", [b"a layer over TLS" * 1000])
    skopeo = Skopeo(tmp_path / "skopeo")
    remote = f"docker://localhost:{port}/lab/tls:v1"

    pushed = skopeo.copy(
        image.reference, remote, f"--dest-cert-dir={certs}", f"--dest-creds=root:{token}"
    )
    assert pushed.returncode == 0, pushed.stderr
    pulled = skopeo.copy(
        remote,
        f"oci:{tmp_path / 'pulled'}:v1",
        f"--src-cert-dir={certs}",
        f"--src-creds=root:{token}",
    )
    assert pulled.returncode == 0, pulled.stderr
    manifest, blobs = read_layout(tmp_path / "pulled", "v1")
    assert manifest == image.manifest and blobs == image.blobs

    # Without the lab's CA, the client's own check refuses the vault's certificate.
    refused = skopeo.copy(remote, f"oci:{tmp_path / 'untrusted'}:v1", f"--src-creds=root:{token}")
    assert refused.returncode != 0
    assert "certificate" in refused.stderr, refused.stderr
    # Plain HTTP, where a token would travel in clear, gets nothing an HTTP client can read.
    plain = http.client.HTTPConnection("localhost", port, timeout=10)
    try:
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/v2/", headers={"Authorization": f"Bearer {token}"})
            plain.getresponse().read()
    finally:
        plain.close()
