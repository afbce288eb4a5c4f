"""`vault k8s-webhook`: a Kubernetes validating admission webhook (AdmissionReview v1 over
HTTPS) that refuses a Pod or a Job whose containers name an image by tag rather than by a digest
pinned in the vault, or whose dataset annotation names no pinned dataset manifest.

It only reads: the API server calls a webhook on dry runs and retries too (`sideEffects: None`),
so it checks the pins as `vault run` does before it submits, and appends nothing; the run is
admitted (appended) by `vault admit`, as before (deploy/kubernetes/README.md)."""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import signal
import socket
import socketserver
import ssl
import threading
import time
from functools import partial
from typing import Any, Final
from urllib.parse import urlsplit

from cli.output import error_line
from cli.warm import Connect, WarmClient
from vault.config import Config
from vault.digest import Digest
from vault.errors import InvalidArgument, Unavailable, VaultError
from vault.runs.pins import check_input

# The annotation that names a pod's dataset manifest (a Job's: its pod template's).
DATASET_ANNOTATION: Final = "pinvault.dev/dataset"
PATH: Final = "/validate"
HEALTH_PATH: Final = "/healthz"
# An AdmissionReview holds the object and, on UPDATE, its old version; etcd keeps an object
# under 1.5 MiB.
MAX_REQUEST: Final = 4 * 1024 * 1024
# Each read of a request, and the TLS handshake, within this (the API server's own timeout
# for a webhook is at most 30 s).
REQUEST_SECONDS: Final = 10.0
# Requests answered at once; more wait in the listen queue.
MAX_CONCURRENT: Final = 32
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


def add_k8s_webhook_commands(sub: Any, connect: Connect) -> None:
    p = sub.add_parser(
        "k8s-webhook",
        help="refuse Kubernetes pods and jobs whose image or dataset is not pinned",
        description="A validating admission webhook over HTTPS (deploy/kubernetes/README.md); "
        f"a pod names its dataset manifest in the annotation {DATASET_ANNOTATION}.",
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
        # (kind, digest) -> when it was last found pinned and intact.
        self._checked: dict[tuple[str, str], float] = {}

    def review(self, body: bytes) -> dict[str, Any]:
        """The AdmissionReview answering `body`; InvalidArgument if `body` is not one."""
        request = _request(body)
        try:
            refusal = self.refusal(request)
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
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": response,
        }

    def refusal(self, request: dict[str, Any]) -> str | None:
        """Why the object may not be created or changed so, or None."""
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
        dataset = _text(pod["annotations"].get(DATASET_ANNOTATION))
        if not dataset:
            problems.append(
                f"{pod['what']} carries no dataset pin: annotate it {DATASET_ANNOTATION} with the "
                "digest of a dataset manifest pinned in the vault"
            )
        if problems:
            return "; ".join(problems)
        try:
            for digest, who in images.items():
                if (reason := self._check("image", digest)) is not None:
                    problems.append(f"{who}: {reason}")
            if (reason := self._check("dataset", dataset)) is not None:
                problems.append(f"annotation {DATASET_ANNOTATION}: {reason}")
        except Unavailable as exc:
            return f"the vault cannot be asked: {error_line(exc)}"
        return "; ".join(problems) or None

    def _check(self, kind: str, digest: str) -> str | None:
        key = (kind, digest)
        with self._lock:
            checked = self._checked.get(key)
        if checked is not None and time.monotonic() - checked < CHECKED_SECONDS:
            return None
        try:
            self._vault.call(lambda client: check_input(client, kind, digest))
        except Unavailable:
            raise
        except VaultError as exc:
            return error_line(exc)
        with self._lock:
            if len(self._checked) >= _MAX_CHECKED:
                self._checked.clear()
            self._checked[key] = time.monotonic()
        return None


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
    return images, pod["annotations"].get(DATASET_ANNOTATION)


def _image_digest(image: str) -> str:
    """The sha256 digest `repository@sha256:…` names."""
    repository, at, digest = image.rpartition("@")
    if not at or not repository:
        raise InvalidArgument(
            f"image {image!r} is named by tag, not by digest: give it as repository@sha256:… "
            "with the digest pinned in the vault as an image"
        )
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


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    # Each read (and the TLS handshake, which the first read does) within this.
    timeout = REQUEST_SECONDS

    def do_GET(self) -> None:
        if urlsplit(self.path).path == HEALTH_PATH:
            self._send(200, b"ok\n", "text/plain")
        else:
            self._refuse(
                404, f"nothing at {urlsplit(self.path).path}: POST AdmissionReviews to {PATH}"
            )

    def do_POST(self) -> None:
        if urlsplit(self.path).path != PATH:
            self._refuse(
                404, f"nothing at {urlsplit(self.path).path}: POST AdmissionReviews to {PATH}"
            )
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdecimal():
            self._refuse(411, "the request has no Content-Length")
            return
        if int(length) > MAX_REQUEST:
            self._refuse(413, f"the request is {length} bytes, more than {MAX_REQUEST}")
            return
        body = self.rfile.read(int(length))
        try:
            answer = self.server.webhook.review(body)
        except InvalidArgument as exc:
            log.warning("malformed AdmissionReview from %s: %s", self.client_address[0], exc)
            self._refuse(400, f"malformed AdmissionReview: {exc}")
            return
        self._send(200, json.dumps(answer).encode(), "application/json")

    def _refuse(self, code: int, message: str) -> None:
        self.close_connection = True
        self._send(code, (" ".join(message.split()) + "\n").encode(), "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.client_address[0], format % args)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], webhook: Webhook, tls: ssl.SSLContext) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.webhook = webhook
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        super().__init__(address, _Handler)
        # The handshake is done by the request's own thread, under its timeout, so that a
        # caller that never finishes one holds no more than that thread.
        self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        # At most MAX_CONCURRENT threads: the next connection waits in the listen queue.
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake or a caller that went away: one line, not a traceback.
        log.warning(
            "connection from %s failed", client_address[0], exc_info=log.isEnabledFor(logging.DEBUG)
        )


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
    vault = WarmClient(config, connect)
    try:
        with _Server(address, Webhook(vault), tls) as server:
            vault.warm_up()

            def stop(signum: int, frame: object) -> None:
                # shutdown() waits for serve_forever to return, so not on its own thread.
                threading.Thread(target=server.shutdown, daemon=True).start()

            signal.signal(signal.SIGTERM, stop)
            host, port = str(server.server_address[0]), server.server_address[1]
            shown = f"[{host}]" if ":" in host else host
            print(f"pinvault k8s webhook on https://{shown}:{port}{PATH}", flush=True)
            server.serve_forever(poll_interval=0.5)
    finally:
        vault.close()
    log.info("k8s webhook stopped")
    return 0
