"""How the `vault` command prints: results as JSON, sizes, and the one line an error becomes."""

from __future__ import annotations

import json
import re
from typing import Any

from vault.errors import VaultError, VerificationError
from vault.ledger.entry import UNSAFE_TEXT


def error_line(exc: VaultError) -> str:
    """The one line the command prints for an error: its status, if any, and its message."""
    message = shown(" ".join(str(exc).split()))
    # A failed proof or signature check is the client's own finding: no server said it.
    status = None if isinstance(exc, VerificationError) else exc.status
    return message if status is None else f"{status}: {message}"


_UNSAFE = re.compile(f"[{UNSAFE_TEXT}]")


def print_json(value: Any) -> None:
    """`value` as one line of JSON. Text stays readable UTF-8, but a character that could
    move a terminal's cursor or reorder what follows (C1 controls and bidirectional marks,
    which JSON allows raw) is written as its `\\u` escape: the same JSON value, shown safely."""
    text = json.dumps(value, ensure_ascii=False)
    print(_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


def shown(text: str) -> str:
    """`text` as a terminal line may show it: every character that could move the cursor,
    start a line or reorder what follows (see vault.ledger.entry.UNSAFE_TEXT) written as an
    escape, so that nothing a writer or a server put in an entry passes for other output."""
    return _UNSAFE.sub(lambda m: f"\\u{{{ord(m.group()):04x}}}", text)
