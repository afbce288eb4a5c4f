"""The hot tier: blobs as plain files in a local folder (the NVMe next to the server), each
beside its chunk list, written durably and checked chunk by chunk on every read.

_layout says where its files are (and keeps tmp/ clean), _writer is a single put, _batch a
batched one, _direct reads a blob file, _tier is the BlobStore over them."""

from tiers.hot._direct import ALIGN, READ_BLOCK, READ_BLOCKS_AHEAD, READ_THREADS
from tiers.hot._layout import BATCH_SUFFIX, CHUNKS_SUFFIX
from tiers.hot._tier import HotTier
from tiers.hot._writer import SLOT, SLOTS, SYNC_EVERY, WRITE_THREADS, HotWriter

__all__ = [
    "ALIGN",
    "BATCH_SUFFIX",
    "CHUNKS_SUFFIX",
    "READ_BLOCK",
    "READ_BLOCKS_AHEAD",
    "READ_THREADS",
    "SLOT",
    "SLOTS",
    "SYNC_EVERY",
    "WRITE_THREADS",
    "HotTier",
    "HotWriter",
]
