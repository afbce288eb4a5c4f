"""Admission: the scheduler's question, may this job run?, answered from the ledger and the
content store. A job runs only on pinned inputs whose content is present and intact; admitting
it pins the run (for one team, under a run id nobody knew before), and a replay takes one of its
team's replay slots. Also who may write into a run: its admitted team, and a replay's holder."""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import math
import operator
import secrets
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    VaultError,
)
from vault.ledger.db import Writer
from vault.ledger.entry import Entry
from vault.ledger.log import Ledger
from vault.ledger.records import PinSpec, StoredEntry
from vault.ledger.runid import MAX_INPUTS_BYTES, NONCE_HEX, RunInputs
from vault.server.auth import Identity
from vault.server.content import Content, StoredBlob
from vault.server.damage import KnownDamage
from vault.server.metrics import count_admission
from vault.store.image import MAX_IMAGE_MANIFEST, Named, check_image_held
from vault.store.manifest import (
    MAX_MANIFEST_BYTES,
    RawFile,
    check_manifest,
    summarize_manifest,
)

ADMITTED: Final = "admitted"
MANIFEST: Final = "manifest"
# Set by the vault on every entry that names a run: the team that wrote it.
TEAM: Final = "team"
# A replay's entries carry the sha256 of its lease under this key.
REPLAY: Final = "replay"
# Admissions of many runs touch few inputs; the cache of recent checks stays small.
_MAX_REMEMBERED: Final = 100_000
# Datasets whose refusal is kept, least recently asked about forgotten first.
_MAX_REFUSALS: Final = 4096
# Checks of one input run one at a time (so that a dataset many jobs name at once is read
# once); inputs share this many locks.
_CHECK_LOCKS: Final = 64


@dataclass(frozen=True)
class AdmissionPolicy:
    # An input's content re-hashed within this many seconds is not re-hashed for the next job:
    # admission answers in milliseconds, and the scrubber and every read still check the bytes.
    verify_interval: float = 600.0
    replays_per_team: int = 2
    # A replay that never says it finished gives its slot back after this many seconds.
    replay_lease: float = 86_400.0
    # The largest dataset manifest admission reads (admission.max_manifest_bytes).
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    # A dataset refused for missing files is refused again from memory for this long (at most
    # verify_interval): its files may be put meanwhile. A manifest's bytes never change, so a
    # refusal of the manifest itself is kept for good.
    missing_interval: float = 30.0


@dataclass(frozen=True, slots=True)
class Admitted:
    inputs: RunInputs
    entry: StoredEntry
    new: bool
    # The team admitted for: the run's own, or a replay's.
    team: str
    lease: str = ""


@dataclass(frozen=True, slots=True)
class AdmittedRun:
    """A run as its admission entry (the first `run` entry with stage=admitted whose first
    subject is the run id) says: the team it was admitted for, and that entry."""

    run_id: str
    team: str
    entry: StoredEntry


def _refuse_run_id(claimed: str, inputs: RunInputs, team: str) -> InvalidArgument:
    return InvalidArgument(
        f"run id {claimed} does not name these inputs: expected a run of team {team!r} admitted "
        f"on image {inputs.image}, dataset {inputs.dataset}, seed {inputs.seed}"
        + (f", config {inputs.config}" if inputs.config else "")
    )


class Runs:
    """The admitted runs as the ledger records them, for admission and for the pin path. A run's
    admission entry never changes, so one found is kept."""

    def __init__(self, ledger: Ledger, content: Content) -> None:
        self.ledger = ledger
        self.content = content
        self._admitted: dict[str, AdmittedRun] = {}
        self._inputs: dict[str, RunInputs] = {}
        self._run_shaped: dict[str, bool] = {}

    def could_be_run(self, blob: StoredBlob) -> bool:
        """Whether a stored blob is a run inputs document, so that its digest may be a run id.
        Nothing else can be (a run id is the digest of one), and bytes never change, so the
        answer is kept: a pin naming a digest many entries name pays for no query of them."""
        digest = str(blob.info.sha256)
        if (known := self._run_shaped.get(digest)) is not None:
            return known
        shaped = blob.info.size <= MAX_INPUTS_BYTES
        if shaped:
            _, chunks = self.content.read(blob)
            try:
                RunInputs.decode(b"".join(bytes(chunk.data) for chunk in chunks))
            except InvalidArgument:
                shaped = False
        _remember(self._run_shaped, digest, shaped)
        return shaped

    def admitted(self, run_id: str) -> AdmittedRun | None:
        if (known := self._admitted.get(run_id)) is not None:
            return known
        for stored, _ in self.ledger.pins_of_kind(run_id, "run"):
            entry = Entry.decode(stored.body)
            if entry.subjects[0] == run_id and entry.meta.get("stage") == ADMITTED:
                found = AdmittedRun(run_id, entry.meta.get(TEAM, ""), stored)
                _remember(self._admitted, run_id, found)
                return found
        return None

    def inputs_of(self, run_id: str) -> RunInputs:
        """The run's inputs document, as stored under its run id."""
        if (known := self._inputs.get(run_id)) is not None:
            return known
        blob = self.content.find(Digest.parse(run_id))
        if blob is None:
            raise FailedPrecondition(f"run {run_id} has no inputs document in the store")
        _, chunks = self.content.read(blob)
        inputs = RunInputs.decode(b"".join(bytes(chunk.data) for chunk in chunks))
        if inputs.run_id != run_id:
            raise IntegrityError(f"the inputs document stored as {run_id} is {inputs.run_id}")
        _remember(self._inputs, run_id, inputs)
        return inputs

    def find(self, inputs: RunInputs, team: str) -> tuple[AdmittedRun, RunInputs] | None:
        """The team's first admitted run of these inputs (a run admitted before run ids had a
        nonce included), or None."""
        subjects = tuple(dict.fromkeys(inputs.subjects))
        for stored, _ in self.ledger.pins_of_kind(inputs.dataset, "run"):
            entry = Entry.decode(stored.body)
            if (
                entry.meta.get("stage") == ADMITTED
                and entry.meta.get(TEAM) == team
                and entry.meta.get("seed") == str(inputs.seed)
                and entry.subjects[1:] == subjects
            ):
                run = self.admitted(entry.subjects[0])
                # Only a run's first admission entry makes it that team's.
                if run is None or run.entry.index != stored.index:
                    continue
                full = self.inputs_of(run.run_id)
                if full.bare == inputs:
                    return run, full
        return None

    def replay_holder(self, run_id: str, team: str, replay: str) -> bool:
        """Whether `team` holds (or held) the replay slot of `run_id` whose lease hashes to
        `replay`: a replay by another team writes into the run under that lease."""
        if not replay:
            return False
        rows = self.ledger.db.fetch(
            "SELECT lease FROM replay_leases WHERE team = ? AND run_id = ?", (team, run_id)
        )
        return any(replay_tag(lease) == replay for (lease,) in rows)

    def writer_team(self, subjects: tuple[str, ...], meta: Mapping[str, str], who: Identity) -> str:
        """The team a pin naming `subjects` is written for, when it names an admitted run; ""
        when it names none. Refused unless the caller writes for the team each run was admitted
        for, or holds a replay slot of it and the pin carries that replay's tag. `who` is the
        caller's `Identity`: an authenticated caller writes for its own team only; the one local
        user for the team it claims (meta `team`), by default the run's."""
        runs = [run for s in dict.fromkeys(subjects) if (run := self.admitted(s)) is not None]
        if not runs:
            return ""
        claimed = meta.get(TEAM, "")
        if who.authenticated:
            if claimed and claimed != who.team:
                raise PermissionDenied(
                    f"{who.name} belongs to team {who.team!r} and may not write for team "
                    f"{claimed!r}"
                )
            team = who.team
        else:
            team = claimed or runs[0].team
        for run in runs:
            if team != run.team and not self.replay_holder(run.run_id, team, meta.get(REPLAY, "")):
                raise PermissionDenied(
                    f"run {run.run_id} was admitted for team {run.team!r}, and only that team "
                    f"writes into it: {who.name} writes for team {team!r}"
                )
        return team


class _Stop(Exception):
    """Ends a walk over a manifest's files early."""


def _first_file_of(data: bytes | bytearray, missing: set[bytes]) -> str:
    """The path of the first file, in manifest order, whose digest (raw) is one of `missing`."""
    return _first_of(data, missing)[0]


def _first_of(data: bytes | bytearray, among: set[bytes]) -> tuple[str, bytes]:
    """The path and digest (raw) of the first file, in manifest order, whose digest is one of
    `among`."""
    first: list[tuple[str, bytes]] = []

    def look(batch: list[RawFile]) -> None:
        for path, _, _, hexdigest in batch:
            raw = binascii.a2b_hex(hexdigest)
            if raw in among:
                first.append((path.decode(), raw))
                raise _Stop

    with contextlib.suppress(_Stop):
        check_manifest(data, look, len(data))
    return first[0]


def replay_tag(lease: str) -> str:
    """What a replay's entries carry for its lease: its sha256, never the lease, which can
    release the slot."""
    return "sha256:" + hashlib.sha256(lease.encode()).hexdigest()


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _MAX_REMEMBERED:
        cache.clear()
    cache[key] = value


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
        # image digest -> the blobs it names, all found held at its last check.
        self._image_blobs: dict[str, int] = {}
        self.runs = Runs(ledger, content)
        # (team, inputs without nonce) -> the team's run of them, once found.
        self._found: dict[tuple[str, RunInputs], tuple[AdmittedRun, RunInputs]] = {}
        # One server admits a team's new run once; servers sharing PostgreSQL also take an
        # advisory lock (see _run_entry).
        self._new_run = threading.Lock()
        self._leases = Writer(ledger.db)
        self._leases_lock = threading.Lock()
        # dataset digest -> its refusal (error type, message) and until when it stands.
        self._refused: OrderedDict[str, tuple[type[VaultError], str, float]] = OrderedDict()
        self._refused_lock = threading.Lock()
        self._check_locks = [threading.Lock() for _ in range(_CHECK_LOCKS)]
        # Kept for the server's life: each thread keeps its own database connection.
        # What the vault's own checks found damaged and nobody has repaired since.
        self._damage = KnownDamage(content.store)

    def close(self) -> None:
        self._damage.close()
        self._leases.close()

    # ------------------------------------------------------------------ admit

    def admit(
        self, inputs: RunInputs, *, team: str, author: str, run_id: str = "", replay_of: str = ""
    ) -> Admitted:
        """Admit a job on `inputs` (without nonce) for `team`: its team's run of these inputs,
        made now (with a nonce of the vault's, so its run id was unknowable until now) if the
        team has none. With `run_id`, that run, which must be the team's run of these inputs;
        with `replay_of`, the run of that published manifest, and one of the team's slots."""
        try:
            admitted = self._admit(inputs.bare, team, author, run_id, replay_of)
        except Exception as exc:
            count_admission(exc)
            raise
        count_admission(None)
        return admitted

    def _admit(
        self, inputs: RunInputs, team: str, author: str, run_id: str, replay_of: str
    ) -> Admitted:
        external = self.check_inputs(inputs)
        if replay_of:
            run, full, lease = self._replay(inputs, team, replay_of)
            return Admitted(full, run.entry, False, team, lease)
        if run_id:
            run, full = self.claimed_run(inputs, team, run_id)
            return Admitted(full, run.entry, False, team)
        entry, full, new = self._run_entry(inputs, team, author, external)
        return Admitted(full, entry, new, team)

    def claimed_run(
        self, inputs: RunInputs, team: str, run_id: str
    ) -> tuple[AdmittedRun, RunInputs]:
        """The run `run_id` names, refused unless it is the team's run of these inputs."""
        run = self.runs.admitted(run_id)
        if run is None or run.team != team:
            raise _refuse_run_id(run_id, inputs, team)
        full = self.runs.inputs_of(run_id)
        if full.bare != inputs.bare:
            raise _refuse_run_id(run_id, inputs, team)
        return run, full

    @staticmethod
    def _roles(inputs: RunInputs) -> list[tuple[str, str]]:
        roles = [("image", inputs.image), ("dataset", inputs.dataset)]
        if inputs.config:
            roles.append(("config", inputs.config))
        return roles

    def known_run(self, inputs: RunInputs, team: str) -> tuple[AdmittedRun, RunInputs] | None:
        """The team's run of these inputs, when admitting it again needs no hashing and no
        append: the run was found before and every input was checked within the verify
        interval."""
        now = self._clock()
        for key in self._roles(inputs):
            checked = self._checked.get(key)
            if checked is None or now - checked >= self.policy.verify_interval:
                return None
        return self._found.get((team, inputs.bare))

    def check_inputs(self, inputs: RunInputs) -> bool:
        """Refuse inputs that are not pinned, or whose content is missing or fails its check.
        Returns whether any input is pinned only as external content (kept elsewhere)."""
        external = False
        for role, digest in self._roles(inputs):
            if not self._recently_checked(role, digest):
                with self._check_locks[hash((role, digest)) % _CHECK_LOCKS]:
                    # Another admission may have checked it while this one waited.
                    if not self._recently_checked(role, digest):
                        self._check_input(role, digest)
            external = external or (role, digest) in self._external
        return external

    def _recently_checked(self, role: str, digest: str) -> bool:
        checked = self._checked.get((role, digest))
        return checked is not None and self._clock() - checked < self.policy.verify_interval

    def _check_input(self, role: str, digest: str) -> None:
        now = self._clock()
        pins = self.ledger.pins_of_kind(digest, role)
        if not pins:
            raise FailedPrecondition(
                f"{role} {digest} is not pinned as {_an(role)}: pin it first "
                f"(vault pin {role} {digest})"
            )
        if all(is_external for _, is_external in pins):
            # Kept elsewhere (an OCI registry, say): the pin is all the vault can vouch for.
            self._external.add((role, digest))
        else:
            self._external.discard((role, digest))
            self._check_content(role, digest)
        _remember(self._checked, (role, digest), now)

    def _check_content(self, role: str, digest: str) -> None:
        if role == "dataset":
            self._raise_kept_refusal(digest)
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
        elif role == "image" and blob.info.size <= MAX_IMAGE_MANIFEST:
            body = bytes(self._read_whole(digest, blob.info.size))
            held = check_image_held(digest, body, self._image_manifest, self._lacking)
            _remember(self._image_blobs, digest, held)

    def image_blobs(self, digest: str) -> int:
        """How many blobs image `digest` names, all found held when it was last checked (0:
        external, not an OCI manifest, or not checked since this server started)."""
        return self._image_blobs.get(digest, 0)

    def _image_manifest(self, digest: str) -> bytes:
        """A manifest an image index lists, read whole and verified (check_image_held has
        found it held)."""
        blob = self.content.get(Digest.parse(digest))
        if blob.info.size > MAX_IMAGE_MANIFEST:
            raise FailedPrecondition(
                f"{digest}, listed as an image manifest, is {blob.info.size} bytes: more than "
                f"a manifest may be ({MAX_IMAGE_MANIFEST})"
            )
        return bytes(self._read_whole(digest, blob.info.size))

    def _lacking(self, blobs: Sequence[Named]) -> set[str]:
        """The digests of `blobs` the store does not hold at their stated size."""
        sizes = {Digest.parse(b.digest).raw: b.size for b in blobs}
        return {"sha256:" + raw.hex() for raw in self.content.lacking(sorted(sizes), sizes)}

    def _check_dataset_files(self, digest: str, size: int) -> None:
        """Refuse a dataset whose manifest is not valid or names a file the store lacks. The
        manifest is read through the one validator, which keeps only its distinct digests;
        the database looks them up a batch at a time (see Content.lacking)."""
        limit = self.policy.max_manifest_bytes
        if size > limit:
            self._refuse(
                digest,
                InvalidArgument(
                    f"dataset {digest} is {size} bytes, more than a manifest may be "
                    f"(admission.max_manifest_bytes is {limit})"
                ),
            )
        data = self._read_whole(digest, size)
        try:
            summary = summarize_manifest(data, limit)
        except InvalidArgument as exc:
            del data
            self._refuse(
                digest, FailedPrecondition(f"dataset {digest} is not a dataset manifest: {exc}")
            )
        # In order of their first two bytes, which is all the look-ups need: two stable sorts
        # by one byte each cost about half of one full sort.
        wanted = sorted(summary.sizes, key=operator.itemgetter(1))
        wanted.sort(key=operator.itemgetter(0))
        missing = self.content.lacking(wanted, summary.sizes)
        if missing:
            self._refuse_wrong_size(digest, data, summary.sizes, missing)
            self._refuse(
                digest,
                FailedPrecondition(
                    f"dataset {digest} is missing {len(missing)} of its {summary.files} "
                    f"files' content (first: {_first_file_of(data, missing)})"
                ),
                for_seconds=min(self.policy.verify_interval, self.policy.missing_interval),
            )
        damaged = self._damage.damaged_among(summary.sizes)
        if damaged:
            first = _first_file_of(data, damaged)
            self._refuse(
                digest,
                FailedPrecondition(
                    f"dataset {digest} has {len(damaged)} of its {summary.files} files' content "
                    f"known damaged in the store (first: {first}): repair it with `vault repair "
                    "DIGEST --from PATH`"
                ),
                for_seconds=min(self.policy.verify_interval, self.policy.missing_interval),
            )

    def _refuse_wrong_size(
        self, digest: str, data: bytearray, sizes: dict[bytes, int], lacking: set[bytes]
    ) -> None:
        """Refuse for good (blobs and manifests never change) a dataset whose manifest gives
        a stored file another size than its blob's, naming the first such file."""
        stored = self.content.find_many("sha256:" + sha256.hex() for sha256 in lacking)
        wrong = {
            sha256
            for sha256 in lacking
            if (blob := stored.get("sha256:" + sha256.hex())) is not None
            and blob.info.size != sizes[sha256]
        }
        if not wrong:
            return
        path, sha256 = _first_of(data, wrong)
        self._refuse(
            digest,
            FailedPrecondition(
                f"dataset {digest} says {path!r} is {sizes[sha256]} bytes, but its content "
                f"sha256:{sha256.hex()} is stored with "
                f"{stored['sha256:' + sha256.hex()].info.size} bytes"
            ),
        )

    def _read_whole(self, digest: str, size: int) -> bytearray:
        """A blob's verified bytes in one buffer, with no second copy on the way."""
        data = bytearray(size)
        view = memoryview(data)
        at = 0
        _, chunks = self.content.read(self.content.get(Digest.parse(digest)))
        for chunk in chunks:
            piece = chunk.data  # each read of the field copies its bytes
            view[at : at + len(piece)] = piece
            at += len(piece)
        view.release()
        if at != size:
            raise IntegrityError(f"dataset {digest} read back {at} of its {size} bytes")
        return data

    def _refuse(self, digest: str, error: VaultError, *, for_seconds: float = math.inf) -> None:
        """Raise `error`, kept as the dataset's answer for `for_seconds`."""
        if for_seconds > 0:
            with self._refused_lock:
                self._refused[digest] = (type(error), str(error), self._clock() + for_seconds)
                self._refused.move_to_end(digest)
                while len(self._refused) > _MAX_REFUSALS:
                    self._refused.popitem(last=False)
        raise error

    def _raise_kept_refusal(self, digest: str) -> None:
        with self._refused_lock:
            kept = self._refused.get(digest)
            if kept is None:
                return
            if self._clock() >= kept[2]:
                del self._refused[digest]
                return
            self._refused.move_to_end(digest)
        raise kept[0](kept[1])

    def _find(self, inputs: RunInputs, team: str) -> tuple[AdmittedRun, RunInputs] | None:
        if (known := self._found.get((team, inputs))) is not None:
            return known
        found = self.runs.find(inputs, team)
        if found is not None:
            _remember(self._found, (team, inputs), found)
        return found

    def _run_entry(
        self, inputs: RunInputs, team: str, author: str, external: bool
    ) -> tuple[StoredEntry, RunInputs, bool]:
        if (found := self._find(inputs, team)) is not None:
            return found[0].entry, found[1], False
        with self._new_run, self._across_servers(f"run {team} {inputs.run_id}"):
            if (found := self._find(inputs, team)) is not None:
                return found[0].entry, found[1], False
            # The vault's nonce makes the run id: nobody could name this run before now.
            full = inputs.with_nonce(secrets.token_hex(NONCE_HEX // 2))
            run_id = full.run_id
            # The inputs document is stored first, so the run id names a blob anyone can read.
            self.content.put([full.encode()], Digest.parse(run_id))
            spec = PinSpec.checked(
                kind="run",
                subjects=list(dict.fromkeys((run_id, *inputs.subjects))),
                author=author,
                meta={"stage": ADMITTED, "seed": str(inputs.seed), TEAM: team},
                external=external,
            )
            (entry,) = self.ledger.append([spec])
            _remember(self._found, (team, inputs), (AdmittedRun(run_id, team, entry), full))
            return entry, full, True

    @contextlib.contextmanager
    def _across_servers(self, key: str) -> Iterator[None]:
        """Servers sharing one PostgreSQL make a team's run of some inputs once: an advisory
        lock, held until the run's entry is appended, so that the next server finds it. (On
        SQLite one server owns the ledger, and a transaction here would block the append.)"""
        if self.ledger.db.is_sqlite:
            yield
            return
        with self._leases_lock, self._leases.begin() as tx:
            tx.run("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(key.encode()),))
            yield

    # ------------------------------------------------------------------ replays

    def _replay(
        self, inputs: RunInputs, team: str, manifest: str
    ) -> tuple[AdmittedRun, RunInputs, str]:
        """The run a published manifest is of, which must be a run of these inputs and sealed by
        the team that run was admitted for, and a replay slot of `team`'s for it."""
        manifest = str(Digest.parse(manifest))
        published = [
            entry
            for stored in self.ledger.pins_of_kind(manifest, "run")
            if (entry := Entry.decode(stored[0].body)).meta.get("stage") == MANIFEST
            and entry.subjects[0] == manifest
        ]
        runs = sorted({s for e in published for s in e.subjects[1:]})
        if not runs:
            raise FailedPrecondition(f"{manifest} is not a published run manifest")
        for run_id in runs:
            run = self.runs.admitted(run_id)
            if run is None or self.runs.inputs_of(run_id).bare != inputs:
                continue
            sealed = [e for e in published if run_id in e.subjects[1:]]
            if not any(e.meta.get(TEAM) == run.team for e in sealed):
                first = sealed[0]
                raise PermissionDenied(
                    f"run manifest {manifest} was pinned by {first.author} (team "
                    f"{first.meta.get(TEAM) or 'not recorded'}), not by team {run.team!r}, which "
                    f"run {run_id} was admitted for: only a run's own team seals its manifest"
                )
            return run, self.runs.inputs_of(run_id), self._take_replay_slot(run_id, team, manifest)
        raise InvalidArgument(
            f"run manifest {manifest} is of run {runs[0]}, not of a run admitted on these inputs"
        )

    def _take_replay_slot(self, run_id: str, team: str, manifest: str) -> str:
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
                (lease, team, run_id, manifest, now, now + self.policy.replay_lease),
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
