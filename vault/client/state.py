"""The client's trust state: the last checkpoint it verified and the vault key it trusts, kept
in a state file (or in memory), and moved forward only over a proof that the new one extends it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vault.client.channel import rpc_errors
from vault.client.trust import TrustedLog
from vault.errors import VerificationError
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.cosignature import WitnessPolicy
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc


class StateFile:
    """The client's last verified checkpoint (and the vault key it trusts), kept in a small JSON
    file, updated atomically under a lock so concurrent commands cannot roll it back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted in place of the lock file is refused, not opened.
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(self.path.with_suffix(".lock"), flags, 0o600), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state: dict[str, Any] = {}
                if self.path.exists():
                    try:
                        state = json.loads(self.path.read_text())
                    except (OSError, ValueError) as exc:
                        raise VerificationError(
                            f"client state file {self.path} is unreadable: {exc}"
                        ) from None
                before = dict(state)
                yield state
                if state != before:
                    self._write(state)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, state: dict[str, Any]) -> None:
        """Replace the state file atomically, through a new file of a random name (O_EXCL|
        O_NOFOLLOW, mode 0600: nothing planted beside it is followed), removed on failure."""
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


class TrustState:
    """One client's trust in one vault: the vault's key (pinned by `verifier_key`, or trusted on
    first use and kept), and the TrustedLog it has verified, loaded and saved around each use;
    with `witnesses`, every checkpoint must carry the cosignatures the policy requires."""

    def __init__(
        self,
        ledger: rpc.LedgerStub,
        state: StateFile | None,
        verifier_key: str | None,
        witnesses: WitnessPolicy | None = None,
    ) -> None:
        self._ledger = ledger
        self._file = state
        self._verifier_key = verifier_key
        self.witnesses = witnesses
        # Without a state file, what this client verified lasts as long as it does.
        self._memory: dict[str, Any] = {}

    @contextlib.contextmanager
    def trusted(self) -> Iterator[TrustedLog]:
        """The TrustedLog, under the state file's lock; what it holds on leaving is kept."""
        with self._state() as state:
            if "verifier" not in state:
                with rpc_errors():
                    key = self._ledger.GetVerifierKey(pb.VerifierKeyRequest())
                if self._verifier_key and key.key != self._verifier_key:
                    raise VerificationError(
                        f"the vault's checkpoint key is {key.key}, "
                        f"not the configured {self._verifier_key}"
                    )
                state.update(TrustedLog(Verifier.from_string(key.key), key.origin).to_dict())
            elif self._verifier_key and state["verifier"] != self._verifier_key:
                raise VerificationError(
                    f"the client state trusts key {state['verifier']}, not the configured "
                    f"{self._verifier_key}; remove the state file only if the vault's key "
                    "was rotated on purpose"
                )
            trusted = TrustedLog.from_dict(state, witnesses=self.witnesses)
            yield trusted
            state.update(trusted.to_dict())

    def advance(self, note: str) -> Checkpoint:
        """Verify the checkpoint `note` and move to it, over a consistency proof asked of the
        vault from the last one verified."""
        with self.trusted() as trusted:
            proof: list[bytes] = []
            size = _note_size(note)
            if 0 < trusted.size < size:
                with rpc_errors():
                    proof = list(
                        self._ledger.GetConsistencyProof(
                            pb.ConsistencyProofRequest(old_size=trusted.size, new_size=size)
                        ).hashes
                    )
            return trusted.update(note, proof)

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        if self._file is None:
            yield self._memory
        else:
            with self._file.locked() as state:
                yield state


def _note_size(note: str) -> int:
    try:
        return int(note.split("\n")[1])
    except (IndexError, ValueError):
        raise VerificationError("malformed checkpoint note: no size line") from None
