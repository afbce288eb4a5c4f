"""The run library and datasets, used inside a job and by researchers: a client of the vault as
the scheduler is, which reaches the server only through `vault.client`.

    from vault.runs import Run, start
"""

from vault.ledger.runid import RunInputs, parse_seed
from vault.runs.library import Artefact, Checkpoint, OutputFile, Run, RunManifest, start

__all__ = [
    "Artefact",
    "Checkpoint",
    "OutputFile",
    "Run",
    "RunInputs",
    "RunManifest",
    "parse_seed",
    "start",
]
