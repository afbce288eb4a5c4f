"""The explorer page opened from its files on disk, with no vault running, in a real headless
Chromium: a proof bundle `vault bundle` wrote of a real run is opened and verified in the
browser (the signed tree head's signature, the witness's cosignature, every inclusion proof,
the inputs document, the run manifest and replicate.sh), and the run is shown; an altered
bundle, or one signed by another key than the one the page expects, shows as failed, naming
what is wrong."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page

from tests.services.vault_server import REPO_ROOT
from tests.test_bundle import Proved, proved_run
from vault.ledger.checkpoint import SigningKey

PAGE = REPO_ROOT / "vault" / "server" / "explorer_page" / "index.html"


@pytest.fixture(scope="module")
def proved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proved]:
    with proved_run(tmp_path_factory.mktemp("bundle")) as made:
        yield made


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # Nothing but the page's own files: a request anywhere else fails the test.
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    yield page
    context.close()
    assert errors == [], f"the page raised: {errors}"
    assert all(url.startswith(("file://", "blob:")) for url in requests), requests


def open_bundle(page: Page, bundle: Path) -> str:
    """Open the page from disk, open `bundle` as a user picks a file, and return the verdict."""
    page.goto(PAGE.as_uri())
    page.wait_for_selector("#status:has-text('Opened from a file')")
    page.set_input_files("#bundle-file", str(bundle))
    verdict = page.locator("#verdict[data-state]")
    verdict.wait_for()
    return str(verdict.get_attribute("data-state"))


def test_a_runs_bundle_is_verified_in_the_browser_with_no_vault(page: Page, proved: Proved) -> None:
    assert open_bundle(page, proved.run_bundle) == "verified"
    verdict = page.inner_text("#verdict")
    key_label = "+".join(proved.verifier_key.split("+")[:2])
    witness_label = "+".join(proved.witness_key.split("+")[:2])
    assert f"inclusion of {proved.run_entries} entries in the signed tree head" in verdict
    assert f"size {proved.size}" in verdict
    assert f"Cosigned by witness {witness_label}" in verdict
    assert "Documents checked: inputs document, run manifest, replicate.sh." in verdict
    # Without an expected key set, the page says the key is the bundle's own.
    assert "a key taken from the bundle itself" in verdict
    assert key_label in verdict
    assert page.inner_text("#run-id") == proved.run_id
    assert proved.manifest in page.inner_html("#view")
    with page.expect_download() as download:
        page.click(".replicate")
    assert Path(download.value.path()).read_bytes() == proved.replicate_sh


def test_with_the_vaults_key_expected_the_bundle_is_anchored_and_another_key_fails(
    page: Page, proved: Proved
) -> None:
    page.goto(PAGE.as_uri())
    page.click("#settings summary")
    page.fill("#pinned-key", proved.verifier_key)
    page.click("#save-settings")
    assert open_bundle(page, proved.run_bundle) == "verified"
    assert "(the expected key set here)" in page.inner_text("#verdict")

    other = SigningKey.generate(proved.verifier_key.split("+")[0]).verifier()
    page.click("#settings summary")
    page.fill("#pinned-key", str(other))
    page.click("#save-settings")
    assert open_bundle(page, proved.run_bundle) == "failed"
    assert (
        f"signed tree head: the signed tree head has no signature by {other.name}"
        in page.inner_text("#verdict")
    )
    assert page.inner_text("#view") == ""


def _altered(proved: Proved, role: str, old: bytes, new: bytes) -> Path:
    bundle = json.loads(proved.run_bundle.read_bytes())
    data = base64.b64decode(bundle["documents"][role])
    bundle["documents"][role] = base64.b64encode(data.replace(old, new, 1)).decode()
    path = proved.folder / f"browser-{role}.bundle"
    path.write_text(json.dumps(bundle))
    return path


def _altered_entry(proved: Proved) -> Path:
    bundle = json.loads(proved.run_bundle.read_bytes())
    item = bundle["tlogEntries"][-1]
    body = base64.b64decode(item["canonicalizedBody"]).replace(b'"team":"', b'"team":"x', 1)
    item["canonicalizedBody"] = base64.b64encode(body).decode()
    path = proved.folder / "browser-entry.bundle"
    path.write_text(json.dumps(bundle))
    return path


def _without_cosignature(proved: Proved) -> Path:
    bundle = json.loads(proved.run_bundle.read_bytes())
    note = bundle["verificationMaterial"]["checkpoint"]
    text, signatures = note.split("\n\n")
    bundle["verificationMaterial"]["checkpoint"] = f"{text}\n\n{signatures.splitlines()[0]}\n"
    path = proved.folder / "browser-cosignature.bundle"
    path.write_text(json.dumps(bundle))
    return path


def test_an_altered_bundle_shows_as_failed_naming_what_is_wrong(page: Page, proved: Proved) -> None:
    witness_label = "+".join(proved.witness_key.split("+")[:2])
    cases = [
        (
            _altered(proved, "runManifest", b'"path":"metrics.json"', b'"path":"metrics.jsom"'),
            "which no entry of the bundle pins as run",
        ),
        (
            _altered(proved, "replicateScript", b"exec vault replay", b"exec vault  replay"),
            "replicate.sh is not the script that replays run manifest",
        ),
        (
            _altered(proved, "runInputs", b'"seed":"', b'"seed":"1'),
            "the run inputs document hashes to",
        ),
        (_altered_entry(proved), "it is not proven in the signed tree head of size"),
        (
            _without_cosignature(proved),
            f"the signed tree head carries no cosignature by witness {witness_label}",
        ),
    ]
    for path, reason in cases:
        assert open_bundle(page, path) == "failed", path
        assert reason in page.inner_text("#verdict"), path
        assert page.inner_text("#view") == ""
    not_a_bundle = proved.folder / "not-a-bundle.json"
    not_a_bundle.write_text('{"mediaType": "application/vnd.pinvault.bundle.v2+json"}')
    assert open_bundle(page, not_a_bundle) == "failed"
    assert "bundle format version 2 is not supported" in page.inner_text("#verdict")


def test_a_witness_expected_here_must_have_cosigned_whatever_the_bundle_names(
    page: Page, proved: Proved
) -> None:
    """A bundle stripped of its witness (the cosignature line and the witness's key both taken
    out) is still consistent in itself; with the witness expected in the page's settings, it
    fails, and the honest bundle says the cosignature is of the witness expected here."""
    witness_label = "+".join(proved.witness_key.split("+")[:2])
    bundle = json.loads(_without_cosignature(proved).read_bytes())
    bundle["verificationMaterial"]["witnessKeys"] = []
    stripped = proved.folder / "browser-no-witness.bundle"
    stripped.write_text(json.dumps(bundle))
    assert open_bundle(page, stripped) == "verified"
    assert "Cosigned" not in page.inner_text("#verdict")

    page.click("#settings summary")
    page.fill("#expected-witnesses", proved.witness_key)
    page.click("#save-settings")
    assert open_bundle(page, proved.run_bundle) == "verified"
    assert f"Cosigned by witness {witness_label} (the witnesses expected here)" in page.inner_text(
        "#verdict"
    )
    assert open_bundle(page, stripped) == "failed"
    assert (
        f"the signed tree head carries no cosignature by witness {witness_label}"
        in page.inner_text("#verdict")
    )
    assert page.inner_text("#view") == ""
