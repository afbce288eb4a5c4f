"""The run library and datasets, used inside a job and by researchers: a client of the vault as
the scheduler is, which reaches the server only through `vault.client`.

    from vault.runs import Run, start
"""

from vault.ledger.runid import RunInputs, parse_seed
from vault.runs.manifest import (
    CheckpointManifest,
    RunManifest,
    load_checkpoint_manifest,
    load_run_manifest,
)
from vault.runs.run import Artefact, Checkpoint, OutputFile, Run, start

__all__ = [
    "Artefact",
    "Checkpoint",
    "CheckpointManifest",
    "OutputFile",
    "Run",
    "RunInputs",
    "RunManifest",
    "load_checkpoint_manifest",
    "load_run_manifest",
    "parse_seed",
    "start",
]
