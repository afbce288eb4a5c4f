"""What a job is given: the variables the scheduler set, and the admitted run they name as the
vault holds it (its inputs document and its `run` entry with stage=admitted)."""

from __future__ import annotations

from collections.abc import Mapping

from vault.client import VaultClient
from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument, NotFound
from vault.ledger.entry import Entry
from vault.ledger.runid import MAX_INPUTS_BYTES, RunInputs
from vault.runs.manifest import entries_naming, read_bounded


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
    for proven in entries_naming(client, inputs.run_id):
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
