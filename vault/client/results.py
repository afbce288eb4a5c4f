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
    """A stored blob: its sha256 and blake3 digests, size, and when the vault stored it."""

    sha256: Digest
    blake3: Digest
    size: int
    stored_at: str

    @classmethod
    def from_wire(cls, blob: pb.BlobInfo) -> BlobInfo:
        """From the server's answer; InvalidArgument for a malformed digest. The values are
        the server's word until the blob's bytes are checked against its digest."""
        return cls(Digest.parse(blob.sha256), Digest.parse(blob.blake3), blob.size, blob.stored_at)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put stored (checked to be the bytes sent) and whether the vault lacked it; for
    a direct put, the mirrors that held a verified copy when it returned (the others follow
    from the vault's queue); and the chunk root of the bytes sent, computed by the client as
    it sent them (vault.client.ranges), which a pin of the blob records (None if the client
    did not compute it)."""

    blob: BlobInfo
    created: bool
    mirrors: tuple[str, ...] = ()
    chunk_root: bytes | None = None


@dataclass(frozen=True, slots=True)
class Stat:
    """A blob as the vault describes it, and the entries pinning it, as listed (unproven:
    `VaultClient.lookup` proves them)."""

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
    # The blobs the image names, each found held by the vault (0: an image pinned as
    # external, or not an OCI manifest).
    image_blobs: int = 0

    @property
    def seed(self) -> int:
        """The admitted seed."""
        return self.inputs.seed
