"""What `--since` and `--until` take: a duration back from now (`90s`, `30m`, `2h`, `3d`,
`1w`), a date (`2026-11-24`, midnight UTC) or an RFC 3339 time (any offset); each becomes the
ledger's time format, and anything else is a usage error naming the forms."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from datetime import datetime

_AGO = re.compile(r"([1-9][0-9]{0,5})([smhdw])")
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_FORMS: Final = "a duration such as 2h or 3d, a date such as 2026-11-24, or an RFC 3339 time"


def time_arg(text: str, now: datetime | None = None) -> str:
    """`text` as the ledger writes times (RFC 3339, UTC, microseconds, `Z`)."""
    from datetime import UTC, datetime, timedelta

    from vault.errors import InvalidArgument
    from vault.ledger.entry import time_bound

    ago = _AGO.fullmatch(text)
    if ago is not None:
        moment = (now or datetime.now(UTC)) - timedelta(seconds=int(ago[1]) * _SECONDS[ago[2]])
        return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if _DATE.fullmatch(text):
        text += "T00:00:00Z"
    try:
        return time_bound(text, "time")
    except InvalidArgument:
        raise argparse.ArgumentTypeError(f"expected {_FORMS}, found {text!r}") from None
