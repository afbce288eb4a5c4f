"""The project's error types, each with the gRPC status it is told as. They become status codes
only at the transport edge (`vault.server.edge`), errors again in the client
(`vault.client.channel`), and one-line messages in the command (`cli.output`)."""

from __future__ import annotations

import errno
import os
from typing import ClassVar, Final

from vault.files import size_text


class VaultError(Exception):
    """Base of every error pinvault raises on purpose; its message is one line for a user."""

    # The name of the gRPC status this error is answered with (None: INTERNAL).
    status: ClassVar[str | None] = None


class InvalidArgument(VaultError):
    """The caller sent something malformed: a bad digest, an unknown kind, oversized metadata."""

    status = "INVALID_ARGUMENT"


class ConfigError(InvalidArgument):
    """The configuration (its file, a PINVAULT_* variable, a command-line option) is unreadable,
    names an unknown key, or holds a value of the wrong type or out of its range."""


class NotFound(VaultError):
    """No blob, entry or checkpoint by that name."""

    status = "NOT_FOUND"


class FailedPrecondition(VaultError):
    """The request is well formed but the state does not allow it (pinning a blob not stored)."""

    status = "FAILED_PRECONDITION"


class IntegrityError(VaultError):
    """Stored or received bytes do not match their digest: data loss unless a good copy exists."""

    status = "DATA_LOSS"


class VerificationError(VaultError):
    """A proof, checkpoint, signature or ledger audit failed.

    `index` names the first ledger index where the failure was found, when there is one.
    """

    status = "DATA_LOSS"

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class RollbackError(VerificationError):
    """The vault presented a history that does not extend the one a client already verified."""


class Unavailable(VaultError):
    """The vault (or a part it depends on) cannot be reached."""

    status = "UNAVAILABLE"


class ResourceExhausted(VaultError):
    """The vault has run out of something the call needs: room on a disk, a stream slot."""

    status = "RESOURCE_EXHAUSTED"


class QuotaExceeded(ResourceExhausted):
    """A team asked for more than its share (replays running at once)."""


class Unauthenticated(VaultError):
    """The call carried no credential, or one the vault does not know."""

    status = "UNAUTHENTICATED"


class PermissionDenied(VaultError):
    """The caller is known but its role or team does not allow this."""

    status = "PERMISSION_DENIED"


# What an operating system says when a write finds no room: the disk, or the user's quota on
# it, is full.
DISK_FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


class DiskFull(ResourceExhausted):
    """A write found no room on the disk that holds `folder`. The vault goes on serving reads,
    and its writes work again as soon as space is freed there."""

    def __init__(self, folder: str | os.PathLike[str], *, needed: int) -> None:
        self.folder = os.fspath(folder)
        self.needed = needed
        import shutil  # here, not above: every command imports this module, few fill a disk

        try:
            free = f"{size_text(shutil.disk_usage(self.folder).free)} free"
        except OSError:
            free = "free space unknown"
        super().__init__(
            f"no space left on the disk holding {self.folder} ({free}, at least "
            f"{size_text(needed)} needed): free space there and retry"
        )
