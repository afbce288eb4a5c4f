"""The client's trust state: the last checkpoint it verified of each ledger and the vault key it
trusts, kept per ledger (its origin and key) in a state folder, in one state file, or in memory,
and moved forward only over a proof that the new checkpoint extends it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from vault.client.channel import rpc_errors
from vault.client.trust import DEFAULT_MAX_WITNESS_AGE, TrustedLog
from vault.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    VerificationError,
)
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.cosignature import WitnessPolicy
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

# How long a command waits for another to finish with a state file before it gives up: others
# hold it only to read, check one proof and write a few hundred bytes.
LOCK_WAIT: Final = 60.0
_LOCK_POLL: Final = 0.005


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
            _lock(lock.fileno(), self.path)
            try:
                state: dict[str, Any] = {}
                if self.path.exists():
                    try:
                        state = json.loads(self.path.read_text())
                    except (OSError, ValueError) as exc:
                        raise VerificationError(
                            f"client state file {self.path} is unreadable: {exc}"
                        ) from None
                    if not isinstance(state, dict):
                        raise VerificationError(
                            f"client state file {self.path} does not hold a JSON object"
                        )
                before = dict(state)
                yield state
                if state != before:
                    self._write(state)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, state: dict[str, Any]) -> None:
        """Replace the state file atomically, through a new file of a random name (O_EXCL|
        O_NOFOLLOW, mode 0600: nothing planted beside it is followed), removed on failure."""
        tmp = self.path.with_name(f".{self.path.name}.{os.urandom(8).hex()}.tmp")
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


def _lock(fd: int, path: Path) -> None:
    """Take the lock on `fd`, waiting at most LOCK_WAIT for the process that holds it."""
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"client state file {path} stayed locked by another command for "
                    f"{LOCK_WAIT:.0f}s"
                ) from None
            time.sleep(_LOCK_POLL)


def address_file_name(target: str) -> str:
    """The state file a client kept per server address before states were kept per ledger."""
    return "trust-" + re.sub(r"[^A-Za-z0-9._-]", "_", target) + ".json"


def ledger_file_name(origin: str, verifier: str) -> str:
    """The state file of one ledger: named by its origin (readable) and its key (unique)."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", origin)[:80]
    return f"trust-{readable}-{hashlib.sha256(verifier.encode()).hexdigest()[:16]}.json"


class LedgerStates:
    """A state folder: one state file per ledger, and `servers.json`, which ledger (origin and
    key) each server address serves, so that one ledger reached at two addresses has one
    state, and an address once seen serving a ledger is held to it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.servers = StateFile(folder / "servers.json")

    def ledger(self, origin: str, verifier: str) -> StateFile:
        return StateFile(self.folder / ledger_file_name(origin, verifier))

    def by_address(self, target: str) -> StateFile:
        return StateFile(self.folder / address_file_name(target))


class TrustState:
    """One client's trust in one vault: the vault's key (pinned by `verifier_key`, or trusted on
    first use and kept), and the TrustedLog it has verified, loaded and saved around each use
    under a lock (the state file's, and this client's own for its threads); with `witnesses`,
    every checkpoint must carry the cosignatures the policy requires, the newest no older than
    `max_witness_age` seconds."""

    def __init__(
        self,
        ledger: rpc.LedgerStub,
        state: StateFile | LedgerStates | None,
        verifier_key: str | None,
        witnesses: WitnessPolicy | None = None,
        *,
        target: str = "",
        timeout: float | None = None,
        max_witness_age: float = DEFAULT_MAX_WITNESS_AGE,
    ) -> None:
        self._ledger = ledger
        self._folder = state if isinstance(state, LedgerStates) else None
        self._file = state if isinstance(state, StateFile) else None
        self._verifier_key = verifier_key
        self.witnesses = witnesses
        self._target = target
        self._timeout = timeout
        self._max_witness_age = max_witness_age
        # The ledger the folder says this address serves (origin, key), once looked up.
        self._identity: tuple[str, str] | None = None
        # Threads sharing this client take turns, as processes sharing the file do.
        self._lock = threading.RLock()
        # Without a state file, what this client verified lasts as long as it does.
        self._memory: dict[str, Any] = {}

    @contextlib.contextmanager
    def trusted(self) -> Iterator[TrustedLog]:
        """The TrustedLog, under the state's locks; what it holds on leaving is kept."""
        with self._lock, self._state() as state:
            if "verifier" not in state:
                origin, key = self._identity or self._vault_identity()
                state.update(TrustedLog(Verifier.from_string(key), origin).to_dict())
            if self._verifier_key and state["verifier"] != self._verifier_key:
                raise VerificationError(
                    f"the client state trusts key {state['verifier']}, not the configured "
                    f"{self._verifier_key}; remove the state file only if the vault's key "
                    "was rotated on purpose"
                )
            trusted = TrustedLog.from_dict(
                state, witnesses=self.witnesses, max_witness_age=self._max_witness_age
            )
            yield trusted
            state.update(trusted.to_dict())

    def known_size(self) -> int:
        """The size of the last checkpoint verified, for a call that asks for a proof from it."""
        with self.trusted() as trusted:
            return trusted.size

    def accept(self, note: str, proof: Sequence[bytes] = (), proved_from: int = -1) -> Checkpoint:
        """Verify the checkpoint `note` and move to it if it is newer. `proof` is the vault's
        consistency proof to it from size `proved_from`; if the trusted state is no longer
        there (another command or thread moved it meanwhile) or the checkpoint is older, the
        proof between the two is asked of the vault."""
        with self.trusted() as trusted:
            size = _note_size(note)
            if proved_from != trusted.size or size < trusted.size:
                proof = self._consistency(trusted.size, size)
            return trusted.update(note, proof)

    def advance(self, note: str) -> Checkpoint:
        """Verify the checkpoint `note` and move to it, over a consistency proof asked of the
        vault from the last one verified."""
        return self.accept(note)

    def _consistency(self, a: int, b: int) -> list[bytes]:
        """The vault's proof that the tree of the smaller of `a`, `b` is a prefix of the other;
        empty if it has none to give (a tree it does not have: the check then fails)."""
        old, new = min(a, b), max(a, b)
        if old == 0 or old == new:
            return []
        try:
            with rpc_errors():
                response = self._ledger.GetConsistencyProof(
                    pb.ConsistencyProofRequest(old_size=old, new_size=new), timeout=self._timeout
                )
        except (InvalidArgument, NotFound, FailedPrecondition):
            return []
        return list(response.hashes)

    def _vault_identity(self) -> tuple[str, str]:
        """The origin and key the vault says it signs with, once checked against the key
        configured."""
        with rpc_errors():
            key = self._ledger.GetVerifierKey(pb.VerifierKeyRequest(), timeout=self._timeout)
        if self._verifier_key and key.key != self._verifier_key:
            raise VerificationError(
                f"the vault's checkpoint key is {key.key}, not the configured {self._verifier_key}"
            )
        Verifier.from_string(key.key)
        return key.origin, key.key

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        if self._folder is not None and self._file is None:
            self._file = self._resolve(self._folder)
        if self._file is None:
            yield self._memory
        else:
            with self._file.locked() as state:
                yield state

    def _resolve(self, folder: LedgerStates) -> StateFile:
        """The state file of the ledger this client's address serves: the one the folder
        names for it, else the one of the ledger the vault says it is (joining the state kept
        for this address by earlier versions, whose file is then removed)."""
        migrated: StateFile | None = None
        with folder.servers.locked() as servers:
            known = servers.get(self._target)
            if known is not None:
                if not (
                    isinstance(known, dict)
                    and isinstance(known.get("origin"), str)
                    and isinstance(known.get("verifier"), str)
                ):
                    raise VerificationError(
                        f"client state file {folder.servers.path} is malformed at {self._target!r}"
                    )
                identity: tuple[str, str] = (known["origin"], known["verifier"])
            else:
                old = folder.by_address(self._target)
                if old.path.exists():
                    with old.locked() as kept:
                        kept_log = TrustedLog.from_dict(kept)
                        identity = (kept_log.origin, str(kept_log.verifier))
                        self._join(folder.ledger(*identity), kept_log)
                    migrated = old
                else:
                    identity = self._vault_identity()
                servers[self._target] = {"origin": identity[0], "verifier": identity[1]}
        if migrated is not None:
            # Its checkpoint is now in the ledger's file, written and synced above.
            for path in (migrated.path, migrated.path.with_suffix(".lock")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self._identity = identity
        return folder.ledger(*identity)

    def _join(self, file: StateFile, kept: TrustedLog) -> None:
        """Join `kept` into the ledger's state file (RollbackError, leaving both as they are,
        if the two are not one a prefix of the other)."""
        with file.locked() as state:
            if not state:
                state.update(kept.to_dict())
                return
            current = TrustedLog.from_dict(state)
            if str(current.verifier) != str(kept.verifier) or current.origin != kept.origin:
                raise VerificationError(
                    f"client state file {file.path} is of another ledger than its name says"
                )
            current.merge(kept.size, kept.root, self._consistency(current.size, kept.size))
            state.update(current.to_dict())


def _note_size(note: str) -> int:
    try:
        return int(note.split("\n")[1])
    except (IndexError, ValueError):
        raise VerificationError("malformed checkpoint note: no size line") from None
