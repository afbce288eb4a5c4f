"""The OCI Distribution API of a real `vault serve` ([registry]), spoken with plain HTTP requests
as a registry client speaks it: blobs pushed whole and in chunks, manifests and indexes pushed
by tag and pulled by tag and digest, every push pinned as an `image` entry, tags resolved
through the ledger, deletes recorded as `withdraw` entries (manifests, tags) or hidden from one
repository (blobs), and pushes and deletes refused to callers without a writer's token."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import re
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import StartVault
from tests.services import ociconformance
from tests.services.vault_server import VaultServer, run_vault
from vault.client import Credentials, VaultClient
from vault.errors import InvalidArgument, NotFound
from vault.http_edge import BodyError, Edge, Limits, Response
from vault.store.manifest import FileEntry, build_manifest, encode_manifest

CREDENTIALS = {
    "PINVAULT_AUTH_MODE": "credentials",
    "PINVAULT_REGISTRY_LISTEN": "127.0.0.1:0",
    "PINVAULT_REGISTRY_UPLOADS_PER_CALLER": "3",
}
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
_URL = re.compile(r"registry \(OCI distribution\) at (http://\S+)")


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)

    def codes(self) -> list[str]:
        document = json.loads(self.body)
        assert isinstance(document, dict)
        return [error["code"] for error in document["errors"]]


class Registry:
    """Plain HTTP requests to the registry, with one caller's credentials."""

    def __init__(self, url: str, authorization: str = "") -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "", parts.port or 80
        self.authorization = authorization

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def as_(self, authorization: str) -> Registry:
        return Registry(f"http://{self.host}:{self.port}", authorization)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Iterator[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        sent = dict(headers or {})
        if self.authorization:
            sent["Authorization"] = self.authorization
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            chunked = body is not None and not isinstance(body, bytes)
            connection.request(method, path, body=body, headers=sent, encode_chunked=chunked)
            response = connection.getresponse()
            return Answer(
                response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
            )
        finally:
            connection.close()

    def push_blob(self, name: str, data: bytes) -> str:
        digest = sha256(data)
        answer = self.request("POST", f"/v2/{name}/blobs/uploads/?digest={digest}", data)
        assert answer.status == 201, answer
        assert answer.headers["location"] == f"/v2/{name}/blobs/{digest}"
        return digest

    def push_manifest(self, name: str, reference: str, document: object, kind: str) -> str:
        body = json.dumps(document).encode()
        answer = self.request(
            "PUT", f"/v2/{name}/manifests/{reference}", body, {"Content-Type": kind}
        )
        assert answer.status == 201, answer
        assert answer.headers["docker-content-digest"] == sha256(body)
        return sha256(body)


@dataclass
class Vault:
    server: VaultServer
    registry: Registry
    admin: VaultClient
    admin_token: str
    writer: str
    reader: str


def _token(admin: VaultClient, name: str, role: str) -> str:
    return admin.create_token(name=name, team="vision", role=role)[1]


def _registry_url(server: VaultServer) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = _URL.search(server.log())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise AssertionError(f"the registry's address is not in the log:\n{server.log()}")


@contextlib.contextmanager
def _vault(base: Path, env: Mapping[str, str]) -> Iterator[Vault]:
    """A vault that asks for credentials, with a registry, a writer's and a reader's token."""
    server = VaultServer(base, env=env)
    admin_token = (
        run_vault(
            *("token", "create", "--offline", "--name", "root", "--team", "ops"),
            *("--role", "admin"),
            env={"PINVAULT_DATA_DIR": str(server.data_dir), **env},
            state_home=server.state_home,
        )
        .ok()
        .stdout.strip()
    )
    with server:
        admin = VaultClient(server.address, credentials=Credentials(token=admin_token), timeout=60)
        with admin:
            writer = _token(admin, "pusher", "writer")
            reader = _token(admin, "puller", "reader")
            registry = Registry(_registry_url(server), f"Bearer {writer}")
            yield Vault(server, registry, admin, admin_token, writer, reader)


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vault]:
    with _vault(tmp_path_factory.mktemp("registry"), CREDENTIALS) as vault:
        yield vault


def _image(registry: Registry, name: str, layer: bytes, config: bytes) -> dict[str, object]:
    layer_digest = registry.push_blob(name, layer)
    config_digest = registry.push_blob(name, config)
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": LAYER, "digest": layer_digest, "size": len(layer)}],
    }


def test_an_image_and_an_index_are_pushed_pulled_and_pinned(vault: Vault) -> None:
    registry = vault.registry
    assert registry.request("GET", "/v2/").status == 200
    layer = bytes(range(256)) * 4096  # 1 MiB
    # The config in chunks: an upload opened, two chunks, the last one with the closing PUT.
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {}}).encode()
    opened = registry.request("POST", "/v2/lab/train/blobs/uploads/")
    assert opened.status == 202, opened
    location = opened.headers["location"]
    first = registry.request(
        "PATCH",
        location,
        config[:10],
        {"Content-Range": "0-9", "Content-Type": "application/octet-stream"},
    )
    assert first.status == 202 and first.headers["range"] == "0-9", first
    # A chunk that does not start where the upload ends is refused, saying where it ends.
    wrong = registry.request("PATCH", location, config[10:], {"Content-Range": "5-20"})
    assert wrong.status == 416 and wrong.headers["range"] == "0-9", wrong
    closed = registry.request("PUT", f"{location}?digest={sha256(config)}", config[10:])
    assert closed.status == 201, closed
    assert closed.headers["docker-content-digest"] == sha256(config)

    manifest = _image(registry, "lab/train", layer, config)
    digest = registry.push_manifest("lab/train", "v1", manifest, OCI_MANIFEST)

    by_tag = registry.request("GET", "/v2/lab/train/manifests/v1")
    assert by_tag.status == 200 and by_tag.headers["content-type"] == OCI_MANIFEST
    assert by_tag.headers["docker-content-digest"] == digest and sha256(by_tag.body) == digest
    assert registry.request("GET", f"/v2/lab/train/manifests/{digest}").body == by_tag.body
    head = registry.request("HEAD", "/v2/lab/train/manifests/v1")
    assert head.status == 200 and head.headers["docker-content-digest"] == digest

    layer_digest = sha256(layer)
    blob = registry.request("GET", f"/v2/lab/train/blobs/{layer_digest}")
    assert blob.status == 200 and blob.body == layer
    assert blob.headers["docker-content-digest"] == layer_digest
    blob_head = registry.request("HEAD", f"/v2/lab/train/blobs/{layer_digest}")
    assert blob_head.status == 200 and blob_head.headers["content-length"] == str(len(layer))
    part = registry.request(
        "GET", f"/v2/lab/train/blobs/{layer_digest}", headers={"Range": "bytes=1000-300000"}
    )
    assert part.status == 206 and part.body == layer[1000:300001]
    assert part.headers["content-range"] == f"bytes 1000-300000/{len(layer)}"

    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": digest,
                "size": len(by_tag.body),
                "platform": {"architecture": "amd64", "os": "linux"},
            }
        ],
    }
    index_digest = registry.push_manifest("lab/train", "multi", index, OCI_INDEX)
    pulled = registry.request("GET", "/v2/lab/train/manifests/multi")
    assert pulled.headers["content-type"] == OCI_INDEX
    assert pulled.headers["docker-content-digest"] == index_digest
    assert registry.request("GET", "/v2/lab/train/tags/list").json() == {
        "name": "lab/train",
        "tags": ["multi", "v1"],
    }
    page = registry.request("GET", "/v2/lab/train/tags/list?n=1")
    assert page.json() == {"name": "lab/train", "tags": ["multi"]}
    assert "last=multi" in page.headers["link"]

    # The pins are in the ledger, verified against a signed checkpoint, by the pusher's name.
    (pinned,) = vault.admin.lookup(digest)
    assert pinned.entry.kind == "image" and pinned.entry.author == "pusher"
    assert dict(pinned.entry.meta) == {
        "media-type": OCI_MANIFEST,
        "repository": "lab/train",
        "tag": "v1",
    }
    (index_pin,) = vault.admin.lookup(index_digest)
    assert index_pin.entry.meta["tag"] == "multi"


def test_a_large_layer_is_streamed_in_one_chunked_request(vault: Vault) -> None:
    registry = vault.registry
    piece = hashlib.sha256(b"layer").digest() * 2048  # 64 KiB
    layer = piece * 200  # 12.5 MiB, sent in 64 KiB pieces with chunked transfer encoding
    opened = registry.request("POST", "/v2/lab/big/blobs/uploads/")
    sent = registry.request("PATCH", opened.headers["location"], iter([piece] * 200))
    assert sent.status == 202 and sent.headers["range"] == f"0-{len(layer) - 1}", sent
    closed = registry.request("PUT", f"{sent.headers['location']}?digest={sha256(layer)}")
    assert closed.status == 201, closed
    pulled = registry.request("GET", f"/v2/lab/big/blobs/{sha256(layer)}")
    assert pulled.status == 200 and pulled.body == layer


def test_bytes_that_do_not_match_their_digest_are_refused_and_nothing_is_kept(
    vault: Vault,
) -> None:
    registry = vault.registry
    sent, claimed = b"the layer as sent", sha256(b"the layer as announced")
    whole = registry.request("POST", f"/v2/lab/bad/blobs/uploads/?digest={claimed}", sent)
    assert whole.status == 400 and whole.codes() == ["DIGEST_INVALID"], whole
    opened = registry.request("POST", "/v2/lab/bad/blobs/uploads/")
    registry.request("PATCH", opened.headers["location"], sent)
    chunked = registry.request("PUT", f"{opened.headers['location']}?digest={claimed}")
    assert chunked.status == 400 and chunked.codes() == ["DIGEST_INVALID"], chunked
    for digest in (claimed, sha256(sent)):
        missing = registry.request("GET", f"/v2/lab/bad/blobs/{digest}")
        assert missing.status == 404 and missing.codes() == ["BLOB_UNKNOWN"]
    assert vault.admin.find_missing([claimed, sha256(sent)]) == [claimed, sha256(sent)]
    # A manifest whose bytes are not the digest it is pushed as is refused too.
    manifest = _image(registry, "lab/bad", b"a layer", b"{}")
    body = json.dumps(manifest).encode()
    refused = registry.request(
        "PUT", f"/v2/lab/bad/manifests/{claimed}", body, {"Content-Type": OCI_MANIFEST}
    )
    assert refused.status == 400 and refused.codes() == ["DIGEST_INVALID"]
    with pytest.raises(NotFound):
        vault.admin.lookup(sha256(body))
    assert vault.admin.find_missing([sha256(body)]) == [sha256(body)]


def test_a_manifest_naming_a_blob_the_vault_lacks_is_refused(vault: Vault) -> None:
    registry = vault.registry
    manifest = _image(registry, "lab/partial", b"one layer", b"{}")
    absent = sha256(b"a layer never pushed")
    manifest["layers"] = [{"mediaType": LAYER, "digest": absent, "size": 20}]
    body = json.dumps(manifest).encode()
    refused = registry.request(
        "PUT", "/v2/lab/partial/manifests/v1", body, {"Content-Type": OCI_MANIFEST}
    )
    assert refused.status == 400 and refused.codes() == ["MANIFEST_BLOB_UNKNOWN"]
    assert absent in json.loads(refused.body)["errors"][0]["message"]
    unknown = registry.request("GET", "/v2/lab/partial/manifests/v1")
    assert unknown.status == 404 and unknown.codes() == ["MANIFEST_UNKNOWN"]
    assert registry.request("GET", "/v2/lab/partial/tags/list").codes() == ["NAME_UNKNOWN"]
    broken = registry.request(
        "PUT", "/v2/lab/partial/manifests/v1", b"{not json", {"Content-Type": OCI_MANIFEST}
    )
    assert broken.status == 400 and broken.codes() == ["MANIFEST_INVALID"]


def test_pushes_need_a_writers_token(vault: Vault) -> None:
    anonymous = vault.registry.as_("")
    refused = anonymous.request("POST", "/v2/lab/x/blobs/uploads/?digest=" + sha256(b"x"), b"x")
    assert refused.status == 401 and refused.codes() == ["UNAUTHORIZED"]
    assert refused.headers["www-authenticate"] == (
        f'Bearer realm="http://{vault.registry.address}/token",service="pinvault",'
        'scope="repository:lab/x:pull,push"'
    )
    assert anonymous.request("GET", "/v2/").status == 401
    # A reader's token, as podman and skopeo send it with --creds: the password of Basic.
    basic = base64.b64encode(f"puller:{vault.reader}".encode()).decode()
    reader = vault.registry.as_(f"Basic {basic}")
    assert reader.request("GET", "/v2/").status == 200
    denied = reader.request("POST", "/v2/lab/x/blobs/uploads/?digest=" + sha256(b"x"), b"x")
    assert denied.status == 403 and denied.codes() == ["DENIED"]
    manifest = _image(vault.registry, "lab/x", b"x layer", b"{}")
    refused_manifest = reader.request(
        "PUT",
        "/v2/lab/x/manifests/v1",
        json.dumps(manifest).encode(),
        {"Content-Type": OCI_MANIFEST},
    )
    assert refused_manifest.status == 403
    assert reader.request("GET", "/v2/lab/x/manifests/v1").status == 404
    assert vault.admin.find_missing([sha256(b"x")]) == [sha256(b"x")]
    forged = vault.registry.as_(f"Bearer {vault.writer[:-4]}0000")
    assert forged.request("GET", "/v2/").status == 401


def _ask_token(registry: Registry, query: str, authorization: str) -> Answer:
    return registry.as_(authorization).request("GET", f"/token?{query}")


def _basic(name: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{token}".encode()).decode()


def test_the_token_endpoint_issues_tokens_for_the_scopes_a_role_allows(vault: Vault) -> None:
    anonymous = vault.registry.as_("")
    realm = f'realm="http://{vault.registry.address}/token",service="pinvault"'
    pull = anonymous.request("GET", "/v2/lab/tok/manifests/v1")
    assert pull.status == 401 and pull.codes() == ["UNAUTHORIZED"]
    assert pull.headers["www-authenticate"] == (f'Bearer {realm},scope="repository:lab/tok:pull"')
    assert anonymous.request("GET", "/v2/").headers["www-authenticate"] == f"Bearer {realm}"
    # The endpoint itself asks for Basic credentials: the vault token as the password.
    bare = anonymous.request("GET", "/token?service=pinvault&scope=repository:lab/tok:pull")
    assert bare.status == 401 and bare.headers["www-authenticate"] == 'Basic realm="pinvault"'

    scopes = "service=pinvault&scope=repository:lab/tok:pull,push"
    issued = _ask_token(vault.registry, scopes, _basic("pusher", vault.writer))
    assert issued.status == 200, issued
    answer = issued.json()
    assert isinstance(answer, dict) and answer["expires_in"] == 300
    assert answer["access_token"] == answer["token"] and answer["token"].startswith("pvr1.")
    assert vault.writer not in issued.body.decode()
    bearer = vault.registry.as_(f"Bearer {answer['token']}")
    layer = b"pushed with a registry token"
    bearer.push_blob("lab/tok", layer)
    assert bearer.request("GET", f"/v2/lab/tok/blobs/{sha256(layer)}").body == layer
    # Another repository is outside the token: the client is sent back for that scope.
    elsewhere = bearer.request("GET", f"/v2/lab/other/blobs/{sha256(layer)}")
    assert elsewhere.status == 401
    assert elsewhere.headers["www-authenticate"].endswith('scope="repository:lab/other:pull"')

    # A reader asking to push gets a token that pulls only, and its push is denied.
    read_only = _ask_token(vault.registry, scopes, _basic("puller", vault.reader)).json()
    assert isinstance(read_only, dict)
    reader = vault.registry.as_(f"Bearer {read_only['token']}")
    assert reader.request("GET", f"/v2/lab/tok/blobs/{sha256(layer)}").status == 200
    denied = reader.request("POST", f"/v2/lab/tok/blobs/uploads/?digest={sha256(b'r')}", b"r")
    assert denied.status == 403 and denied.codes() == ["DENIED"]

    # A token changed in any byte is not one the vault issued.
    token = answer["token"]
    for forged in (token[:-2] + ("AA" if token[-2:] != "AA" else "BB"), token + "x", "pvr1.e30."):
        refused = vault.registry.as_(f"Bearer {forged}").request("GET", "/v2/")
        assert refused.status == 401 and refused.codes() == ["UNAUTHORIZED"], forged
    # Several scopes at once; scopes of other kinds are left out of the token.
    many = _ask_token(
        vault.registry,
        "scope=repository:lab/a:pull&scope=repository:lab/b:pull%20registry:catalog:*",
        _basic("puller", vault.reader),
    )
    assert many.status == 200, many
    issued_many = many.json()
    assert isinstance(issued_many, dict)
    both = vault.registry.as_(f"Bearer {issued_many['token']}")
    for name in ("lab/a", "lab/b"):
        assert both.request("GET", f"/v2/{name}/tags/list").status == 404  # pulled, none there
    wrong_service = _ask_token(vault.registry, "service=elsewhere", _basic("puller", vault.reader))
    assert wrong_service.status == 400


def test_the_token_endpoint_counts_failed_credentials_against_the_address(
    tmp_path: Path,
) -> None:
    env = {**CREDENTIALS, "PINVAULT_SERVER_FAILED_AUTH_BURST": "3"}
    with _vault(tmp_path, env) as vault:
        wrong = _basic("pusher", vault.writer[:-8] + "00000000")
        answers = [_ask_token(vault.registry, "service=pinvault", wrong) for _ in range(5)]
        assert [a.status for a in answers] == [401, 401, 401, 429, 429]
        assert answers[-1].codes() == ["TOOMANYREQUESTS"]
        assert "too many failed credentials" in answers[-1].body.decode()
        # A forged registry token is a failed credential too; a valid token is never held back.
        forged = vault.registry.as_("Bearer pvr1.e30.AAAA").request("GET", "/v2/")
        assert forged.status == 429
        good = _ask_token(vault.registry, "service=pinvault", _basic("pusher", vault.writer))
        assert good.status == 200


def test_a_moved_tag_resolves_to_the_newest_push_and_the_old_one_stays(vault: Vault) -> None:
    registry = vault.registry
    old = registry.push_manifest(
        "lab/moving", "latest", _image(registry, "lab/moving", b"old", b"{}"), OCI_MANIFEST
    )
    new = registry.push_manifest(
        "lab/moving", "latest", _image(registry, "lab/moving", b"new", b"{}"), OCI_MANIFEST
    )
    assert old != new
    latest = registry.request("GET", "/v2/lab/moving/manifests/latest")
    assert latest.headers["docker-content-digest"] == new
    kept = registry.request("GET", f"/v2/lab/moving/manifests/{old}")
    assert kept.status == 200 and sha256(kept.body) == old
    # The tag is a name in one repository only.
    elsewhere = registry.request("GET", "/v2/lab/other/manifests/latest")
    assert elsewhere.status == 404 and elsewhere.codes() == ["MANIFEST_UNKNOWN"]
    assert registry.request("GET", f"/v2/lab/other/manifests/{old}").status == 404


def _status(registry: Registry, method: str, path: str) -> int:
    return registry.request(method, path).status


def _tags_of(registry: Registry, name: str) -> object:
    document = registry.request("GET", f"/v2/{name}/tags/list").json()
    assert isinstance(document, dict)
    return document["tags"]


def _entries(vault: Vault, digest: str) -> list[tuple[str, str, dict[str, str]]]:
    """The kind, author and metadata of every entry naming `digest`, proven in the ledger."""
    return [(p.entry.kind, p.entry.author, dict(p.entry.meta)) for p in vault.admin.lookup(digest)]


def test_a_deleted_tag_resolves_to_nothing_until_it_is_pushed_again(vault: Vault) -> None:
    registry, name = vault.registry, "lab/untag"
    manifest = _image(registry, name, b"a layer whose tag is deleted", b"{}")
    digest = registry.push_manifest(name, "v1", manifest, OCI_MANIFEST)
    registry.push_manifest(name, "stable", manifest, OCI_MANIFEST)

    deleted = registry.request("DELETE", f"/v2/{name}/manifests/v1")
    assert deleted.status == 202, deleted
    gone = registry.request("GET", f"/v2/{name}/manifests/v1")
    assert gone.status == 404 and gone.codes() == ["MANIFEST_UNKNOWN"]
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/v1") == 404
    # The manifest stays, by digest and by its other tag.
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/{digest}") == 200
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/stable") == 200
    assert _tags_of(registry, name) == ["stable"]
    again = registry.request("DELETE", f"/v2/{name}/manifests/v1")
    assert again.status == 404 and again.codes() == ["MANIFEST_UNKNOWN"]

    # Pushed again, the tag is back.
    registry.push_manifest(name, "v1", manifest, OCI_MANIFEST)
    assert (
        registry.request("GET", f"/v2/{name}/manifests/v1").headers["docker-content-digest"]
        == digest
    )
    assert _tags_of(registry, name) == ["stable", "v1"]
    # The delete is an entry of its own, by the caller, and the pins stay where they were.
    pinned = {"repository": name, "media-type": OCI_MANIFEST}
    assert _entries(vault, digest) == [
        ("image", "pusher", {**pinned, "tag": "v1"}),
        ("image", "pusher", {**pinned, "tag": "stable"}),
        ("withdraw", "pusher", {"repository": name, "tag": "v1"}),
        ("image", "pusher", {**pinned, "tag": "v1"}),
    ]


def test_a_deleted_manifest_takes_its_tags_and_its_referrers_listing_with_it(
    vault: Vault,
) -> None:
    registry, name = vault.registry, "lab/gone"
    manifest = _image(registry, name, b"a layer whose manifest is deleted", b"{}")
    size = len(json.dumps(manifest).encode())
    digest = registry.push_manifest(name, "v1", manifest, OCI_MANIFEST)
    registry.push_manifest(name, "latest", manifest, OCI_MANIFEST)
    kept = registry.push_manifest(
        name, "keep", _image(registry, name, b"another layer", b"{}"), OCI_MANIFEST
    )
    # The same manifest in another repository, which the delete leaves alone.
    registry.push_manifest("lab/gone-elsewhere", "v1", manifest, OCI_MANIFEST)
    sbom = registry.push_blob(name, b"an sbom")
    referrer = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.example.sbom",
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": sha256(b"{}"),
            "size": 2,
        },
        "layers": [{"mediaType": LAYER, "digest": sbom, "size": 7}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": digest, "size": size},
    }
    referring = registry.push_manifest(
        name, sha256(json.dumps(referrer).encode()), referrer, OCI_MANIFEST
    )

    def referrers() -> list[str]:
        index = registry.request("GET", f"/v2/{name}/referrers/{digest}").json()
        assert isinstance(index, dict)
        return [m["digest"] for m in index["manifests"]]

    assert referrers() == [referring]
    assert _status(registry, "DELETE", f"/v2/{name}/manifests/{referring}") == 202
    assert referrers() == []
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/{referring}") == 404

    assert _status(registry, "DELETE", f"/v2/{name}/manifests/{digest}") == 202
    for reference in (digest, "v1", "latest"):
        gone = registry.request("GET", f"/v2/{name}/manifests/{reference}")
        assert gone.status == 404 and gone.codes() == ["MANIFEST_UNKNOWN"], reference
    assert _tags_of(registry, name) == ["keep"]
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/{kept}") == 200
    assert _status(registry, "HEAD", "/v2/lab/gone-elsewhere/manifests/v1") == 200
    again = registry.request("DELETE", f"/v2/{name}/manifests/{digest}")
    assert again.status == 404 and again.codes() == ["MANIFEST_UNKNOWN"]
    assert _status(registry, "DELETE", f"/v2/lab/never/manifests/{digest}") == 404

    # Pushed again by digest, the manifest is back; the tags it had are not.
    registry.push_manifest(name, digest, manifest, OCI_MANIFEST)
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/{digest}") == 200
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/v1") == 404
    assert ("withdraw", "pusher", {"repository": name}) in _entries(vault, digest)


def test_a_deleted_blob_is_unknown_in_its_repository_only_until_pushed_again(
    vault: Vault,
) -> None:
    registry, name = vault.registry, "lab/blobs"
    layer = b"a layer deleted from one repository"
    digest = registry.push_blob(name, layer)
    registry.push_blob("lab/blobs-other", layer)
    path = f"/v2/{name}/blobs/{digest}"

    assert _status(registry, "DELETE", path) == 202
    assert _status(registry, "HEAD", path) == 404
    hidden = registry.request("GET", path)
    assert hidden.status == 404 and hidden.codes() == ["BLOB_UNKNOWN"]
    assert registry.request("GET", f"/v2/lab/blobs-other/blobs/{digest}").body == layer
    again = registry.request("DELETE", path)
    assert again.status == 404 and again.codes() == ["BLOB_UNKNOWN"]
    never = registry.request("DELETE", f"/v2/{name}/blobs/{sha256(b'never pushed')}")
    assert never.status == 404 and never.codes() == ["BLOB_UNKNOWN"]
    # A manifest pushed there naming it is refused; its bytes are still the vault's.
    manifest = _image(registry, name, b"another layer of the image", b"{}")
    manifest["layers"] = [{"mediaType": LAYER, "digest": digest, "size": len(layer)}]
    body = json.dumps(manifest).encode()
    headers = {"Content-Type": OCI_MANIFEST}
    refused = registry.request("PUT", f"/v2/{name}/manifests/v1", body, headers)
    assert refused.status == 400 and refused.codes() == ["MANIFEST_BLOB_UNKNOWN"], refused
    assert vault.admin.find_missing([digest]) == []

    # Mounted from a repository that has it, it is back.
    mounted = registry.request(
        "POST", f"/v2/{name}/blobs/uploads/?mount={digest}&from=lab/blobs-other"
    )
    assert mounted.status == 201, mounted
    assert _status(registry, "HEAD", path) == 200
    # Mounted from one it was deleted from, it is not: the client is given an upload instead.
    assert _status(registry, "DELETE", path) == 202
    refused_mount = registry.request(
        "POST", f"/v2/lab/blobs-third/blobs/uploads/?mount={digest}&from={name}"
    )
    assert refused_mount.status == 202, refused_mount
    registry.request("DELETE", refused_mount.headers["location"])
    # Pushed again, it is back, and the manifest is taken.
    registry.push_blob(name, layer)
    assert _status(registry, "HEAD", path) == 200
    assert registry.request("PUT", f"/v2/{name}/manifests/v1", body, headers).status == 201


def test_deletes_need_a_writers_token_granting_delete(vault: Vault) -> None:
    registry, name = vault.registry, "lab/guarded"
    manifest = _image(registry, name, b"a guarded layer", b"{}")
    layer = manifest["layers"][0]["digest"]  # type: ignore[index]
    digest = registry.push_manifest(name, "v1", manifest, OCI_MANIFEST)
    paths = (
        f"/v2/{name}/manifests/v1",
        f"/v2/{name}/manifests/{digest}",
        f"/v2/{name}/blobs/{layer}",
    )

    reader = registry.as_(_basic("puller", vault.reader))
    asked = f"service=pinvault&scope=repository:{name}:*"
    issued = _ask_token(registry, asked, _basic("puller", vault.reader)).json()
    assert isinstance(issued, dict)
    read_only = registry.as_(f"Bearer {issued['token']}")
    for caller in (reader, read_only):
        for path in paths:
            denied = caller.request("DELETE", path)
            assert denied.status == 403 and denied.codes() == ["DENIED"], (path, denied)
    anonymous = registry.as_("").request("DELETE", paths[0])
    assert anonymous.status == 401
    assert anonymous.headers["www-authenticate"].endswith(f'scope="repository:{name}:delete"')

    # A writer's registry token for pull and push is sent back for delete; `*` grants it.
    pushing = _ask_token(
        registry, f"service=pinvault&scope=repository:{name}:pull,push", _basic("p", vault.writer)
    ).json()
    assert isinstance(pushing, dict)
    challenged = registry.as_(f"Bearer {pushing['token']}").request("DELETE", paths[0])
    assert challenged.status == 401, challenged
    assert challenged.headers["www-authenticate"].endswith(f'scope="repository:{name}:delete"')
    everything = _ask_token(registry, asked, _basic("p", vault.writer)).json()
    assert isinstance(everything, dict)
    writer = registry.as_(f"Bearer {everything['token']}")
    assert [_status(writer, "DELETE", path) for path in paths] == [202, 202, 202]
    assert [_status(writer, "HEAD", path) for path in paths] == [404, 404, 404]
    assert [kind for kind, _, _ in _entries(vault, digest)] == ["image", "withdraw", "withdraw"]


def test_a_withdraw_is_written_only_by_the_registry(vault: Vault) -> None:
    registry, name = vault.registry, "lab/forged"
    digest = registry.push_manifest(
        name, "v1", _image(registry, name, b"a layer kept", b"{}"), OCI_MANIFEST
    )
    with pytest.raises(InvalidArgument, match="only by the vault's registry"):
        vault.admin.pin("withdraw", digest, meta={"repository": name, "tag": "v1"})
    assert _status(registry, "HEAD", f"/v2/{name}/manifests/v1") == 200
    assert [kind for kind, _, _ in _entries(vault, digest)] == ["image"]


def test_after_deletes_the_ledger_verifies_and_the_image_is_still_admitted(vault: Vault) -> None:
    registry, name = vault.registry, "lab/admitted"
    manifest = _image(registry, name, b"a layer of an image a job runs on", b"{}")
    layer = manifest["layers"][0]["digest"]  # type: ignore[index]
    digest = registry.push_manifest(name, "v1", manifest, OCI_MANIFEST)
    for path in ("manifests/v1", f"manifests/{digest}", f"blobs/{layer}"):
        assert _status(registry, "DELETE", f"/v2/{name}/{path}") == 202, path
    as_admin = {"PINVAULT_CLIENT_TOKEN": vault.admin_token}
    vault.server.run("verify", "--blobs", env=as_admin).ok()
    listed = vault.server.run(
        "log", "--kind", "withdraw", "--digest", digest, "--json", env=as_admin
    )
    assert [(e["kind"], e["meta"]) for e in listed.ok().json_lines()] == [
        ("withdraw", {"repository": name, "tag": "v1"}),
        ("withdraw", {"repository": name}),
    ]
    # A registry delete withdraws a name, not the pin: a job on the image is admitted.
    rows = b"a,1\n"
    listed = FileEntry("rows.csv", len(rows), 0o644, str(vault.admin.put(rows).blob.sha256))
    dataset = str(vault.admin.put(encode_manifest(build_manifest([listed]))).blob.sha256)
    vault.admin.pin("dataset", dataset)
    admission = vault.admin.admit(image=digest, dataset=dataset, seed=7)
    assert admission.inputs.image == digest


def test_open_uploads_are_bounded_per_caller(vault: Vault) -> None:
    registry = vault.registry
    opened = [registry.request("POST", "/v2/lab/many/blobs/uploads/") for _ in range(3)]
    assert [o.status for o in opened] == [202, 202, 202]
    refused = registry.request("POST", "/v2/lab/many/blobs/uploads/")
    assert refused.status == 429 and refused.codes() == ["TOOMANYREQUESTS"]
    # Another caller's upload is not found by its address, nor cancelled through it.
    other = vault.registry.as_(f"Bearer {_token(vault.admin, 'other-pusher', 'writer')}")
    assert other.request("GET", opened[0].headers["location"]).status == 404
    for o in opened:
        assert registry.request("DELETE", o.headers["location"]).status == 204
    again = registry.request("POST", "/v2/lab/many/blobs/uploads/")
    assert again.status == 202
    registry.request("DELETE", again.headers["location"])


def test_a_blob_whose_stored_copy_is_damaged_is_never_served_whole(vault: Vault) -> None:
    registry = vault.registry
    layer = b"a layer that rots on disk " * 4096
    digest = registry.push_blob("lab/rot", layer)
    with vault.server.blob_path(digest).open("r+b") as stored:
        stored.seek(50_000)
        stored.write(b"X")
    # The answer ends short of its announced length: the client's read fails, and no byte of
    # the damaged chunk was sent.
    with pytest.raises(http.client.IncompleteRead) as cut:
        registry.request("GET", f"/v2/lab/rot/blobs/{digest}")
    assert b"X" not in cut.value.partial


def test_in_local_mode_it_answers_loopback_names_only_and_bounds_each_upload(
    start_vault: StartVault,
) -> None:
    server = start_vault(
        env={
            "PINVAULT_REGISTRY_LISTEN": "127.0.0.1:0",
            "PINVAULT_REGISTRY_MAX_UPLOAD_BYTES": "100000",
        }
    )
    registry = Registry(_registry_url(server))
    assert registry.request("GET", "/v2/").status == 200
    # A web page whose own name resolves to 127.0.0.1 sends that name.
    rebound = registry.request("GET", "/v2/", headers={"Host": "evil.example"})
    assert rebound.status == 403 and rebound.codes() == ["DENIED"]
    opened = registry.request("POST", "/v2/lab/local/blobs/uploads/")
    location = opened.headers["location"]
    too_big = registry.request("PATCH", location, iter([b"x" * 50_000] * 3))
    assert too_big.status == 413 and too_big.codes() == ["SIZE_INVALID"], too_big
    assert registry.request("GET", location).codes() == ["BLOB_UPLOAD_UNKNOWN"]
    digest = registry.push_manifest(
        "lab/local", "v1", _image(registry, "lab/local", b"layer", b"{}"), OCI_MANIFEST
    )
    with server.client() as client:
        (pinned,) = client.lookup(digest)
    assert pinned.entry.kind == "image" and pinned.entry.meta["repository"] == "lab/local"


def test_a_delete_on_one_server_is_seen_at_once_by_another(
    tmp_path: Path, postgres_url: str
) -> None:
    env = {"PINVAULT_REGISTRY_LISTEN": "127.0.0.1:0", "PINVAULT_LEDGER_ORIGIN": "registry.test/l"}
    with VaultServer(tmp_path / "a", database=postgres_url, env=env) as first:
        shared = tmp_path / "shared.toml"
        shared.write_text(f'[ledger]\nkey_file = "{first.key_path}"\norigin = "registry.test/l"\n')
        second = VaultServer(
            tmp_path / "b", database=postgres_url, env=env, args=["--config", str(shared)]
        )
        with second:
            one, other = Registry(_registry_url(first)), Registry(_registry_url(second))
            name = "lab/balanced"
            manifest = _image(one, name, b"a layer behind a balancer", b"{}")
            layer = manifest["layers"][0]["digest"]  # type: ignore[index]
            digest = one.push_manifest(name, "v1", manifest, OCI_MANIFEST)
            one.push_manifest(name, "v2", manifest, OCI_MANIFEST)
            blob = f"/v2/{name}/blobs/{layer}"
            assert _tags_of(other, name) == ["v1", "v2"]
            assert _status(other, "HEAD", blob) == 200

            assert _status(other, "DELETE", f"/v2/{name}/manifests/v1") == 202
            assert _status(one, "HEAD", f"/v2/{name}/manifests/v1") == 404
            assert _status(one, "HEAD", f"/v2/{name}/manifests/v2") == 200
            assert _status(one, "DELETE", f"/v2/{name}/manifests/{digest}") == 202
            for reference in (digest, "v2"):
                gone = other.request("GET", f"/v2/{name}/manifests/{reference}")
                assert gone.status == 404 and gone.codes() == ["MANIFEST_UNKNOWN"], reference
            assert _tags_of(other, name) == []
            assert _status(one, "DELETE", blob) == 202
            assert _status(other, "HEAD", blob) == 404
            one.push_blob(name, b"a layer behind a balancer")
            assert _status(other, "HEAD", blob) == 200


class _Counted:
    """A sink that counts the bytes of the body it is given."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, piece: bytes) -> Response | None:
        self.size += len(piece)
        return None

    def finish(self) -> Response:
        return Response.text(200, f"{self.size} bytes")

    def abort(self, error: BodyError) -> Response:
        return Response.text(error.status, str(error))


def _streaming_edge(limits: Limits) -> Edge:
    return Edge("stream-test", lambda request: _Counted(), limits=limits)


def _exchange(port: int, head: bytes, pieces: list[bytes], pause: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head)
        for piece in pieces:
            time.sleep(pause)
            try:
                conn.sendall(piece)
            except OSError:
                break
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


def test_a_streamed_body_must_keep_its_minimum_rate() -> None:
    limits = Limits(
        body_seconds=0.5, min_body_rate=1000, max_body_bytes=1 << 20, methods=frozenset({"PUT"})
    )
    with _streaming_edge(limits) as edge:
        head = b"PUT /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 5000\r\n\r\n"
        # 1000 bytes at once buys one more second; the rest never comes fast enough.
        answer = _exchange(edge.port, head, [b"a" * 1000, b"b" * 10, b"c" * 10], pause=1.0)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"too slowly" in answer
        # A body at the rate is taken whole, far past body_seconds.
        answer = _exchange(edge.port, head, [b"d" * 1000] * 5, pause=0.2)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"5000 bytes\n")


def test_a_streamed_body_past_its_bound_is_refused() -> None:
    limits = Limits(min_body_rate=1000, max_body_bytes=4096, methods=frozenset({"PUT"}))
    with _streaming_edge(limits) as edge:
        head = b"PUT /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"800\r\n" + b"z" * 2048 + b"\r\n"
        answer = _exchange(edge.port, head, [piece] * 3 + [b"0\r\n\r\n"])
        assert answer.startswith(b"HTTP/1.1 413 "), answer


# The suite's workflows this registry passes, the deletes among them: a manifest or tag deleted
# is withdrawn by a new entry, a blob hidden from its repository; no entry and no byte is removed.
CONFORMANCE_PASSES = (
    "Ping",
    "Blob push",
    "Blob post only",
    "Blob post put",
    "Blob chunked",
    "Blob streaming",
    "Blob mount",
    "Blob anonymous mount",
    "Blob get",
    "Blob get range",
    "Blob head",
    "Blob upload cancel",
    "Manifest put by digest",
    "Manifest put by tag",
    "Manifest put with subject",
    "Manifest get by digest",
    "Manifest get by tag",
    "Manifest head by digest",
    "Manifest head by tag",
    "Tag listing",
    "Referrers",
    "Image",
    "Index",
    "Nested Index",
    "Artifact",
    "Artifacts with Subject",
    "Missing Subject",
    "Bad Digest Image",
    "Invalid Manifest Digest",
    "Blob delete",
    "Blob delete atomic",
    "Manifest delete",
    "Manifest delete atomic",
    "Tag delete",
    "Tag delete atomic",
)


def test_the_oci_conformance_suite_passes_pull_push_and_discovery(tmp_path: Path) -> None:
    binary = ociconformance.build()
    env = {**CREDENTIALS, "PINVAULT_REGISTRY_UPLOADS_PER_CALLER": "64"}
    with _vault(tmp_path / "vault", env) as vault:
        outcome = ociconformance.run(
            binary,
            tmp_path / "conformance",
            {
                "OCI_REGISTRY": vault.registry.address,
                "OCI_TLS": "disabled",
                "OCI_REPO1": "conformance/one",
                "OCI_REPO2": "conformance/two",
                # As podman and skopeo send --creds: the token is Basic's password.
                "OCI_USERNAME": "pusher",
                "OCI_PASSWORD": vault.writer,
                "OCI_API_BLOBS_UPLOAD_CANCEL": "true",
                # Deletes, each checked at once by a HEAD that must answer 404.
                **{
                    f"OCI_API_{api}_{setting}": "true"
                    for api in ("BLOBS", "MANIFESTS", "TAGS")
                    for setting in ("DELETE", "ATOMIC")
                },
                # Deprecated in image-spec 1.1: layers a registry is told not to hold, which
                # this one refuses (an image is pinned only with every layer held).
                "OCI_DATA_NONDISTRIBUTABLE": "false",
                # The vault keeps blobs by sha256.
                "OCI_DATA_SHA512": "false",
            },
        )
    failed = sorted(name for name, verdict in outcome.results.items() if verdict == "FAIL")
    assert failed == [], outcome.output[-8000:]
    for name in CONFORMANCE_PASSES:
        assert outcome.results.get(name) == "Pass", (name, outcome.output[-8000:])
