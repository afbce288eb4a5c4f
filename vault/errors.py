"""The project's error types. They become gRPC status codes only at the transport edge
(`vault.service.status`) and one-line messages in the command."""

from __future__ import annotations


class VaultError(Exception):
    """Base of every error pinvault raises on purpose; its message is one line for a user."""


class InvalidArgument(VaultError):
    """The caller sent something malformed: a bad digest, an unknown kind, oversized metadata."""


class NotFound(VaultError):
    """No blob, entry or checkpoint by that name."""


class FailedPrecondition(VaultError):
    """The request is well formed but the state does not allow it (pinning a blob not stored)."""


class IntegrityError(VaultError):
    """Stored or received bytes do not match their digest: data loss unless a good copy exists."""


class VerificationError(VaultError):
    """A proof, checkpoint, signature or ledger audit failed.

    `index` names the first ledger index where the failure was found, when there is one.
    """

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class RollbackError(VerificationError):
    """The vault presented a history that does not extend the one a client already verified."""


class Unavailable(VaultError):
    """The vault (or a part it depends on) cannot be reached."""


class QuotaExceeded(VaultError):
    """A team asked for more than its share (replays running at once)."""


class Unauthenticated(VaultError):
    """The call carried no credential, or one the vault does not know."""


class PermissionDenied(VaultError):
    """The caller is known but its role or team does not allow this."""
