"""Chunks kept as zstd frames, one frame a chunk, as the warm and cold tiers store them: when a
frame is worth keeping, and how a stored frame is checked before it is decompressed."""

from __future__ import annotations

from typing import Final

import zstandard

from vault.errors import IntegrityError
from vault.store.chunks import ChunkList

# A chunk is kept compressed only if that saves at least 1/32 of it: below that, the saving
# is not worth decompressing the chunk on every read.
SAVING_FRACTION: Final = 32


def compressor(level: int) -> zstandard.ZstdCompressor:
    # Each frame states its size, which reads check before decompressing.
    return zstandard.ZstdCompressor(level=level, write_content_size=True)


def worth_keeping(raw_length: int, frame_length: int) -> bool:
    """Whether a chunk of `raw_length` bytes is kept as its frame of `frame_length` bytes."""
    return frame_length <= raw_length - raw_length // SAVING_FRACTION


def inflate(
    frame: bytes, chunks: ChunkList, index: int, decompressor: zstandard.ZstdDecompressor
) -> bytes:
    """Chunk `index` of `chunks` from its stored frame; IntegrityError naming the chunk if it
    cannot be had (the caller checks the bytes against the chunk list)."""
    offset, length = chunks.span(index)
    where = f"stored copy of {chunks.sha256} is damaged: chunk at byte offset {offset}"
    try:
        # A damaged frame header could claim any size; nothing is allocated before the claim
        # matches the chunk list.
        claimed = zstandard.frame_content_size(frame)
        if claimed != length:
            raise IntegrityError(f"{where} claims {claimed} bytes, expected {length}")
        data: bytes = decompressor.decompress(frame, max_output_size=length)
    except zstandard.ZstdError as error:
        raise IntegrityError(f"{where} does not decompress: {error}") from None
    return data
