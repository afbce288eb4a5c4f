"""Admission: the scheduler's question, may this job run?, answered from the ledger and the
content store. A job runs only on pinned inputs whose content is present and intact; admitting
it pins the run, and a replay takes one of its team's replay slots."""

from __future__ import annotations

import secrets
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from vault.digest import Digest
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
)
from vault.ledger.db import Writer
from vault.ledger.entry import Entry
from vault.ledger.log import Ledger, PinSpec, StoredEntry
from vault.ledger.runid import RunInputs
from vault.server.content import Content
from vault.store.manifest import MAX_MANIFEST_BYTES, decode_manifest

ADMITTED: Final = "admitted"
MANIFEST: Final = "manifest"
# Admissions of many runs touch few inputs; the cache of recent checks stays small.
_MAX_REMEMBERED: Final = 100_000


@dataclass(frozen=True)
class AdmissionPolicy:
    # An input's content re-hashed within this many seconds is not re-hashed for the next job:
    # admission answers in milliseconds, and the scrubber and every read still check the bytes.
    verify_interval: float = 600.0
    replays_per_team: int = 2
    # A replay that never says it finished gives its slot back after this many seconds.
    replay_lease: float = 86_400.0


@dataclass(frozen=True, slots=True)
class Admitted:
    inputs: RunInputs
    entry: StoredEntry
    new: bool
    # The team admitted for (a run admitted before may have been pinned for another).
    team: str
    lease: str = ""


def check_run_id(inputs: RunInputs, claimed: str) -> None:
    if claimed and claimed != inputs.run_id:
        raise InvalidArgument(
            f"run id {claimed} does not name these inputs: they make run {inputs.run_id}"
        )


def _an(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


class Admitter:
    def __init__(
        self,
        ledger: Ledger,
        content: Content,
        policy: AdmissionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.content = content
        self.policy = policy or AdmissionPolicy()
        self._clock = clock
        # (role, digest) -> when its pin and content were last checked; and which of those
        # are pinned only as external content.
        self._checked: dict[tuple[str, str], float] = {}
        self._external: set[tuple[str, str]] = set()
        self._runs: dict[str, StoredEntry] = {}
        # One server admits a new run once; across servers a second `run` pin of the same run
        # id is harmless (the earlier index is the run's).
        self._new_run = threading.Lock()
        self._leases = Writer(ledger.db)
        self._leases_lock = threading.Lock()

    def close(self) -> None:
        self._leases.close()

    # ------------------------------------------------------------------ admit

    def admit(
        self, inputs: RunInputs, *, team: str, author: str, run_id: str = "", replay_of: str = ""
    ) -> Admitted:
        check_run_id(inputs, run_id)
        external = self.check_inputs(inputs)
        lease = self._take_replay_slot(inputs, team, replay_of) if replay_of else ""
        try:
            entry, new = self._run_entry(inputs, team, author, external)
        except BaseException:
            if lease:
                self.release_replay(lease, team)
            raise
        return Admitted(inputs, entry, new, team, lease)

    @staticmethod
    def _roles(inputs: RunInputs) -> list[tuple[str, str]]:
        roles = [("image", inputs.image), ("dataset", inputs.dataset)]
        if inputs.config:
            roles.append(("config", inputs.config))
        return roles

    def known_run(self, inputs: RunInputs) -> StoredEntry | None:
        """The run's pin, when admitting it again needs no hashing and no append: the run is
        pinned and every input was checked within the verify interval."""
        now = self._clock()
        for key in self._roles(inputs):
            checked = self._checked.get(key)
            if checked is None or now - checked >= self.policy.verify_interval:
                return None
        return self._existing_run(inputs.run_id)

    def check_inputs(self, inputs: RunInputs) -> bool:
        """Refuse inputs that are not pinned, or whose content is missing or fails its check.
        Returns whether any input is pinned only as external content (kept elsewhere)."""
        external = False
        for role, digest in self._roles(inputs):
            now = self._clock()
            checked = self._checked.get((role, digest))
            if checked is not None and now - checked < self.policy.verify_interval:
                external = external or (role, digest) in self._external
                continue
            pins = self.ledger.pins_of_kind(digest, role)
            if not pins:
                raise FailedPrecondition(
                    f"{role} {digest} is not pinned as {_an(role)}: pin it first "
                    f"(vault pin {role} {digest})"
                )
            if all(is_external for _, is_external in pins):
                # Kept elsewhere (an OCI registry, say): the pin is all the vault can vouch for.
                external = True
                self._external.add((role, digest))
            else:
                self._external.discard((role, digest))
                self._check_content(role, digest)
            self._remember(self._checked, (role, digest), now)
        return external

    def _check_content(self, role: str, digest: str) -> None:
        blob = self.content.find(Digest.parse(digest))
        if blob is None:
            raise FailedPrecondition(
                f"{role} {digest} is pinned but its content is not in the store"
            )
        try:
            self.content.store.verify(blob.info.sha256)
        except NotFound:
            raise FailedPrecondition(
                f"{role} {digest} is catalogued but its bytes are missing from the store"
            ) from None
        except IntegrityError as exc:
            raise IntegrityError(f"{role} {digest} fails its check: {exc}") from None
        if role == "dataset":
            self._check_dataset_files(digest, blob.info.size)

    @staticmethod
    def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
        if len(cache) >= _MAX_REMEMBERED:
            cache.clear()
        cache[key] = value

    def _check_dataset_files(self, digest: str, size: int) -> None:
        if size > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"dataset {digest} is {size} bytes, too large for a manifest")
        _, chunks = self.content.read(self.content.get(Digest.parse(digest)))
        data = b"".join(bytes(chunk.data) for chunk in chunks)
        try:
            manifest = decode_manifest(data)
        except InvalidArgument as exc:
            raise FailedPrecondition(f"dataset {digest} is not a dataset manifest: {exc}") from None
        missing = set(self.content.find_missing(f.sha256 for f in manifest.files))
        if missing:
            first = next(f.path for f in manifest.files if f.sha256 in missing)
            raise FailedPrecondition(
                f"dataset {digest} is missing {len(missing)} of its {len(manifest.files)} "
                f"files' content (first: {first})"
            )

    def _existing_run(self, run_id: str) -> StoredEntry | None:
        if (known := self._runs.get(run_id)) is not None:
            return known  # entries never change, so a run's pin, once found, is kept
        for stored, _ in self.ledger.pins_of_kind(run_id, "run"):
            entry = Entry.decode(stored.body)
            if entry.subjects[0] == run_id and entry.meta.get("stage") == ADMITTED:
                self._remember(self._runs, run_id, stored)
                return stored
        return None

    def _run_entry(
        self, inputs: RunInputs, team: str, author: str, external: bool
    ) -> tuple[StoredEntry, bool]:
        run_id = inputs.run_id
        if (found := self._existing_run(run_id)) is not None:
            return found, False
        with self._new_run:
            if (found := self._existing_run(run_id)) is not None:
                return found, False
            # The inputs document is stored first, so the run id names a blob anyone can read.
            self.content.put([inputs.encode()], Digest.parse(run_id))
            spec = PinSpec.checked(
                kind="run",
                subjects=list(dict.fromkeys((run_id, *inputs.subjects))),
                author=author,
                meta={"stage": ADMITTED, "seed": str(inputs.seed), "team": team},
                external=external,
            )
            (entry,) = self.ledger.append([spec])
            return entry, True

    # ------------------------------------------------------------------ replays

    def _take_replay_slot(self, inputs: RunInputs, team: str, manifest: str) -> str:
        manifest = str(Digest.parse(manifest))
        published = [Entry.decode(e.body) for e in self.ledger.entries_for([manifest])[manifest]]
        runs = {
            s
            for e in published
            if e.kind == "run" and e.meta.get("stage") == MANIFEST
            for s in e.subjects[1:]
        }
        if not runs:
            raise FailedPrecondition(f"{manifest} is not a published run manifest")
        if inputs.run_id not in runs:
            raise InvalidArgument(
                f"run manifest {manifest} is of run {min(runs)}, not of these inputs' run "
                f"{inputs.run_id}"
            )
        limit = self.policy.replays_per_team
        lease = secrets.token_hex(16)
        now = time.time()
        with self._leases_lock, self._leases.begin() as tx:
            if not self.ledger.db.is_sqlite:
                # Servers sharing one PostgreSQL grant a team's slots one at a time; SQLite's
                # BEGIN IMMEDIATE already does. The lock key is the team, hashed to 32 bits.
                tx.run("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(team.encode()),))
            ((running,),) = tx.all(
                "SELECT COUNT(*) FROM replay_leases "
                "WHERE team = ? AND released IS NULL AND expires > ?",
                (team, now),
            )
            if running >= limit:
                raise QuotaExceeded(
                    f"team {team!r} already runs {running} replays (at most {limit} at once): "
                    "wait for one to finish"
                )
            tx.run(
                "INSERT INTO replay_leases (lease, team, run_id, manifest, started, expires) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (lease, team, inputs.run_id, manifest, now, now + self.policy.replay_lease),
            )
        return lease

    def release_replay(self, lease: str, team: str | None) -> None:
        """Give a replay's slot back; `team` None is an administrator's release of any team's."""
        with self._leases_lock, self._leases.begin() as tx:
            rows = tx.all(
                "SELECT team FROM replay_leases WHERE lease = ? AND released IS NULL", (lease,)
            )
            if not rows:
                raise NotFound("no running replay holds that lease")
            if team is not None and rows[0][0] != team:
                raise PermissionDenied("that replay belongs to another team")
            tx.run("UPDATE replay_leases SET released = ? WHERE lease = ?", (time.time(), lease))
