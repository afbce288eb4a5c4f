"""The run library's documents (docs/run-manifest.md): the run manifest and the checkpoint
manifest, encoded canonically, decoded strictly, and read verified from a vault."""

from __future__ import annotations

import itertools
import platform
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from vault.canonical import canonical_json, expect_fields, load_json_object
from vault.client import ProvenEntry, VaultClient, read_all
from vault.config import ENV_SCRIPT
from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from vault.ledger.entry import Entry
from vault.ledger.runid import RunInputs
from vault.store.manifest import check_path

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

SHA256_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")
_VARIABLE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
        """A checkpoint manifest, its files put in order; InvalidArgument for a run that is
        not a sha256 digest, a bad step, no files, a bad or repeated path, a malformed digest,
        or a name that is both a file and another file's folder."""
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
        """The manifest as the JSON object docs/run-manifest.md describes."""
        return {
            "type": CHECKPOINT_TYPE,
            "v": FORMAT_VERSION,
            "run": self.run,
            "step": self.step,
            "files": [f.as_json() for f in self.files],
        }

    def encode(self) -> bytes:
        """The canonical (JCS) bytes whose sha256 is the checkpoint's digest."""
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
        """The run's id: the digest of its inputs document."""
        return self.inputs.run_id

    @property
    def seed(self) -> int:
        """The seed the run was admitted with."""
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
        """A run manifest, its outputs and checkpoints put in order; InvalidArgument for a
        team or environment variable out of bounds, a step listed twice, a bad path or a
        malformed digest."""
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
        """The manifest as the JSON object docs/run-manifest.md describes."""
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
        """The canonical (JCS) bytes whose sha256 is the manifest's digest."""
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
    if not SHA256_DIGEST.fullmatch(value):
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


def read_bounded(client: VaultClient, digest: str, what: str, limit: int) -> bytes:
    """A blob's bytes, verified against `digest` by the client, refused before reading if
    larger than `limit`."""
    reader = client.open(digest)
    if reader.info.size > limit:
        raise InvalidArgument(f"{what} {digest} is {reader.info.size} bytes (at most {limit})")
    return read_all(reader)


def load_run_manifest(client: VaultClient, digest: str, *, purpose: str = "replay") -> RunManifest:
    """A published run manifest: fetched verified, decoded strictly, and checked to be pinned
    as its run's manifest by the team the run was admitted for (what `vault replay` and `vault
    run export` start from). A manifest anyone else pinned for the run is refused, naming who
    pinned it and refusing to `purpose` it."""
    wanted = str(Digest.parse(digest))
    manifest = RunManifest.decode(
        read_bounded(client, wanted, "run manifest", MAX_RUN_MANIFEST_BYTES)
    )
    published = [
        p.entry
        for p in entries_naming(client, wanted)
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
    admission = first_admission(entries_naming(client, manifest.run_id), manifest.run_id)
    if admission is None:
        raise FailedPrecondition(
            f"run {manifest.run_id} was never admitted: no `run` entry with stage=admitted names it"
        )
    team = admission.meta.get("team", "")
    if not team or not any(e.meta.get("team") == team for e in published):
        sealer = published[0]
        raise PermissionDenied(
            f"run manifest {wanted} was sealed by {sealer.author} (team "
            f"{sealer.meta.get('team') or 'not recorded'}, entry {sealer.index}), not by team "
            f"{team or 'none'}, which run {manifest.run_id} was admitted for: "
            f"refusing to {purpose} it"
        )
    return manifest


def first_admission(entries: Sequence[ProvenEntry], run_id: str) -> Entry | None:
    """The run's admission entry among `entries` (in ledger order): the first `run` entry with
    stage=admitted whose first subject is the run id, as the vault takes it."""
    for proven in entries:
        entry = proven.entry
        if (
            entry.kind == "run"
            and entry.meta.get("stage") == "admitted"
            and entry.subjects[:1] == (run_id,)
        ):
            return entry
    return None


def load_checkpoint_manifest(client: VaultClient, digest: str) -> CheckpointManifest:
    """A checkpoint manifest, fetched verified against its digest (IntegrityError if the bytes
    do not match, NotFound if the vault lacks them) and decoded strictly (InvalidArgument if
    it is malformed, too large or not canonical)."""
    return CheckpointManifest.decode(
        read_bounded(client, digest, "checkpoint manifest", MAX_CHECKPOINT_MANIFEST_BYTES)
    )


def entries_naming(client: VaultClient, digest: str) -> list[ProvenEntry]:
    """The proven entries naming `digest`, in ledger order; none is an empty list."""
    try:
        found = client.lookup(digest)
    except NotFound:
        return []
    return sorted(found, key=lambda p: p.entry.index)
