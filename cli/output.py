"""How the `vault` command prints: results as JSON, sizes, the one line an error becomes, and
the exit status of each kind of failure (the table in docs/cli.md)."""

from __future__ import annotations

import functools
import re
import sys
from typing import TYPE_CHECKING, Any, Final

# What an error is loads when there is one to print: `vault --help` needs none of it.
if TYPE_CHECKING:
    from vault.errors import VaultError

# Exit statuses: BSD sysexits.h (EX_*) for every kind of failure it names, argparse's 2 for a
# command line (and a configuration) the command cannot run with, and the shell's 128 + signal
# for a command a signal stopped. docs/cli.md is the table a user reads.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # anything not named below
EXIT_USAGE: Final = 2
EXIT_INVALID: Final = 64  # EX_USAGE: a bad syntax in a parameter (a malformed digest)
EXIT_INTEGRITY: Final = 65  # EX_DATAERR: bytes, a proof or a signature fail their check
EXIT_NOT_FOUND: Final = 66  # EX_NOINPUT: no blob, entry or pin by that name
EXIT_UNAVAILABLE: Final = 69  # EX_UNAVAILABLE: the vault (or a mirror, sbatch) cannot be reached
EXIT_INTERNAL: Final = 70  # EX_SOFTWARE: the vault failed in a way it has no status for
EXIT_IO: Final = 74  # EX_IOERR: a local file or folder the command was given is unusable
EXIT_EXHAUSTED: Final = 75  # EX_TEMPFAIL: no room or no quota now; retry later
EXIT_PERMISSION: Final = 77  # EX_NOPERM: no credential, or one without the right
EXIT_PRECONDITION: Final = 78  # EX_CONFIG: the vault's state does not allow it (a conflict)
EXIT_INTERRUPTED: Final = 130  # 128 + SIGINT

# The gRPC status each error type is told as (vault.errors) -> its kind and exit status.
_BY_STATUS: Final[dict[str | None, tuple[str, int]]] = {
    "INVALID_ARGUMENT": ("invalid_input", EXIT_INVALID),
    "DATA_LOSS": ("integrity", EXIT_INTEGRITY),
    "NOT_FOUND": ("not_found", EXIT_NOT_FOUND),
    "UNAVAILABLE": ("unavailable", EXIT_UNAVAILABLE),
    "PERMISSION_DENIED": ("permission", EXIT_PERMISSION),
    "UNAUTHENTICATED": ("permission", EXIT_PERMISSION),
    "FAILED_PRECONDITION": ("precondition", EXIT_PRECONDITION),
    "RESOURCE_EXHAUSTED": ("exhausted", EXIT_EXHAUSTED),
    None: ("internal", EXIT_INTERNAL),
}


def error_kind(exc: VaultError) -> tuple[str, int]:
    """The kind of failure `exc` is, as `--json` names it, and the command's exit status."""
    from vault.errors import ConfigError

    # A configuration the command cannot run with is a usage error, as argparse's are.
    if isinstance(exc, ConfigError):
        return "config", EXIT_USAGE
    return _BY_STATUS.get(exc.status, _BY_STATUS[None])


def error_line(exc: VaultError) -> str:
    """The one line the command prints for an error: its status, if any, and its message."""
    from vault.errors import VerificationError

    message = shown(" ".join(str(exc).split()))
    # A failed proof or signature check is the client's own finding: no server said it.
    status = None if isinstance(exc, VerificationError) else exc.status
    return message if status is None else f"{status}: {message}"


def fail(exc: VaultError, *, as_json: bool) -> int:
    """Report `exc` on standard error (one line, or with `--json` one JSON object) and return
    the exit status of its kind."""
    kind, code = error_kind(exc)
    if as_json:
        report_json(kind, " ".join(str(exc).split()), code)
    else:
        print(f"vault: {error_line(exc)}", file=sys.stderr)
    return code


def report(kind: str, message: str, code: int, *, as_json: bool) -> int:
    """Report a failure that is no VaultError (an interrupt, an unusable file) as `fail` does."""
    if as_json:
        report_json(kind, message, code)
    else:
        print(f"vault: {shown(message)}", file=sys.stderr)
    return code


def report_json(kind: str, message: str, code: int) -> None:
    """`{"error": {"kind", "message", "exit"}}` as one line on standard error."""
    print(_json_line({"error": {"kind": kind, "message": message, "exit": code}}), file=sys.stderr)


@functools.cache
def _unsafe() -> re.Pattern[str]:
    # Compiled at the first use rather than at import: `vault --help` prints no server text.
    from vault.ledger.entry import UNSAFE_TEXT

    return re.compile(f"[{UNSAFE_TEXT}]")


def _json_line(value: Any) -> str:
    import json

    text = json.dumps(value, ensure_ascii=False)
    return _unsafe().sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def print_json(value: Any) -> None:
    """`value` as one line of JSON. Text stays readable UTF-8, but a character that could
    move a terminal's cursor or reorder what follows (C1 controls and bidirectional marks,
    which JSON allows raw) is written as its `\\u` escape: the same JSON value, shown safely."""
    print(_json_line(value))


def shown(text: str) -> str:
    """`text` as a terminal line may show it: every character that could move the cursor,
    start a line or reorder what follows (see vault.ledger.entry.UNSAFE_TEXT) written as an
    escape, so that nothing a writer or a server put in an entry passes for other output."""
    return _unsafe().sub(lambda m: f"\\u{{{ord(m.group()):04x}}}", text)
