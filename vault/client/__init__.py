"""The Python client of a pinvault server. It fails closed: no bytes and no entry are returned
unless they were verified against their digest or a signed, consistent checkpoint.

    from vault.client import VaultClient
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each name loads its module when first asked for, so that a command importing one part of
# the client (the channel and a look-up) does not load the others (transfers, readers).
_MODULES = {
    "Admission": "vault.client.results",
    "BlobInfo": "vault.client.results",
    "BlobReader": "vault.client.reader",
    "Credentials": "vault.client.channel",
    "ProvenEntry": "vault.client.results",
    "PutResult": "vault.client.results",
    "Stat": "vault.client.results",
    "VaultClient": "vault.client.client",
    "open_client": "vault.client.connect",
    "read_all": "vault.client.reader",
}

if TYPE_CHECKING:
    from vault.client.channel import Credentials
    from vault.client.client import VaultClient
    from vault.client.connect import open_client
    from vault.client.reader import BlobReader, read_all
    from vault.client.results import Admission, BlobInfo, ProvenEntry, PutResult, Stat

__all__ = [
    "Admission",
    "BlobInfo",
    "BlobReader",
    "Credentials",
    "ProvenEntry",
    "PutResult",
    "Stat",
    "VaultClient",
    "open_client",
    "read_all",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
