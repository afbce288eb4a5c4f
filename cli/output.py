"""How the `vault` command prints: results as JSON, sizes, and the one line an error becomes."""

from __future__ import annotations

import json
import re
from typing import Any, Final

from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    VaultError,
)
from vault.ledger.entry import UNSAFE_TEXT

# The status a user is told: the one the server answered with, or the one it would give the
# same error found before any request. A failed proof or signature check (VerificationError)
# is the client's own finding and has no status.
_STATUS: Final = (
    (InvalidArgument, "INVALID_ARGUMENT"),
    (NotFound, "NOT_FOUND"),
    (FailedPrecondition, "FAILED_PRECONDITION"),
    (IntegrityError, "DATA_LOSS"),
    (Unavailable, "UNAVAILABLE"),
    (QuotaExceeded, "RESOURCE_EXHAUSTED"),
    (Unauthenticated, "UNAUTHENTICATED"),
    (PermissionDenied, "PERMISSION_DENIED"),
)


def error_line(exc: VaultError) -> str:
    """The one line the command prints for an error: its status, if any, and its message."""
    message = shown(" ".join(str(exc).split()))
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return f"{status}: {message}"
    return message


def print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False))


_UNSAFE = re.compile(f"[{UNSAFE_TEXT}]")


def shown(text: str) -> str:
    """`text` as a terminal line may show it: every character that could move the cursor,
    start a line or reorder what follows (see vault.ledger.entry.UNSAFE_TEXT) written as an
    escape, so that nothing a writer or a server put in an entry passes for other output."""
    return _UNSAFE.sub(lambda m: f"\\u{{{ord(m.group()):04x}}}", text)
