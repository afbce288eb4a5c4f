"""The ledger explorer (`vault serve --explorer-http`) in a real headless Chromium against a real
`vault serve`: a search finds a run made by the run library and shows its inputs, seed, outputs,
checkpoints and a `replicate.sh` download, each answer verified in the browser; an answer
tampered with on its way to the page shows as failed; the HTTP surface is read-only, bounded and
strict; with credentials the API answers only to a reader's bearer token."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Route

from tests.services.vault_server import REPO_ROOT, VaultServer, run_vault
from vault.client import Credentials, VaultClient
from vault.ledger.checkpoint import Checkpoint, SigningKey, Verifier
from vault.ledger.cosignature import WitnessKey
from vault.ledger.entry import Entry
from vault.ledger.merkle import (
    MerkleTree,
    leaf_hash,
    verify_consistency,
    verify_inclusion,
)
from vault.runs import start
from vault.runs.dataset import add_dataset
from vault.wire import pinvault_pb2 as pb

SCREENSHOTS = REPO_ROOT / ".cache" / "explorer"
ORIGIN = "explorer.test/ledger"
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def explorer_url(server: VaultServer) -> str:
    lines = [line for line in server.banner if line.strip().startswith("explorer at ")]
    assert len(lines) == 1, server.banner
    return lines[0].strip().removeprefix("explorer at ")


@dataclass(frozen=True)
class SealedRun:
    run_id: str
    seed: int
    image: str
    dataset: str
    dataset_files: dict[str, bytes]
    manifest: str
    output: str
    checkpoint: str
    replicate_sh: str
    hostile_image: str


@pytest.fixture(scope="module")
def explorer_vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultServer]:
    server = VaultServer(
        tmp_path_factory.mktemp("vault"),
        env={"PINVAULT_LEDGER_ORIGIN": ORIGIN},
        serve_args=("--explorer-http", "0"),
    )
    # A checkpoint key whose base64 holds "+" (as about half do), which the page must read as
    # the Go verifier key format says: name+keyid+base64, the name without "+".
    key = SigningKey.generate(ORIGIN)
    while "+" not in str(key.verifier()).split("+", 2)[2]:
        key = SigningKey.generate(ORIGIN)
    server.data_dir.mkdir(parents=True)
    key.save(server.key_path)
    with server:
        assert f"checkpoint key {key.verifier()}" in server.banner[1]
        yield server


@pytest.fixture(scope="module")
def sealed(explorer_vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> SealedRun:
    """A run made by the run library, as a job makes it: a dataset pinned, the run admitted,
    an output and a checkpoint recorded, the run manifest and replicate.sh published."""
    folder = tmp_path_factory.mktemp("dataset")
    files = {"train.csv": b"x,y\n1,2\n3,4\n", "labels/classes.txt": b"cat\ndog\n"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    seed = random.getrandbits(64)
    with explorer_vault.client() as client:
        image = str(client.put(b"an image for the explorer tests").blob.sha256)
        client.pin("image", image, meta={"name": "trainer"})
        hostile = str(client.put(b"an image with a hostile name").blob.sha256)
        client.pin("image", hostile, meta={"name": HOSTILE})
        dataset = add_dataset(client, folder, name="tiny").digest
        admission = client.admit(image=image, dataset=dataset, seed=seed, team="vision")
    out = tmp_path_factory.mktemp("out")
    env = {
        "PINVAULT_RUN_ID": admission.run_id,
        "PINVAULT_SEED": str(seed),
        "PINVAULT_IMAGE": image,
        "PINVAULT_DATASET": dataset,
        "PINVAULT_CLIENT_SERVER": explorer_vault.address,
        "PINVAULT_CLIENT_STATE_FILE": str(out.parent / "trust.json"),
    }
    with start(environ=env, output_dir=out) as run:
        with run.output("predictions.csv") as f:
            f.write(b"id,label\n1,cat\n")
        run.checkpoint(7, {"model.bin": b"weights at step 7"})
    script = (out / "replicate.sh").read_text()
    manifest = script.split()[4]
    with explorer_vault.client() as client:
        entries = [p.entry for p in client.lookup(admission.run_id)]
    (checkpoint,) = [e.subjects[0] for e in entries if e.kind == "checkpoint"]
    (output,) = [e.subjects[0] for e in entries if e.kind == "artefact"]
    return SealedRun(
        admission.run_id,
        seed,
        image,
        dataset,
        files,
        manifest,
        output,
        checkpoint,
        script,
        hostile,
    )


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert errors == [], f"the page raised: {errors}"


def digests_in(page: Page, selector: str) -> set[str]:
    """The full digests shown (shortened, with the whole in a title and a copy button) in the
    part of the page `selector` names."""
    found = page.eval_on_selector_all(
        f"{selector} [data-digest]", "nodes => nodes.map(n => n.dataset.digest)"
    )
    return set(found)


def search(page: Page, url: str, text: str) -> str:
    """Open the explorer, search `text` as a user types it, and return the verdict's state."""
    page.goto(url)
    page.wait_for_selector("#status:has-text('entries')")
    page.fill("#search", text)
    page.click("#search-button")
    verdict = page.locator("#verdict[data-state]")
    verdict.wait_for()
    return str(verdict.get_attribute("data-state"))


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Any
    body: bytes

    def error(self) -> str:
        value = json.loads(self.body)
        assert set(value) == {"error"}, value
        return str(value["error"])


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> Answer:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(response.status, response.headers, response.read())
    except urllib.error.HTTPError as error:
        with error:
            return Answer(error.code, error.headers, error.read())


# ---------------------------------------------------------------------- what a user sees


def test_a_search_finds_a_run_with_its_inputs_outputs_and_verified_proofs(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    assert search(page, url, sealed.run_id) == "verified"
    verdict = page.inner_text("#verdict")
    assert "Verified" in verdict
    assert "verified in this browser" in verdict
    assert "Signed tree head's Ed25519 signature verified in this browser with key" in verdict
    assert f"{sealed.run_id}, {sealed.manifest}" in verdict  # the documents hashed here
    assert page.inner_text("#run-id") == sealed.run_id
    assert page.inner_text("#seed") == str(sealed.seed)
    view = page.inner_text("#view")
    shown = digests_in(page, "#view")
    assert {
        sealed.image,
        sealed.dataset,
        sealed.output,
        sealed.checkpoint,
        sealed.manifest,
    } <= shown
    # The inputs carry the names their pins give them.
    assert "trainer" in page.inner_text(f"#view [data-digest='{sealed.image}']")
    assert "predictions.csv" in view
    assert "team vision" in view
    entries = page.inner_text("#entries")
    assert entries.count("\tverified") >= 4  # admission, output, checkpoint, manifest
    assert "FAILED" not in entries
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run.png"), full_page=True)

    # The download is the very replicate.sh the run library wrote beside the run's outputs.
    with page.expect_download() as download:
        page.click(".replicate")
    assert download.value.suggested_filename == "replicate.sh"
    assert Path(download.value.path()).read_text() == sealed.replicate_sh

    # Following the dataset shows its members, verified against the dataset's digest.
    page.locator(f"#view [data-digest='{sealed.dataset}'] button.digest").first.click()
    page.wait_for_selector("#view h2:has-text('Dataset tiny')")
    assert page.get_attribute("#verdict", "data-state") == "verified"
    members = page.inner_text("#view")
    for name, data in sealed.dataset_files.items():
        assert name in members
        assert sha256_of(data) in digests_in(page, "#view")
    assert "2 files, 20 bytes." in members


def test_a_checkpoint_and_a_run_manifest_are_shown_by_their_digests(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    assert search(page, url, sealed.checkpoint) == "verified"
    view = page.inner_text("#view")
    assert "Training checkpoint, step 7" in view
    assert "model.bin" in view
    assert {sha256_of(b"weights at step 7"), sealed.run_id} <= digests_in(page, "#view")

    assert search(page, url, sealed.manifest) == "verified"
    assert page.inner_text("#seed") == str(sealed.seed)
    assert "predictions.csv" in page.inner_text("#view")
    with page.expect_download() as download:
        page.click(".replicate")
    assert Path(download.value.path()).read_text() == sealed.replicate_sh


def test_a_job_arrays_run_shows_each_tasks_manifest_and_replicate_sh(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page, tmp_path: Path
) -> None:
    seed = random.getrandbits(64)
    with explorer_vault.client() as client:
        admission = client.admit(
            image=sealed.image, dataset=sealed.dataset, seed=seed, team="vision"
        )
    scripts = {}
    for task in ("0", "1"):
        env = {
            "PINVAULT_RUN_ID": admission.run_id,
            "PINVAULT_SEED": str(seed),
            "PINVAULT_IMAGE": sealed.image,
            "PINVAULT_DATASET": sealed.dataset,
            "PINVAULT_CLIENT_SERVER": explorer_vault.address,
            "PINVAULT_CLIENT_STATE_FILE": str(tmp_path / "trust.json"),
            "SLURM_ARRAY_TASK_ID": task,
        }
        with (
            start(environ=env, output_dir=tmp_path / task) as run,
            run.output(f"part-{task}.csv") as f,
        ):
            f.write(b"task %s\n" % task.encode())
        scripts[task] = (tmp_path / task / "replicate.sh").read_text()
    assert search(page, explorer_url(explorer_vault), admission.run_id) == "verified"
    assert page.locator("#view h2.task").all_inner_texts() == ["Task 0", "Task 1"]
    view = page.inner_text("#view")
    assert "part-0.csv" in view and "part-1.csv" in view
    for number, task in enumerate(("0", "1")):
        with page.expect_download() as download:
            page.locator(".replicate").nth(number).click()
        assert Path(download.value.path()).read_text() == scripts[task]


def test_an_entry_by_index_shows_its_leaf_hash_and_proof(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    with explorer_vault.client() as client:
        (admission,) = [
            p for p in client.lookup(sealed.run_id) if p.entry.meta.get("stage") == "admitted"
        ]
    index = admission.entry.index
    assert search(page, explorer_url(explorer_vault), f"#{index}") == "verified"
    page.click(f"#entries button:text-is('#{index}')")
    detail = page.inner_text("#entry-detail")
    leaf = hashlib.sha256(b"\x00" + admission.entry.encode()).hexdigest()
    assert leaf in detail
    assert json.loads(page.inner_text("#entry-json"))["subjects"][0] == sealed.run_id
    assert "proof\tverified" in detail


def test_a_dataset_whose_manifest_rotted_shows_why_it_cannot_be_listed(
    explorer_vault: VaultServer, page: Page, tmp_path: Path
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_bytes(b"soon unreadable\n")
    with explorer_vault.client() as client:
        digest = add_dataset(client, tmp_path / "data", name="rotten").digest
    with explorer_vault.blob_path(digest).open("r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0x40]))
    assert search(page, explorer_url(explorer_vault), digest) == "verified"
    view = page.inner_text("#view")
    assert f"blob {digest} cannot be read" in view
    assert "a.txt" not in view


def test_hostile_metadata_and_file_names_are_shown_as_text(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page, tmp_path: Path
) -> None:
    url = explorer_url(explorer_vault)
    assert search(page, url, sealed.hostile_image) == "verified"
    assert HOSTILE in page.inner_text("#entries")
    assert page.locator("img").count() == 0
    assert page.title() == "pinvault ledger explorer"

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / HOSTILE).write_bytes(b"a file with a hostile name\n")
    with explorer_vault.client() as client:
        digest = add_dataset(client, tmp_path / "data", name=HOSTILE).digest
    assert search(page, url, digest) == "verified"
    view = page.inner_text("#view")
    assert f"Dataset {HOSTILE}" in view
    assert HOSTILE + "\t27\t" in view  # the file's path and size, as text
    assert page.locator("img").count() == 0
    assert page.title() == "pinvault ledger explorer"


def _tamper_entry(answer: dict[str, Any]) -> str:
    entry = answer["entries"][0]
    body = base64.b64decode(entry["body"]).replace(b'"team":"vision"', b'"team":"vizion"')
    entry["body"] = base64.b64encode(body).decode()
    return f"entry {entry['index']}: its inclusion proof leads to another root"


def _tamper_proof(answer: dict[str, Any]) -> str:
    entry = answer["entries"][-1]
    first = bytearray(base64.b64decode(entry["proof"][0]))
    first[0] ^= 1
    entry["proof"][0] = base64.b64encode(first).decode()
    return f"entry {entry['index']}: its inclusion proof leads to another root"


def _tamper_document(answer: dict[str, Any]) -> str:
    ((digest, data),) = [(d, v) for d, v in answer["blobs"].items() if d != answer["query"]]
    changed = base64.b64decode(data).replace(
        b'"path":"predictions.csv"', b'"path":"prediction5.csv"'
    )
    answer["blobs"][digest] = base64.b64encode(changed).decode()
    return f"document {digest}: its bytes hash to sha256:"


def _tamper_unpinned_document(answer: dict[str, Any]) -> str:
    # A document that hashes to its digest but that no entry pins is no document of the run.
    data = (
        b'{"dataset":"sha256:0","image":"sha256:0","seed":"1","type":"pinvault.run-inputs","v":1}'
    )
    digest = sha256_of(data)
    answer["blobs"][digest] = base64.b64encode(data).decode()
    return f"document {digest}: no verified entry shown names it"


def _tamper_shape(answer: dict[str, Any]) -> str:
    answer["entries"] = 5
    return "the answer is malformed:"


def _tamper_signature(answer: dict[str, Any]) -> str:
    note = answer["checkpoint"]
    head, _, line = note.rstrip("\n").rpartition("\n")
    dash, name, signature = line.split(" ")
    raw = bytearray(base64.b64decode(signature))
    raw[-1] ^= 1
    answer["checkpoint"] = f"{head}\n{dash} {name} {base64.b64encode(raw).decode()}\n"
    return "signed tree head: the signed tree head's signature by"


@pytest.mark.parametrize(
    "tamper",
    [
        _tamper_entry,
        _tamper_proof,
        _tamper_document,
        _tamper_unpinned_document,
        _tamper_signature,
        _tamper_shape,
    ],
    ids=["entry", "proof", "document", "unpinned-document", "signature", "shape"],
)
def test_a_tampered_answer_shows_as_failed(
    explorer_vault: VaultServer,
    sealed: SealedRun,
    page: Page,
    tamper: Callable[[dict[str, Any]], str],
) -> None:
    expected: list[str] = []

    def rewrite(route: Route) -> None:
        response = route.fetch()
        answer = response.json()
        expected.append(tamper(answer))
        route.fulfill(response=response, body=json.dumps(answer))

    page.route("**/api/lookup?*", rewrite)
    assert search(page, explorer_url(explorer_vault), sealed.run_id) == "failed"
    verdict = page.inner_text("#verdict")
    assert "Verification FAILED" in verdict
    assert expected[0] in verdict
    # Nothing of a failed answer is shown: not as the run's, nor as entries.
    assert page.locator("#run-id").count() == 0
    assert page.inner_text("#view") == ""
    assert page.inner_text("#entries") == ""
    assert page.locator("tr, [data-digest]").count() == 0
    if tamper is _tamper_entry:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "tampered.png"), full_page=True)


def test_a_pinned_verifier_key_that_is_not_the_vaults_fails(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    page.goto(url)
    page.click("#settings summary")
    other = "pinvault/other+0b0fd8cd+AaXl6aSH5d0lX2vK3SZM1Ioa8qIMEWAPNmtBqZj31zWi"
    page.fill("#pinned-key", other)
    page.click("#save-settings")
    assert search(page, url, sealed.run_id) == "failed"
    assert f"not the expected {other}" in page.inner_text("#verdict")


def test_a_witness_expected_here_that_has_not_cosigned_fails_the_answer(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    page.goto(url)
    page.click("#settings summary")
    witness = WitnessKey("witness.test/absent", SigningKey.generate("absent").verifier().public_key)
    page.fill("#expected-witnesses", str(witness))
    page.click("#save-settings")
    assert search(page, url, sealed.run_id) == "failed"
    assert f"carries no cosignature by witness {witness.label}" in page.inner_text("#verdict")
    assert page.inner_text("#view") == ""


def test_a_run_with_more_entries_than_an_answer_carries_still_shows_its_manifest(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page, tmp_path: Path
) -> None:
    seed = random.getrandbits(64)
    with explorer_vault.client() as client:
        admission = client.admit(
            image=sealed.image, dataset=sealed.dataset, seed=seed, team="vision"
        )
        env = {
            "PINVAULT_RUN_ID": admission.run_id,
            "PINVAULT_SEED": str(seed),
            "PINVAULT_IMAGE": sealed.image,
            "PINVAULT_DATASET": sealed.dataset,
            "PINVAULT_CLIENT_SERVER": explorer_vault.address,
            "PINVAULT_CLIENT_STATE_FILE": str(tmp_path / "trust.json"),
        }
        with start(environ=env, output_dir=tmp_path / "out") as run:
            # Outputs kept elsewhere, 1,100 of them: more than one answer carries.
            client.ledger.PinBatch(
                pb.PinBatchRequest(
                    pins=[
                        pb.PinRequest(
                            kind="artefact",
                            subjects=[sha256_of(b"shard %d" % n), admission.run_id],
                            meta={"path": f"shards/{n}.bin", "size": "1"},
                            external=True,
                            author="sharder@lab",
                        )
                        for n in range(1100)
                    ]
                ),
                timeout=60,
            )
            with run.output("summary.txt") as f:
                f.write(b"1100 shards\n")
    manifest = (tmp_path / "out" / "replicate.sh").read_text().split()[4]
    assert search(page, explorer_url(explorer_vault), admission.run_id) == "verified"
    assert "More entries name this than one answer carries" in page.inner_text("#verdict")
    view = page.inner_text("#view")
    assert manifest in digests_in(page, "#view")
    assert "summary.txt" in view and "shards/1099.bin" in view


def test_the_page_keeps_the_checkpoint_it_verified_and_catches_a_rewritten_history(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    assert search(page, url, sealed.image) == "verified"
    assert "the first signed tree head this browser has verified" in page.inner_text("#verdict")
    key = str(page.text_content("#vault-key"))
    remembered = page.evaluate("(key) => localStorage.getItem(seenKey({text: key}))", key)
    seen = json.loads(remembered)
    with explorer_vault.client() as client:
        newer = str(client.put(b"pinned after the first visit").blob.sha256)
        client.pin("config", newer)
    assert search(page, url, newer) == "verified"
    assert (
        f"consistent with the signed tree head of size {seen['size']} this browser verified before "
        "(consistency proof checked in this browser)"
    ) in page.inner_text("#verdict")

    # What the browser remembers is now of a tree this vault never signed: its answers, though
    # each is signed and proven, do not extend it.
    forged = base64.b64encode(hashlib.sha256(b"another history").digest()).decode()
    page.evaluate(
        "([key, seen]) => localStorage.setItem(seenKey({text: key}), seen)",
        [key, json.dumps({"size": seen["size"], "root": forged})],
    )
    assert search(page, url, newer) == "failed"
    verdict = page.inner_text("#verdict")
    assert f"does not extend the tree of size {seen['size']} (root {forged})" in verdict
    assert "the vault rewrote or forked its history" in verdict
    assert page.inner_text("#view") == ""


def test_the_pages_proof_checks_agree_with_the_ledgers_code(
    page: Page, explorer_vault: VaultServer
) -> None:
    """The page's RFC 9162 walks against vault.ledger.merkle's proofs for every position and
    pair of sizes up to 40, and a flipped bit in any proof refused."""
    page.goto(explorer_url(explorer_vault))
    page.wait_for_selector("#status:has-text('entries')")
    tree = MerkleTree(leaf_hash(b"leaf %d" % n) for n in range(40))
    cases = []
    for new in range(1, 41):
        for index in range(new):
            cases.append(
                [
                    "inclusion",
                    index,
                    new,
                    tree.leaf(index),
                    tree.inclusion_proof(index, new),
                    tree.root(new),
                ]
            )
        for old in range(0, new + 1):
            cases.append(
                [
                    "consistency",
                    old,
                    new,
                    tree.root(old),
                    tree.consistency_proof(old, new),
                    tree.root(new),
                ]
            )
    encoded = [
        [kind, a, b, x.hex(), [h.hex() for h in proof], y.hex()]
        for kind, a, b, x, proof, y in cases
    ]
    results = page.evaluate(
        """async (cases) => {
            const bytes = (h) => Uint8Array.from(h.match(/../g) || [], (x) => parseInt(x, 16));
            const check = async (kind, a, b, x, proof, y) => kind === "inclusion"
                ? equal((await rootFromInclusionProof(a, b, x, proof)) || new Uint8Array(), y)
                : consistent(a, b, x, y, proof);
            const out = [];
            for (const [kind, a, b, x, proof, y] of cases) {
                const path = proof.map(bytes);
                const good = await check(kind, a, b, bytes(x), path, bytes(y));
                const bad = [];
                for (let i = 0; i < path.length; i++) {
                    const flipped = path.map((h) => h.slice());
                    flipped[i][31] ^= 1;
                    bad.push(await check(kind, a, b, bytes(x), flipped, bytes(y)));
                }
                const short = path.length > 0 &&
                    await check(kind, a, b, bytes(x), path.slice(1), bytes(y));
                out.push([good, bad.some(Boolean), short]);
            }
            return out;
        }""",
        encoded,
    )
    failures = [
        (case[0], case[1], case[2], result)
        for case, result in zip(cases, results, strict=True)
        if result != [True, False, False]
    ]
    assert failures == []
    assert len(cases) > 1600


# ---------------------------------------------------------------------- layout and navigation

LONG_NOTE = "lr=3e-4;" * 60 + "/scratch/" + "x" * 300  # no space to break at


def page_geometry(page: Page) -> dict[str, Any]:
    """What a reader meets: the document's width against the window's, where the entries'
    columns end, and how tall each shown digest is against its line."""
    return dict(
        page.evaluate(
            """() => {
            const right = (n) => n.getBoundingClientRect().right;
            return {
                viewport: window.innerWidth,
                scrollWidth: document.documentElement.scrollWidth,
                height: document.documentElement.scrollHeight,
                columnsRight: Math.max(...[...document.querySelectorAll(
                    "#entries th, #entries td")].map(right)),
                proofColumn: [...document.querySelectorAll("#entries td:last-child")].map(
                    (n) => [n.getBoundingClientRect().left, right(n)]),
                digestLines: [...document.querySelectorAll("[data-digest] button.digest")].map(
                    (n) => n.getBoundingClientRect().height /
                        parseFloat(getComputedStyle(n).lineHeight === "normal"
                            ? parseFloat(getComputedStyle(n).fontSize) * 1.2
                            : getComputedStyle(n).lineHeight)),
            };
        }"""
        )
    )


@pytest.mark.parametrize("width", [1366, 1920])
def test_a_run_with_long_metadata_fits_the_window(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page, tmp_path: Path, width: int
) -> None:
    with explorer_vault.client() as client:
        admission = client.admit(
            image=sealed.image, dataset=sealed.dataset, seed=width, team="vision"
        )
        for n in range(5):
            output = str(client.put(b"an output with a long note %d" % n).blob.sha256)
            client.pin(
                "artefact",
                [output, admission.run_id],
                meta={"path": f"deep/{'nested/' * 20}{n}.bin", "note": LONG_NOTE, "team": "vision"},
            )
    page.set_viewport_size({"width": width, "height": 900})
    assert search(page, explorer_url(explorer_vault), admission.run_id) == "verified"
    page.screenshot(path=str(tmp_path / f"run-{width}.png"), full_page=True)
    shown = page_geometry(page)
    assert shown["scrollWidth"] <= shown["viewport"] == width, shown
    assert shown["columnsRight"] <= width, shown
    # The proof column is on screen, with room for its word, on every row.
    assert len(shown["proofColumn"]) == 6
    assert all(right <= width and right - left >= 40 for left, right in shown["proofColumn"])
    # Every digest keeps to one line: shortened, the whole of it a click away.
    assert shown["digestLines"] and max(shown["digestLines"]) < 1.5, shown["digestLines"]
    ref = page.locator(f"#entries [data-digest='{admission.run_id}']").first
    short = f"{admission.run_id[:11]}\u2026{admission.run_id[-4:]}"
    assert ref.locator("button.digest").inner_text() == short
    assert ref.locator("button.digest").get_attribute("title") == admission.run_id
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    ref.locator("button.copy").click()
    # The clipboard is written asynchronously: the button says so once it is done.
    ref.locator("button.copy:text-is('copied')").wait_for(timeout=10_000)
    assert page.evaluate("navigator.clipboard.readText()") == admission.run_id
    # The long note wraps inside its column.
    assert LONG_NOTE in page.inner_text("#entries").replace("\n", "")


def test_back_and_forward_bring_each_view_back(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    assert search(page, url, sealed.run_id) == "verified"
    assert page.inner_text("#run-id") == sealed.run_id
    page.fill("#search", "#0")
    page.click("#search-button")
    page.wait_for_selector("#entries button:text-is('#0')")
    assert page.locator("#run-id").count() == 0
    page.go_back()
    page.wait_for_selector("#run-id")
    assert page.inner_text("#run-id") == sealed.run_id
    assert page.input_value("#search") == sealed.run_id
    assert page.get_attribute("#verdict", "data-state") == "verified"
    page.go_forward()
    page.wait_for_selector("#entries button:text-is('#0')")
    assert page.locator("#run-id").count() == 0
    assert page.input_value("#search") == "#0"


def test_a_dataset_is_found_by_its_name_and_tag(
    explorer_vault: VaultServer, page: Page, tmp_path: Path
) -> None:
    digests = {}
    for tag in ("v1", "v2"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "images.idx").write_bytes(b"mnist %s\n" % tag.encode())
        with explorer_vault.client() as client:
            digests[tag] = add_dataset(client, tmp_path / tag, name="mnist-mini", tag=tag).digest
    url = explorer_url(explorer_vault)
    assert search(page, url, "mnist-mini@v1") == "verified"
    assert "Dataset mnist-mini" in page.inner_text("#view")
    assert "pinned at entry #" in page.inner_text("#view")
    assert sha256_of(b"mnist v1\n") in digests_in(page, "#view")
    # The entry's subject carries the name it pins.
    ref = page.locator(f"#entries [data-digest='{digests['v1']}']")
    assert ref.locator(".name").inner_text() == "mnist-mini@v1"
    # The name alone: its newest pin.
    assert search(page, url, "mnist-mini") == "verified"
    assert sha256_of(b"mnist v2\n") in digests_in(page, "#view")
    assert page.locator("#entries tbody tr").count() == 2
    # A name nobody pinned is one line.
    page.fill("#search", "mnist-mini@v9")
    page.click("#search-button")
    page.wait_for_selector("#status.error")
    assert page.inner_text("#status") == (
        "no dataset is pinned as mnist-mini@v9 (of the newest 10000 dataset pins)"
    )
    assert page.locator("#verdict").is_hidden()
    bad = get(f"{url}api/dataset?name=a%40b")
    assert (bad.status, bad.error()) == (400, "dataset name 'a@b': at most 256 characters, no '@'")


def entries_listed(page: Page) -> list[tuple[int, str, str]]:
    """The rows of the entries table: index, kind and author."""
    rows = page.locator("#entries tbody tr").all()
    return [
        (
            int(row.locator("td").nth(0).inner_text().removeprefix("#")),
            row.locator("td").nth(1).inner_text(),
            row.locator("td").nth(3).inner_text(),
        )
        for row in rows
    ]


def test_recent_entries_are_listed_newest_first_by_kind_and_by_author(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    with explorer_vault.client() as client:
        client.ledger.PinBatch(
            pb.PinBatchRequest(
                pins=[
                    pb.PinRequest(
                        kind="config",
                        subjects=[sha256_of(b"a config by ann %d" % n)],
                        meta={"name": f"sweep-{n}"},
                        external=True,
                        author="ann@explorer",
                    )
                    for n in range(30)
                ]
            ),
            timeout=60,
        )
    url = explorer_url(explorer_vault)
    size = json.loads(get(url + "api/vault").body)["size"]
    page.goto(url)
    page.wait_for_selector("#status:has-text('entries')")
    page.click("#recent")
    page.wait_for_selector("#verdict[data-state]")
    assert page.get_attribute("#verdict", "data-state") == "verified"
    assert page.inner_text("#entries h2") == "Recent entries, newest first"
    first = [index for index, _, _ in entries_listed(page)]
    assert first == list(range(size - 1, size - 26, -1))
    page.click("#older")
    page.wait_for_selector(f"#entries button:text-is('#{size - 26}')")
    assert page.get_attribute("#verdict", "data-state") == "verified"
    assert entries_listed(page)[0][0] == size - 26
    page.go_back()
    page.wait_for_selector(f"#entries button:text-is('#{size - 1}')")

    assert search(page, url, "author:ann@explorer") == "verified"
    listed = entries_listed(page)
    assert [(kind, author) for _, kind, author in listed] == [("config", "ann@explorer")] * 25
    assert [i for i, _, _ in listed] == sorted((i for i, _, _ in listed), reverse=True)
    assert "name=sweep-29" in page.inner_text("#entries")
    assert search(page, url, "kind:checkpoint") == "verified"
    assert {kind for _, kind, _ in entries_listed(page)} == {"checkpoint"}
    assert sealed.checkpoint in digests_in(page, "#entries")

    # A page of the log whose entries are not newest first is not what was asked.
    def reorder(route: Route) -> None:
        response = route.fetch()
        answer = response.json()
        answer["entries"].reverse()
        route.fulfill(response=response, body=json.dumps(answer))

    page.route("**/api/log?*", reorder)
    assert search(page, url, "author:ann@explorer") == "failed"
    assert "it is out of order" in page.inner_text("#verdict")
    assert page.locator("#entries tr").count() == 0

    for query, error in (
        ("limit=0", "limit is 1 to 100, not 0"),
        ("limit=101", "limit is 1 to 100, not 101"),
        ("before=x", "before is a number, not 'x'"),
        ("colour=red", "unknown query parameter 'colour'"),
    ):
        answer = get(f"{url}api/log?{query}")
        assert (answer.status, answer.error()) == (400, error), query
    missing = get(f"{url}api/log?kind=nothing")
    assert (missing.status, missing.error()) == (
        404,
        f"no entry of kind 'nothing' before index {size}",
    )


def test_the_ledgers_signed_tree_head_is_never_called_a_checkpoint(
    explorer_vault: VaultServer, sealed: SealedRun, page: Page
) -> None:
    url = explorer_url(explorer_vault)
    assert search(page, url, sealed.checkpoint) == "verified"
    verdict = page.inner_text("#verdict")
    assert "signed tree head of size" in verdict
    assert "checkpoint" not in verdict.lower()
    assert "Training checkpoint, step 7" in page.inner_text("#view")
    page.locator("#entries tbody button.link").first.click()
    detail = page.inner_text("#entry-detail")
    assert "signed tree head\tsize " in detail
    assert "\ncheckpoint\t" not in detail


# ---------------------------------------------------------------------- the HTTP surface


def test_the_http_surface_is_read_only_bounded_and_strict(
    explorer_vault: VaultServer, sealed: SealedRun
) -> None:
    url = explorer_url(explorer_vault)
    page = get(url)
    assert page.status == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Connection"] == "close"
    for path in ("/../etc/passwd", "/index.html", "/api", "/api/nothing", "/explorer.js/x"):
        assert get(url.rstrip("/") + path).status == 404, path
    assert get(url, method="POST").status == 405
    # Another site whose name resolves to 127.0.0.1 (DNS rebinding) is refused; loopback names
    # on any port (an SSH tunnel's) are not.
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "[::1"):
        rebound = get(url + "api/lookup?digest=" + sealed.image, {"Host": host})
        assert rebound.status == 403, host
        assert rebound.body == b"the explorer answers only to loopback host names\n"
    for host in ("localhost:9000", "127.0.0.1", "127.1.2.3:80", "[::1]:8470", "LOCALHOST"):
        assert get(url + "api/lookup?digest=" + sealed.image, {"Host": host}).status == 200, host
    assert get(url + "api/lookup?digest=" + "a" * 2000).status == 414
    bad = get(url + "api/lookup?digest=sha256:nothex")
    assert bad.status == 400
    assert "sha256:nothex" in bad.error()
    twice = get(url + "api/lookup?digest=" + sealed.image + "&digest=" + sealed.image)
    assert (twice.status, twice.error()) == (400, "a query parameter is given more than once")
    unknown = "sha256:" + "0" * 64
    missing = get(url + "api/lookup?digest=" + unknown)
    assert (missing.status, missing.error()) == (404, f"no entry names {unknown}")
    found = get(url + "api/lookup?digest=" + sealed.image)
    assert found.status == 200
    assert found.headers["Cache-Control"] == "no-store"
    assert found.headers["Content-Type"] == "application/json"


def check_with_the_ledgers_code(answer: dict[str, Any], verifier: str) -> Checkpoint:
    """An API answer verified by vault.ledger, as `vault verify` would: every entry's proof
    against the checkpoint, signed by the vault's key."""
    assert answer["verifier"] == verifier
    checkpoint = Verifier.from_string(verifier).open(answer["checkpoint"])
    for item in answer["entries"]:
        body = base64.b64decode(item["body"])
        assert Entry.decode(body).index == item["index"]
        proof = [base64.b64decode(h) for h in item["proof"]]
        verify_inclusion(leaf_hash(body), item["index"], checkpoint.size, proof, checkpoint.root)
    return checkpoint


@pytest.mark.parametrize("engine", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_api_answers_what_the_ledgers_own_verifier_accepts(
    engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    database = request.getfixturevalue("postgres_url") if engine == "postgres" else None
    with VaultServer(
        tmp_path / "vault", database=database, serve_args=("--explorer-http", "0")
    ) as server:
        url = explorer_url(server)
        with server.client() as client:
            verifier = str(client.verifier())
            image = str(client.put(b"an image looked up through the explorer").blob.sha256)
            for n in range(3):
                client.pin("image", image, meta={"name": f"trainer-{n}"})
            blake3 = str(client.stat(image).blob.blake3)
        found = get(f"{url}api/lookup?digest={image}")
        assert found.status == 200
        answer = json.loads(found.body)
        checkpoint = check_with_the_ledgers_code(answer, verifier)
        names = [Entry.decode(base64.b64decode(e["body"])).meta["name"] for e in answer["entries"]]
        assert names == ["trainer-0", "trainer-1", "trainer-2"]
        # A blake3 alias finds the same entries.
        alias = json.loads(get(f"{url}api/lookup?digest={blake3}").body)
        assert alias["entries"] == answer["entries"]
        entry = json.loads(get(f"{url}api/entry?index=1").body)
        check_with_the_ledgers_code(entry, verifier)
        assert entry["entries"] == answer["entries"][1:2]
        consistency = json.loads(get(f"{url}api/consistency?old=1&new={checkpoint.size}").body)
        first = Verifier.from_string(verifier).open(
            json.loads(get(f"{url}api/entry?index=0").body)["checkpoint"]
        )
        assert first.size == checkpoint.size
        proof = [base64.b64decode(h) for h in consistency["proof"]]
        one = MerkleTree([leaf_hash(base64.b64decode(answer["entries"][0]["body"]))]).root()
        verify_consistency(1, checkpoint.size, one, checkpoint.root, proof)
        # A page of the log, newest first, and the next page's bound.
        page = json.loads(get(f"{url}api/log?kind=image&limit=2").body)
        check_with_the_ledgers_code(page, verifier)
        assert page["entries"] == answer["entries"][:0:-1]
        assert page["next"] == 1
        last = json.loads(get(f"{url}api/log?kind=image&before=1").body)
        assert (last["entries"], last["next"]) == (answer["entries"][:1], None)
        assert get(f"{url}api/log?author=nobody").status == 404
        assert get(f"{url}api/consistency?old=2&new=1").status == 400
        assert get(f"{url}api/consistency?old=1&new=99").status == 404
        assert get(f"{url}api/entry?index=99").status == 404
        assert get(f"{url}api/entry?index=-1").status == 400


def test_the_explorer_listens_only_on_loopback_and_a_bad_port_is_one_line(tmp_path: Path) -> None:
    refused = run_vault(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--explorer-http",
        "0.0.0.0:0",
        env={"PINVAULT_DATA_DIR": str(tmp_path / "data")},
        state_home=tmp_path / "state",
    )
    assert "in auth.mode 'local' it listens only on loopback, not 0.0.0.0" in refused.error_line()
    env = {"PINVAULT_DATA_DIR": str(tmp_path / "data")}
    bad = run_vault("serve", "--listen", "127.0.0.1:0", "--explorer-http", "nope", env=env)
    assert bad.error_line() == (
        "vault: INVALID_ARGUMENT: --explorer-http 'nope': expected [HOST:]PORT, PORT 0 to 65535"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_vault("serve", "--listen", "127.0.0.1:0", "--explorer-http", str(port), env=env)
    line = busy.error_line(alone=False)
    assert line.startswith(f"vault: UNAVAILABLE: cannot serve explorer on 127.0.0.1:{port}: "), line


# ---------------------------------------------------------------------- credentials


def test_with_credentials_the_api_answers_only_a_bearer_token(
    tmp_path: Path, browser: Browser
) -> None:
    credentials = {"PINVAULT_AUTH_MODE": "credentials"}
    with VaultServer(
        tmp_path / "vault", env=credentials, serve_args=("--explorer-http", "127.0.0.1:0")
    ) as server:
        tokens = {}
        for name, role in (("root", "admin"), ("ann", "reader")):
            tokens[role] = run_vault(
                "token", "create", "--offline", "--name", name, "--team", "ops", "--role", role,
                env={"PINVAULT_DATA_DIR": str(server.data_dir), **credentials},
                state_home=server.state_home,
            ).ok().stdout.strip()  # fmt: skip
        with VaultClient(
            server.address, credentials=Credentials(token=tokens["admin"]), timeout=60
        ) as client:
            image = str(client.put(b"an image behind credentials").blob.sha256)
            client.pin("image", image, meta={"name": "private"})
        url = explorer_url(server)
        api = f"{url}api/lookup?digest={image}"
        anonymous = get(api)
        assert anonymous.status == 401
        assert "give a bearer token" in anonymous.error()
        assert b"private" not in anonymous.body
        assert get(url + "api/vault").status == 401
        assert get(api, {"Authorization": "Bearer pv_notatoken_x"}).status == 401
        assert get(api, {"Authorization": "Basic " + tokens["reader"]}).status == 401
        reader = get(api, {"Authorization": "Bearer " + tokens["reader"]})
        assert reader.status == 200
        assert json.loads(reader.body)["query"] == image
        # The page holds no data and loads without a token; it asks for one.
        context = browser.new_context()
        page = context.new_page()
        try:
            page.goto(url)
            page.wait_for_selector("#token-box:not([hidden])")
            assert "give a bearer token" in page.inner_text("#status")
            page.fill("#token", tokens["reader"])
            page.click("#save-settings")
            page.wait_for_selector("#status:has-text('entries')")
            page.fill("#search", image)
            page.click("#search-button")
            page.wait_for_selector("#verdict[data-state]")
            state = page.get_attribute("#verdict", "data-state")
            assert state == "verified", page.inner_text("#verdict")
            assert "private" in page.inner_text("#entries")
        finally:
            context.close()
