"""The cold tier: blobs on one S3 endpoint (a peer institution's mirror), each 1 MiB chunk kept
zstd-compressed where that saves space, so that any range can be fetched, decompressed and
checked without the rest of the blob. Speaks only the common S3 API, so any S3 server will do.

_s3 talks to the endpoint, _layout says how a blob is laid out in objects, _upload puts one,
_crypt seals what an encrypted tier stores, _tier is the BlobStore over them."""

from tiers.cold._crypt import NAMES_ID, KeyRing, new_key
from tiers.cold._layout import (
    DATA_FORMAT,
    FORMAT,
    INDEX_PROBE,
    READ_WINDOW,
    ColdLayout,
    Extent,
    decode_index,
    encode_index,
    index_length,
)
from tiers.cold._tier import (
    COMPRESSION_LEVEL,
    DIRECT_PARTS_MAX,
    DIRECT_PUT_MAX,
    LOOKUP_THREADS,
    CheckedUpload,
    ColdTier,
    DirectRead,
    DirectUpload,
)
from tiers.cold._upload import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    PART_GROWTH,
    PART_MAX_DOUBLINGS,
    PART_SIZE,
    UPLOAD_THREADS,
    ColdWriter,
)

__all__ = [
    "COMPRESSION_LEVEL",
    "DATA_FORMAT",
    "DIRECT_PARTS_MAX",
    "DIRECT_PUT_MAX",
    "FORMAT",
    "INDEX_PROBE",
    "LOOKUP_THREADS",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "NAMES_ID",
    "PART_GROWTH",
    "PART_MAX_DOUBLINGS",
    "PART_SIZE",
    "READ_WINDOW",
    "UPLOAD_THREADS",
    "CheckedUpload",
    "ColdLayout",
    "ColdTier",
    "ColdWriter",
    "DirectRead",
    "DirectUpload",
    "Extent",
    "KeyRing",
    "decode_index",
    "encode_index",
    "index_length",
    "new_key",
]
