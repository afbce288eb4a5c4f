"""The warm tier: an append-only archive folder of write-once pack files, small blobs packed
together and large ones in a file of their own, zstd-compressed chunk by chunk where that saves
space, found through a crash-safe SQLite index, and checked chunk by chunk on every read.

_record is a blob's record in a pack, _codec its chunks' compression, _packs the pack files,
_index the SQLite index, _writer a put, _tier the BlobStore over them."""

from tiers.warm._index import INDEX_NAME, INDEX_VERSION
from tiers.warm._packs import PACK_SUFFIX
from tiers.warm._record import Frame, StoredRecord
from tiers.warm._tier import LEVEL, PACK_LIMIT, SMALL_LIMIT, WarmTier
from tiers.warm._writer import WarmWriter

__all__ = [
    "INDEX_NAME",
    "INDEX_VERSION",
    "LEVEL",
    "PACK_LIMIT",
    "PACK_SUFFIX",
    "SMALL_LIMIT",
    "Frame",
    "StoredRecord",
    "WarmTier",
    "WarmWriter",
]
