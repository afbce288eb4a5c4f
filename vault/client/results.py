"""What the client's calls return, each built only from answers it has verified: a blob's
description, a put's outcome, a blob's pins, a proved entry and an admitted job."""

from __future__ import annotations

from dataclasses import dataclass

from vault.digest import Digest
from vault.ledger.checkpoint import Checkpoint
from vault.ledger.entry import Entry
from vault.ledger.runid import RunInputs
from vault.wire import pinvault_pb2 as pb


@dataclass(frozen=True, slots=True)
class BlobInfo:
    sha256: Digest
    blake3: Digest
    size: int
    stored_at: str

    @classmethod
    def from_wire(cls, blob: pb.BlobInfo) -> BlobInfo:
        return cls(Digest.parse(blob.sha256), Digest.parse(blob.blake3), blob.size, blob.stored_at)


@dataclass(frozen=True, slots=True)
class PutResult:
    blob: BlobInfo
    created: bool


@dataclass(frozen=True, slots=True)
class Stat:
    blob: BlobInfo
    pins: list[Entry]


@dataclass(frozen=True, slots=True)
class ProvenEntry:
    """An entry whose inclusion in `checkpoint` was verified."""

    entry: Entry
    leaf_hash: bytes
    proof: list[bytes]
    checkpoint: Checkpoint


@dataclass(frozen=True, slots=True)
class Admission:
    """A job the vault admitted: its run id (the digest of `inputs`), the run's `run` pin,
    verified, whether the run is new, and a replay's slot in its team's quota."""

    run_id: str
    inputs: RunInputs
    entry: ProvenEntry
    new: bool
    lease: str
    # The team the vault admitted the job for; the run's pin may name the team that first
    # admitted the same inputs.
    team: str

    @property
    def seed(self) -> int:
        return self.inputs.seed
