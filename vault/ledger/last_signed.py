"""The last checkpoint a server signed, kept in a file of its own outside the database, so that
a server never signs over a history that was rewritten behind it: a database whose rows were
changed, re-chained and stripped of their checkpoints looks consistent on its own, but not
beside a checkpoint the server signed before."""

from __future__ import annotations

import base64
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from vault.errors import VerificationError
from vault.files import fsync_dir, write_all
from vault.ledger.checkpoint import Verifier

log = logging.getLogger(__name__)


class LastSigned:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._recorded = -1

    def note(self) -> str | None:
        """The signed note the file holds, or None when there is none to read."""
        try:
            return self.path.read_text("utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def check(
        self,
        verifier: Verifier,
        size: int,
        root: Callable[[int], bytes],
        last_matching: Callable[[int], int],
    ) -> None:
        """Raise VerificationError unless the stored ledger of `size` entries (whose Merkle root
        of the first n is `root(n)`) agrees with the recorded checkpoint. `last_matching(n)`
        is the size of the largest stored checkpoint below n that still agrees, so that the
        error can name the range where entries changed."""
        try:
            note = self.path.read_text("utf-8")
        except FileNotFoundError:
            if size:
                log.warning("%s is missing: no check against the last signed checkpoint", self.path)
            return
        except (OSError, UnicodeDecodeError) as exc:
            raise VerificationError(
                f"cannot read the last signed checkpoint {self.path}: {exc}"
            ) from None
        if not _signed_by_key_of(note, verifier):
            # The signing key was replaced (a rotation, or a new server on old data): this note
            # says nothing the new key can check. The next checkpoint is recorded in its place.
            log.warning("%s was signed by another key: not checked against it", self.path)
            return
        try:
            signed = verifier.open(note)
        except VerificationError as exc:
            raise VerificationError(f"the last signed checkpoint {self.path}: {exc}") from None
        self._recorded = signed.size
        if signed.size > size:
            raise VerificationError(
                f"this server signed a checkpoint for {signed.size} entries but only {size} are "
                "stored (the ledger was truncated)",
                index=size,
            )
        if root(signed.size) != signed.root:
            first = last_matching(signed.size)
            raise VerificationError(
                f"the stored entries do not match the checkpoint for {signed.size} entries this "
                f"server signed last ({self.path}): an entry at index {first} to "
                f"{signed.size - 1} was changed",
                index=first,
            )

    def record(self, note: str, size: int) -> None:
        """Replace the file with a newer signed note, durably: a new file of a name no one else
        could have made, synced, renamed over the old one, the folder synced."""
        if size <= self._recorded:
            return
        temp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600)
        try:
            write_all(fd, note.encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, self.path)
        fsync_dir(self.path.parent)
        self._recorded = size


def _signed_by_key_of(note: str, verifier: Verifier) -> bool:
    """Whether a signature line of the note names the verifier's key (by its key id)."""
    for line in note.split("\n\n", 1)[-1].splitlines():
        _, _, signature = line.rpartition(" ")
        try:
            if base64.b64decode(signature, validate=True)[:4] == verifier.key_id:
                return True
        except ValueError:
            continue
    return False
