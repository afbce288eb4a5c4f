"""The project's error types, each with the gRPC status it is told as. They become status codes
only at the transport edge (`vault.server.edge`), errors again in the client
(`vault.client.channel`), and one-line messages in the command (`cli.output`)."""

from __future__ import annotations

from typing import ClassVar


class VaultError(Exception):
    """Base of every error pinvault raises on purpose; its message is one line for a user."""

    # The name of the gRPC status this error is answered with (None: INTERNAL).
    status: ClassVar[str | None] = None


class InvalidArgument(VaultError):
    """The caller sent something malformed: a bad digest, an unknown kind, oversized metadata."""

    status = "INVALID_ARGUMENT"


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


class QuotaExceeded(VaultError):
    """A team asked for more than its share (replays running at once)."""

    status = "RESOURCE_EXHAUSTED"


class Unauthenticated(VaultError):
    """The call carried no credential, or one the vault does not know."""

    status = "UNAUTHENTICATED"


class PermissionDenied(VaultError):
    """The caller is known but its role or team does not allow this."""

    status = "PERMISSION_DENIED"
