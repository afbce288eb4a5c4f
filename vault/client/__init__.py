"""The Python client of a pinvault server. It fails closed: no bytes and no entry are returned
unless they were verified against their digest or a signed, consistent checkpoint.

    from vault.client import VaultClient
"""

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
