"""The ledger explorer: a read-only web page and its JSON API on the vault's bounded HTTP server.
The API answers (the entries naming a digest, one entry, the pins of a dataset name, or a page
of the log, newest first) with entries' exact bytes, their inclusion proofs, the signed
checkpoint and the blobs a view shows (inputs documents, run, dataset and checkpoint
manifests), so that the page verifies everything it shows in the browser before it shows it."""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from sqlalchemy import select

from vault.digest import Digest, check_digest
from vault.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    VaultError,
)
from vault.ledger import db as tables
from vault.ledger.entry import Entry
from vault.ledger.log import Ledger
from vault.ledger.records import StoredEntry
from vault.server.auth import Authenticator, Gate
from vault.server.content import Content
from vault.server.failed_credentials import caller_address
from vault.server.http_endpoint import Endpoint, Limits, Request, Response

log = logging.getLogger(__name__)

# What one answer carries at most: of a digest named by more entries (an image every run
# uses) the first ones are shown, and the page says there are more.
MAX_ENTRIES: Final = 1000
# A blob larger than this is named but not sent (the page says so): the browser hashes every
# byte it shows, and a dataset of a million files has a manifest of ~150 MiB.
MAX_BLOB_BYTES: Final = 16 * 1024 * 1024
# Of a job array's tasks, the manifests of this many are sent.
MAX_TASK_MANIFESTS: Final = 16
# Longer request targets are refused before they are parsed (a digest query is ~90 bytes).
MAX_TARGET: Final = 1024
# A page of the log (recent entries, of a kind or by an author) holds at most this many.
MAX_LOG_PAGE: Final = 100
LOG_PAGE: Final = 25
# A dataset name is looked for among this many of the newest dataset pins: names are not
# indexed, and their pins are few beside a ledger's other entries.
MAX_NAME_SCAN: Final = 10_000
# Pins of one dataset name an answer carries, newest first.
MAX_NAMED: Final = 50
# The kinds of pin whose `name` the page shows beside a run's inputs.
_NAMED_KINDS: Final = ("image", "dataset", "config")
# Longest kind, author, dataset name or tag a query may give (a dataset name is at most 200).
MAX_WORD: Final = 256

JSON: Final = "application/json"
_LOOPBACK_NAMES: Final = frozenset({"localhost", "[::1]"})
_IPV4_LOOPBACK: Final = re.compile(r"127(?:\.(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){3}")
# The page loads only its own script and style, talks only to its own origin, and cannot be
# framed: ledger metadata is hostile text, and the page puts it in the document as text only.
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_PAGE_HEADERS: Final = (
    ("Content-Security-Policy", CSP),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
)
# A browser keeps a few connections open, each costing the edge a coroutine until it is idle
# past the head deadline (or evicted by a newer one from the same address).
LIMITS: Final = Limits(workers=4, queue=32, per_address=16, connections=128)

_PAGE_FILES: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/explorer.js": ("explorer.js", "text/javascript; charset=utf-8"),
    "/explorer.css": ("explorer.css", "text/css; charset=utf-8"),
}

_STATUS: Final[Sequence[tuple[type[VaultError], int]]] = (
    (Unauthenticated, 401),
    (PermissionDenied, 403),
    (QuotaExceeded, 429),
    (NotFound, 404),
    (InvalidArgument, 400),
)


def load_page() -> dict[str, tuple[bytes, str]]:
    """The page's files (shipped as package data beside this module), by the path served."""
    folder = resources.files("vault.server").joinpath("explorer_page")
    return {
        path: (folder.joinpath(name).read_bytes(), content_type)
        for path, (name, content_type) in _PAGE_FILES.items()
    }


def _text(status: int, message: str) -> Response:
    return Response(status, (message + "\n").encode(), headers=_PAGE_HEADERS)


def _json(status: int, value: Any) -> Response:
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()
    return Response(status, data, JSON, headers=_PAGE_HEADERS)


def _query(text: str) -> dict[str, str]:
    try:
        fields = parse_qs(text, strict_parsing=bool(text), max_num_fields=4)
    except ValueError:
        raise InvalidArgument("malformed query string") from None
    if any(len(values) != 1 for values in fields.values()):
        raise InvalidArgument("a query parameter is given more than once")
    return {name: values[0] for name, values in fields.items()}


class ExplorerServer(Endpoint):
    """The explorer's page and API for `ledger` and `content` on `host`:`port` (port 0: one the
    system picks). With `tokens` (auth.mode = credentials), every API call must carry
    `Authorization: Bearer <token>` of a token whose role may read, so the page shows nobody
    more than `vault lookup` and `vault get` would; the page's own files hold no data and are
    served to anyone."""

    what = "explorer"

    def __init__(
        self,
        ledger: Ledger,
        content: Content,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tokens: Authenticator | None = None,
        limits: Limits = LIMITS,
    ) -> None:
        super().__init__(host, port, limits=limits)
        self.ledger = ledger
        self.content = content
        self.tokens = tokens
        self.page = load_page()

    def respond(self, request: Request) -> Response:
        target = request.target
        if len(target) > MAX_TARGET:
            return _text(414, "request target too long")
        if not self.host_allowed(request.header("Host")):
            return _text(403, "the explorer answers only to loopback host names")
        parts = urlsplit(target)
        page = self.page.get(target)
        if page is not None:
            data, content_type = page
            return Response(200, data, content_type, headers=_PAGE_HEADERS)
        if target == "/favicon.ico":
            # Asked by every browser; the page has none.
            return Response(204, b"", headers=_PAGE_HEADERS)
        if not parts.path.startswith("/api/") or target.startswith("//"):
            return _text(404, "not found")
        try:
            self.authorise(request.header("Authorization"), request.peer)
            query = _query(parts.query)
            answer = self.api(parts.path, query)
        except VaultError as exc:
            status = next((code for kind, code in _STATUS if isinstance(exc, kind)), 503)
            return _json(status, {"error": str(exc)})
        return _json(200, answer)

    def host_allowed(self, hosts: Sequence[str]) -> bool:
        """Whether the Host a request names is loopback (any port: an SSH tunnel picks its
        own). Without credentials this is what keeps other web sites out: a page that makes
        its own host name resolve to 127.0.0.1 (DNS rebinding) sends that name."""
        if self.tokens is not None:
            return True
        if len(hosts) != 1:
            return False
        name = hosts[0].strip().lower()
        name = name[: name.find("]") + 1] if name.startswith("[") else name.partition(":")[0]
        return name in _LOOPBACK_NAMES or _IPV4_LOOPBACK.fullmatch(name) is not None

    def authorise(self, headers: Sequence[str], peer: str = "") -> None:
        """Refuse an API call without a token whose role may read. The token is checked as
        the gRPC gate checks it (`Gate.identify`), and a failed one is counted against the
        caller's address `peer` (an IP address) in the same allowance as its gRPC calls."""
        if self.tokens is None:
            return
        if len(headers) != 1:
            raise self.tokens.refused(
                caller_address(peer),
                Unauthenticated(
                    "this vault asks for credentials: give a bearer token (`vault token create`)"
                ),
            )
        who = Gate("credentials", self.tokens).identify(
            [("authorization", headers[0])], {}, address=caller_address(peer)
        )
        if not who.may("read"):
            raise PermissionDenied(f"{who.name} (role {who.role}) may not read the ledger")

    def api(self, path: str, query: dict[str, str]) -> dict[str, Any]:
        if path == "/api/vault":
            _only(query)
            return {
                "verifier": str(self.ledger.verifier),
                "size": self.ledger.size,
                "credentials": self.tokens is not None,
            }
        if path == "/api/lookup":
            _only(query, "digest")
            return self.lookup(query.get("digest", ""))
        if path == "/api/entry":
            _only(query, "index")
            return self.entry(query.get("index", ""))
        if path == "/api/log":
            _only(query, "kind", "author", "before", "limit")
            return self.recent(query)
        if path == "/api/dataset":
            _only(query, "name", "tag")
            return self.dataset(query.get("name", ""), query.get("tag", ""))
        if path == "/api/consistency":
            _only(query, "old", "new")
            return self.consistency(query.get("old", ""), query.get("new", ""))
        raise NotFound(f"no such API call: {path}")

    def consistency(self, old: str, new: str) -> dict[str, Any]:
        """The proof that the tree of `old` entries is a prefix of the tree of `new`, for a
        browser that verified a checkpoint of one size before and sees another now."""
        sizes = []
        for name, text in (("old", old), ("new", new)):
            if not text.isdigit() or len(text) > 16:
                raise InvalidArgument(f"{name} is a tree size, not {text[:40]!r}")
            sizes.append(int(text))
        return {"proof": [_b64(h) for h in self.ledger.consistency_proof(*sizes)]}

    def lookup(self, text: str) -> dict[str, Any]:
        """The entries naming a digest (a blake3 alias: its blob's), each with its proof, and
        the blobs the page's view of it needs."""
        digest = check_digest(text.strip())
        keys = [digest]
        if not digest.startswith("sha256:"):
            found = self.content.find(Digest.parse(digest))
            if found is not None:
                keys.append(str(found.info.sha256))
        named: dict[int, StoredEntry] = {}
        for key in keys:
            for stored in self.ledger.entries_naming(key, MAX_ENTRIES + 1):
                named[stored.index] = stored
        if not named:
            raise NotFound(f"no entry names {digest}")
        entries = [named[i] for i in sorted(named)][:MAX_ENTRIES]
        more = len(named) > MAX_ENTRIES
        sha256 = keys[-1]
        if more:
            # A long run's manifest pin may come after its first entries; its `run` entries
            # (admission, manifests) are few, so they are all sent.
            shown = {e.index for e in entries}
            extra = [e for e, _ in self.ledger.pins_of_kind(sha256, "run") if e.index not in shown]
            entries = sorted(entries + extra[:MAX_ENTRIES], key=lambda e: e.index)
        return self._answer(
            sha256,
            entries,
            self._blobs_for(sha256, entries),
            more=more,
            names=self._names_of_inputs(sha256, entries),
        )

    def entry(self, text: str) -> dict[str, Any]:
        if not text.isdigit() or len(text) > 16:
            raise InvalidArgument(f"an entry index is a number, not {text[:40]!r}")
        stored = self.ledger.entry(int(text))
        return self._answer(f"#{int(text)}", [stored], {}, more=False)

    def recent(self, query: dict[str, str]) -> dict[str, Any]:
        """A page of the log, newest first: the entries before index `before` (all, if not
        given), of one `kind` and by one `author` if given; `next` is the `before` of the page
        after it, or null on the last page."""
        kind = _word(query, "kind")
        author = _word(query, "author")
        before = _number(query, "before", self.ledger.size)
        limit = _number(query, "limit", LOG_PAGE)
        if not 1 <= limit <= MAX_LOG_PAGE:
            raise InvalidArgument(f"limit is 1 to {MAX_LOG_PAGE}, not {limit}")
        rows = self._newest(before, limit + 1, kind=kind, author=author)
        if not rows:
            raise NotFound("no entry " + _described(kind=kind, author=author, before=before))
        entries = rows[:limit]
        answer = self._answer("log", entries, {}, more=False)
        answer["next"] = entries[-1].index if len(rows) > limit else None
        return answer

    def dataset(self, name: str, tag: str) -> dict[str, Any]:
        """The pins of a dataset name (and tag, if given), newest first, and the manifest of
        the newest, which the page lists."""
        for what, text in (("dataset name", name), ("dataset tag", tag)):
            if len(text) > MAX_WORD or "@" in text or text != text.strip():
                raise InvalidArgument(
                    f"{what} {text[:40]!r}: at most {MAX_WORD} characters, no '@'"
                )
        if not name:
            raise InvalidArgument("a dataset name is needed (NAME or NAME@TAG)")
        found: list[StoredEntry] = []
        for stored in self._newest(self.ledger.size, MAX_NAME_SCAN, kind="dataset"):
            entry = Entry.decode(stored.body)
            if entry.meta.get("name") == name and (not tag or entry.meta.get("tag", "") == tag):
                found.append(stored)
                if len(found) == MAX_NAMED:
                    break
        reference = f"{name}@{tag}" if tag else name
        if not found:
            raise NotFound(
                f"no dataset is pinned as {reference} (of the newest {MAX_NAME_SCAN} dataset pins)"
            )
        newest = Entry.decode(found[0].body).subjects[0]
        return self._answer(reference, found, {newest: self._blob(newest)}, more=False)

    def _newest(
        self, before: int, limit: int, *, kind: str = "", author: str = ""
    ) -> list[StoredEntry]:
        """The ledger's entries below index `before`, newest first, at most `limit`: the log's
        own query (`vault.ledger.db.listing`) runs oldest first, which a page of recent
        entries cannot use."""
        e = tables.entries
        query = select(e.c.idx, e.c.body).where(e.c.idx < before)
        if kind:
            query = query.where(e.c.kind == kind)
        if author:
            query = query.where(e.c.author == author)
        query = query.order_by(e.c.idx.desc()).limit(limit)
        with self.ledger.db.read.connect() as conn:
            return [StoredEntry(idx, bytes(body)) for idx, body in conn.execute(query)]

    def _names_of_inputs(self, digest: str, entries: list[StoredEntry]) -> list[StoredEntry]:
        """For a run id: the newest pin that names each of its inputs (its image, dataset and
        config, as the run's admission lists them), so that the page shows the names beside
        their digests."""
        admitted = next(
            (
                e
                for e in map(Entry.decode, (s.body for s in entries))
                if e.kind == "run" and e.meta.get("stage") == "admitted" and e.subjects[0] == digest
            ),
            None,
        )
        if admitted is None:
            return []
        found: list[StoredEntry] = []
        for subject in admitted.subjects[1:]:
            for kind in _NAMED_KINDS:
                pins = [
                    stored
                    for stored, _ in self.ledger.pins_of_kind(subject, kind)[-MAX_NAMED:]
                    if (e := Entry.decode(stored.body)).subjects[0] == subject
                    and e.meta.get("name")
                ]
                if pins:
                    found.append(pins[-1])
                    break
        return found

    def _answer(
        self,
        query: str,
        entries: list[StoredEntry],
        blobs: dict[str, Any],
        *,
        more: bool,
        names: Sequence[StoredEntry] = (),
    ) -> dict[str, Any]:
        signed = self.ledger.checkpoint(max(e.index for e in [*entries, *names]) + 1)

        def proven(e: StoredEntry) -> dict[str, Any]:
            proof = self.ledger.inclusion_proof(e.index, signed.size)
            return {"index": e.index, "body": _b64(e.body), "proof": [_b64(h) for h in proof]}

        return {
            "query": query,
            "verifier": str(self.ledger.verifier),
            "checkpoint": signed.note,
            # More entries name it than an answer carries.
            "more": more,
            "entries": [proven(e) for e in entries],
            # Entries that give digests the view shows their names, proven as the others.
            "names": [proven(e) for e in names],
            "blobs": blobs,
        }

    def _blobs_for(self, digest: str, entries: list[StoredEntry]) -> dict[str, Any]:
        """The documents a view of `digest` shows: its own bytes when an entry pins it as a
        run's inputs, a run, dataset or checkpoint manifest; for a run id, also its team's
        latest run manifest. Each is a base64 string, or an object saying why it is left out."""
        decoded = [Entry.decode(e.body) for e in entries]
        wanted: list[str] = []
        admitted = next(
            (
                e
                for e in decoded
                if e.kind == "run" and e.meta.get("stage") == "admitted" and e.subjects[0] == digest
            ),
            None,
        )
        if admitted is not None:
            wanted.append(digest)
            team = admitted.meta.get("team", "")
            # The latest manifest of each task (one, but for a job array), as `vault run
            # export` reads them: sealed for the run by its own team, not by a replay.
            latest = {
                e.meta.get("task", ""): e.subjects[0]
                for e in decoded
                if e.kind == "run"
                and e.meta.get("stage") == "manifest"
                and digest in e.subjects[1:]
                and team
                and e.meta.get("team") == team
                and "replay" not in e.meta
            }
            wanted.extend(latest[task] for task in sorted(latest)[:MAX_TASK_MANIFESTS])
        elif any(
            e.subjects[0] == digest
            and (
                e.kind in ("dataset", "checkpoint")
                or (e.kind == "run" and e.meta.get("stage") == "manifest")
            )
            for e in decoded
        ):
            wanted.append(digest)
        return {d: self._blob(d) for d in dict.fromkeys(wanted)}

    def _blob(self, digest: str) -> Any:
        found = self.content.find(Digest.parse(digest))
        if found is None:
            return {"missing": f"blob {digest} is not in the vault's content store"}
        if found.info.size > MAX_BLOB_BYTES:
            return {
                "missing": f"blob {digest} is {found.info.size} bytes, more than the explorer "
                f"shows ({MAX_BLOB_BYTES}): fetch it with `vault get`"
            }
        # Each chunk was checked against the blob's digest by the store before it came here;
        # a blob no good copy of is left out, and the page says why.
        try:
            _, chunks = self.content.read(found)
            return _b64(b"".join(chunk.data for chunk in chunks))
        except VaultError as exc:
            return {"missing": f"blob {digest} cannot be read: {exc}"}


def _only(query: dict[str, str], *names: str) -> None:
    unknown = sorted(set(query) - set(names))
    if unknown:
        raise InvalidArgument(f"unknown query parameter {unknown[0][:40]!r}")


def _word(query: dict[str, str], name: str) -> str:
    text = query.get(name, "")
    if len(text) > MAX_WORD or text != text.strip():
        raise InvalidArgument(
            f"{name} {text[:40]!r}: at most {MAX_WORD} characters, no white space at either end"
        )
    return text


def _number(query: dict[str, str], name: str, default: int) -> int:
    text = query.get(name)
    if text is None:
        return default
    if not text.isdigit() or len(text) > 16:
        raise InvalidArgument(f"{name} is a number, not {text[:40]!r}")
    return int(text)


def _described(*, kind: str, author: str, before: int) -> str:
    words = [f"of kind {kind!r}"] if kind else []
    words += [f"by {author!r}"] if author else []
    return " ".join([*words, f"before index {before}"])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
