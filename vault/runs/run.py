"""The run library, used inside a job (docs/run-manifest.md): the run's seed, every output recorded
by digest, checkpoints that exist entirely or not at all, and at the end the run manifest, pinned,
with a one-line `replicate.sh` that replays the run."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import re
import secrets
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

from vault import config
from vault.client import ProvenEntry, VaultClient, open_client, read_all
from vault.client.transfer import BATCH_BLOB
from vault.config import (
    ENV_CONFIG,
    ENV_DATASET,
    ENV_IMAGE,
    ENV_REPLAY_LEASE,
    ENV_REPLAY_OF,
    ENV_RUN_ID,
    ENV_SEED,
    ENV_TEAM,
)
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    VerificationError,
)
from vault.files import fsync_dir
from vault.ledger.entry import Entry
from vault.ledger.runid import RunInputs
from vault.runs.job import admission_entry, fetch_inputs, optional_digest, required_variable
from vault.runs.manifest import (
    SHA256_DIGEST,
    CheckpointManifest,
    CheckpointRef,
    Environment,
    FileRecord,
    RunManifest,
    entries_naming,
    load_checkpoint_manifest,
)
from vault.store.manifest import check_path

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

HASH_BLOCK: Final = 1 << 20
PUTS_IN_FLIGHT: Final = 4
# A checkpoint's small files go to the vault in calls of at most this many files and bytes
# (well inside what one PutBatch takes), so that several calls are in flight at once.
CHECKPOINT_BATCH_FILES: Final = 1000
CHECKPOINT_BATCH_BYTES: Final = 32 << 20
REPLICATE_SCRIPT: Final = "replicate.sh"
# Set by Slurm in each task of a job array.
ENV_ARRAY_TASK: Final = "SLURM_ARRAY_TASK_ID"

_DECIMAL: Final = re.compile(r"0|[1-9][0-9]{0,15}")


@dataclass(frozen=True, slots=True)
class Artefact:
    """An output file as recorded: its path relative to the run's output folder, digest, size,
    and the proven `artefact` entry."""

    path: str
    sha256: str
    size: int
    entry: ProvenEntry


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its manifest's digest, the manifest, and its proven entry."""

    digest: str
    manifest: CheckpointManifest
    entry: ProvenEntry
    _client: VaultClient = field(repr=False, compare=False)
    # The digests of the files this process sent when it committed the checkpoint; a file the
    # vault already held (unchanged since an earlier checkpoint) is not among them.
    sent: frozenset[str] = frozenset()

    @property
    def step(self) -> int:
        """The step the checkpoint was committed as."""
        return self.manifest.step

    def read(self, name: str) -> bytes:
        """One file of the checkpoint, in memory, once its bytes matched its digest (the client
        checks every byte) and the size the manifest gives (IntegrityError otherwise). NotFound
        for a name the checkpoint does not have."""
        found = [f for f in self.manifest.files if f.path == name]
        if not found:
            raise NotFound(f"checkpoint {self.digest} (step {self.step}) has no file {name!r}")
        record = found[0]
        reader = self._client.open(record.sha256)
        try:
            if reader.info.size != record.size:
                raise IntegrityError(
                    f"checkpoint {self.digest} says {name!r} is {record.size} bytes, "
                    f"its blob {record.sha256} is {reader.info.size}"
                )
            return read_all(reader)
        finally:
            reader.close()

    def restore(self, target: str | os.PathLike[str]) -> dict[str, Path]:
        """Write the checkpoint's files into `target` (created if absent), each appearing only
        once its bytes matched its digest and its size; a file of the same name is replaced.
        Returns where each file went, by its name in the checkpoint."""
        folder = Path(os.path.abspath(target))
        written: dict[str, Path] = {}
        for f in self.manifest.files:
            path = folder / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            info = self._client.get(f.sha256, path)
            if info.size != f.size:
                path.unlink()
                raise IntegrityError(
                    f"checkpoint {self.digest} says {f.path!r} is {f.size} bytes, "
                    f"its blob {f.sha256} is {info.size}"
                )
            written[f.path] = path
        return written


def start(
    client: VaultClient | None = None,
    *,
    output_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Run:
    """The run this job is, from the variables the scheduler set (see `Run.from_environment`)."""
    return Run.from_environment(client, output_dir=output_dir, environ=environ)


class Run:
    """One run, inside its job. Use `start()`, as `with vault.runs.start() as run:`; leaving
    the block normally publishes the run manifest, leaving it by an exception publishes nothing."""

    def __init__(
        self,
        client: VaultClient,
        inputs: RunInputs,
        *,
        admission: Entry,
        output_dir: Path,
        team: str = "",
        replay_lease: str = "",
        replay_of: str = "",
        environ: Mapping[str, str] | None = None,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self.inputs = inputs
        self.run_id = inputs.run_id
        self.admission = admission
        # The run's team is the one its admission entry records; only a replay, admitted
        # against that entry, runs for a team of its own (the vault holds its slot for it).
        admitted_team = admission.meta.get("team", "")
        if replay_lease:
            self.team = team or admitted_team
        elif team and team != admitted_team:
            raise VerificationError(
                f"{ENV_TEAM} is {team} but run {self.run_id} was admitted for team "
                f"{admitted_team or 'none'} (admission entry {admission.index})"
            )
        else:
            self.team = admitted_team
        self.replay_of = replay_of
        self.output_dir = output_dir
        self._lease = replay_lease
        # A replay has the same run id as the run it replays; its own entries carry the
        # lease's digest (never the lease, which releases the slot) so that its checkpoints
        # and outputs are told apart from the original's, and it starts from scratch.
        self.replay = (
            "sha256:" + hashlib.sha256(replay_lease.encode()).hexdigest() if replay_lease else ""
        )
        env = os.environ if environ is None else environ
        # Each task of a job array has its own checkpoints and outputs inside the run: tasks
        # with the same inputs are one run, but one task never resumes from another's work.
        self.task = env.get(ENV_ARRAY_TASK, "")
        if self.task and not _DECIMAL.fullmatch(self.task):
            raise InvalidArgument(f"{ENV_ARRAY_TASK} is {self.task[:80]!r}: expected a task number")
        self._environ = dict(os.environ if environ is None else environ)
        self._owns_client = owns_client
        # Weak: an output dropped unclosed is collected, and aborts itself, as it would alone.
        self._open: weakref.WeakSet[OutputFile] = weakref.WeakSet()
        self._published = ""

    @classmethod
    def from_environment(
        cls,
        client: VaultClient | None = None,
        *,
        output_dir: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Run:
        """The run named by PINVAULT_RUN_ID, checked against PINVAULT_IMAGE, PINVAULT_DATASET,
        PINVAULT_CONFIG_DIGEST and PINVAULT_SEED, against the inputs document the vault holds
        under the run id, and against the run's admission entry. PINVAULT_SEED may be absent
        (a replay): the seed is then the recorded one. Without `client`, one is made from the
        PINVAULT_CLIENT_* variables and closed with the run."""
        env = os.environ if environ is None else environ
        run_id = required_variable(env, ENV_RUN_ID)
        if not SHA256_DIGEST.fullmatch(run_id):
            raise InvalidArgument(
                f"{ENV_RUN_ID} is {run_id[:80]!r}: expected 'sha256:<64 lowercase hex digits>'"
            )
        claimed = {
            ENV_IMAGE: required_variable(env, ENV_IMAGE),
            ENV_DATASET: required_variable(env, ENV_DATASET),
            ENV_CONFIG: env.get(ENV_CONFIG, ""),
        }
        seed = env.get(ENV_SEED, "")
        # Checked before connecting: a malformed seed or digest is the job's own mistake.
        local = RunInputs.checked(
            image=claimed[ENV_IMAGE],
            dataset=claimed[ENV_DATASET],
            config=claimed[ENV_CONFIG],
            seed=seed or 0,
        )
        owns = client is None
        # Set up as the `vault` command's would be, with the same trust state, so that a job
        # and the command verify against one history.
        vault = open_client(config.load(environ=env)) if client is None else client
        try:
            # The run id names the inputs document (with the vault's nonce), fetched verified;
            # every input the job was given must be the one it records.
            inputs = fetch_inputs(vault, run_id)
            given = {ENV_IMAGE: local.image, ENV_DATASET: local.dataset, ENV_CONFIG: local.config}
            recorded = {ENV_IMAGE: inputs.image, ENV_DATASET: inputs.dataset}
            recorded[ENV_CONFIG] = inputs.config
            if seed:
                given[ENV_SEED] = str(local.seed)
                recorded[ENV_SEED] = str(inputs.seed)
            for name, value in given.items():
                if value != recorded[name]:
                    raise VerificationError(
                        f"{name} is {value or 'unset'} but run {run_id} was admitted with "
                        f"{recorded[name] or 'none'}"
                    )
            admission = admission_entry(vault, inputs)
            folder = Path(os.path.abspath(output_dir if output_dir is not None else os.curdir))
            return cls(
                vault,
                inputs,
                admission=admission,
                output_dir=folder,
                team=env.get(ENV_TEAM, ""),
                replay_lease=env.get(ENV_REPLAY_LEASE, ""),
                replay_of=optional_digest(env, ENV_REPLAY_OF),
                environ=env,
                owns_client=owns,
            )
        except BaseException:
            if owns:
                vault.close()
            raise

    # ------------------------------------------------------------------ seed

    @property
    def seed(self) -> int:
        """The run's seed, as the vault recorded it at admission."""
        return self.inputs.seed

    def rng(self) -> random.Random:
        """A fresh generator seeded with the run's seed: the same sequence on every replay."""
        return random.Random(self.seed)

    # ------------------------------------------------------------------ outputs

    def output(self, path: str | os.PathLike[str]) -> OutputFile:
        """A binary file to write an output through: hashed on the way to disk, and on close
        synced, stored, and recorded as an `artefact` of the run. It appears at `path` only
        then; leaving its `with` block by an exception (or `abort()`) leaves no file and no
        record."""
        relative, target = self._output_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        out = OutputFile(self, relative, target)
        self._open.add(out)
        return out

    def record(self, path: str | os.PathLike[str]) -> Artefact:
        """Store and record a file the job wrote by other means (inside the output folder)."""
        relative, target = self._output_path(path)
        sha256, size = _hash_file(target)
        self._store(target, sha256, size, chunk_root=True)
        return self._pin_artefact(relative, sha256, size)

    def outputs(self) -> list[Artefact]:
        """Every output this run recorded, in earlier processes of it too (a job preempted and
        started again), the latest record of each path, in manifest order."""
        latest: dict[str, Artefact] = {}
        for proven in self._entries("artefact"):
            entry = proven.entry
            path, size = entry.meta.get("path", ""), entry.meta.get("size", "")
            if not _DECIMAL.fullmatch(size):
                raise IntegrityError(f"artefact entry {entry.index} has bad size {size!r}")
            latest[path] = Artefact(path, entry.subjects[0], int(size), proven)
        return [latest[p] for p in sorted(latest, key=lambda p: p.encode("utf-8"))]

    def _output_path(self, path: str | os.PathLike[str]) -> tuple[str, Path]:
        target = Path(os.path.abspath(self.output_dir / path))
        relative = os.path.relpath(target, self.output_dir)
        if relative == os.curdir or relative.split(os.sep)[0] == os.pardir:
            raise InvalidArgument(
                f"output {os.fspath(path)} is not inside the run's output folder {self.output_dir}"
            )
        relative = Path(relative).as_posix()
        if relative == REPLICATE_SCRIPT:
            raise InvalidArgument(f"output {relative} is the name finish() writes the replay to")
        return check_path(relative, "output"), target

    def _store(
        self, source: Path | bytes, sha256: str, size: int, *, chunk_root: bool = False
    ) -> None:
        # `expected` makes the vault refuse bytes that changed after they were hashed. An
        # output, pinned on its own, is put with its chunk root, which its pin then records:
        # its ranges are verified alone (vault.client.ranges).
        result = self.client.put(source, expected=sha256, chunk_root=chunk_root)
        _check_stored(result.blob.sha256, result.blob.size, sha256, size)

    def _pin_artefact(self, relative: str, sha256: str, size: int) -> Artefact:
        meta = self._meta(path=relative, size=str(size))
        proven = self.client.pin("artefact", [sha256, self.run_id], meta=meta)
        return Artefact(relative, sha256, size, proven)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(
        self, step: int, files: Mapping[str, str | os.PathLike[str] | bytes]
    ) -> Checkpoint:
        """Commit a checkpoint: every file is stored, then its manifest, and only then is the
        manifest pinned. Until that pin the checkpoint does not exist for `latest()`, so a job
        that dies on the way leaves the previous one the latest."""
        hashed: list[tuple[FileRecord, Path | bytes]] = []
        for name, source in files.items():
            check_path(name, "checkpoint")
            if isinstance(source, bytes | bytearray | memoryview):
                data = bytes(source)
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                hashed.append((FileRecord(name, digest, len(data)), data))
            else:
                path = Path(source)
                sha256, size = _hash_file(path)
                hashed.append((FileRecord(name, sha256, size), path))
        manifest = CheckpointManifest.checked(
            run=self.run_id, step=step, files=[record for record, _ in hashed]
        )
        lacking = set(self.client.find_missing(sorted({r.sha256 for r, _ in hashed})))
        sends = {r.sha256: (source, r.size) for r, source in hashed if r.sha256 in lacking}
        # Small files (a framework checkpoint's tensors are mostly small) go many to a call,
        # whose syncs the vault shares; large ones stream one to a call.
        batches: list[list[tuple[str, Path | bytes, int]]] = [[]]
        large: list[tuple[str, Path | bytes, int]] = []
        batched = 0
        for digest, (source, size) in sends.items():
            if size > BATCH_BLOB:
                large.append((digest, source, size))
                continue
            if (
                len(batches[-1]) >= CHECKPOINT_BATCH_FILES
                or batched + size > CHECKPOINT_BATCH_BYTES
            ):
                batches.append([])
                batched = 0
            batches[-1].append((digest, source, size))
            batched += size

        def send(item: tuple[str, Path | bytes, int]) -> None:
            digest, source, size = item
            self._store(source, digest, size)

        def send_batch(batch: list[tuple[str, Path | bytes, int]]) -> None:
            results = self.client.put_many(
                [s for _, s, _ in batch], expected=[d for d, _, _ in batch]
            )
            for (digest, _, size), result in zip(batch, results, strict=True):
                _check_stored(result.blob.sha256, result.blob.size, digest, size)

        with ThreadPoolExecutor(max_workers=PUTS_IN_FLIGHT) as pool:
            done = [pool.submit(send_batch, b) for b in batches if b]
            done += [pool.submit(send, item) for item in large]
            for future in done:
                future.result()
        data = manifest.encode()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self._store(data, digest, len(data))
        proven = self.client.pin(
            "checkpoint", [digest, self.run_id], meta=self._meta(step=str(step))
        )
        return Checkpoint(digest, manifest, proven, self.client, frozenset(sends))

    def checkpoints(self) -> list[tuple[int, str, ProvenEntry]]:
        """Every committed checkpoint of this run as (step, manifest digest, entry), in the
        order they were committed."""
        found = []
        for proven in self._entries("checkpoint"):
            step = proven.entry.meta.get("step", "")
            if not _DECIMAL.fullmatch(step):
                raise IntegrityError(f"checkpoint entry {proven.entry.index} has bad step {step!r}")
            found.append((int(step), proven.entry.subjects[0], proven))
        return found

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint of this run (highest step; of equal steps, the one
        committed last), from the ledger, so a job started again after a preemption finds it;
        None if there is none. Its manifest is fetched verified and must name this run and
        step."""
        found = self.checkpoints()
        if not found:
            return None
        step, digest, proven = max(found, key=lambda c: (c[0], c[2].entry.index))
        manifest = load_checkpoint_manifest(self.client, digest)
        if manifest.run != self.run_id or manifest.step != step:
            raise IntegrityError(
                f"checkpoint entry {proven.entry.index} pins {digest} as step {step} of run "
                f"{self.run_id}, but that manifest is step {manifest.step} of run {manifest.run}"
            )
        return Checkpoint(digest, manifest, proven, self.client)

    # ------------------------------------------------------------------ the end

    def manifest(self) -> RunManifest:
        """The run manifest as it would be published now."""
        steps: dict[int, str] = {}
        for step, digest, _ in self.checkpoints():
            steps[step] = digest  # of one step committed twice, the later one
        return RunManifest.checked(
            inputs=self.inputs,
            team=self.team,
            environment=Environment.capture(self._environ),
            outputs=[FileRecord(a.path, a.sha256, a.size) for a in self.outputs()],
            checkpoints=[CheckpointRef(s, d) for s, d in steps.items()],
        )

    def finish(self) -> str:
        """Publish the run manifest: store it, pin it as kind `run` (stage=manifest), write
        `replicate.sh` in the output folder, and give a replay's slot back. Returns the
        manifest's digest; calling it again returns the same digest and publishes nothing."""
        if self._published:
            return self._published
        if self._open:
            names = sorted(out.path for out in self._open)
            raise FailedPrecondition(
                f"output {names[0]} is still open: close or abort it before finishing the run"
            )
        data = self.manifest().encode()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self._store(data, digest, len(data))
        meta = self._meta(stage="manifest")
        if self.replay_of:
            meta["replay-of"] = self.replay_of
        self.client.pin("run", [digest, self.run_id], meta=meta)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        _write_durably(
            self.output_dir / REPLICATE_SCRIPT,
            f'#!/bin/sh\nexec vault replay {digest} "$@"\n'.encode(),
            0o755,
        )
        self._published = digest
        if self._lease:
            # A lease past its expiry has already given its slot back: nothing left to do.
            with contextlib.suppress(NotFound):
                self.client.release_replay(self._lease, team=self.team)
        return digest

    def close(self) -> None:
        """Abort the outputs still open (no file, no record) and close the client if the run
        made it. Publishes nothing: that is `finish()`."""
        for out in list(self._open):
            out.abort()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A block left by an exception (a crash, a preemption's signal) is not a finished run:
        # what it recorded stays in the ledger for the next attempt, but no manifest claims it.
        try:
            if exc_type is None:
                self.finish()
        finally:
            self.close()

    # ------------------------------------------------------------------ the ledger

    def _meta(self, **meta: str) -> dict[str, str]:
        # The team is the vault's to record: it refuses a pin whose caller is not of it.
        meta["team"] = self.team
        if self.replay:
            meta["replay"] = self.replay
        if self.task:
            meta["task"] = self.task
        return meta

    def _entries(self, kind: str) -> Iterator[ProvenEntry]:
        """This run's entries of `kind`, in ledger order: those its own team wrote (as the vault
        recorded it), of this replay only on a replay, and of this array task only in a job
        array. The vault refuses other teams' pins into a run; this is the second lock."""
        for proven in entries_naming(self.client, self.run_id):
            entry = proven.entry
            if (
                entry.kind == kind
                and len(entry.subjects) == 2
                and entry.subjects[1] == self.run_id
                and entry.meta.get("team") == self.team
                and entry.meta.get("replay", "") == self.replay
                and entry.meta.get("task", "") == self.task
            ):
                yield proven


class OutputFile(io.RawIOBase):
    """An output being written: bytes go to a hidden file beside the target and into SHA-256;
    `close()` syncs, stores, checks the vault's digest, moves the file into place and records
    it. Dropped without `close()`, or left by an exception, it is aborted."""

    def __init__(self, run: Run, path: str, target: Path) -> None:
        super().__init__()
        self.path = path
        self.target = target
        self.artefact: Artefact | None = None
        self._run = run
        self._partial = target.with_name(f".{target.name}.pinvault-partial-{secrets.token_hex(8)}")
        self._file = open(self._partial, "xb")  # noqa: SIM115
        self._hash = hashlib.sha256()
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        """Write and hash `data`; ValueError once the output is closed or aborted."""
        if self.closed:
            raise ValueError("write to a closed output")
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._hash.update(view)
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        """How many bytes were written."""
        return self._size

    def flush(self) -> None:
        """Flush to the hidden file; nothing is stored or recorded before `close()`."""
        # IOBase.close() flushes after the file underneath was closed.
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        """Commit: the file is in place and recorded once this returns. IntegrityError if
        the vault stored other bytes than were written; on any failure the output is aborted
        (no file, no record)."""
        if self.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            sha256 = "sha256:" + self._hash.hexdigest()
            self._run._store(self._partial, sha256, self._size, chunk_root=True)
            os.replace(self._partial, self.target)
            fsync_dir(self.target.parent)
            self.artefact = self._run._pin_artefact(self.path, sha256, self._size)
        except BaseException:
            self.abort()
            raise
        self._done()

    def abort(self) -> None:
        """Discard what was written: no file, no record."""
        if self.closed:
            return
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._partial)
        self._done()

    def _done(self) -> None:
        self._run._open.discard(self)
        super().close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # IOBase would close(), committing whatever half was written: abort instead.
        with contextlib.suppress(Exception):
            self.abort()


# ---------------------------------------------------------------------- helpers


def _check_stored(stored: object, stored_size: int, sha256: str, size: int) -> None:
    if str(stored) != sha256 or stored_size != size:
        raise IntegrityError(
            f"the vault stored {stored} ({stored_size} bytes), expected {sha256} ({size} bytes)"
        )


def _hash_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
    with f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return "sha256:" + digest.hexdigest(), size


def _write_durably(path: Path, data: bytes, mode: int) -> None:
    partial = path.with_name(f".{path.name}.pinvault-partial-{secrets.token_hex(8)}")
    try:
        with open(partial, "xb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    fsync_dir(path.parent)
