"""Witnessed checkpoints: each checkpoint the ledger signs is submitted to the configured
witnesses (c2sp.org/tlog-witness, POST /add-checkpoint with a consistency proof from the size
each last cosigned), and served with the cosignatures they return appended to the note, so that
a client can demand that independent witnesses saw the same, append-only ledger."""

from __future__ import annotations

import base64
import http.client
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final

from vault.config import Config
from vault.errors import ConfigError, InvalidArgument, Unavailable, VaultError, VerificationError
from vault.ledger.cosignature import MAX_WITNESSES, WitnessKey, cosignatures, split_note
from vault.ledger.log import Ledger
from vault.ledger.records import SignedCheckpoint

log = logging.getLogger(__name__)

# A witness that answers 409 names the size it cosigned last; the submission is made again from
# there, and a witness that keeps moving is asked again at the next pass.
MAX_CONFLICTS: Final = 2
# Larger answers than this are not read: a witness answers a few signature lines.
MAX_ANSWER_BYTES: Final = 64 * 1024
# Seconds between two errors logged for the same kind of refusal by one witness.
REFUSALS_LOGGED_EVERY: Final = 60.0
ADD_CHECKPOINT: Final = "/add-checkpoint"
_SEPARATORS = re.compile(r"[\s,]+")
_SIZE = re.compile(r"(0|[1-9][0-9]{0,19})\n?")
# What a tlog-witness status says about a refused checkpoint.
_REFUSALS: Final = {
    400: "the old size is larger than the checkpoint's, or the request is malformed",
    403: "the checkpoint is not signed by the key the witness knows for this ledger",
    404: "nothing answers at that URL or the witness does not know this ledger's origin",
    422: "the checkpoint does not extend the one the witness cosigned last (a fork or a "
    "rewritten history)",
}


@dataclass(frozen=True, slots=True)
class Witness:
    """One witness: where to submit checkpoints, and the key its cosignatures verify with."""

    url: str
    key: WitnessKey

    @property
    def label(self) -> str:
        return self.key.label


def configured_witnesses(config: Config) -> list[Witness]:
    """The witnesses [witnesses] names, as `URL KEY` pairs; ConfigError naming what is wrong, so
    that a server with a bad list stops before it creates anything."""
    tokens = [t for t in _SEPARATORS.split(config.witnesses.endpoints.strip()) if t]
    witnesses: list[Witness] = []
    for n in range(0, len(tokens), 2):
        url, key = tokens[n], tokens[n + 1] if n + 1 < len(tokens) else ""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"witnesses.endpoints: expected `URL KEY` pairs with an http(s) URL, found "
                f"{url[:80]!r} where a URL belongs"
            )
        if parts.query or parts.fragment:
            raise ConfigError(f"witnesses.endpoints: {url[:80]!r} has a query or a fragment")
        if not key:
            raise ConfigError(f"witnesses.endpoints: witness {url[:80]!r} has no key after it")
        # The witness's base URL, or its add-checkpoint URL (as the tlog-witness spec names
        # it): requests go to the base URL's add-checkpoint either way.
        base = url.rstrip("/")
        if base.endswith(ADD_CHECKPOINT):
            base = base[: -len(ADD_CHECKPOINT)]
        try:
            witness = Witness(base, WitnessKey.from_string(key))
        except InvalidArgument as exc:
            raise ConfigError(f"witnesses.endpoints: witness {url[:80]!r}: {exc}") from None
        if any(w.key == witness.key for w in witnesses):
            raise ConfigError(f"witnesses.endpoints: witness {witness.label} is named twice")
        witnesses.append(witness)
    if len(witnesses) > MAX_WITNESSES:
        raise ConfigError(
            f"witnesses.endpoints: {len(witnesses)} witnesses, at most {MAX_WITNESSES}"
        )
    if config.witnesses.quorum > len(witnesses):
        raise ConfigError(
            f"witnesses.quorum: {config.witnesses.quorum} cosignatures asked of "
            f"{len(witnesses)} witnesses"
        )
    return witnesses


class _Overtaken(Exception):
    """The witness has cosigned a larger checkpoint of this ledger, which another server on the
    same database signed; this server has caught up with the database to at least its size."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class Refused(VerificationError):
    """A witness would not cosign a checkpoint: it does not extend what the witness saw."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class _Seen:
    """What this server knows of one witness."""

    # The size of the checkpoint the witness cosigned last, as far as this server knows.
    size: int = 0
    # The last submission failed for want of an answer: only the background pass asks again.
    unreachable: bool = False
    # The size of a checkpoint the witness refused, not submitted again.
    refused: int = -1
    # The last refusal logged, by its kind (a status, or a rollback), and when.
    logged: tuple[str, float] = ("", 0.0)
    # When (time.monotonic) the witness last cosigned the checkpoint being witnessed.
    cosigned_at: float = 0.0


class Witnessing:
    """The cosigned checkpoint of the ledger, kept up to date by a background pass once an
    interval, and on demand when a caller needs a checkpoint newer than the one cosigned.

    Each witness is asked one request at a time, in order, on a thread of its own. A witness
    that does not answer costs the background pass its time-out, and a caller at most one:
    calls skip it until the background pass hears from it again. A witness that refuses a
    checkpoint is not asked about it again; that is logged as an error, since it means this
    server's ledger does not extend what the witness saw (a rollback or a fork). A witness that
    has cosigned a larger checkpoint, which another server of the same ledger had it cosign,
    has the checkpoint of that size (signed here, or taken) submitted instead."""

    def __init__(
        self,
        ledger: Ledger,
        witnesses: Sequence[Witness],
        *,
        quorum: int = 0,
        timeout: float = 10.0,
        interval: float = 1.0,
        refresh: float = 60.0,
    ) -> None:
        """`refresh`: seconds after which the background pass submits a checkpoint the ledger
        has not moved past again, so that its newest cosignature (which carries the time the
        witness made it) stays fresh while the ledger is idle."""
        if not witnesses:
            raise InvalidArgument("witnessing needs at least one witness")
        self.ledger = ledger
        self.witnesses = tuple(witnesses)
        self.quorum = quorum or len(self.witnesses)
        self.timeout = timeout
        self.refresh = refresh
        self._seen = {w.key: _Seen() for w in self.witnesses}
        self._askers = {
            w.key: ThreadPoolExecutor(1, thread_name_prefix=f"witness-{n}")
            for n, w in enumerate(self.witnesses)
        }
        # The checkpoint being witnessed, the cosignature lines it has, and the questions
        # about it still out.
        self._signed: SignedCheckpoint | None = None
        self._lines: dict[WitnessKey, str] = {}
        self._asking: dict[WitnessKey, Future[str | None]] = {}
        self._reported = -1
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(interval,), name="witnessing", daemon=True
        )

    def start(self) -> Witnessing:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()
        for asker in self._askers.values():
            asker.shutdown(wait=False, cancel_futures=True)

    def checkpoint(self, min_size: int = 0) -> SignedCheckpoint:
        """The latest signed checkpoint covering `min_size` entries, with the cosignatures of
        every witness that answered for it."""
        return self._witness(self.ledger.checkpoint(min_size), background=False)

    def _loop(self, interval: float) -> None:
        while not self._closed.is_set():
            latest = self.ledger.latest
            if latest is not None:
                try:
                    self._witness(latest, background=True)
                except Exception:
                    log.exception("witnessing the checkpoint of size %d failed", latest.size)
            self._closed.wait(interval)

    def _witness(
        self, signed: SignedCheckpoint, *, background: bool, catch_ups: int = 0
    ) -> SignedCheckpoint:
        with self._lock:
            current = self._signed
            if current is not None and current.size >= signed.size:
                # What is being witnessed already covers it (the ledger only grows).
                signed = current
            else:
                self._signed, self._lines, self._asking = signed, {}, {}
            waiting: dict[WitnessKey, Future[str | None]] = {}
            now = time.monotonic()
            for witness in self.witnesses:
                seen = self._seen[witness.key]
                if seen.refused == signed.size:
                    continue
                if witness.key in self._lines and (
                    not background or now - seen.cosigned_at < self.refresh
                ):
                    continue
                if not background and seen.unreachable:
                    continue
                asking = self._asking.get(witness.key)
                if asking is None:
                    asking = self._askers[witness.key].submit(self._ask, witness, signed)
                    self._asking[witness.key] = asking
                waiting[witness.key] = asking
        # Every question ends within its time-outs; this only bounds the wait for one queued
        # behind another.
        wait(waiting.values(), timeout=2 * (MAX_CONFLICTS + 1) * self.timeout)
        with self._lock:
            changed = False
            if self._signed is signed:
                for key, asking in waiting.items():
                    if asking.done() and not asking.cancelled():
                        line = asking.result()
                        if line is not None and self._lines.get(key) != line:
                            self._lines[key] = line
                            changed = True
                        if self._asking.get(key) is asking:
                            del self._asking[key]
                if background:
                    self._report(signed)
                lines = self._lines
            else:
                lines = {k: a.result() or "" for k, a in waiting.items() if a.done()}
            cosigned = "".join(lines.get(w.key) or "" for w in self.witnesses)
            witnessed = SignedCheckpoint(signed.checkpoint, signed.note + cosigned)
        if changed:
            # A tiles client that requires witnesses reads them in the published checkpoint.
            self.ledger.publish_cosigned(witnessed.note, witnessed.size)
        ahead = max((self._seen[key].size for key in waiting), default=0)
        if signed.size < ahead <= self.ledger.size and catch_ups < MAX_CONFLICTS:
            # A witness cosigned a larger checkpoint another server of this ledger signed, and
            # this server has caught up with it (`_submit`): that size is the one to serve.
            try:
                larger = self.ledger.checkpoint(ahead)
            except VaultError as exc:
                log.warning(
                    "cannot sign the checkpoint of size %d the witnesses saw: %s", ahead, exc
                )
                return witnessed
            return self._witness(larger, background=background, catch_ups=catch_ups + 1)
        return witnessed

    def _report(self, signed: SignedCheckpoint) -> None:
        """Log, once a checkpoint, when it gathered fewer cosignatures than the quorum."""
        if signed.size == self._reported or len(self._lines) >= self.quorum:
            return
        missing = [w.label for w in self.witnesses if w.key not in self._lines]
        log.error(
            "the checkpoint of size %d is cosigned by %d of %d witnesses (quorum %d): none "
            "yet from %s",
            signed.size,
            len(self._lines),
            len(self.witnesses),
            self.quorum,
            ", ".join(missing),
        )
        self._reported = signed.size

    def _ask(self, witness: Witness, signed: SignedCheckpoint) -> str | None:
        """The witness's cosignature line for `signed`, or None (logged) if it gave none."""
        seen = self._seen[witness.key]
        try:
            line = self._submit(witness, signed, seen)
        except _Overtaken as exc:
            # Routine where several servers share a ledger: not worth a line each time.
            log.debug(
                "witness %s (%s) has cosigned a checkpoint of size %d, newer than this "
                "server's of size %d: submitting that size",
                witness.label,
                witness.url,
                exc.size,
                signed.size,
            )
            seen.unreachable = False
            return None
        except Refused as exc:
            seen.refused = signed.size
            # Every checkpoint of a rolled-back or forked server is refused: the first of a kind
            # is logged, and then once a minute.
            now = time.monotonic()
            if seen.logged[0] != exc.kind or now - seen.logged[1] >= REFUSALS_LOGGED_EVERY:
                log.error("witness %s (%s) refused: %s", witness.label, witness.url, exc)
                seen.logged = (exc.kind, now)
            return None
        except VaultError as exc:
            if not seen.unreachable:
                log.warning("witness %s (%s): %s", witness.label, witness.url, exc)
            seen.unreachable = True
            return None
        except Exception:
            log.exception("asking witness %s (%s) failed", witness.label, witness.url)
            seen.unreachable = True
            return None
        if seen.unreachable:
            log.info("witness %s (%s) answers again", witness.label, witness.url)
        seen.unreachable = False
        seen.size = signed.size
        seen.cosigned_at = time.monotonic()
        return line

    def _submit(self, witness: Witness, signed: SignedCheckpoint, seen: _Seen) -> str:
        old = seen.size
        for _ in range(MAX_CONFLICTS + 1):
            if old > signed.size:
                if self.ledger.sync() >= old:
                    # Another server on the same database signed further: not a rollback.
                    raise _Overtaken(old)
                raise Refused(
                    f"it has cosigned a checkpoint of size {old} of this ledger, and this "
                    f"server's latest is of size {signed.size}: the ledger was rolled back",
                    kind="rollback",
                )
            proof = self.ledger.consistency_proof(old, signed.size) if 0 < old < signed.size else []
            status, answer = self._post(witness, old, proof, signed.note)
            if status == 200:
                return self._cosignature(witness, signed, answer)
            if status == 409:
                match = _SIZE.fullmatch(answer.decode("ascii", errors="replace"))
                if match is None:
                    raise Unavailable(f"it answered 409 without its size: {answer[:60]!r}")
                old = seen.size = int(match.group(1))
                continue
            if status in _REFUSALS:
                raise Refused(
                    f"POST {witness.url}{ADD_CHECKPOINT} with the checkpoint of size "
                    f"{signed.size} (old size {old}): HTTP {status}, {_REFUSALS[status]}",
                    kind=str(status),
                )
            raise Unavailable(
                f"POST {witness.url}{ADD_CHECKPOINT} with the checkpoint of size {signed.size}: "
                f"HTTP {status}"
            )
        raise Unavailable(f"its size kept changing ({old} last): asked again at the next pass")

    def _post(
        self, witness: Witness, old: int, proof: Sequence[bytes], note: str
    ) -> tuple[int, bytes]:
        """One tlog-witness add-checkpoint request: its status and body."""
        body = f"old {old}\n" + "".join(base64.b64encode(h).decode() + "\n" for h in proof)
        request = urllib.request.Request(
            witness.url + ADD_CHECKPOINT,
            data=(body + "\n" + note).encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return int(response.status), response.read(MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read(MAX_ANSWER_BYTES)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unavailable(f"no answer (time-out {self.timeout:g}s): {reason}") from None

    def _cosignature(self, witness: Witness, signed: SignedCheckpoint, answer: bytes) -> str:
        """The witness's own cosignature line from its answer, once it verifies on the
        checkpoint; lines by other keys are left out."""
        try:
            text = answer.decode("utf-8")
        except UnicodeDecodeError:
            raise Unavailable("its answer is not UTF-8 text") from None
        body, _ = split_note(signed.note)
        if not text.endswith("\n") or "\n\n" in text:
            raise Unavailable(f"its answer is not signature lines: {text[:80]!r}")
        try:
            found = cosignatures(body, text[:-1].split("\n"), [witness.key])
        except VerificationError as exc:
            raise Unavailable(f"its answer is not a valid cosignature: {exc}") from None
        if witness.key not in found:
            raise Unavailable(f"its answer holds no cosignature by its key: {text[:80]!r}")
        return found[witness.key].line


def start_witnessing(config: Config, ledger: Ledger, witnesses: Sequence[Witness]) -> Witnessing:
    """The witnessing of `ledger`'s checkpoints by `witnesses` (from `configured_witnesses`),
    started, once a checkpoint interval."""
    names = ", ".join(f"{w.label} at {w.url}" for w in witnesses)
    log.info("checkpoints are submitted to witnesses %s", names)
    return Witnessing(
        ledger,
        witnesses,
        quorum=config.witnesses.quorum,
        timeout=config.witnesses.timeout,
        interval=config.ledger.checkpoint_interval,
        refresh=config.witnesses.refresh,
    ).start()
