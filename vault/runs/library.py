"""The run library, used inside a job (docs/run-manifest.md): the run's seed, every output recorded
by digest, checkpoints that exist entirely or not at all, and at the end the run manifest, pinned,
with a one-line `replicate.sh` that replays the run."""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import platform
import random
import re
import secrets
import socket
import weakref
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

from vault import config
from vault.canonical import canonical_json, expect_fields, load_json_object
from vault.client.client import ProvenEntry, VaultClient, read_all
from vault.client.connect import open_client
from vault.config import (
    ENV_CONFIG,
    ENV_DATASET,
    ENV_IMAGE,
    ENV_REPLAY_LEASE,
    ENV_REPLAY_OF,
    ENV_RUN_ID,
    ENV_SCRIPT,
    ENV_SEED,
    ENV_TEAM,
)
from vault.digest import Digest
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    VerificationError,
)
from vault.files import fsync_dir
from vault.ledger.entry import Entry
from vault.ledger.runid import MAX_INPUTS_BYTES, RunInputs
from vault.store.manifest import check_path

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

RUN_MANIFEST_TYPE: Final = "pinvault.run-manifest"
CHECKPOINT_TYPE: Final = "pinvault.checkpoint"
FORMAT_VERSION: Final = 1
# Every read of a manifest from the network is bounded: about 250,000 outputs, 50,000 files.
MAX_RUN_MANIFEST_BYTES: Final = 64 * 1024 * 1024
MAX_CHECKPOINT_MANIFEST_BYTES: Final = 16 * 1024 * 1024
# Integers above 2**53 are not exact in every JSON reader, so the formats forbid them.
MAX_INTEGER: Final = 2**53 - 1
MAX_TEAM_LENGTH: Final = 128
MAX_VARIABLE_BYTES: Final = 1024
HASH_BLOCK: Final = 1 << 20
PUTS_IN_FLIGHT: Final = 4
REPLICATE_SCRIPT: Final = "replicate.sh"

# What the scheduler gives a job (see `start`).

# The only variables a run manifest records: named one by one, so that no token, password or
# credential in a job's environment can reach the ledger through a pattern.
RECORDED_VARIABLES: Final = (
    ENV_SCRIPT,
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_PARTITION",
    "SLURM_CLUSTER_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
)

_SHA256: Final = re.compile(r"sha256:[0-9a-f]{64}")
_VARIABLE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DECIMAL: Final = re.compile(r"0|[1-9][0-9]{0,15}")


# ---------------------------------------------------------------------- the formats


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a run manifest's outputs or of a checkpoint: relative POSIX path, digest,
    size in bytes."""

    path: str
    sha256: str
    size: int

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True, slots=True)
class CheckpointManifest:
    """What a checkpoint is: the run, the step, and its files in bytewise UTF-8 path order."""

    run: str
    step: int
    files: tuple[FileRecord, ...]

    @classmethod
    def checked(cls, *, run: str, step: int, files: Sequence[FileRecord]) -> CheckpointManifest:
        what = "checkpoint manifest"
        _check_sha256(what, "run", run)
        _check_step(what, step)
        if not files:
            raise InvalidArgument(f"{what}: a checkpoint needs at least one file, found none")
        ordered = _check_files(what, files)
        # A checkpoint is restored into a folder: a name cannot be a file and a folder at once.
        names = {f.path for f in ordered}
        for f in ordered:
            parts = f.path.split("/")
            for depth in range(1, len(parts)):
                if "/".join(parts[:depth]) in names:
                    raise InvalidArgument(
                        f"{what}: {'/'.join(parts[:depth])!r} is a file and also the folder "
                        f"of {f.path!r}"
                    )
        return cls(run, step, ordered)

    def as_json(self) -> dict[str, Any]:
        return {
            "type": CHECKPOINT_TYPE,
            "v": FORMAT_VERSION,
            "run": self.run,
            "step": self.step,
            "files": [f.as_json() for f in self.files],
        }

    def encode(self) -> bytes:
        return canonical_json(self.as_json())

    @classmethod
    def decode(cls, data: bytes) -> CheckpointManifest:
        """Parse and validate; anything malformed or not canonical is refused."""
        what = "checkpoint manifest"
        obj = load_json_object(what, data, MAX_CHECKPOINT_MANIFEST_BYTES)
        expect_fields(what, obj, {"type", "v", "run", "step", "files"})
        _expect_header(what, obj, CHECKPOINT_TYPE)
        manifest = cls.checked(
            run=_string(what, "run", obj["run"]),
            step=_integer(what, "step", obj["step"]),
            files=_decode_files(what, "files", obj["files"]),
        )
        _expect_canonical(what, manifest.encode(), data)
        return manifest


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    """A committed checkpoint as a run manifest lists it."""

    step: int
    manifest: str

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "manifest": self.manifest}


@dataclass(frozen=True, slots=True)
class Environment:
    """Where a run ran: informational, never part of what makes a run the same experiment."""

    host: str
    python: str
    platform: str
    variables: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def capture(cls, environ: Mapping[str, str]) -> Environment:
        return cls(
            host=socket.gethostname(),
            python=platform.python_version(),
            platform=platform.platform(),
            variables={name: _cut(environ[name]) for name in RECORDED_VARIABLES if name in environ},
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "python": self.python,
            "platform": self.platform,
            "variables": dict(self.variables),
        }


@dataclass(frozen=True, slots=True)
class RunManifest:
    """What a run was and what it made: its inputs (and so its run id), team, environment,
    outputs in bytewise UTF-8 path order and committed checkpoints in step order."""

    inputs: RunInputs
    team: str
    environment: Environment
    outputs: tuple[FileRecord, ...]
    checkpoints: tuple[CheckpointRef, ...]

    @property
    def run_id(self) -> str:
        return self.inputs.run_id

    @property
    def seed(self) -> int:
        return self.inputs.seed

    @classmethod
    def checked(
        cls,
        *,
        inputs: RunInputs,
        team: str,
        environment: Environment,
        outputs: Sequence[FileRecord],
        checkpoints: Sequence[CheckpointRef],
    ) -> RunManifest:
        what = "run manifest"
        if len(team) > MAX_TEAM_LENGTH or not team.isprintable():
            raise InvalidArgument(
                f"{what}: team must be at most {MAX_TEAM_LENGTH} printable characters, "
                f"found {team[:80]!r}"
            )
        for name, value in environment.variables.items():
            if not _VARIABLE.fullmatch(name):
                raise InvalidArgument(f"{what}: bad environment variable name {name[:80]!r}")
            if len(value.encode("utf-8")) > MAX_VARIABLE_BYTES:
                raise InvalidArgument(f"{what}: environment variable {name} is too long")
        ordered = sorted(checkpoints, key=lambda c: c.step)
        for before, after in itertools.pairwise(ordered):
            if before.step == after.step:
                raise InvalidArgument(f"{what}: checkpoint step {after.step} is listed twice")
        for c in ordered:
            _check_step(what, c.step)
            _check_sha256(what, f"checkpoint {c.step}", c.manifest)
        return cls(
            inputs,
            team,
            Environment(
                environment.host,
                environment.python,
                environment.platform,
                dict(sorted(environment.variables.items())),
            ),
            _check_files(what, outputs),
            tuple(ordered),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "type": RUN_MANIFEST_TYPE,
            "v": FORMAT_VERSION,
            "run": self.run_id,
            "inputs": self.inputs.as_json(),
            "team": self.team,
            "environment": self.environment.as_json(),
            "outputs": [f.as_json() for f in self.outputs],
            "checkpoints": [c.as_json() for c in self.checkpoints],
        }

    def encode(self) -> bytes:
        return canonical_json(self.as_json())

    @classmethod
    def decode(cls, data: bytes) -> RunManifest:
        """Parse and validate; anything malformed, not canonical, or whose run id is not the
        digest of its inputs is refused with a message that names the problem."""
        what = "run manifest"
        obj = load_json_object(what, data, MAX_RUN_MANIFEST_BYTES)
        fields = {"type", "v", "run", "inputs", "team", "environment", "outputs", "checkpoints"}
        expect_fields(what, obj, fields)
        _expect_header(what, obj, RUN_MANIFEST_TYPE)
        run = _string(what, "run", obj["run"])
        if not isinstance(obj["inputs"], dict):
            raise InvalidArgument(f"{what}: 'inputs' is not an object")
        try:
            inputs = RunInputs.decode(canonical_json(obj["inputs"]))
        except InvalidArgument as exc:
            raise InvalidArgument(f"{what}: inputs: {exc}") from None
        if inputs.run_id != run:
            raise InvalidArgument(f"{what}: run is {run} but its inputs make run {inputs.run_id}")
        manifest = cls.checked(
            inputs=inputs,
            team=_string(what, "team", obj["team"]),
            environment=_decode_environment(what, obj["environment"]),
            outputs=_decode_files(what, "outputs", obj["outputs"]),
            checkpoints=_decode_checkpoints(what, obj["checkpoints"]),
        )
        _expect_canonical(what, manifest.encode(), data)
        return manifest


def _cut(value: str) -> str:
    data = value.encode("utf-8")
    if len(data) <= MAX_VARIABLE_BYTES:
        return value
    return data[: MAX_VARIABLE_BYTES - 3].decode("utf-8", errors="ignore") + "..."


def _check_sha256(what: str, name: str, value: str) -> None:
    if not _SHA256.fullmatch(value):
        raise InvalidArgument(
            f"{what}: {name} has bad digest {value[:80]!r}: "
            "expected 'sha256:<64 lowercase hex digits>'"
        )


def _check_step(what: str, step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_INTEGER:
        raise InvalidArgument(f"{what}: bad step {step!r}: expected an integer 0 to 2**53-1")


def _check_files(what: str, files: Sequence[FileRecord]) -> tuple[FileRecord, ...]:
    ordered = sorted(files, key=lambda f: f.path.encode("utf-8"))
    for before, after in itertools.pairwise(ordered):
        if before.path == after.path:
            raise InvalidArgument(f"{what}: path {after.path!r} is listed twice")
    for f in ordered:
        check_path(f.path, what)
        _check_sha256(what, repr(f.path), f.sha256)
        if (
            not isinstance(f.size, int)
            or isinstance(f.size, bool)
            or not 0 <= f.size <= MAX_INTEGER
        ):
            raise InvalidArgument(f"{what}: {f.path!r} has bad size {f.size!r}")
    return tuple(ordered)


# -- strict decoding


def _expect_header(what: str, obj: Mapping[str, Any], kind: str) -> None:
    if obj["type"] != kind:
        raise InvalidArgument(f"{what}: type is {str(obj['type'])[:80]!r}, expected {kind!r}")
    if obj["v"] != FORMAT_VERSION or isinstance(obj["v"], bool):
        raise InvalidArgument(f"{what}: version {obj['v']!r} is not {FORMAT_VERSION}")


def _expect_canonical(what: str, canonical: bytes, data: bytes) -> None:
    if canonical != data:
        raise InvalidArgument(
            f"{what} is not in canonical form (RFC 8785 JSON, lists in their documented order)"
        )


def _string(what: str, name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{what}: {name} is not a string")
    return value


def _integer(what: str, name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INTEGER:
        raise InvalidArgument(f"{what}: {name} is {value!r}, expected an integer 0 to 2**53-1")
    return value


def _items(what: str, name: str, value: object, fields: set[str]) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{what}: {name!r} is not a list")
    for n, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidArgument(f"{what}: {name} item {n} is not an object")
        expect_fields(f"{what}: {name} item {n}", item, fields)
    return value


def _decode_files(what: str, name: str, value: object) -> list[FileRecord]:
    return [
        FileRecord(
            _string(what, f"{name} item {n} path", item["path"]),
            _string(what, f"{name} item {n} sha256", item["sha256"]),
            _integer(what, f"{name} item {n} size", item["size"]),
        )
        for n, item in enumerate(_items(what, name, value, {"path", "sha256", "size"}))
    ]


def _decode_checkpoints(what: str, value: object) -> list[CheckpointRef]:
    return [
        CheckpointRef(
            _integer(what, f"checkpoints item {n} step", item["step"]),
            _string(what, f"checkpoints item {n} manifest", item["manifest"]),
        )
        for n, item in enumerate(_items(what, "checkpoints", value, {"step", "manifest"}))
    ]


def _decode_environment(what: str, value: object) -> Environment:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what}: 'environment' is not an object")
    expect_fields(f"{what}: environment", value, {"host", "python", "platform", "variables"})
    variables = value["variables"]
    if not isinstance(variables, dict):
        raise InvalidArgument(f"{what}: environment variables is not an object")
    return Environment(
        host=_string(what, "environment host", value["host"]),
        python=_string(what, "environment python", value["python"]),
        platform=_string(what, "environment platform", value["platform"]),
        variables={k: _string(what, f"environment variable {k}", v) for k, v in variables.items()},
    )


# ---------------------------------------------------------------------- reading from a vault


def _read_bounded(client: VaultClient, digest: str, what: str, limit: int) -> bytes:
    """A blob's bytes, verified against `digest` by the client, refused before reading if
    larger than `limit`."""
    reader = client.open(digest)
    if reader.info.size > limit:
        raise InvalidArgument(f"{what} {digest} is {reader.info.size} bytes (at most {limit})")
    return read_all(reader)


def load_run_manifest(client: VaultClient, digest: str) -> RunManifest:
    """A published run manifest: fetched verified, decoded strictly, and checked to be pinned
    as its run's manifest (what `vault replay` starts from)."""
    wanted = str(Digest.parse(digest))
    manifest = RunManifest.decode(
        _read_bounded(client, wanted, "run manifest", MAX_RUN_MANIFEST_BYTES)
    )
    published = [
        p.entry
        for p in _lookup(client, wanted)
        if p.entry.kind == "run"
        and p.entry.meta.get("stage") == "manifest"
        and p.entry.subjects[:1] == (wanted,)
        and manifest.run_id in p.entry.subjects[1:]
    ]
    if not published:
        raise FailedPrecondition(
            f"{wanted} is not a published run manifest: no `run` entry with stage=manifest "
            f"pins it for run {manifest.run_id}"
        )
    return manifest


def load_checkpoint_manifest(client: VaultClient, digest: str) -> CheckpointManifest:
    return CheckpointManifest.decode(
        _read_bounded(client, digest, "checkpoint manifest", MAX_CHECKPOINT_MANIFEST_BYTES)
    )


# ---------------------------------------------------------------------- inside a job


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

    @property
    def step(self) -> int:
        return self.manifest.step

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
        # A replay is admitted against the original's `run` entry but runs for its own team.
        self.team = team or admission.meta.get("team", "")
        self.replay_of = replay_of
        self.output_dir = output_dir
        self._lease = replay_lease
        # A replay has the same run id as the run it replays; its own entries carry the
        # lease's digest (never the lease, which releases the slot) so that its checkpoints
        # and outputs are told apart from the original's, and it starts from scratch.
        self.replay = (
            "sha256:" + hashlib.sha256(replay_lease.encode()).hexdigest() if replay_lease else ""
        )
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
        run_id = _required(env, ENV_RUN_ID)
        if not _SHA256.fullmatch(run_id):
            raise InvalidArgument(
                f"{ENV_RUN_ID} is {run_id[:80]!r}: expected 'sha256:<64 lowercase hex digits>'"
            )
        claimed = {
            ENV_IMAGE: _required(env, ENV_IMAGE),
            ENV_DATASET: _required(env, ENV_DATASET),
            ENV_CONFIG: env.get(ENV_CONFIG, ""),
        }
        seed = env.get(ENV_SEED, "")
        if seed:
            local = RunInputs.checked(
                image=claimed[ENV_IMAGE],
                dataset=claimed[ENV_DATASET],
                config=claimed[ENV_CONFIG],
                seed=seed,
            )
            if local.run_id != run_id:
                raise VerificationError(
                    f"{ENV_RUN_ID} is {run_id} but the job's inputs (image, dataset, config, "
                    f"seed) make run {local.run_id}: the job's environment is not its admission's"
                )
        owns = client is None
        # Set up as the `vault` command's would be, with the same trust state, so that a job
        # and the command verify against one history.
        vault = open_client(config.load(environ=env)) if client is None else client
        try:
            inputs = _fetch_inputs(vault, run_id)
            recorded = {ENV_IMAGE: inputs.image, ENV_DATASET: inputs.dataset}
            recorded[ENV_CONFIG] = inputs.config
            for name, value in claimed.items():
                if value != recorded[name]:
                    raise VerificationError(
                        f"{name} is {value or 'unset'} but run {run_id} was admitted with "
                        f"{recorded[name] or 'none'}"
                    )
            admission = _admission(vault, inputs)
            folder = Path(os.path.abspath(output_dir if output_dir is not None else os.curdir))
            return cls(
                vault,
                inputs,
                admission=admission,
                output_dir=folder,
                team=env.get(ENV_TEAM, ""),
                replay_lease=env.get(ENV_REPLAY_LEASE, ""),
                replay_of=_optional_digest(env, ENV_REPLAY_OF),
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
        self._store(target, sha256, size)
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

    def _store(self, source: Path | bytes, sha256: str, size: int) -> None:
        # `expected` makes the vault refuse bytes that changed after they were hashed.
        result = self.client.put(source, expected=sha256)
        if str(result.blob.sha256) != sha256 or result.blob.size != size:
            raise IntegrityError(
                f"the vault stored {result.blob.sha256} ({result.blob.size} bytes), "
                f"expected {sha256} ({size} bytes)"
            )

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

        def send(item: tuple[str, tuple[Path | bytes, int]]) -> None:
            digest, (source, size) = item
            self._store(source, digest, size)

        with ThreadPoolExecutor(max_workers=PUTS_IN_FLIGHT) as pool:
            list(pool.map(send, sends.items()))
        data = manifest.encode()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self._store(data, digest, len(data))
        proven = self.client.pin(
            "checkpoint", [digest, self.run_id], meta=self._meta(step=str(step))
        )
        return Checkpoint(digest, manifest, proven, self.client)

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
            f"#!/bin/sh\nvault replay {digest}\n".encode(),
            0o755,
        )
        self._published = digest
        if self._lease:
            # A lease past its expiry has already given its slot back: nothing left to do.
            with contextlib.suppress(NotFound):
                self.client.release_replay(self._lease, team=self.team)
        return digest

    def close(self) -> None:
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
        if self.replay:
            meta["replay"] = self.replay
        return meta

    def _entries(self, kind: str) -> Iterator[ProvenEntry]:
        """This run's entries of `kind` (this replay's only, on a replay), in ledger order."""
        for proven in _lookup(self.client, self.run_id):
            entry = proven.entry
            if (
                entry.kind == kind
                and len(entry.subjects) == 2
                and entry.subjects[1] == self.run_id
                and entry.meta.get("replay", "") == self.replay
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
        if self.closed:
            raise ValueError("write to a closed output")
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._hash.update(view)
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        # IOBase.close() flushes after the file underneath was closed.
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        """Commit: the file is in place and recorded once this returns."""
        if self.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            sha256 = "sha256:" + self._hash.hexdigest()
            self._run._store(self._partial, sha256, self._size)
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


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise InvalidArgument(f"{name} is not set: is this running inside a pinvault job?")
    return value


def _lookup(client: VaultClient, digest: str) -> list[ProvenEntry]:
    """The proven entries naming `digest`, in ledger order; none is an empty list."""
    try:
        found = client.lookup(digest)
    except NotFound:
        return []
    return sorted(found, key=lambda p: p.entry.index)


def _optional_digest(env: Mapping[str, str], name: str) -> str:
    if not env.get(name):
        return ""
    try:
        return str(Digest.parse(env[name]))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{name}: {exc}") from None


def _fetch_inputs(client: VaultClient, run_id: str) -> RunInputs:
    try:
        data = _read_bounded(client, run_id, "run inputs document", MAX_INPUTS_BYTES)
    except NotFound:
        raise FailedPrecondition(
            f"run {run_id} was never admitted: the vault holds no inputs document for it"
        ) from None
    return RunInputs.decode(data)


def _admission(client: VaultClient, inputs: RunInputs) -> Entry:
    for proven in _lookup(client, inputs.run_id):
        entry = proven.entry
        if (
            entry.kind == "run"
            and entry.meta.get("stage") == "admitted"
            and entry.subjects[:1] == (inputs.run_id,)
            and entry.meta.get("seed") == str(inputs.seed)
        ):
            return entry
    raise FailedPrecondition(
        f"run {inputs.run_id} was never admitted: no `run` entry with stage=admitted names it"
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
