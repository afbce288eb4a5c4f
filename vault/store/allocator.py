"""Process-wide allocator tuning for moving large blobs: a program that streams blobs (the
server, the `vault` command, a client library user) calls `keep_freed_buffers()` once."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_buffers() -> bool:
    """Serve 1 MiB message buffers from the heap and keep freed ones for reuse.

    With glibc's defaults every buffer over 128 KiB is a fresh mapping, returned to the kernel
    when freed and faulted in again for the next message; on a machine that reclaims idle
    memory that costs more than hashing the bytes. At most 64 MiB of freed memory is kept.
    Returns whether the C library accepted it (False where it is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 16 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 64 << 20))
