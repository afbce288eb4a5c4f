"""What a job is given: the variables the scheduler set, and the admitted run they name as the
vault holds it (its inputs document and its `run` entry with stage=admitted)."""

from __future__ import annotations

from collections.abc import Mapping

from vault.client import VaultClient
from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument, NotFound
from vault.ledger.entry import Entry
from vault.ledger.runid import MAX_INPUTS_BYTES, RunInputs
from vault.runs.manifest import entries_naming, first_admission, read_bounded


def required_variable(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise InvalidArgument(f"{name} is not set: is this running inside a pinvault job?")
    return value


def optional_digest(env: Mapping[str, str], name: str) -> str:
    if not env.get(name):
        return ""
    try:
        return str(Digest.parse(env[name]))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{name}: {exc}") from None


def fetch_inputs(client: VaultClient, run_id: str) -> RunInputs:
    try:
        data = read_bounded(client, run_id, "run inputs document", MAX_INPUTS_BYTES)
    except NotFound:
        raise FailedPrecondition(
            f"run {run_id} was never admitted: the vault holds no inputs document for it"
        ) from None
    return RunInputs.decode(data)


def admission_entry(client: VaultClient, inputs: RunInputs) -> Entry:
    """The run's admission entry, proved: the first `run` entry with stage=admitted whose first
    subject is the run id, as the vault takes it (its `team` is the team the run is for)."""
    entry = first_admission(entries_naming(client, inputs.run_id), inputs.run_id)
    if entry is None:
        raise FailedPrecondition(
            f"run {inputs.run_id} was never admitted: no `run` entry with stage=admitted names it"
        )
    if entry.meta.get("seed") != str(inputs.seed) or not entry.meta.get("team"):
        raise FailedPrecondition(
            f"run {inputs.run_id}'s admission entry {entry.index} records seed "
            f"{entry.meta.get('seed', 'none')} and team {entry.meta.get('team') or 'none'}: "
            f"expected seed {inputs.seed} and a team"
        )
    return entry
