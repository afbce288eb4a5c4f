"""A sealed run checked as a reviewer without a cluster checks it (`vault replay --check`): its
run manifest, its inputs document and every input, output and checkpoint file it names, each
fetched and verified against its digest and each pin proven against a signed checkpoint, and
what a replay would submit; nothing is appended, admitted or submitted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from vault.client import ProvenEntry, VaultClient
from vault.config import (
    ENV_CONFIG,
    ENV_DATASET,
    ENV_IMAGE,
    ENV_REPLAY_OF,
    ENV_SCRIPT,
    ENV_SEED,
)
from vault.digest import Digest
from vault.errors import FailedPrecondition, IntegrityError, NotFound
from vault.ledger.runid import MAX_INPUTS_BYTES, RunInputs
from vault.runs.dataset import fetch_manifest
from vault.runs.manifest import entries_naming, load_checkpoint_manifest, read_bounded
from vault.runs.pins import require_pin
from vault.runs.run import ENV_ARRAY_TASK
from vault.runs.sealed import SealedRun, find_sealed_run

# The largest batch script a check reads and shows.
MAX_SCRIPT_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Checked:
    """One thing the check verified: what it is, its digest and how it was found good."""

    what: str
    digest: str
    detail: str


@dataclass(frozen=True, slots=True)
class RunCheck:
    """A sealed run whose every pinned input and output verified, and the replay it allows:
    sbatch's arguments (`script` last unless the caller gave its own) and the job's pins."""

    sealed: SealedRun
    checked: tuple[Checked, ...]
    script: str
    script_text: bytes
    sbatch_args: tuple[str, ...]
    pins: dict[str, str]


def verify_blob(client: VaultClient, digest: str, what: str, size: int | None = None) -> int:
    """Read the blob `digest` whole, verified against its digest as it streams; its size.
    NotFound naming `what` if the vault lacks it, IntegrityError if it is not what the digest
    (or the size recorded for it) says."""
    try:
        reader = client.open(digest)
        try:
            if size is not None and reader.info.size != size:
                raise IntegrityError(
                    f"recorded as {size} bytes, but the vault holds {reader.info.size}"
                )
            for _ in reader.chunks():
                pass
        finally:
            reader.close()
    except NotFound:
        raise NotFound(f"{what} {digest} is not in the vault") from None
    except IntegrityError as exc:
        # The vault's finding (a damaged copy) or the client's (bytes not of the digest).
        raise IntegrityError(f"{what} {digest} failed its check: {exc}") from None
    return reader.info.size


def check_run(
    client: VaultClient,
    reference: str,
    *,
    sbatch_args: Sequence[str] = (),
    script: tuple[str, bytes] | None = None,
    on_checked: Callable[[Checked], None] | None = None,
) -> RunCheck:
    """Check the sealed run `reference` (its run id or its manifest's digest) and return what a
    replay would submit; refused with the project's error naming the first thing that fails.
    `script` is the batch script a replay would be given (its digest and bytes) instead of
    the one the manifest records."""
    checked: list[Checked] = []

    def found(what: str, digest: str, detail: str) -> None:
        item = Checked(what, digest, detail)
        checked.append(item)
        if on_checked is not None:
            on_checked(item)

    # The manifest fetched verified and proven sealed by the team its run was admitted for.
    sealed = find_sealed_run(client, reference, purpose="check")
    manifest, run_id = sealed.manifest, sealed.manifest.run_id
    found(
        "run manifest",
        sealed.digest,
        f"sealed by {sealed.sealed.author}, team {sealed.team} (entry {sealed.sealed.index})",
    )
    inputs = _check_inputs_document(client, sealed)
    found(
        "inputs document",
        run_id,
        f"admitted for team {sealed.team} (entry {sealed.admitted.index})",
    )
    for kind, digest in (
        ("image", inputs.image),
        ("dataset", inputs.dataset),
        ("config", inputs.config),
    ):
        if digest:
            found(kind, digest, _check_input(client, kind, digest))
    run_entries = entries_naming(client, run_id)
    for output in manifest.outputs:
        entry = _pinned_for_run(run_entries, "artefact", output.sha256, run_id, path=output.path)
        if entry is None:
            raise FailedPrecondition(
                f"output {output.path} ({output.sha256}) is in the run manifest but not pinned "
                f"as an artefact of run {run_id}"
            )
        verify_blob(client, output.sha256, f"output {output.path}", output.size)
        found(
            f"output {output.path}",
            output.sha256,
            f"{output.size} bytes (entry {entry.entry.index})",
        )
    for ref in manifest.checkpoints:
        entry = _pinned_for_run(run_entries, "checkpoint", ref.manifest, run_id, step=str(ref.step))
        if entry is None:
            raise FailedPrecondition(
                f"checkpoint {ref.step} ({ref.manifest}) is in the run manifest but not pinned "
                f"as a checkpoint of run {run_id}"
            )
        files = load_checkpoint_manifest(client, ref.manifest)
        if files.run != run_id or files.step != ref.step:
            raise IntegrityError(
                f"checkpoint manifest {ref.manifest} is step {files.step} of run {files.run}, "
                f"not step {ref.step} of run {run_id}"
            )
        total = 0
        for record in files.files:
            total += verify_blob(
                client, record.sha256, f"checkpoint {ref.step} file {record.path}", record.size
            )
        found(
            f"checkpoint {ref.step}",
            ref.manifest,
            f"{len(files.files)} files, {total} bytes (entry {entry.entry.index})",
        )
    args = list(sbatch_args)
    variables = manifest.environment.variables
    if script is None:
        recorded = variables.get(ENV_SCRIPT, "")
        if not recorded:
            raise FailedPrecondition(
                "the run manifest records no batch script: give sbatch's arguments, with the "
                "script, after --"
            )
        text = read_bounded(client, str(Digest.parse(recorded)), "batch script", MAX_SCRIPT_BYTES)
        found("batch script", recorded, f"{len(text)} bytes (recorded in the run manifest)")
        args.append("replay.sbatch")
    else:
        recorded, text = script
    task = variables.get(ENV_ARRAY_TASK, "")
    if task.isdecimal() and not any(a.startswith(("--array", "-a")) for a in args):
        args.insert(0, f"--array={task}")
    # The job's pins as a replay sets them; its run id, team and lease would come from the
    # admission, which a check does not ask for (it would append an entry).
    pins = {
        ENV_IMAGE: inputs.image,
        ENV_DATASET: inputs.dataset,
        ENV_SEED: str(inputs.seed),
        **({ENV_CONFIG: inputs.config} if inputs.config else {}),
        ENV_REPLAY_OF: sealed.digest,
        ENV_SCRIPT: recorded,
    }
    return RunCheck(sealed, tuple(checked), recorded, text, tuple(args), pins)


def _check_inputs_document(client: VaultClient, sealed: SealedRun) -> RunInputs:
    """The run's inputs document, stored under its run id: fetched verified, the manifest's
    inputs, and named with the same inputs by the run's proven admission entry."""
    manifest, run_id = sealed.manifest, sealed.manifest.run_id
    try:
        data = read_bounded(client, run_id, "run inputs document", MAX_INPUTS_BYTES)
    except NotFound:
        raise NotFound(f"the inputs document of run {run_id} is not in the vault") from None
    stored = RunInputs.decode(data)
    if stored != manifest.inputs:
        raise IntegrityError(
            f"the inputs document stored as run {run_id} is not the inputs the run manifest "
            f"{sealed.digest} records"
        )
    named = set(sealed.admitted.subjects[1:])
    missing = [d for d in stored.subjects if d not in named]
    if missing:
        raise IntegrityError(
            f"run {run_id}'s admission entry {sealed.admitted.index} does not name its input "
            f"{missing[0]}"
        )
    return stored


def _check_input(client: VaultClient, kind: str, digest: str) -> str:
    """Verify one input: pinned as `kind` (proven), and its content (a dataset's manifest and
    every file it lists) held and verified, unless it is pinned only as kept elsewhere."""
    pins = require_pin(client, kind, digest)
    pinned = f"pinned (entry {pins[0].entry.index})"
    if all(p.entry.external for p in pins):
        return f"{pinned} as external content, kept outside the vault: not read"
    size = verify_blob(client, digest, kind)
    if kind != "dataset":
        return f"{size} bytes, {pinned}"
    listed = fetch_manifest(client, digest)
    total = 0
    for file in listed.files:
        total += verify_blob(client, file.sha256, f"dataset file {file.path}", file.size)
    return f"{len(listed.files)} files, {total} bytes, {pinned}"


def _pinned_for_run(
    entries: Sequence[ProvenEntry], kind: str, digest: str, run_id: str, **meta: str
) -> ProvenEntry | None:
    for proven in entries:
        entry = proven.entry
        if (
            entry.kind == kind
            and entry.subjects[:1] == (digest,)
            and run_id in entry.subjects[1:]
            and all(entry.meta.get(k) == v for k, v in meta.items())
        ):
            return proven
    return None
