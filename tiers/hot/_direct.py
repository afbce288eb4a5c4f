"""Reading a hot-tier blob file in pieces: with direct I/O where the tier allows it (aligned
buffers, threads reading ahead of the caller, the page cache left alone), else through the cache."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Generator
from typing import Final

from vault.store.chunks import CHUNK_SIZE

# Direct I/O needs page-aligned buffers, lengths and offsets; 4 KiB suits 512-byte and
# 4 KiB-sector devices alike.
ALIGN: Final = 4096
O_DIRECT: Final[int] = getattr(os, "O_DIRECT", 0)
# Reads with direct I/O: two threads, each reading a block into its own aligned buffer, keep
# two reads in flight, a few blocks ahead of the caller.
READ_BLOCK: Final = 2 * CHUNK_SIZE
READ_THREADS: Final = 2
READ_BLOCKS_AHEAD: Final = 4


def read_pieces(
    fd: int, start: int, end: int, piece: int, *, direct: bool
) -> Generator[bytes, None, None]:
    """The bytes [start, end) of a blob file in pieces of `piece` bytes (the last may be
    shorter); a piece cut short by the end of the file ends the stream, for the caller's
    check to catch. `direct`: the tier may use direct I/O."""
    large = end - start > READ_BLOCK
    if direct and large and start % ALIGN == 0 and piece % ALIGN == 0:
        # Past the page cache, a large read does not evict everything else, nor pay for
        # filling the cache with pages it will not read again; small blobs, the ones read
        # over and over, stay cached.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
        return _direct_pieces(fd, start, end, piece)
    return _buffered_pieces(fd, start, end, piece)


def _buffered_pieces(fd: int, start: int, end: int, piece: int) -> Generator[bytes, None, None]:
    """Bytes [start, end) of a file in pieces of `piece` bytes, through the page cache; a piece
    cut short by the end of the file is the last."""
    if end - start > piece:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
    for offset in range(start, end, piece):
        wanted = min(piece, end - offset)
        data = os.pread(fd, wanted, offset)
        yield data
        if len(data) < wanted:
            return


def _direct_pieces(fd: int, start: int, end: int, piece: int) -> Generator[bytes, None, None]:
    """As _buffered_pieces, with direct I/O: READ_THREADS threads each read READ_BLOCK bytes
    at a time into their own aligned buffer, up to READ_BLOCKS_AHEAD blocks ahead of the
    caller, so that the disk, the copies out and the caller's checks overlap."""
    block = max(READ_BLOCK // piece, 1) * piece
    blocks = range(start, end, block)
    ready: dict[int, tuple[list[bytes], bool] | BaseException] = {}
    changed = threading.Condition()
    taken = 0
    stopping = False

    def read_block(buffer: memoryview, offset: int) -> tuple[list[bytes], bool]:
        """The block's pieces, and whether it was read whole; a short read ends with the
        piece it cut (perhaps empty)."""
        length = min(block, end - offset)
        got = os.preadv(fd, [buffer[: -(-length // ALIGN) * ALIGN]], offset)
        available = min(got, length)
        pieces = [
            bytes(buffer[at : min(at + piece, available)])
            for at in range(0, length, piece)
            if at <= available
        ]
        return pieces, available == length

    def run(first: int) -> None:
        number = first
        try:
            with mmap.mmap(-1, block) as map_, memoryview(map_) as buffer:
                for number in range(first, len(blocks), READ_THREADS):
                    with changed:
                        while not stopping and number - taken >= READ_BLOCKS_AHEAD:
                            changed.wait()
                        if stopping:
                            return
                    result = read_block(buffer, blocks[number])
                    with changed:
                        ready[number] = result
                        changed.notify_all()
        except BaseException as error:
            # The caller raises it when it reaches this block.
            with changed:
                ready[number] = error
                changed.notify_all()

    threads = [
        threading.Thread(target=run, args=(first,), name=f"pinvault-read-{first}", daemon=True)
        for first in range(min(READ_THREADS, len(blocks)))
    ]
    for thread in threads:
        thread.start()
    try:
        for number in range(len(blocks)):
            with changed:
                while number not in ready:
                    changed.wait()
                result = ready.pop(number)
                taken = number + 1
                changed.notify_all()
            if isinstance(result, BaseException):
                raise result
            pieces, whole = result
            yield from pieces
            if not whole:
                return
    finally:
        with changed:
            stopping = True
            changed.notify_all()
        for thread in threads:
            thread.join()
