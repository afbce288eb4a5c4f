"""`vault k8s-webhook` as the Kubernetes API server sees it: AdmissionReview v1 requests built
from the Kubernetes client's own models, sent over HTTPS to the real webhook process (its
certificate verified), which asks a real `vault serve`. A pod or a Job is allowed only on images
named by pinned digests and a pinned dataset manifest, refused otherwise naming the container
and the vault's reason word for word (an OCI image missing a blob, that blob), refused while the
vault is down, and a malformed review gets HTTP 400. An allowed review says in its audit
annotations what was checked of the images. The deployment's manifest says what the webhook
needs of the API server."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes.client import (
    ApiClient,
    V1Container,
    V1Job,
    V1JobSpec,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1PodTemplateSpec,
)

from tests.conftest import StartVault
from tests.services.base import terminate
from tests.services.vault_server import REPO_ROOT, VAULT_COMMAND, VaultServer, command_env
from tests.test_agent import Pinned, vaults_word
from tests.test_slurm import pin_oci_image, short_dir
from vault.client import VaultClient

ANNOTATION = "pinvault.dev/dataset"
BANNER = "pinvault k8s webhook on https://"
# Pinned's image is one file: the annotation an allowed pod on it carries.
ONE_FILE = "one file, verified when stored"
DEPLOY = REPO_ROOT / "deploy" / "kubernetes"


def certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pinvault-webhook")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "tls.crt", folder / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class Webhook:
    """One `vault k8s-webhook` process asking the vault at `server`, on 127.0.0.1, port 0."""

    def __init__(self, base: Path, server: str) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.server = server
        self.cert, self.key = certificate(base)
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> Self:
        out, err = self.base / "webhook.out", self.base / "webhook.log"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            self.process = subprocess.Popen(
                [
                    *VAULT_COMMAND,
                    "k8s-webhook",
                    "--listen",
                    "127.0.0.1:0",
                    "--tls-cert",
                    str(self.cert),
                    "--tls-key",
                    str(self.key),
                ],
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env=command_env(
                    state_home=self.base / "state",
                    extra={"PINVAULT_CLIENT_SERVER": self.server},
                ),
                cwd=REPO_ROOT,
            )
        deadline = time.monotonic() + 30
        while not (line := out.read_text()).startswith(BANNER):
            assert self.process.poll() is None, self.log()
            assert time.monotonic() < deadline, "the webhook did not start"
            time.sleep(0.02)
        self.url = line.split()[-1]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self.process = self.process, None
        terminate(process, "the k8s webhook", 15)

    def log(self) -> str:
        return (self.base / "webhook.log").read_text(errors="replace")

    def post(self, body: bytes, path: str = "/validate") -> tuple[int, bytes]:
        """POST `body` as the API server does, verifying the webhook's certificate."""
        context = ssl.create_default_context(cafile=str(self.cert))
        host, port = self.url.removeprefix("https://").split("/")[0].rsplit(":", 1)
        connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
        try:
            connection.request(
                "POST", f"{path}?timeout=10s", body, {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def review(self, obj: V1Pod | V1Job, *, operation: str = "CREATE", old: Any = None) -> Any:
        """The response to an AdmissionReview of `obj`, after checking it echoes the uid."""
        uid = str(uuid.uuid4())
        status, body = self.post(json.dumps(admission_review(uid, obj, operation, old)).encode())
        assert status == 200, body
        answer = json.loads(body)
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == uid
        return answer["response"]


def admission_review(uid: str, obj: V1Pod | V1Job, operation: str, old: Any) -> dict[str, Any]:
    """What the API server sends for `obj`: the object as its JSON, and the request about it."""
    serialize = ApiClient().sanitize_for_serialization
    group, version = ("batch", "v1") if isinstance(obj, V1Job) else ("", "v1")
    kind = {"group": group, "version": version, "kind": obj.kind}
    resource = {"group": group, "version": version, "resource": obj.kind.lower() + "s"}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": obj.metadata.name,
            "namespace": "research",
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": serialize(obj),
            "oldObject": serialize(old) if old is not None else None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def pod(
    image: str, dataset: str | None, *, init_image: str | None = None, name: str = "train"
) -> V1Pod:
    annotations = {ANNOTATION: dataset} if dataset is not None else None
    init = [V1Container(name="fetch", image=init_image)] if init_image else None
    return V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=V1ObjectMeta(name=name, namespace="research", annotations=annotations),
        spec=V1PodSpec(
            containers=[V1Container(name="trainer", image=image, command=["python", "train.py"])],
            init_containers=init,
            restart_policy="Never",
        ),
    )


def job(template: V1Pod) -> V1Job:
    return V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=V1ObjectMeta(name="train-job", namespace="research"),
        spec=V1JobSpec(template=V1PodTemplateSpec(metadata=template.metadata, spec=template.spec)),
    )


def by_digest(digest: str) -> str:
    return f"registry.example/research/train@{digest}"


def refused(response: Any) -> str:
    assert response["allowed"] is False, response
    assert response["status"]["code"] == 403, response
    message: str = response["status"]["message"]
    return message


@pytest.fixture(scope="module")
def vault(
    clean_environment: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VaultServer]:
    with VaultServer(tmp_path_factory.mktemp("k8s-vault")) as server:
        yield server


@pytest.fixture(scope="module")
def pinned(vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Pinned:
    return Pinned(vault, tmp_path_factory.mktemp("k8s-pins"))


@pytest.fixture(scope="module")
def webhook(vault: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    with Webhook(tmp_path_factory.mktemp("k8s-webhook"), vault.address) as hook:
        yield hook
        assert "Traceback" not in hook.log(), hook.log()


def test_a_pod_on_a_pinned_image_digest_and_dataset_is_allowed(
    webhook: Webhook, pinned: Pinned
) -> None:
    response = webhook.review(pod(by_digest(pinned.image), pinned.dataset))
    assert response["allowed"] is True, response
    assert "status" not in response
    assert response["auditAnnotations"] == {"image-held": f"{pinned.image}: {ONE_FILE}"}


def test_an_allowed_pod_records_what_was_checked_of_its_images(
    webhook: Webhook, vault: VaultServer, pinned: Pinned
) -> None:
    with VaultClient(vault.address, timeout=60) as client:
        image = pin_oci_image(client)
        other = pin_oci_image(client)
    response = webhook.review(pod(by_digest(image.digest), pinned.dataset))
    assert response["allowed"] is True, response
    assert response["auditAnnotations"] == {
        "image-held": f"{image.digest}: 3 blobs, each verified when stored"
    }
    # Asked again within the cache's time, the answer is the same.
    again = webhook.review(pod(by_digest(image.digest), pinned.dataset, name="again"))
    assert again["auditAnnotations"] == response["auditAnnotations"]
    # Several images are counted, not listed: the one file is one blob.
    several = pod(by_digest(image.digest), pinned.dataset, init_image=by_digest(other.digest))
    several.spec.containers.append(V1Container(name="sidecar", image=by_digest(pinned.image)))
    response = webhook.review(several)
    assert response["auditAnnotations"] == {
        "image-held": "3 images: 7 blobs, each verified when stored"
    }
    # An image kept in a registry is pinned --external: recorded, nothing of it fetched.
    elsewhere = "sha256:" + os.urandom(32).hex()
    vault.run("pin", "image", elsewhere, "--external").ok()
    response = webhook.review(pod(by_digest(elsewhere), pinned.dataset))
    assert response["auditAnnotations"] == {"image-external": f"{elsewhere}: recorded, not fetched"}
    mixed = pod(by_digest(elsewhere), pinned.dataset, init_image=by_digest(image.digest))
    assert webhook.review(mixed)["auditAnnotations"] == {
        "image-held": f"{image.digest}: 3 blobs, each verified when stored",
        "image-external": f"{elsewhere}: recorded, not fetched",
    }


@pytest.mark.parametrize("left_out", ["config", "layer", "manifest"])
def test_a_pod_on_an_image_not_held_whole_is_refused_naming_the_missing_blob(
    webhook: Webhook, vault: VaultServer, pinned: Pinned, left_out: str
) -> None:
    with VaultClient(vault.address, timeout=60) as client:
        image = pin_oci_image(client, left_out)
    response = webhook.review(pod(by_digest(image.digest), pinned.dataset))
    message = refused(response)
    assert "auditAnnotations" not in response
    assert message == f"container 'trainer': {image.refusal}"
    # In the words `vault admit` (and so the Slurm plugin) uses.
    assert vaults_word(vault, pinned.request(image=image.digest)) == image.refusal


def test_an_image_by_tag_is_refused_naming_the_container(webhook: Webhook, pinned: Pinned) -> None:
    message = refused(webhook.review(pod("registry.example/research/train:v3", pinned.dataset)))
    assert message.startswith(
        "container 'trainer': image 'registry.example/research/train:v3' is named by tag, not "
        "by digest"
    ), message


def test_a_digest_not_pinned_is_refused_as_the_vault_refuses_it(
    webhook: Webhook, vault: VaultServer, pinned: Pinned
) -> None:
    message = refused(webhook.review(pod(by_digest(pinned.unpinned), pinned.dataset)))
    slurm = vaults_word(vault, pinned.request(image=pinned.unpinned))
    assert slurm == (
        f"FAILED_PRECONDITION: image {pinned.unpinned} is not pinned as an image: pin it first "
        f"(vault pin image {pinned.unpinned})"
    )
    assert message == f"container 'trainer': {slurm}"


def test_a_dataset_annotation_missing_or_not_a_pinned_manifest_is_refused(
    webhook: Webhook, vault: VaultServer, pinned: Pinned, tmp_path: Path
) -> None:
    image = by_digest(pinned.image)
    message = refused(webhook.review(pod(image, None)))
    assert message == (
        f"pod 'train' carries no dataset pin: annotate it {ANNOTATION} with the digest of a "
        "dataset manifest pinned in the vault"
    )
    # Pinned, but as an image: not a dataset.
    message = refused(webhook.review(pod(image, pinned.image)))
    assert message == (
        f"annotation {ANNOTATION}: FAILED_PRECONDITION: dataset {pinned.image} is not pinned as "
        f"a dataset: pin it first (vault pin dataset {pinned.image})"
    )
    # Pinned as a dataset, but its bytes are no manifest: refused as `vault admit` refuses it.
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"not a manifest " + os.urandom(8))
    digest = vault.run("put", str(notes)).ok().stdout.split()[0]
    vault.run("pin", "dataset", digest).ok()
    message = refused(webhook.review(pod(image, digest)))
    slurm = vaults_word(vault, pinned.request(dataset=digest))
    assert slurm.startswith(f"FAILED_PRECONDITION: dataset {digest} is not a dataset manifest: ")
    assert message == f"annotation {ANNOTATION}: {slurm}"
    # Not a digest at all.
    message = refused(webhook.review(pod(image, "imagenet-latest")))
    assert message.startswith(f"annotation {ANNOTATION}: INVALID_ARGUMENT: "), message
    assert "imagenet-latest" in message


def test_a_jobs_pod_template_and_init_containers_are_checked(
    webhook: Webhook, pinned: Pinned
) -> None:
    good = pod(by_digest(pinned.image), pinned.dataset)
    assert webhook.review(job(good))["allowed"] is True
    tagged_init = pod(by_digest(pinned.image), pinned.dataset, init_image="busybox:1.36")
    message = refused(webhook.review(job(tagged_init)))
    assert message.startswith("init container 'fetch': image 'busybox:1.36' is named by tag")
    unpinned_init = pod(
        by_digest(pinned.image), pinned.dataset, init_image=by_digest(pinned.unpinned)
    )
    message = refused(webhook.review(unpinned_init))
    assert message.startswith(
        f"init container 'fetch': FAILED_PRECONDITION: image {pinned.unpinned} is not pinned"
    ), message
    # A Job's template without the annotation: its pods would carry none.
    bare = pod(by_digest(pinned.image), None)
    message = refused(webhook.review(job(bare)))
    assert message.startswith("the pod template of job 'train-job' carries no dataset pin")


def test_an_image_volume_is_checked_as_a_containers_image_is(
    webhook: Webhook, pinned: Pinned
) -> None:
    """A Kubernetes image volume mounts an image's files into the pod: by tag or by an
    unpinned digest it is refused as a container's image is; by a pinned digest, allowed."""

    def with_image_volume(reference: str) -> Any:
        review = admission_review(
            str(uuid.uuid4()), pod(by_digest(pinned.image), pinned.dataset), "CREATE", None
        )
        review["request"]["object"]["spec"]["volumes"] = [
            {"name": "weights", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}
        ]
        status, body = webhook.post(json.dumps(review).encode())
        assert status == 200, body
        return json.loads(body)["response"]

    assert with_image_volume(by_digest(pinned.image))["allowed"] is True
    message = refused(with_image_volume("registry.example/models/weights:v3"))
    assert message.startswith(
        "image volume 'weights': image 'registry.example/models/weights:v3' is named by tag"
    ), message
    message = refused(with_image_volume(by_digest(pinned.unpinned)))
    assert message.startswith(
        f"image volume 'weights': FAILED_PRECONDITION: image {pinned.unpinned} is not pinned"
    ), message


def test_the_vault_down_refuses_with_the_reason(start_vault: StartVault, tmp_path: Path) -> None:
    with short_dir("pinvault-k8s-down-") as base:
        own = start_vault("own", listen=f"unix:{base}/vault.sock")
        pins = Pinned(own, tmp_path / "pins")
        with Webhook(tmp_path / "webhook", own.address) as hook:
            admitted = pod(by_digest(pins.image), pins.dataset)
            assert hook.review(admitted)["allowed"] is True
            assert own.stop() == 0
            message = refused(hook.review(pod(by_digest(pins.unpinned), pins.dataset)))
            assert message.startswith("the vault cannot be asked: UNAVAILABLE: "), message
            # An update that changes no pin (a label, a finalizer) needs no vault: the job
            # controller must still be able to finish its pods.
            relabelled = pod(by_digest(pins.image), pins.dataset)
            relabelled.metadata.labels = {"done": "yes"}
            response = hook.review(relabelled, operation="UPDATE", old=admitted)
            assert response["allowed"] is True, response
            # One that changes an image does.
            changed = pod(by_digest(pins.unpinned), pins.dataset)
            message = refused(hook.review(changed, operation="UPDATE", old=admitted))
            assert message.startswith("the vault cannot be asked: UNAVAILABLE: "), message
        assert "Traceback" not in hook.log(), hook.log()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": ', "the request is not JSON"),
        (b"[1, 2]", "the request is not a JSON object"),
        (
            b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}',
            "expected an AdmissionReview of admission.k8s.io/v1, found kind 'AdmissionReview' "
            "of apiVersion 'admission.k8s.io/v1beta1'",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
            "the AdmissionReview's request has no uid",
        ),
    ],
)
def test_a_malformed_review_gets_400(webhook: Webhook, body: bytes, reason: str) -> None:
    status, answer = webhook.post(body)
    assert status == 400
    line = answer.decode()
    assert line.startswith(f"malformed AdmissionReview: {reason}"), line
    assert line.count("\n") == 1


def test_an_oversized_request_is_refused_unread(webhook: Webhook) -> None:
    context = ssl.create_default_context(cafile=str(webhook.cert))
    host, port = webhook.url.removeprefix("https://").split("/")[0].rsplit(":", 1)
    connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
    try:
        # The size announced, and none of the body sent: the answer comes without it.
        connection.putrequest("POST", "/validate")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(64 * 1024 * 1024))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413
        assert response.read().decode().startswith("the request is 67108864 bytes, more than")
    finally:
        connection.close()


def test_the_manifest_asks_for_no_side_effects_and_fails_closed() -> None:
    # The webhook's own manifest: deploy/kubernetes also holds the vault's Deployment and Service.
    documents = list(yaml.safe_load_all((DEPLOY / "webhook.yaml").read_text()))
    kinds = {d["kind"]: d for d in documents if d}
    assert {"ValidatingWebhookConfiguration", "Deployment", "Service"} <= set(kinds)
    (hook,) = kinds["ValidatingWebhookConfiguration"]["webhooks"]
    assert hook["sideEffects"] == "None"
    assert hook["failurePolicy"] == "Fail"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["clientConfig"]["service"]["path"] == "/validate"
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in hook["rules"]}
    assert (("",), ("pods", "pods/ephemeralcontainers")) in rules
    assert (("batch",), ("jobs",)) in rules
    assert all(set(r["operations"]) == {"CREATE", "UPDATE"} for r in hook["rules"])
    # Namespaces opt in by a label: kube-system and the webhook's own (whose pods could
    # otherwise never start) are never gated unless someone labels them.
    assert hook["namespaceSelector"] == {"matchLabels": {"pinvault.dev/enforce": "true"}}
    command = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert command[:1] == ["k8s-webhook"]
    # Only the API server may connect: one ingress rule, from an address block, to the port.
    policy = kinds["NetworkPolicy"]
    assert policy["metadata"]["namespace"] == kinds["Deployment"]["metadata"]["namespace"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "pinvault-webhook"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert [list(source) for source in rule["from"]] == [["ipBlock"]]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8443}]
