"""The Python client of a pinvault server. It fails closed: no bytes and no entry are returned
unless they were verified against their digest or a signed, consistent checkpoint.

    from vault.client import VaultClient
"""

from vault.client.client import (
    Admission,
    BlobInfo,
    BlobReader,
    Credentials,
    ProvenEntry,
    PutResult,
    Stat,
    VaultClient,
    read_all,
)
from vault.client.connect import open_client

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
