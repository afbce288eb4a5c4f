"""A client's memory of the last checkpoint it verified, and the rule for moving it forward:
only to a checkpoint signed by the vault's key that provably extends it (and, where witnesses
are required, that enough of them cosigned, recently enough). An older checkpoint is believed
only once proved a prefix of the trusted one, and never moves it back. No I/O here."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from vault.errors import InvalidArgument, RollbackError, VerificationError
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.cosignature import Cosignature, WitnessPolicy
from vault.ledger.merkle import EMPTY_ROOT, HASH_SIZE, verify_consistency

_STATE_KEYS: Final = frozenset({"origin", "size", "root", "verifier"})
# How old the newest cosignature on a checkpoint may be before a client requiring witnesses
# refuses it (client.max_witness_age): a vault that keeps serving one old, cosigned checkpoint
# hides every entry since.
DEFAULT_MAX_WITNESS_AGE: Final = 86_400.0


class TrustedLog:
    """The (size, root) of one vault's ledger that this client has verified.

    `update` moves it forward; on any failure the state is left exactly as it was, so a client
    that is shown a forked or rolled-back ledger keeps the evidence of what it saw before.
    With `witnesses`, a checkpoint is trusted only once the witnesses the policy requires have
    cosigned it: they saw it extend what they saw before, which a vault that rolled back or
    shows different histories to different clients cannot have them do.
    """

    __slots__ = (
        "_clock",
        "_max_witness_age",
        "_origin",
        "_root",
        "_size",
        "_verifier",
        "_witnesses",
    )

    def __init__(
        self,
        verifier: Verifier,
        origin: str,
        size: int = 0,
        root: bytes = EMPTY_ROOT,
        *,
        witnesses: WitnessPolicy | None = None,
        max_witness_age: float = DEFAULT_MAX_WITNESS_AGE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not origin:
            raise InvalidArgument("a trusted log needs its origin")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"a trusted size is a non-negative integer, found {size!r}")
        if len(root) != HASH_SIZE:
            raise InvalidArgument(f"a trusted root is {HASH_SIZE} bytes, found {len(root)}")
        if size == 0 and root != EMPTY_ROOT:
            raise InvalidArgument(
                f"the root of the empty ledger is {EMPTY_ROOT.hex()}, not {bytes(root).hex()}"
            )
        self._verifier = verifier
        self._origin = origin
        self._size = size
        self._root = bytes(root)
        self._witnesses = witnesses
        self._max_witness_age = max_witness_age
        self._clock = clock

    @property
    def verifier(self) -> Verifier:
        return self._verifier

    @property
    def origin(self) -> str:
        return self._origin

    @property
    def size(self) -> int:
        return self._size

    @property
    def root(self) -> bytes:
        return self._root

    def update(self, note: str, consistency_proof: Sequence[bytes]) -> Checkpoint:
        """Verify a signed checkpoint (and the witnesses' cosignatures, if required) and a
        consistency proof between it and the trusted state: from the trusted size to a newer
        checkpoint, which is then trusted, or from an older checkpoint to the trusted size,
        which is believed but leaves the state where it is (a concurrent client moved it past
        what this answer saw). Raises RollbackError if the vault presents a shorter or
        rewritten ledger, VerificationError for any other failure."""
        checkpoint = self._verifier.open(note)
        if checkpoint.origin != self._origin:
            raise VerificationError(
                f"checkpoint is for ledger {checkpoint.origin!r}, but this client trusts "
                f"ledger {self._origin!r}: check the vault address and verifier key"
            )
        if checkpoint.size == self._size and checkpoint.root != self._root:
            raise RollbackError(
                f"vault rewrote its history: size {self._size} was verified with root "
                f"{self._root.hex()} but the vault now signs root {checkpoint.root.hex()}"
            )
        if checkpoint.size < self._size:
            try:
                verify_consistency(
                    checkpoint.size, self._size, checkpoint.root, self._root, consistency_proof
                )
            except VerificationError as exc:
                raise RollbackError(
                    f"vault rolled back: it presents size {checkpoint.size} but size "
                    f"{self._size} was already verified, and it does not prove the one a "
                    f"prefix of the other ({exc})"
                ) from None
            self._check_witnesses(note, checkpoint)
            return checkpoint
        try:
            verify_consistency(
                self._size, checkpoint.size, self._root, checkpoint.root, consistency_proof
            )
        except VerificationError as exc:
            raise VerificationError(
                f"vault did not prove that its ledger of size {checkpoint.size} extends the "
                f"size {self._size} already verified: {exc}"
            ) from None
        self._check_witnesses(note, checkpoint)
        self._size = checkpoint.size
        self._root = checkpoint.root
        return checkpoint

    def merge(self, size: int, root: bytes, consistency_proof: Sequence[bytes]) -> None:
        """Join another trusted state of this ledger (one kept before states were kept per
        ledger): move to it if it is newer, once `consistency_proof` between the two shows one
        a prefix of the other; RollbackError if they disagree."""
        old, new = sorted(((size, bytes(root)), (self._size, self._root)))
        try:
            verify_consistency(old[0], new[0], old[1], new[1], consistency_proof)
        except VerificationError as exc:
            raise RollbackError(
                f"two trusted states of ledger {self._origin!r} disagree: size {size} root "
                f"{bytes(root).hex()} and size {self._size} root {self._root.hex()} are not "
                f"one a prefix of the other ({exc}): the vault showed a fork"
            ) from None
        if size > self._size:
            self._size, self._root = size, bytes(root)

    def _check_witnesses(self, note: str, checkpoint: Checkpoint) -> list[Cosignature]:
        """The required witnesses' cosignatures on `note`, the newest of them recent enough."""
        if self._witnesses is None:
            return []
        found = self._witnesses.check(note)
        newest = max(found, key=lambda c: c.timestamp)
        age = self._clock() - newest.timestamp
        if age > self._max_witness_age:
            when = datetime.fromtimestamp(newest.timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            raise VerificationError(
                f"the checkpoint of size {checkpoint.size} was last cosigned {_duration(age)} "
                f"ago (by witness {newest.witness.label} at {when}), more than the "
                f"{_duration(self._max_witness_age)} allowed (client.max_witness_age): the "
                "vault may be hiding every entry since (a freeze), or its witnesses are down"
            )
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self._origin,
            "size": self._size,
            "root": self._root.hex(),
            "verifier": str(self._verifier),
        }

    @classmethod
    def from_dict(
        cls,
        state: Mapping[str, Any],
        *,
        witnesses: WitnessPolicy | None = None,
        max_witness_age: float = DEFAULT_MAX_WITNESS_AGE,
    ) -> TrustedLog:
        """Rebuild from `to_dict()` output; unknown or missing keys are an error. The witnesses
        required are the client's configuration, not its state."""
        if not isinstance(state, Mapping):
            raise InvalidArgument("trusted log state: expected an object")
        keys = set(state)
        if keys != _STATE_KEYS:
            missing = sorted(_STATE_KEYS - keys)
            unknown = sorted(keys - _STATE_KEYS)
            raise InvalidArgument(
                f"trusted log state: missing keys {missing}, unknown keys {unknown}"
            )
        origin, size, root_hex, vkey = (
            state["origin"],
            state["size"],
            state["root"],
            state["verifier"],
        )
        if not isinstance(origin, str) or not isinstance(vkey, str):
            raise InvalidArgument("trusted log state: origin and verifier must be strings")
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidArgument(f"trusted log state: size must be an integer, found {size!r}")
        if not isinstance(root_hex, str) or len(root_hex) != 2 * HASH_SIZE:
            raise InvalidArgument(f"trusted log state: root must be {2 * HASH_SIZE} hex digits")
        try:
            root = bytes.fromhex(root_hex)
        except ValueError:
            raise InvalidArgument(
                f"trusted log state: root must be {2 * HASH_SIZE} hex digits"
            ) from None
        return cls(
            Verifier.from_string(vkey),
            origin,
            size,
            root,
            witnesses=witnesses,
            max_witness_age=max_witness_age,
        )


def _duration(seconds: float) -> str:
    """`seconds` as a person reads an age: 90s, 25m, 26h, 3d."""
    for unit, length in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * length:
            return f"{seconds / length:.0f}{unit}"
    return f"{seconds:.3g}s"
