"""How the warm tier compresses a chunk (or finds it not worth it, cheaply) and decompresses
one, with zstd contexts shared between the threads that put and read."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

import zstandard

from tiers import frames
from vault.store.chunks import ChunkList

_C = TypeVar("_C")

# Chunks shorter than this are not worth a compression attempt.
_MIN_COMPRESS: Final = 64
# Before compressing a large chunk, three samples of it are compressed at level 1; if they do
# not shrink, the chunk is taken to be incompressible (already compressed media, encrypted or
# random bytes) and stored raw without paying for a full compression.
_SAMPLE: Final = 16 << 10
_SAMPLE_ABOVE: Final = 4 * _SAMPLE
_SAMPLE_KEEP: Final = 0.9


class ChunkCodec:
    """Chunks to frames and back at one zstd level. zstd contexts are not thread-safe and are
    costly to make for every chunk: each caller borrows one from a pool (list pop and append
    are atomic)."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._compressors: list[zstandard.ZstdCompressor] = []
        self._samplers: list[zstandard.ZstdCompressor] = []
        self._decompressors: list[zstandard.ZstdDecompressor] = []

    def deflate(self, chunk: bytes) -> tuple[bytes, bool]:
        """The chunk's frame as stored, and whether it is compressed."""
        if len(chunk) < _MIN_COMPRESS:
            return chunk, False
        if len(chunk) > _SAMPLE_ABOVE:
            middle = len(chunk) // 2
            sample = b"".join((chunk[:_SAMPLE], chunk[middle : middle + _SAMPLE], chunk[-_SAMPLE:]))
            with _borrow(self._samplers, _fast_compressor) as sampler:
                if len(sampler.compress(sample)) > _SAMPLE_KEEP * len(sample):
                    return chunk, False
        with _borrow(self._compressors, self._compressor) as compressor:
            frame = compressor.compress(chunk)
        if not frames.worth_keeping(len(chunk), len(frame)):
            return chunk, False
        return frame, True

    def inflate(self, frame: bytes, compressed: bool, chunks: ChunkList, index: int) -> bytes:
        """Chunk `index` of `chunks` from its stored frame (checked by frames.inflate)."""
        if not compressed:
            return frame
        with _borrow(self._decompressors, zstandard.ZstdDecompressor) as decompressor:
            return frames.inflate(frame, chunks, index, decompressor)

    def _compressor(self) -> zstandard.ZstdCompressor:
        return frames.compressor(self.level)


@contextlib.contextmanager
def _borrow(pool: list[_C], make: Callable[[], _C]) -> Iterator[_C]:
    try:
        codec = pool.pop()
    except IndexError:
        codec = make()
    try:
        yield codec
    finally:
        pool.append(codec)


def _fast_compressor() -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=1)
