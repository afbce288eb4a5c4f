"""`vault k8s-webhook`: a Kubernetes validating admission webhook (AdmissionReview v1 over
HTTPS) that refuses a Pod or a Job whose containers name an image by tag rather than by a digest
pinned in the vault, or whose dataset annotation names no pinned dataset manifest.

It only reads: the API server calls a webhook on dry runs and retries too (`sideEffects: None`),
so it checks the pins as `vault run` does before it submits, and appends nothing; the run is
admitted (appended) by `vault admit`, as before (deploy/kubernetes/README.md). What it checked of
an allowed pod's images goes into the review's audit annotations, the one place Kubernetes keeps
a validating webhook's word on an allowed request."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import ssl
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from cli.output import error_line
from cli.run import held_words
from vault.errors import InvalidArgument, Unavailable, VaultError

# The client (gRPC), the run library and the HTTP edge load when the webhook starts, not for
# `vault k8s-webhook --help`.
if TYPE_CHECKING:
    from cli.warm import Connect, WarmClient
    from vault.config import Config
    from vault.http_edge import Limits, Request, Response
    from vault.runs.pins import Found

# The annotation that names a pod's dataset manifest (a Job's: its pod template's).
DATASET_ANNOTATION: Final = "pinvault.dev/dataset"
# The audit annotations of an allowed review: what was checked of its images. The API server
# prefixes each key with the webhook's name (pins.pinvault.dev/image-held).
IMAGE_HELD: Final = "image-held"
IMAGE_EXTERNAL: Final = "image-external"
PATH: Final = "/validate"
HEALTH_PATH: Final = "/healthz"
# An AdmissionReview holds the object and, on UPDATE, its old version; etcd keeps an object
# under 1.5 MiB.
MAX_REQUEST: Final = 4 * 1024 * 1024


def limits() -> Limits:
    """The webhook's edge limits. The API server's own timeout for a webhook is at most 30 s:
    a request's head (the TLS handshake included) and its body each arrive within 10 s, or the
    connection is closed. The API servers are a few addresses, each keeping many connections;
    anyone else is kept out by the NetworkPolicy, and callers that drip bytes are evicted by
    newer connections."""
    from vault.http_edge import Limits

    return Limits(
        head_seconds=10.0,
        body_seconds=10.0,
        write_seconds=10.0,
        work_seconds=25.0,
        max_body_bytes=MAX_REQUEST,
        per_address=64,
        connections=512,
        # Reviews that ask the vault, at once; more wait in a queue of 256, then get 503.
        workers=16,
        queue=256,
        methods=frozenset({"GET", "HEAD", "POST"}),
    )


# An input found pinned and intact is not asked about again for this long: a Job's pods carry
# the same pins, and pins are never taken back.
CHECKED_SECONDS: Final = 600.0
_MAX_CHECKED: Final = 10_000
_CONTAINER_FIELDS: Final = (
    ("initContainers", "init container"),
    ("containers", "container"),
    ("ephemeralContainers", "ephemeral container"),
)

log = logging.getLogger("pinvault.k8s")


def webhook_arguments(p: argparse.ArgumentParser, *, connect: Connect) -> None:
    """The arguments of `vault k8s-webhook` (cli/main.py adds the command, and imports this
    module only when it runs)."""
    p.description = (
        "A validating admission webhook over HTTPS (deploy/kubernetes/README.md); "
        f"a pod names its dataset manifest in the annotation {DATASET_ANNOTATION}."
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to serve HTTPS")
    p.add_argument("--tls-cert", required=True, metavar="FILE", help="the certificate, PEM")
    p.add_argument("--tls-key", required=True, metavar="FILE", help="its private key, PEM")
    p.set_defaults(func=partial(_serve, connect=connect))


class Webhook:
    """The warm client and the decision on one AdmissionReview."""

    def __init__(self, vault: WarmClient) -> None:
        self._vault = vault
        self._lock = threading.Lock()
        # (kind, digest) -> when it was last found pinned and intact, and what was found.
        self._checked: dict[tuple[str, str], tuple[float, Found]] = {}

    def review(self, body: bytes) -> dict[str, Any]:
        """The AdmissionReview answering `body`; InvalidArgument if `body` is not one."""
        request = _request(body)
        checked: dict[str, str] = {}
        try:
            refusal = self.refusal(request, checked)
        except InvalidArgument:
            raise
        except Exception as exc:
            # Fail closed, in one line to the user; the whole story goes to the log.
            log.exception("review failed")
            refusal = f"the pinvault webhook failed: {' '.join(str(exc).split())}"
        response: dict[str, Any] = {"uid": request["uid"], "allowed": refusal is None}
        if refusal is not None:
            log.info("refused %s: %s", _described(request), refusal)
            response["status"] = {"code": 403, "reason": "Forbidden", "message": refusal}
        elif checked:
            response["auditAnnotations"] = checked
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": response,
        }

    def refusal(self, request: dict[str, Any], checked: dict[str, str]) -> str | None:
        """Why the object may not be created or changed so, or None; what was checked of its
        images goes into `checked`, as audit annotations."""
        if request.get("operation") not in ("CREATE", "UPDATE"):
            return None
        pod = _pod_of(request, "object")
        if request.get("operation") == "UPDATE" and _pins(pod) == _pins(
            _pod_of(request, "oldObject")
        ):
            # Nothing the pins name changed (a label, a finalizer): checked when it was made.
            return None
        images: dict[str, str] = {}
        problems = []
        for field, label in _CONTAINER_FIELDS:
            for container in _list(pod["spec"], field):
                who = f"{label} {_text(container.get('name'))!r}"
                try:
                    images.setdefault(_image_digest(_text(container.get("image"))), who)
                except InvalidArgument as exc:
                    problems.append(f"{who}: {exc}")
        # An image volume (spec.volumes[].image) mounts an image's content: pinned as a
        # container's image is.
        for name, reference in _image_volumes(pod):
            who = f"image volume {name!r}"
            try:
                images.setdefault(_image_digest(reference), who)
            except InvalidArgument as exc:
                problems.append(f"{who}: {exc}")
        dataset = _text(pod["annotations"].get(DATASET_ANNOTATION))
        if not dataset:
            problems.append(
                f"{pod['what']} carries no dataset pin: annotate it {DATASET_ANNOTATION} with the "
                "digest of a dataset manifest pinned in the vault"
            )
        if problems:
            return "; ".join(problems)
        found: dict[str, Found | None] = {}
        try:
            for digest, who in images.items():
                reason, found[digest] = self._check("image", digest)
                if reason is not None:
                    problems.append(f"{who}: {reason}")
            reason, _ = self._check("dataset", dataset)
            if reason is not None:
                problems.append(f"annotation {DATASET_ANNOTATION}: {reason}")
        except Unavailable as exc:
            return f"the vault cannot be asked: {error_line(exc)}"
        checked.update(_image_annotations(found))
        return "; ".join(problems) or None

    def _check(self, kind: str, digest: str) -> tuple[str | None, Found | None]:
        """Why the input is refused (or None), and what was found of it."""
        key = (kind, digest)
        with self._lock:
            checked = self._checked.get(key)
        if checked is not None and time.monotonic() - checked[0] < CHECKED_SECONDS:
            return None, checked[1]
        try:
            from vault.runs.pins import check_input

            found = self._vault.call(lambda client: check_input(client, kind, digest))
        except Unavailable:
            raise
        except VaultError as exc:
            return error_line(exc), None
        with self._lock:
            if len(self._checked) >= _MAX_CHECKED:
                self._checked.clear()
            self._checked[key] = (time.monotonic(), found)
        return None, found


def _image_annotations(found: dict[str, Found | None]) -> dict[str, str]:
    """What was checked of a pod's images, as audit annotations: one image is named, several
    are counted (an annotation stays one short line however many containers a pod has)."""
    held = {d: f for d, f in found.items() if f is not None and not f.external}
    external = [d for d, f in found.items() if f is not None and f.external]
    annotations = {}
    if len(held) == 1:
        ((digest, one),) = held.items()
        annotations[IMAGE_HELD] = f"{digest}: {held_words(one.image_blobs)}"
    elif held:
        # An image held as one file is that one blob.
        blobs = sum(f.image_blobs or 1 for f in held.values())
        annotations[IMAGE_HELD] = f"{len(held)} images: {blobs} blobs, each verified when stored"
    if len(external) == 1:
        annotations[IMAGE_EXTERNAL] = f"{external[0]}: recorded, not fetched"
    elif external:
        annotations[IMAGE_EXTERNAL] = f"{len(external)} images: recorded, not fetched"
    return annotations


def _request(body: bytes) -> dict[str, Any]:
    try:
        review = json.loads(body)
    except ValueError as exc:
        raise InvalidArgument(f"the request is not JSON: {exc}") from None
    if not isinstance(review, dict):
        raise InvalidArgument("the request is not a JSON object")
    found = (review.get("apiVersion"), review.get("kind"))
    if found != ("admission.k8s.io/v1", "AdmissionReview"):
        raise InvalidArgument(
            f"expected an AdmissionReview of admission.k8s.io/v1, found kind {found[1]!r} of "
            f"apiVersion {found[0]!r}"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise InvalidArgument("the AdmissionReview has no request")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise InvalidArgument("the AdmissionReview's request has no uid")
    return request


def _pod_of(request: dict[str, Any], field: str) -> dict[str, Any]:
    """The pod `request[field]` is or (a Job) makes: its spec, its annotations, and how a
    refusal names it. What the webhook does not check is refused: its rules are wrong."""
    resource = request.get("kind") or {}
    kind = (_text(resource.get("group")), _text(resource.get("kind")))
    obj = request.get(field)
    if not isinstance(obj, dict):
        raise InvalidArgument(f"the AdmissionReview's request has no {field}")
    name = _text(_dict(obj, "metadata").get("name")) or _text(
        _dict(obj, "metadata").get("generateName")
    )
    if kind == ("", "Pod"):
        pod, what = obj, f"pod {name!r}"
    elif kind == ("batch", "Job"):
        pod, what = _dict(_dict(obj, "spec"), "template"), f"the pod template of job {name!r}"
    else:
        raise InvalidArgument(
            f"pinvault checks pods and batch jobs, not {kind[1]!r} of group {kind[0]!r}: the "
            "webhook's rules send it what it cannot check"
        )
    return {
        "spec": _dict(pod, "spec"),
        "annotations": _dict(_dict(pod, "metadata"), "annotations"),
        "what": what,
    }


def _pins(pod: dict[str, Any]) -> tuple[object, ...]:
    images = tuple(
        _text(c.get("image")) for field, _ in _CONTAINER_FIELDS for c in _list(pod["spec"], field)
    )
    return images, tuple(_image_volumes(pod)), pod["annotations"].get(DATASET_ANNOTATION)


def _image_volumes(pod: dict[str, Any]) -> list[tuple[str, str]]:
    """The name and image reference of each image volume of `pod`."""
    found = []
    for volume in _list(pod["spec"], "volumes"):
        if "image" in volume:
            name = _text(volume.get("name"))
            found.append((name, _text(_dict(volume, "image").get("reference"))))
    return found


def _image_digest(image: str) -> str:
    """The sha256 digest `repository@sha256:…` names."""
    repository, at, digest = image.rpartition("@")
    if not at or not repository:
        raise InvalidArgument(
            f"image {image!r} is named by tag, not by digest: give it as repository@sha256:… "
            "with the digest pinned in the vault as an image"
        )
    from vault.digest import Digest

    parsed = Digest.parse(digest)
    if parsed.algorithm != "sha256":
        raise InvalidArgument(
            f"image {image!r}: an image's digest is sha256, not {parsed.algorithm}"
        )
    return str(parsed)


def _dict(obj: dict[str, Any], field: str) -> dict[str, Any]:
    value = obj.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field} is not an object")
    return value


def _list(obj: dict[str, Any], field: str) -> list[dict[str, Any]]:
    value = obj.get(field) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidArgument(f"{field} is not a list of objects")
    return value


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _described(request: dict[str, Any]) -> str:
    resource = request.get("kind") or {}
    where = f"{_text(request.get('namespace'))}/{_text(request.get('name'))}"
    return f"{_text(resource.get('kind'))} {where}"


class _Answers:
    """The webhook's HTTP side: AdmissionReviews POSTed to PATH, and the probes' HEALTH_PATH;
    each runs on one of the edge's worker threads."""

    def __init__(self, webhook: Webhook) -> None:
        self.webhook = webhook

    def __call__(self, request: Request) -> Response:
        from vault.http_edge import Response

        path = urlsplit(request.target).path
        if request.method in ("GET", "HEAD") and path == HEALTH_PATH:
            return Response(200, b"ok\n")
        if request.method != "POST" or path != PATH:
            return Response.text(
                404, f"nothing at {path}: POST AdmissionReviews to {PATH}", close=True
            )
        if not request.header("Content-Length"):
            return Response.text(411, "the request has no Content-Length", close=True)
        try:
            answer = self.webhook.review(request.body)
        except InvalidArgument as exc:
            log.warning("malformed AdmissionReview from %s: %s", request.peer, exc)
            return Response.text(400, f"malformed AdmissionReview: {exc}", close=True)
        return Response(200, json.dumps(answer).encode(), "application/json")


def _address(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdecimal() or int(port) > 65535:
        raise InvalidArgument(f"--listen {listen!r}: expected HOST:PORT")
    return host, int(port)


def _tls(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise InvalidArgument(
            f"cannot use --tls-cert {cert} with --tls-key {key}: {exc.reason or exc}"
        ) from None
    return context


def _serve(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    address = _address(args.listen)
    tls = _tls(args.tls_cert, args.tls_key)
    log.setLevel(logging.INFO)
    from cli.warm import WarmClient
    from vault.http_edge import Edge

    vault = WarmClient(config, connect)
    stopped = threading.Event()
    try:
        edge = Edge(
            "k8s webhook",
            _Answers(Webhook(vault)),
            *address,
            limits=limits(),
            tls=tls,
            server="pinvault-webhook",
        )
        with edge:
            vault.warm_up()
            signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
            shown = f"[{address[0]}]" if ":" in address[0] else address[0]
            print(f"pinvault k8s webhook on https://{shown}:{edge.port}{PATH}", flush=True)
            while not stopped.wait(0.5):
                pass
    finally:
        vault.close()
    log.info("k8s webhook stopped")
    return 0
